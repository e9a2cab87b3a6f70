# Everyday targets. `make demo` and `make test` are the two commands of the README.
PY ?= python3.11
VENV := .venv
VPY := $(VENV)/bin/python
# The CPU build of torch 2.13 lies on the CI machines' disk; on a GPU host set TORCH_SPEC="torch".
TORCH_SPEC ?= torch==2.13.0
PROTOS := $(wildcard protos/strop/v1/*.proto)

.PHONY: setup demo test test-gpu lint format protos check-protos bench clean

$(VENV)/.setup-done: pyproject.toml
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q --upgrade pip
	$(VPY) -m pip install -q "$(TORCH_SPEC)"
	$(VPY) -m pip install -q -e ".[dev]"
	touch $@

setup: $(VENV)/.setup-done

demo: setup
	$(VPY) -m strop.demo

test: setup check-protos lint
	TRITON_INTERPRET=1 $(VPY) -m pytest -m "not gpu" -q

test-gpu: setup
	$(VPY) -m pytest -m gpu -q

lint: setup
	$(VPY) -m ruff check .
	$(VPY) -m ruff format --check .

format: setup
	$(VPY) -m ruff format .
	$(VPY) -m ruff check --fix .

protos: setup
	$(VPY) -m grpc_tools.protoc -Iprotos --python_out=protos --pyi_out=protos --grpc_python_out=protos $(PROTOS)

# Fails when the committed generated code differs from what the .proto files produce.
check-protos: setup
	rm -rf .protos-check && mkdir -p .protos-check
	$(VPY) -m grpc_tools.protoc -Iprotos --python_out=.protos-check --pyi_out=.protos-check --grpc_python_out=.protos-check $(PROTOS)
	diff -r -x __pycache__ -x '*.proto' -x '__init__.py' .protos-check/strop/v1 protos/strop/v1 | grep -v '^Only in protos' | (! grep .) || (echo "generated protos are stale: run 'make protos'" && exit 1)
	rm -rf .protos-check

bench: setup
	$(VPY) bench/run.py --help

clean:
	rm -rf $(VENV) .protos-check .pytest_cache
