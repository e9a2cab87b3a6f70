"""The CUDA trainer image's smoke test, run by the image's own Python (it needs nothing but the image).

On a GPU node (deploy/README.md, "The CUDA trainer image"): the driver reached (libcuda through the NVIDIA
container toolkit), a Triton kernel compiled and run (its C launcher built with the image's gcc and linked against
the driver's libcuda.so.1), bitsandbytes' 4-bit quantization on the GPU dequantized bit for bit by strop's NF4
kernel, and a bf16 matmul through cuBLAS from the CUDA wheels:

    docker run --rm -i --gpus all --entrypoint /opt/strop/bin/python IMAGE - < deploy/gpu_smoke.py

With ``--cpu-only`` (``make image-gpu`` on a host without a GPU): only what can be checked there: the CUDA build
of torch and its CUDA 13.0 wheels, triton, bitsandbytes and strop import, and Triton's launcher toolchain is in
the image. Prints one JSON object; exits non-zero on the first failure.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import sysconfig
from importlib import metadata


def main(argv: list[str]) -> None:
    cpu_only = "--cpu-only" in argv
    import bitsandbytes
    import torch
    import triton

    import strop.trainer_svc.server  # noqa: F401  (the service, its gRPC layer and the trainer core)
    from strop.kernels.ops.nf4 import nf4_dequantize, nf4_dequantize_reference
    from strop.kernels.ops.rmsnorm import rms_norm, rms_norm_reference

    facts = {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "cudnn": torch.backends.cudnn.version() if torch.backends.cudnn.is_available() else None,
        "triton": triton.__version__,
        "bitsandbytes": bitsandbytes.__version__,
        "nvidia_wheels": sorted(
            d.metadata["Name"]
            for d in metadata.distributions()
            if d.metadata["Name"].startswith(("nvidia-", "cuda-"))
        ),
        "cc": shutil.which("gcc") or shutil.which("cc"),
        "python_h": os.path.exists(os.path.join(sysconfig.get_paths()["include"], "Python.h")),
        "cuda_available": torch.cuda.is_available(),
    }
    # the CUDA build (PyPI's Linux wheel), not the CPU one, and the toolchain Triton compiles its launcher with
    assert facts["torch_cuda"] and facts["torch_cuda"].startswith("13."), facts
    assert "+cpu" not in facts["torch"], facts
    assert facts["cc"] and facts["python_h"], f"Triton's launcher needs a C compiler and Python.h: {facts}"
    assert any(n.startswith("nvidia-cublas") for n in facts["nvidia_wheels"]), facts
    if not cpu_only:
        assert facts["cuda_available"], f"no GPU visible (driver, NVIDIA_VISIBLE_DEVICES): {facts}"
        facts["device"] = torch.cuda.get_device_name(0)
        facts["capability"] = list(torch.cuda.get_device_capability(0))
        x = torch.randn(37, 256, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(256, device="cuda", dtype=torch.bfloat16)
        y = rms_norm(x, w)  # a Triton kernel: compiled for this GPU, launched through libcuda
        torch.testing.assert_close(y, rms_norm_reference(x, w), rtol=1.6e-2, atol=1e-2)
        from bitsandbytes.functional import quantize_4bit

        packed, state = quantize_4bit(
            torch.randn(128, 256, device="cuda", dtype=torch.bfloat16),
            quant_type="nf4",
            compress_statistics=True,
        )
        assert torch.equal(nf4_dequantize(packed, state), nf4_dequantize_reference(packed, state))
        a = torch.randn(512, 512, device="cuda", dtype=torch.bfloat16)
        torch.testing.assert_close((a @ a).float(), a.float() @ a.float(), rtol=5e-2, atol=5e-1)
        torch.cuda.synchronize()
        facts["gpu_checks"] = ["triton rms_norm", "bitsandbytes nf4 + strop dequant", "cublas bf16 matmul"]
    print(json.dumps(facts))


if __name__ == "__main__":
    main(sys.argv[1:])
