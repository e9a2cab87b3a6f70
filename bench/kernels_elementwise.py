"""Microbenchmarks of strop's RMSNorm, RoPE, SwiGLU and fused linear cross-entropy against torch.

Run on the H200 (CUDA only):

    python bench/kernels_elementwise.py [--json PATH] [--sets 3] [--tokens 16384]

Shapes are DESIGN.md's: 16,384 tokens; RMSNorm on hidden 4,096; RoPE with 32 q / 8 kv heads × 128 on
[B=8, T=2,048] in HF's transposed-view layout; SwiGLU on intermediate 14,336; bf16. FLCE at 16,384 tokens
× vocab 128,256 × hidden 4,096 with a frozen lm_head against ``F.linear`` + fp32 ``F.cross_entropy``.

Method: the device-to-device copy bandwidth is measured first (``dst.copy_(src)``, 1 GiB, read + write).
Each op is timed with ``triton.testing.do_bench`` (median; it flushes L2 before every run) while cycling
through ``--sets`` independent input sets, so no run finds its inputs cached. Bandwidth counts each input
read once and each output written once; scratch traffic (dW partials, autograd copies) is not credited.
strop's ``bwd`` rows call the backward launchers directly; torch's call ``autograd.grad`` on a retained
graph (so they include autograd's small per-call overhead). ``fwd+bwd`` rows run both systems through
``autograd.grad`` (no accumulation into ``.grad``). FLCE peak extra memory is ``max_memory_allocated`` during one fwd+bwd minus what was allocated
before it (the inputs). Acceptance targets (DESIGN.md): RMSNorm, RoPE and SwiGLU fwd and bwd ≥ 80% of copy
bandwidth; FLCE extra memory ≤ 15% of the reference's and time no slower.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
from collections.abc import Callable
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
import triton
import triton.testing
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from strop.kernels.ops.fused_linear_ce import fused_linear_cross_entropy
from strop.kernels.ops.rmsnorm import rms_norm, rms_norm_bwd, rms_norm_fwd, rms_norm_reference
from strop.kernels.ops.rope import rope_qk, rope_qk_bwd, rope_qk_fwd
from strop.kernels.ops.swiglu import swiglu, swiglu_bwd, swiglu_fwd

BF16 = torch.bfloat16
DEVICE = "cuda"
BW_TARGET = 0.80  # fraction of copy bandwidth (DESIGN.md)
FLCE_MEM_TARGET = 0.15  # fraction of the reference's peak extra memory (DESIGN.md)


@dataclass
class Row:
    op: str
    mode: str
    system: str
    median_ms: float
    gbytes: float | None = None
    tbps: float | None = None
    pct_of_copy: float | None = None
    tflops: float | None = None
    peak_extra_gib: float | None = None
    target: str = ""
    meets: bool | None = None


def median_ms(fn: Callable[[], object], grad_to_none: list[torch.Tensor] | None = None) -> float:
    return triton.testing.do_bench(fn, warmup=25, rep=200, grad_to_none=grad_to_none, return_mode="median")


def cycling(fn: Callable, sets: list[tuple]) -> Callable[[], object]:
    """A zero-argument callable that applies ``fn`` to the next input set each call."""
    it = itertools.cycle(sets)
    return lambda: fn(*next(it))


def copy_bandwidth_tbps() -> float:
    src = torch.empty(2**29, dtype=BF16, device=DEVICE).normal_()  # 1 GiB
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    return 2 * src.nbytes / (ms * 1e-3) / 1e12


def bandwidth_rows(op: str, mode: str, nbytes: int, fns: dict[str, Callable], copy_tbps: float, target: bool):
    rows = []
    for system, fn in fns.items():
        ms = median_ms(fn)
        tbps = nbytes / (ms * 1e-3) / 1e12
        pct = 100 * tbps / copy_tbps
        strop = system == "strop" and target
        rows.append(
            Row(
                op,
                mode,
                system,
                ms,
                nbytes / 1e9,
                tbps,
                pct,
                target=f"≥ {BW_TARGET:.0%} of copy" if strop else "",
                meets=(pct >= 100 * BW_TARGET) if strop else None,
            )
        )
    return rows


def _rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return (scale * torch.randn(*shape, device=DEVICE)).to(BF16)


def bench_rmsnorm(tokens: int, n_sets: int, copy_tbps: float) -> list[Row]:
    h = 4096
    sets = []
    for _ in range(n_sets):
        x, w, dy = _rand(tokens, h), (1 + 0.1 * torch.randn(h, device=DEVICE)).to(BF16), _rand(tokens, h)
        _, rstd = rms_norm_fwd(x, w)
        xg, wg = x.clone().requires_grad_(), w.clone().requires_grad_()
        y_ref = rms_norm_reference(xg, w)
        y_ref_dw = rms_norm_reference(xg, wg)
        sets.append((x, w, dy, rstd, xg, wg, y_ref, y_ref_dw))
    row_bytes, vec_bytes, rstd_bytes = tokens * h * 2, h * 2, tokens * 4
    fwd_bytes = 2 * row_bytes + vec_bytes + rstd_bytes
    bwd_bytes = 3 * row_bytes + vec_bytes + rstd_bytes  # read dy, x, w, rstd; write dx
    rows = bandwidth_rows(
        "RMSNorm",
        "fwd",
        fwd_bytes,
        {
            "strop": cycling(lambda x, w, *_: rms_norm_fwd(x, w), sets),
            "torch": cycling(lambda x, w, *_: rms_norm_reference(x, w), sets),
        },
        copy_tbps,
        True,
    )
    rows += bandwidth_rows(
        "RMSNorm",
        "bwd (frozen w)",
        bwd_bytes,
        {
            "strop": cycling(lambda x, w, dy, rstd, *_: rms_norm_bwd(dy, x, w, rstd, compute_dw=False), sets),
            "torch": cycling(
                lambda x, w, dy, r, xg, wg, y, _: torch.autograd.grad(y, xg, dy, retain_graph=True), sets
            ),
        },
        copy_tbps,
        True,
    )
    rows += bandwidth_rows(
        "RMSNorm",
        "bwd (+dW)",
        bwd_bytes + vec_bytes,
        {
            "strop": cycling(lambda x, w, dy, rstd, *_: rms_norm_bwd(dy, x, w, rstd, compute_dw=True), sets),
            "torch": cycling(
                lambda x, w, dy, r, xg, wg, y, yw: torch.autograd.grad(yw, (xg, wg), dy, retain_graph=True),
                sets,
            ),
        },
        copy_tbps,
        True,
    )

    def fwd_bwd(op):
        return lambda x, w, dy, r, xg, *_: torch.autograd.grad(op(xg, w), xg, dy)

    rows += bandwidth_rows(
        "RMSNorm",
        "fwd+bwd",
        fwd_bytes + bwd_bytes,
        {
            "strop": cycling(fwd_bwd(rms_norm), sets),
            "torch": cycling(fwd_bwd(rms_norm_reference), sets),
        },
        copy_tbps,
        False,
    )
    return rows


def bench_rope(tokens: int, n_sets: int, copy_tbps: float) -> list[Row]:
    b, hq, hk, d = 8, 32, 8, 128
    t = tokens // b
    sets = []
    for _ in range(n_sets):
        # HF's layout: [B, T, H, D] projections viewed as [B, H, T, D].
        q_src, k_src = _rand(b, t, hq, d), _rand(b, t, hk, d)
        angles = torch.rand(b, t, d // 2, device=DEVICE) * 100
        emb = torch.cat((angles, angles), -1)
        cos, sin = emb.cos().to(BF16), emb.sin().to(BF16)
        dq, dk = _rand(b, hq, t, d), _rand(b, hk, t, d)
        qg, kg = q_src.clone().requires_grad_(), k_src.clone().requires_grad_()
        q_ref, k_ref = apply_rotary_pos_emb(qg.transpose(1, 2), kg.transpose(1, 2), cos, sin)
        sets.append((q_src.transpose(1, 2), k_src.transpose(1, 2), cos, sin, dq, dk, qg, kg, q_ref, k_ref))
    qk_bytes, cs_bytes = tokens * (hq + hk) * d * 2, 2 * tokens * d * 2
    nbytes = 2 * qk_bytes + cs_bytes  # read and write q/k, read cos/sin
    rows = bandwidth_rows(
        "RoPE (q+k)",
        "fwd",
        nbytes,
        {
            "strop": cycling(lambda q, k, c, s, *_: rope_qk_fwd(q, k, c, s), sets),
            "torch": cycling(lambda q, k, c, s, *_: apply_rotary_pos_emb(q, k, c, s), sets),
        },
        copy_tbps,
        True,
    )
    rows += bandwidth_rows(
        "RoPE (q+k)",
        "bwd",
        nbytes,
        {
            "strop": cycling(lambda q, k, c, s, dq, dk, *_: rope_qk_bwd(dq, dk, c, s), sets),
            "torch": cycling(
                lambda *a: torch.autograd.grad(a[8:10], a[6:8], a[4:6], retain_graph=True), sets
            ),
        },
        copy_tbps,
        True,
    )

    def fwd_bwd(op):
        # strop rotates the leaf projections in place, which only drifts their values (a rotation).
        return lambda q, k, c, s, dq, dk, qg, kg, *_: torch.autograd.grad(
            op(qg.transpose(1, 2), kg.transpose(1, 2), c, s), (qg, kg), (dq, dk)
        )

    rows += bandwidth_rows(
        "RoPE (q+k)",
        "fwd+bwd",
        2 * nbytes,
        {
            "strop": cycling(fwd_bwd(rope_qk), sets),
            "torch": cycling(fwd_bwd(apply_rotary_pos_emb), sets),
        },
        copy_tbps,
        False,
    )
    return rows


def bench_swiglu(tokens: int, n_sets: int, copy_tbps: float) -> list[Row]:
    inter = 14336
    sets = []
    for _ in range(n_sets):
        g, u, dh = _rand(tokens, inter, scale=3.0), _rand(tokens, inter), _rand(tokens, inter)
        gg, ug = g.clone().requires_grad_(), u.clone().requires_grad_()
        sets.append((g, u, dh, gg, ug, F.silu(gg) * ug))
    elems = tokens * inter * 2
    rows = bandwidth_rows(
        "SwiGLU",
        "fwd",
        3 * elems,
        {
            "strop": cycling(lambda g, u, *_: swiglu_fwd(g, u), sets),
            "torch": cycling(lambda g, u, *_: F.silu(g) * u, sets),
        },
        copy_tbps,
        True,
    )
    rows += bandwidth_rows(
        "SwiGLU",
        "bwd",
        5 * elems,
        {  # read dh, g, u; write dg, du
            "strop": cycling(lambda g, u, dh, *_: swiglu_bwd(dh, g, u), sets),
            "torch": cycling(
                lambda g, u, dh, gg, ug, h: torch.autograd.grad(h, (gg, ug), dh, retain_graph=True), sets
            ),
        },
        copy_tbps,
        True,
    )

    def fwd_bwd(op):
        return lambda g, u, dh, gg, ug, _: torch.autograd.grad(op(gg, ug), (gg, ug), dh)

    rows += bandwidth_rows(
        "SwiGLU",
        "fwd+bwd",
        8 * elems,
        {
            "strop": cycling(fwd_bwd(swiglu), sets),
            "torch": cycling(fwd_bwd(lambda g, u: F.silu(g) * u), sets),
        },
        copy_tbps,
        False,
    )
    return rows


def _flce_reference(hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(hidden, weight).float(), labels)


def bench_flce(tokens: int, h: int = 4096, v: int = 128256) -> list[Row]:
    hidden = _rand(tokens, h).requires_grad_()
    weight = _rand(v, h, scale=h**-0.5)  # frozen lm_head
    labels = torch.randint(0, v, (tokens,), device=DEVICE)
    labels[::8] = -100
    systems = {"strop": fused_linear_cross_entropy, "torch": _flce_reference}
    flops = 2 * 2 * tokens * h * v  # logits GEMM + d_hidden GEMM (frozen head: no dW GEMM)
    results = {}
    for system, fn in systems.items():

        def step(fn=fn):
            fn(hidden, weight, labels).backward()

        step()
        hidden.grad = None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        extra = (torch.cuda.max_memory_allocated() - base) / 2**30
        hidden.grad = None
        ms = median_ms(step, grad_to_none=[hidden])
        results[system] = (ms, extra)
    ref_ms, ref_extra = results["torch"]
    rows = []
    for system, (ms, extra) in results.items():
        strop = system == "strop"
        meets = (extra <= FLCE_MEM_TARGET * ref_extra and ms <= ref_ms) if strop else None
        target = f"mem ≤ {FLCE_MEM_TARGET:.0%} of torch, time ≤ torch" if strop else ""
        rows.append(
            Row(
                f"FLCE V={v} (frozen head)",
                "fwd+bwd",
                system,
                ms,
                tflops=flops / (ms * 1e-3) / 1e12,
                peak_extra_gib=extra,
                target=target,
                meets=meets,
            )
        )
    return rows


def markdown(rows: list[Row], copy_tbps: float) -> str:
    def fmt(x: float | None, spec: str) -> str:
        return "" if x is None else format(x, spec)

    lines = [
        f"Device-to-device copy bandwidth: {copy_tbps:.2f} TB/s",
        "",
        "| op | pass | system | median ms | GB moved | TB/s | % of copy | TFLOP/s | peak extra GiB | target | meets |",
        "|---|---|---|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        meets = "" if r.meets is None else ("yes" if r.meets else "**NO**")
        lines.append(
            f"| {r.op} | {r.mode} | {r.system} | {r.median_ms:.3f} | {fmt(r.gbytes, '.3f')} | {fmt(r.tbps, '.2f')} "
            f"| {fmt(r.pct_of_copy, '.0f')} | {fmt(r.tflops, '.0f')} | {fmt(r.peak_extra_gib, '.2f')} "
            f"| {r.target} | {meets} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--json", metavar="PATH", help="also write the numbers as JSON")
    parser.add_argument("--sets", type=int, default=3, help="input sets cycled through (default 3)")
    parser.add_argument("--tokens", type=int, default=16384, help="tokens per op (default 16,384)")
    parser.add_argument("--skip-flce", action="store_true", help="skip the fused linear CE benchmark")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("kernels_elementwise.py needs a CUDA GPU", file=sys.stderr)
        return 2
    torch.manual_seed(0)
    copy_tbps = copy_bandwidth_tbps()
    rows: list[Row] = []
    for bench in (bench_rmsnorm, bench_rope, bench_swiglu):
        rows += bench(args.tokens, args.sets, copy_tbps)
        torch.cuda.empty_cache()
    if not args.skip_flce:
        rows += bench_flce(args.tokens)
    print(markdown(rows, copy_tbps))
    if args.json:
        meta = {
            "device": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "triton": triton.__version__,
            "tokens": args.tokens,
            "sets": args.sets,
            "copy_tbps": copy_tbps,
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "rows": [asdict(r) for r in rows]}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
