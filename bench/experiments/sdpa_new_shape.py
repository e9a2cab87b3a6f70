"""What a new sequence length costs SDPA on this GPU: the first forward + backward at each length against a repeat.

A GRPO step trains its group as one row whose length (the prompt plus the completions' sum) changes from step to
step; SDPA's cuDNN backend builds an execution graph for each new shape (torch caches them by shape), the flash and
memory-efficient backends do not. Shapes of the shared-prefix row at an 8K prompt (``kernels/trainers/
shared_prompt.py``): the prompt's causal attention ``[1, 32, P, 128]`` (GQA 8 kv heads) and the completions'
queries ``[1, 32, C, 128]`` against the prompt + completion keys under an additive mask. For each backend set, for
``--lengths`` new prompt lengths: milliseconds of the first forward + backward at that length, then the median of
three repeats; one row as each finishes.

Then the same for the training attention itself (``shared_prompt.attend``) over a GRPO group's row at an 8B
model's heads (the prompt, then ``--group`` completions of ``--completion`` inputs each), three ways: SDPA's
default order at the exact lengths; the same with the lengths in buckets (``shared_prompt.BUCKETS``, the default on
CUDA): a new length whose buckets were seen should cost a repeat; and flash + efficient + math at the exact
lengths (no cuDNN: no build, slower kernels). The repeat column is what each way costs every step.

    python3 bench/experiments/sdpa_new_shape.py [--lengths 4] [--prompt 8192] [--completions 504] [--group 8]
        [--completion 63]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

HEADS, KV_HEADS, DIM = 32, 8, 128


def _step(p: int, c: int) -> None:
    dev, dt = "cuda", torch.bfloat16
    q = torch.randn(1, HEADS, p + c, DIM, device=dev, dtype=dt, requires_grad=True)
    k = torch.randn(1, KV_HEADS, p + c, DIM, device=dev, dtype=dt, requires_grad=True)
    v = torch.randn(1, KV_HEADS, p + c, DIM, device=dev, dtype=dt, requires_grad=True)
    causal = F.scaled_dot_product_attention(
        q[:, :, :p], k[:, :, :p], v[:, :, :p], is_causal=True, enable_gqa=True
    )
    mask = torch.zeros(c, p + c, device=dev, dtype=dt)
    mask[:, p:] = torch.finfo(dt).min
    mask[:, p:].triu_(
        1
    )  # each completion query: the prompt and the keys up to itself (one sample, for shape)
    later = F.scaled_dot_product_attention(q[:, :, p:], k, v, attn_mask=mask, enable_gqa=True)
    (causal.float().sum() + later.float().sum()).backward()
    torch.cuda.synchronize()


def _ms(fn) -> float:
    torch.cuda.synchronize()
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1000


def _attend_step(p: int, group: int, n: int, buckets: bool) -> None:
    from strop.kernels.trainers import shared_prompt

    rows = shared_prompt.Rows.single(p, [n] * group)
    dev, dt = "cuda", torch.bfloat16
    # [1, L, heads, 128] transposed, as a decoder's projections hand them over
    q = torch.randn(1, rows.width, HEADS, DIM, device=dev, dtype=dt).transpose(1, 2).requires_grad_()
    k, v = (
        torch.randn(1, rows.width, KV_HEADS, DIM, device=dev, dtype=dt).transpose(1, 2).requires_grad_()
        for _ in range(2)
    )
    shared_prompt.BUCKETS = buckets
    shared_prompt.attend(rows, q, k, v).float().sum().backward()
    torch.cuda.synchronize()


def _attend_table(args) -> None:
    ways = {
        "cuDNN first, exact lengths": (False, None),
        "cuDNN first, lengths in buckets": (True, None),
        "flash + efficient + math, exact lengths": (
            False,
            [SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH],
        ),
    }
    print(f"\nshared_prompt.attend, a GRPO row: prompt + {args.group} x {args.completion} inputs, fwd + bwd")
    print("| way | prompt | first ms | repeat ms (median of 3) | first - repeat ms |")
    print("|---|---:|---:|---:|---:|", flush=True)
    for i, (name, (buckets, backends)) in enumerate(ways.items()):
        for j in range(
            args.lengths + 1
        ):  # the first length of a way warms its buckets (and flash's first call)
            p = args.prompt + 16 * ((args.lengths + 1) * i + j) + 7  # no length the other ways or table used

            def run(p=p, buckets=buckets, backends=backends):
                if backends is None:
                    _attend_step(p, args.group, args.completion, buckets)
                else:
                    with sdpa_kernel(backends):
                        _attend_step(p, args.group, args.completion, buckets)

            first = _ms(run)
            again = statistics.median(_ms(run) for _ in range(3))
            label = name + (" (warm-up length)" if j == 0 else "")
            print(f"| {label} | {p:,} | {first:.1f} | {again:.1f} | {first - again:.1f} |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--lengths", type=int, default=4)
    ap.add_argument("--prompt", type=int, default=8192)
    ap.add_argument("--completions", type=int, default=504)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--completion", type=int, default=63)
    args = ap.parse_args()
    sets = {
        "default (cuDNN first)": None,
        "flash + efficient + math": [
            SDPBackend.FLASH_ATTENTION,
            SDPBackend.EFFICIENT_ATTENTION,
            SDPBackend.MATH,
        ],
    }
    _step(256, 64)  # CUDA context, cuBLAS handles
    print("| backends | prompt | first fwd+bwd ms | repeat ms (median of 3) | first - repeat ms |")
    print("|---|---:|---:|---:|---:|", flush=True)
    for i, (name, backends) in enumerate(sets.items()):
        for j in range(args.lengths):
            p = args.prompt + 16 * (args.lengths * i + j) + 1  # a length no earlier row used

            def run(p=p, backends=backends):
                if backends is None:
                    _step(p, args.completions)
                else:
                    with sdpa_kernel(backends):
                        _step(p, args.completions)

            first = _ms(run)
            again = statistics.median(_ms(run) for _ in range(3))
            print(f"| {name} | {p:,} | {first:.1f} | {again:.1f} | {first - again:.1f} |", flush=True)
    _attend_table(args)


if __name__ == "__main__":
    main()
