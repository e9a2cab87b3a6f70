"""One MoE layer's router, forward and forward + backward: HF's ``Qwen3MoeTopKRouter`` (a linear layer, then torch's
softmax, top-k, sum, division and cast) vs the same linear layer then strop's fused router op
(``kernels/ops/moe_router.py``), on the Qwen3-30B-A3B router's shape.

Shape: --tokens rows (8 × 2048 default) of hidden 2048, 128 experts, top 8 renormalised, bf16 hidden states, router
weight and weights (as the benchmark's QLoRA model). The router weight is frozen (the default); the backward
gives the hidden states' gradient through the weights, as a training step does. Reported per system: the median
ms of --iters calls after --warmup (CUDA events), the CUDA kernels one forward + backward launches (torch's
profiler), and, for strop, the largest weight difference from HF's and the rows whose chosen experts differ
(only rows with equal logits at the k-th place may: random bf16 logits have such ties). A training step runs each
router's forward twice (the checkpointed recompute) and its backward once: the last line gives 48 layers' worth.

Usage (GPU machine)::

    python bench/moe_router_bench.py
    python bench/moe_router_bench.py --smoke     # CPU, interpreter, tiny shape: checks the script only
"""

from __future__ import annotations

import argparse
import os
import statistics


def _time(fn, iters: int, warmup: int, cuda: bool) -> float:
    import time

    import torch

    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def _kernels(fn, cuda: bool) -> int | None:
    import torch
    from torch.profiler import ProfilerActivity, profile

    if not cuda:
        return None
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8 * 2048)
    ap.add_argument("--iters", type=int, default=50)
    ap.add_argument("--warmup", type=int, default=10)
    ap.add_argument("--layers", type=int, default=48, help="layers a step, for the last line")
    ap.add_argument("--smoke", action="store_true")
    a = ap.parse_args()
    if a.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch
    from torch import nn
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    from strop.kernels.ops.moe_router import moe_router

    cuda = not a.smoke
    device = "cuda" if cuda else "cpu"
    t, h, e, k = (64, 64, 16, 4) if a.smoke else (a.tokens, 2048, 128, 8)
    iters, warmup = (2, 1) if a.smoke else (a.iters, a.warmup)
    cfg = Qwen3MoeConfig(hidden_size=h, num_experts=e, num_experts_per_tok=k, norm_topk_prob=True)
    torch.manual_seed(0)
    router = Qwen3MoeTopKRouter(cfg)
    nn.init.normal_(router.weight, std=0.02)
    router = router.to(device=device, dtype=torch.bfloat16).requires_grad_(False)
    x = torch.randn(t, h, device=device, dtype=torch.bfloat16).requires_grad_()
    dw = torch.randn(t, k, device=device, dtype=torch.bfloat16)

    def hf():
        return router(x)

    def ours():
        logits = nn.functional.linear(x, router.weight)
        w, idx = moe_router(logits, k, normalize=True, out_dtype=logits.dtype)
        return logits, w, idx

    def linear():
        return nn.functional.linear(x, router.weight), None, None

    print(f"router {t} tokens x hidden {h}, {e} experts, top {k} renormalised, bf16, on {device}", flush=True)
    print(f"{'system':<14}{'fwd ms':>9}{'fwd+bwd ms':>12}{'kernels':>9}", flush=True)
    rows = {}
    for name, fn in (("hf", hf), ("strop", ours), ("linear alone", linear)):

        def fwd(fn=fn):
            fn()

        def fwd_bwd(fn=fn, name=name):
            out = fn()
            (out[0] if name == "linear alone" else out[1]).backward(
                torch.ones_like(out[0]) if name == "linear alone" else dw
            )
            x.grad = None

        rows[name] = (_time(fwd, iters, warmup, cuda), _time(fwd_bwd, iters, warmup, cuda))
        n = _kernels(fwd_bwd, cuda)
        print(
            f"{name:<14}{rows[name][0]:>9.4f}{rows[name][1]:>12.4f}{n if n is not None else '-':>9}",
            flush=True,
        )
    with torch.no_grad():
        _, w_ref, i_ref = hf()
        _, w, i = ours()
    same = (i_ref.sort(-1).values == i.sort(-1).values).all(-1)
    print(
        f"strop vs hf: max |dw| {(w.float() - w_ref.float()).abs().max().item():.3g} where the choices agree "
        f"({(w.float() - w_ref.float())[same].abs().max().item() if same.any() else float('nan'):.3g}); "
        f"rows choosing other experts {(~same).sum().item()} of {t}",
        flush=True,
    )
    (hf_f, hf_fb), (our_f, our_fb) = rows["hf"], rows["strop"]
    saved = a.layers * ((hf_fb - our_fb) + (hf_f - our_f))
    print(
        f"a step of {a.layers} checkpointed layers (2 forwards + 1 backward each): {saved:.1f} ms less",
        flush=True,
    )


if __name__ == "__main__":
    main()
