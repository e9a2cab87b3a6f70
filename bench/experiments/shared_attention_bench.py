"""Attention cost of prompt sharing on the H200, DPO-bench shapes (4 pairs, prompt 512 + completions 512; 32 query
heads of 128, 8 KV heads repeated as HF's SDPA path does with a mask): forward + backward, ms per call.

    unshared   [8, 32, 1024, 128], is_causal (what TRL's rows run: flash)
    shared     [4, 32, 1536, 128] with the [4, 1, 1536, 1536] boolean mask (what shared_prompt.py runs)
    split      [4, 32, 1024, 128] is_causal for prompt + chosen, and [4, 32, 512, 128] queries of the rejected
               completion over [prompt | rejected] keys with a lower-right causal mask (two calls, no dense mask)
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F
from torch.nn.attention.bias import causal_lower_right

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
    from strop.kernels.trainers.shared_prompt import share_prompts
    from tests.kernels.trainers.test_shared_prompt import _batch

    ids, am, cm = _batch(prompts=(512,) * 4, chosen=(512,) * 4, rejected=(512,) * 4)
    mask = share_prompts(ids.cuda(), am.cuda(), cm.cuda(), attn_implementation="sdpa").attention_mask
    h, d = 32, 128

    def qkv(b, t, s=None):
        s = s or t
        q = torch.randn(b, h, t, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = torch.randn(b, h, s, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        return q, k, v

    def fwd_bwd(q, k, v, **kw):
        def run():
            o = F.scaled_dot_product_attention(q, k, v, **kw)
            o.backward(torch.ones_like(o))

        return run

    q, k, v = qkv(8, 1024)
    print(f"unshared is_causal       {timed(fwd_bwd(q, k, v, is_causal=True)):7.3f} ms", flush=True)
    q, k, v = qkv(4, 1536)
    print(f"shared boolean mask      {timed(fwd_bwd(q, k, v, attn_mask=mask)):7.3f} ms", flush=True)
    q1, k1, v1 = qkv(4, 1024)
    q2, k2, v2 = qkv(4, 512, 1024)
    both = (fwd_bwd(q1, k1, v1, is_causal=True), fwd_bwd(q2, k2, v2, attn_mask=causal_lower_right(512, 1024)))
    print(f"split, two calls         {timed(lambda: [f() for f in both]):7.3f} ms", flush=True)


if __name__ == "__main__":
    main()
