"""How far the H200's e4m3 GEMM (``torch._scaled_mm``, rowwise scales) lands from the fp64 product of its
dequantized operands, in units of the e8m13 accumulator's rounding on Σ|â||b̂| — the model behind the bound of
``tests/kernels/ops/test_fp8.py`` (at most K roundings of 2⁻¹³ each; an fp32 accumulator would show ~2⁻¹⁰ of a unit).

    python3 bench/fp8_accumulator.py
"""

from __future__ import annotations

import torch

from strop.kernels.ops.fp8 import fp8_weight, quantize_rows


def main() -> None:
    torch.manual_seed(0)
    print("| M × K × N | max excess over bf16 rounding / (2⁻¹³ Σ|â||b̂|) | max |y − ŷ| / Σ|â||b̂| |")
    print("|---|---:|---:|")
    for m, k, n in [(33, 64, 48), (16, 224, 96), (256, 4096, 512), (256, 14336, 512)]:
        x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        w = (torch.randn(n, k, device="cuda") * 0.05).to(torch.bfloat16)
        f = fp8_weight(w)
        xq, xs = quantize_rows(x)
        y = f.forward(xq, xs, torch.bfloat16).double()
        a_hat = xq.double() * xs.double()
        b_hat = (f.w.double() * f.w_scale.t().double()).t()
        emu = a_hat @ b_hat
        total = a_hat.abs() @ b_hat.abs()
        excess = ((y - emu).abs() - 2.0**-8 * emu.abs()).clamp_min(0)
        print(
            f"| {m} × {k} × {n} | {(excess / (2.0**-13 * total)).max().item():.3f} | "
            f"{((y - emu).abs() / total).max().item():.2e} |"
        )


if __name__ == "__main__":
    main()
