#!/usr/bin/env bash
# Build .whl/ (git-ignored) on the CPU machine: the wheels the bare H200 image lacks, for `device` calls to carry
# (carry: [".whl"]) and `source bench/gpu_env.sh` to install. A call carries at most 64 MiB: bitsandbytes' wheel
# (~43 MB) is repacked with only its CUDA 13.0 library (the image's torch is cu130) and its CPU one (~3.6 MB).
#   bash bench/gpu_wheels.sh            # the training set: trl, bitsandbytes, datasets (+ dill, multiprocess), grpc health/reflection
#   bash bench/gpu_wheels.sh gguf       # also gguf (export benchmarks; llama-cpp-python must be built separately)
set -euo pipefail
cd "$(dirname "$0")/.."
out=.whl
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pkgs=(trl==1.16.0 bitsandbytes==0.50.2 datasets==5.2.0 "dill<0.4.2" "multiprocess<0.70.20"
  grpcio-health-checking==1.84.0 grpcio-reflection==1.84.0)
[[ "${1:-}" == gguf ]] && pkgs+=(gguf)
# the GPU image: CPython 3.12 on x86-64 Linux; --no-deps: it already has torch, transformers, peft, grpcio, pyarrow
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 --platform any -d "$tmp" "${pkgs[@]}"
bnb=$(ls "$tmp"/bitsandbytes-*.whl)
mkdir "$tmp/bnb"
python3 -m zipfile -e "$bnb" "$tmp/bnb"
find "$tmp/bnb" -name 'libbitsandbytes_*.so' ! -name '*_cpu.so' ! -name '*_cuda130.so' -delete
rm "$bnb"
(cd "$tmp/bnb" && python3 - "$bnb" <<'PY'
import os, sys, zipfile
with zipfile.ZipFile(sys.argv[1], "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
    for root, _, files in os.walk("."):
        for f in files:
            z.write(os.path.join(root, f), os.path.relpath(os.path.join(root, f), "."))
PY
)
rm -rf "$tmp/bnb"
mkdir -p "$out"
cp "$tmp"/*.whl "$out"/
ls -l "$out"
du -sh "$out"
