"""Sweep the RMSNorm backward-with-dW launch shape on the GPU.

    python bench/rmsnorm_dw_sweep.py

Round 1 (programs per SM only, one row per loop step) stayed at 57–63% of copy bandwidth: each
program walks its rows serially with one 4096-wide row in flight, and occupancy is bounded by registers.
This sweep adds the two ways to keep more bytes in flight per program: a [rows × cols] tile per loop step
(``DW_ROWS_PER_STEP``) and software-pipelined loads (``DW_NUM_STAGES`` via ``tl.range``), with the warp
count and programs per SM. Round 2 found 2 programs/SM × 2-row tiles × 3 stages at 80% (bench/RESULTS.md);
round 3 (this grid) adds 1 program/SM and 4 stages, and the dW partials are summed and cast in one launch.
Prints a table sorted by time; every config's dW and dx are checked against the fp32 reference.
"""

from __future__ import annotations

import itertools

import torch
import triton.testing

import strop.kernels.ops.rmsnorm as rn

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
ref_dx, ref_dw = rn.rms_norm_bwd_reference(dy, x, w, 1e-5)
frozen_ms = triton.testing.do_bench(
    lambda: rn.rms_norm_bwd(dy, x, w, rstd, compute_dw=False), return_mode="median"
)
print(f"copy {copy_tbps:.2f} TB/s; frozen-weight bwd {gbytes / frozen_ms / 1e9 / copy_tbps:.0%} of copy")
rows = []
# rows per program is a power of two, so per_sm 1 / 2 / 4 are the distinct launch shapes at 16,384 rows
for per_sm, rps, stages, warps in itertools.product((1, 2, 4), (1, 2, 4), (2, 3, 4), (8,)):
    rn.DW_PROGRAMS_PER_SM, rn.DW_ROWS_PER_STEP, rn.DW_NUM_STAGES, rn.DW_NUM_WARPS = per_sm, rps, stages, warps
    rn.DW_SMEM_BYTES = 1 << 30  # sweep the exact shape asked for
    try:
        dx, dw = rn.rms_norm_bwd(dy, x, w, rstd, compute_dw=True)
        ms = triton.testing.do_bench(
            lambda: rn.rms_norm_bwd(dy, x, w, rstd, compute_dw=True), return_mode="median"
        )
    except Exception as e:  # e.g. out of shared memory or registers for this shape
        print(
            f"per_sm={per_sm} rows/step={rps} stages={stages} warps={warps}: {type(e).__name__} {str(e)[:80]}"
        )
        continue
    err_dw = ((dw.float() - ref_dw).abs().max() / ref_dw.abs().max()).item()
    err_dx = ((dx.float() - ref_dx).abs().max() / ref_dx.abs().max()).item()
    rows.append((ms, per_sm, rps, stages, warps, err_dw, err_dx))
rows.sort()
print("| programs/SM | rows/step | stages | warps | ms | TB/s | % of copy | rel err dW | rel err dx |")
print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
for ms, per_sm, rps, stages, warps, e_dw, e_dx in rows:
    tbps = gbytes / ms / 1e9
    print(
        f"| {per_sm} | {rps} | {stages} | {warps} | {ms:.3f} | {tbps:.2f} | {100 * tbps / copy_tbps:.0f} "
        f"| {e_dw:.1e} | {e_dx:.1e} |"
    )
