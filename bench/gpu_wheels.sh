#!/usr/bin/env bash
# Build .whl/ (git-ignored) on the CPU machine: the wheels requirements/gpu.txt lists under "# carried wheels", for
# `device` calls to carry (carry: [".whl"]) and `source bench/gpu_env.sh` to install on the bare H200 image.
# A call carries at most 64 MiB: bitsandbytes' wheel (~43 MB) is repacked with only its CUDA 13.0 library (the
# image's torch is cu130) and its CPU one (~3.6 MB). The export benchmarks also need gguf and a llama-cpp-python
# wheel built on this machine (bench/RESULTS.md, the 3B export); this script does not make those.
set -euo pipefail
cd "$(dirname "$0")/.."
mapfile -t pins < <(sed -n '/^# carried wheels/,$p' requirements/gpu.txt | grep -E '^[A-Za-z0-9_.-]+==')
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
# the image: CPython 3.12 on x86-64 Linux; --no-deps: it has torch, transformers, peft, grpcio, pyarrow already
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --platform manylinux_2_24_x86_64 --platform manylinux2014_x86_64 --platform any -d "$tmp" "${pins[@]}"
mkdir -p .whl
python3 - "$tmp" .whl <<'PY'
import pathlib, re, shutil, sys, zipfile

src, out = map(pathlib.Path, sys.argv[1:])
unused = re.compile(r"libbitsandbytes_(?!cpu\.|cuda130\.).*\.so$")  # other CUDA, ROCm and XPU builds
for whl in src.glob("*.whl"):
    if not whl.name.startswith("bitsandbytes-"):
        shutil.copy(whl, out / whl.name)
        continue
    with zipfile.ZipFile(whl) as zin, zipfile.ZipFile(out / whl.name, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as z:
        for item in zin.infolist():
            if not unused.search(item.filename):
                z.writestr(item, zin.read(item.filename))
PY
ls -l .whl
du -sh .whl
