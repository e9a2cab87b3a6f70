#!/usr/bin/env bash
# Source this on the H200 machine (bare image, no network): installs carried wheels and strop itself.
#   .whl/ (carried, git-ignored): the wheels requirements/gpu.txt lists as carried, built on the CPU machine by
#   `bash bench/gpu_wheels.sh` (bitsandbytes trimmed to its CUDA 13.0 + CPU libs); for exports also gguf and
#   llama-cpp-python (built on the CPU machine).
set -e
if compgen -G ".whl/*.whl" > /dev/null; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
python3 -m pip install -q --no-index --no-deps --no-build-isolation -e . > /tmp/strop-install.log 2>&1 \
  || { cat /tmp/strop-install.log; exit 1; }
export PYTORCH_ALLOC_CONF=expandable_segments:True PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1
python3 - <<'PY'
import importlib, torch
mods = ["triton", "transformers", "peft", "trl", "bitsandbytes", "grpc", "google.protobuf", "datasets", "pyarrow"]
vers = {m: getattr(importlib.import_module(m), "__version__", "?") for m in mods}
print(f"GPU {torch.cuda.get_device_name(0)} torch {torch.__version__} " + " ".join(f"{k} {v}" for k, v in vers.items()))
PY
set +e
