"""Sweep the RMSNorm backward-with-dW launch shape on the GPU (programs per SM → rows per program).

    python bench/rmsnorm_dw_sweep.py

Prediction before running: the dW variant is latency-bound (each program walks 32 rows serially with
one 4096-wide row in flight); 2–4x more programs with 4–16 rows each should approach the frozen-weight
backward's 96% of copy bandwidth, at the price of a larger fp32 partial buffer (n_programs x 4096 x 4 B).
"""

from __future__ import annotations

import torch
import triton.testing

import strop.kernels.rmsnorm as rn

T, H = 16384, 4096
x = torch.randn(T, H, device="cuda", dtype=torch.bfloat16)
w = torch.randn(H, device="cuda", dtype=torch.bfloat16)
dy = torch.randn_like(x)
_, rstd = rn.rms_norm_fwd(x, w, 1e-5)
src = torch.empty(1 << 28, dtype=torch.uint8, device="cuda")
dst = torch.empty_like(src)
copy_ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
copy_tbps = 2 * src.numel() / copy_ms / 1e9
gbytes = 3 * T * H * 2  # read x, dy; write dx (dW and rstd are negligible)
ref = rn.rms_norm_bwd(dy, x, w, rstd, compute_dw=True)[1].float()
print(f"copy {copy_tbps:.2f} TB/s")
print("| programs/SM | rows/program | ms | TB/s | % of copy | max |dW - dW(4)| |")
print("|---:|---:|---:|---:|---:|---:|")
for per_sm in (4, 8, 16, 32, 64):
    rn.DW_PROGRAMS_PER_SM = per_sm
    ms = triton.testing.do_bench(
        lambda: rn.rms_norm_bwd(dy, x, w, rstd, compute_dw=True), return_mode="median"
    )
    dw = rn.rms_norm_bwd(dy, x, w, rstd, compute_dw=True)[1].float()
    rows = triton.next_power_of_2(triton.cdiv(T, per_sm * rn.num_sms(x.device)))
    tbps = gbytes / ms / 1e9
    print(
        f"| {per_sm} | {rows} | {ms:.3f} | {tbps:.2f} | {100 * tbps / copy_tbps:.0f} | {(dw - ref).abs().max():.2e} |"
    )
