"""The FP8 base GEMMs (``kernels/ops/fp8.py``) against bf16 at the 8B shapes of a 16K-token step, on the GPU.

For each projection of Llama-3-8B (q, k/v, o, gate/up, down) and direction (forward x Wᵀ, backward dy W): the bf16
GEMM cuBLAS runs on the exact path, the e4m3 rowwise-scaled GEMM alone, and the same with the rowwise quantization
of its activation operand (what the FP8 path pays per GEMM: ``quantize_rows`` then ``torch._scaled_mm``). Also the
quantizer's bandwidth. CUDA-event timing (``kernels_lora._time_ms``), median of 20 after 5 warm-ups.

    python3 bench/fp8_gemm.py [--tokens 16384]
"""

from __future__ import annotations

import argparse
from functools import partial

import torch
from kernels_lora import _time_ms  # bench/: the CUDA-event median every kernel bench uses

from strop.kernels.ops.fp8 import fp8_weight, quantize_rows

_ms = partial(_time_ms, iters=20, warmup=5)

SHAPES = {
    "q/o": (4096, 4096),
    "k/v": (1024, 4096),
    "gate/up": (14336, 4096),
    "down": (4096, 14336),
}  # (out, in)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=16384)
    n = p.parse_args().tokens
    bf16 = torch.bfloat16
    print("| GEMM | bf16 ms | fp8 GEMM ms | fp8 + quantize ms | speed-up | bf16 TFLOP/s | fp8 + q TFLOP/s |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, (out_f, in_f) in SHAPES.items():
        w = torch.randn(out_f, in_f, device="cuda", dtype=bf16) * 0.02
        f = fp8_weight(w)
        for direction, (k, width) in (("fwd", (in_f, out_f)), ("bwd dx", (out_f, in_f))):
            a = torch.randn(n, k, device="cuda", dtype=bf16)
            aq = quantize_rows(a)
            if direction == "fwd":
                exact, run = (lambda a=a, w=w: a @ w.t()), f.forward
            else:
                exact, run = (lambda a=a, w=w: a @ w), f.backward
            gemm = lambda aq=aq, run=run: run(*aq, bf16)  # noqa: E731
            full = lambda a=a, run=run: run(*quantize_rows(a), bf16)  # noqa: E731
            t_b, t_g, t_f = _ms(exact), _ms(gemm), _ms(full)
            flops = 2 * n * k * width
            print(
                f"| {name} {direction} ({n}×{k} · {k}×{width}) | {t_b:.3f} | {t_g:.3f} | {t_f:.3f} | "
                f"{t_b / t_f:.2f}× | {flops / t_b / 1e9:.0f} | {flops / t_f / 1e9:.0f} |"
            )
    x = torch.randn(n, 14336, device="cuda", dtype=bf16)
    t_q = _ms(lambda: quantize_rows(x))
    moved = x.numel() * (2 + 1) + n * 4
    print(f"\nquantize_rows [{n}, 14336] bf16: {t_q:.3f} ms, {moved / t_q / 1e6:.0f} GB/s")


if __name__ == "__main__":
    main()
