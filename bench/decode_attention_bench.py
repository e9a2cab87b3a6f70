"""Benchmark: the sampler's decode attention, SDPA (what ``gqa_decode_attention`` ran before) against strop's kernel
split over the keys (``kernels/ops/decode_attention.py``), at the GRPO decode shape of an 8B model (CUDA, bf16).

Shape: one request, ``--samples`` samples x 4 query heads on each of 8 kv heads (head dim 128), over a cache of the
prompt plus one block of ``--new`` slots a sample, the sampler's additive mask (a sample sees the prompt and its own
block). Per prompt length, one row as it finishes: microseconds a call (median of ``--iters`` CUDA-event timings,
after warm-up), the floor of reading K and V once at ``--bandwidth`` TB/s, and the kernel's largest difference from
SDPA. Each call is what one layer does a decode step.

    python bench/decode_attention_bench.py [--prompts 1024,8192,32768] [--samples 8] [--new 64]
"""

from __future__ import annotations

import argparse
import functools
import statistics

import torch

from strop.kernels.ops.decode_attention import decode_attention

KV_HEADS, GROUP, DIM = 8, 4, 128


def _time(fn, iters: int) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) * 1000)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompts", default="1024,8192,32768")
    ap.add_argument("--samples", type=int, default=8)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--bandwidth", type=float, default=4.8, help="TB/s for the floor (H200: 4.8)")
    args = ap.parse_args()
    s, dt = args.samples, torch.bfloat16
    print(
        f"decode attention, 1 request x {s} samples, {KV_HEADS} kv heads x {GROUP} query heads, dim {DIM}, bf16"
    )
    print("| prompt | keys | SDPA us | split kernel us | speed-up | K/V read floor us | max diff vs SDPA |")
    print("|---:|---:|---:|---:|---:|---:|---:|", flush=True)
    for p in (int(x) for x in args.prompts.split(",")):
        length = p + s * args.new
        torch.manual_seed(0)
        q = torch.randn(1, KV_HEADS, s * GROUP, DIM, device="cuda", dtype=dt)
        k = torch.randn(1, KV_HEADS, length, DIM, device="cuda", dtype=dt)
        v = torch.randn(1, KV_HEADS, length, DIM, device="cuda", dtype=dt)
        slot = torch.arange(length, device="cuda")
        owner = torch.where(slot < p, -1, (slot - p) // args.new)
        seen = (owner[None] == -1) | (owner[None] == torch.arange(s, device="cuda")[:, None])
        mask = torch.where(seen, 0.0, torch.finfo(dt).min).to(dt)[None]  # [1, S, L]
        full = mask[:, None].repeat_interleave(
            GROUP, dim=2
        )  # [1, 1, S·g, L] as gqa_decode_attention built it
        scale = DIM**-0.5

        sdpa = functools.partial(
            torch.nn.functional.scaled_dot_product_attention, q, k, v, attn_mask=full, scale=scale
        )
        split = functools.partial(decode_attention, q, k, v, mask, GROUP, scale)
        diff = float((split().float() - sdpa().float()).abs().max())
        t_sdpa, t_split = _time(sdpa, args.iters), _time(split, args.iters)
        floor = 2 * k.numel() * k.element_size() / (args.bandwidth * 1e12) * 1e6
        print(
            f"| {p:,} | {length:,} | {t_sdpa:.1f} | {t_split:.1f} | {t_sdpa / t_split:.1f}x | {floor:.1f} | {diff:.2e} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
