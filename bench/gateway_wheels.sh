#!/usr/bin/env bash
# Build .whl-gw/ (git-ignored) on the CPU machine: the Tinker gateway's wheels (the lock's [tinker] pins) for the
# H200 image (CPython 3.12), which has none of them, for bench/gateway_bench.py. Large packages the image already
# has (torch's world, transformers, numpy, grpcio, protobuf, …) are left out. On the device:
#   source bench/gpu_env.sh && python3 -m pip install -q --no-index --find-links .whl-gw \
#       tinker==0.38.0 fastapi uvicorn zstandard
# (pip installs only what the image lacks), with carry [".whl", ".whl-gw"].
set -euo pipefail
cd "$(dirname "$0")/.."
HAVE='^(numpy|transformers|tokenizers|huggingface-hub|hf-xet|safetensors|protobuf|grpcio|pyyaml|regex|packaging|filelock|fsspec|tqdm|typing-extensions)=='
mapfile -t pins < <(python3 deploy/lock_subset.py requirements/lock.txt pyproject.toml --extra tinker --no-torch \
    | grep -E '^[A-Za-z0-9_.-]+==' | sed 's/ \\$//' | grep -Ev "$HAVE")
rm -rf .whl-gw && mkdir -p .whl-gw
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform any -d .whl-gw "${pins[@]}"
du -sh .whl-gw
