"""Attention cost of prompt sharing on the H200, DPO-bench shapes (4 pairs, prompt 512 + completions 512; 32 query
heads / 8 kv heads of 128, as the 8B): forward + backward of one layer's attention, ms per call.

    TRL's rows      [8, 32, 1024, 128], is_causal, grouped heads (what the unshared batch runs)
    gathered        the shared batch's q, k, v gathered into TRL's rows, is_causal there, the output gathered back
                    (``shared_prompt.py`` before the shared-prefix attention became its one owner)
    attend          ``shared_prompt.attend``: [4, 32, 1024, 128] is_causal for prompt + chosen, and the rejected
                    completion's [4, 32, 512, 128] queries over [prompt | rejected] keys with a lower-right causal bias

``--prompt/--completion`` change the shape; ``--pairs 1 --prompt 16384 --completion 16384`` is the long-context
shape, where the gathered path's share of memory traffic is smaller and attention's FLOPs dominate; ``--ragged``
gives the pairs other lengths, as real data has (TRL's rows then run a causal-and-padding mask, ``attend`` its
masked call).
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")


def timed(fn, reps=20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> None:
    from strop.kernels.trainers import shared_prompt
    from tests.kernels.trainers.test_shared_prompt import _batch

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=4)
    p.add_argument("--prompt", type=int, default=512)
    p.add_argument("--completion", type=int, default=512)
    p.add_argument(
        "--ragged",
        action="store_true",
        help="pairs of other lengths (pair i: prompt + 32i, completions − 64i, − 32i)",
    )
    a = p.parse_args()
    b, pr, c = a.pairs, a.prompt, a.completion
    step = (32, 64, 32) if a.ragged else (0, 0, 0)
    prompts, chosen, rejected = (
        [n + sign * s * i for i in range(b)] for n, sign, s in zip((pr, c, c), (1, -1, -1), step, strict=True)
    )
    ids, am, cm = _batch(prompts=prompts, chosen=chosen, rejected=rejected)
    ids, am, cm = ids.cuda(), am.cuda(), cm.cuda()
    shared = shared_prompt.share_prompts(ids, am, cm, attn_implementation="sdpa")
    hq, hkv, d, width, t = 32, 8, 128, shared.rows.width, ids.shape[1]
    index = shared.index.reshape(-1)
    valid = am.bool().reshape(-1)
    # each shared position's place in TRL's rows (a prompt position's copies in both rows compute the same output;
    # a padding position of the shared rows takes any)
    source = torch.zeros(b * width, dtype=torch.long, device="cuda")
    source[index[valid]] = torch.arange(index.numel(), device="cuda")[valid]
    # TRL's rows with padding run HF's SDPA with a causal-and-padding mask and the kv heads repeated
    pos = torch.arange(t, device="cuda")
    rows_mask = (
        None if bool(am.all()) else ((pos[:, None] >= pos[None, :]) & am.bool()[:, None, :]).unsqueeze(1)
    )

    def sdpa_rows(q, k, v):
        if rows_mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        k, v = k.repeat_interleave(hq // hkv, 1), v.repeat_interleave(hq // hkv, 1)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=rows_mask)

    def leaf(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, requires_grad=True)

    def fwd_bwd(run):
        def step():
            o = run()
            o.backward(torch.ones_like(o))

        return step

    q, k, v = leaf(2 * b, hq, t, d), leaf(2 * b, hkv, t, d), leaf(2 * b, hkv, t, d)
    rows = fwd_bwd(lambda: sdpa_rows(q, k, v))
    how = "is_causal" if rows_mask is None else "masked"
    print(f"pairs {list(zip(prompts, chosen, rejected, strict=True))}", flush=True)
    print(f"TRL's rows [{2 * b}, {hq}, {t}, {d}] {how:9}   {timed(rows):8.3f} ms", flush=True)

    qs, ks, vs = leaf(b, hq, width, d), leaf(b, hkv, width, d), leaf(b, hkv, width, d)

    def gathered():
        def to_rows(x):
            flat = x.transpose(1, 2).reshape(b * width, x.shape[1], d)
            return flat.index_select(0, index).view(2 * b, t, x.shape[1], d).transpose(1, 2)

        out = sdpa_rows(to_rows(qs), to_rows(ks), to_rows(vs))
        flat = out.transpose(1, 2).reshape(2 * b * t, hq, d)
        return flat.index_select(0, source).view(b, width, hq, d)

    print(f"gathered to TRL's rows and back        {timed(fwd_bwd(gathered)):8.3f} ms", flush=True)
    new = fwd_bwd(lambda: shared_prompt.attend(shared.rows, qs, ks, vs))
    how = "causal + lower-right" if shared.rows.lower_right() else "causal + masked"
    print(f"attend ({how})          {timed(new):8.3f} ms", flush=True)


if __name__ == "__main__":
    main()
