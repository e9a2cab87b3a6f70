"""One MoE layer's experts, forward + backward: HF + PEFT (its expert path over PEFT's merged stacks) vs strop's
grouped expert GEMM (``kernels/lora/moe.py``), on a Qwen3-30B-A3B layer's shape.

``baseline`` runs HF's experts with the implementation the model's config resolves to (``from_config`` of a
Qwen3-MoE: transformers' ``grouped_mm`` experts, torch's grouped GEMM, wherever torch has it); ``hf-eager`` is HF's
per-expert loop (``experts_implementation="eager"``). The output names the implementation the baseline ran.

Shape: hidden 2048, 128 experts of intermediate 768, 8 per token, LoRA r=16 alpha=16 on gate_up_proj and down_proj
(PEFT ``target_parameters``), bf16 experts, fp32 adapters, bf16 autocast; routing from a random router (softmax,
top-8, renormalized, as Qwen3-MoE). Reported per system: ms per forward + backward (median of --iters after
--warmup), peak allocated memory above the inputs, and the largest difference of the output and of the LoRA
gradients from HF + PEFT's (bf16 both: a sanity check, not a parity test; tests/kernels/models/test_moe_gpu.py is that).
A third system, ``strop-nf4``, runs the grouped GEMM over the same experts held in strop's NF4 storage (quantized in
place after the first two, as a 4-bit session holds them); its differences include the NF4 error of the weights
(tests/kernels/ops/test_moe_nf4.py is its parity test).

Usage (GPU machine)::

    python bench/moe_experts_bench.py --tokens 16384
    python bench/moe_experts_bench.py --tokens 16384 --profile   # and one profiled strop / strop-nf4 iteration each
    python bench/moe_experts_bench.py --smoke          # CPU, interpreter, tiny shape: checks the script only
    python bench/moe_experts_bench.py --merge          # the stack merge alone: each autotuned tile's time

``--merge`` times ``moe_gemm``'s merge kernel alone (NF4 codes, double-quantized, to a bf16 ``W + s·B·A``, rank 16)
at the layer's two stacks, gate/up [128, 1536, 2048] and down [128, 2048, 768]: every tile the autotuner tried with
its time, the tile kept, then the median of --iters merges and the bandwidth of its bytes (bf16 written, codes and
absmax codes read).
"""

from __future__ import annotations

import argparse
import statistics
import time


def build(a, device):
    import torch
    from peft import LoraConfig, get_peft_model
    from torch import nn
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    h, inter, experts, k = (64, 32, 8, 2) if a.smoke else (2048, 768, 128, 8)
    cfg = Qwen3MoeConfig(
        hidden_size=h, moe_intermediate_size=inter, num_experts=experts, num_experts_per_tok=k
    )
    dtype = torch.float32 if a.smoke else torch.bfloat16
    torch.manual_seed(0)

    class Holder(nn.Module):  # PEFT wants a model; the experts module is all this benchmark runs
        def __init__(self):
            super().__init__()
            self.experts = Qwen3MoeExperts(cfg)

    m = Holder()
    with torch.no_grad():
        m.experts.gate_up_proj.normal_(0, 0.02)
        m.experts.down_proj.normal_(0, 0.02)
    m = m.to(device=device, dtype=dtype)
    lora = LoraConfig(r=16, lora_alpha=16, target_parameters=["experts.gate_up_proj", "experts.down_proj"])
    pm = get_peft_model(m, lora)
    for p in pm.parameters():
        if p.requires_grad:
            p.data = p.data.float()
            with torch.no_grad():
                p.normal_(0, 0.02)
    x = torch.randn(a.tokens, h, device=device, dtype=dtype) * 0.1
    router = torch.randn(experts, h, device=device, dtype=dtype) * 0.02
    probs = torch.softmax((x @ router.T).float(), -1)
    w, idx = torch.topk(probs, k, -1)
    w = (w / w.sum(-1, keepdim=True)).to(dtype)
    return pm, cfg, x, idx, w


def model_experts_implementation(cfg) -> str:
    """The experts implementation a Qwen3-MoE model built from ``cfg`` dispatches to (built on the meta device)."""
    import torch
    from transformers import Qwen3MoeForCausalLM

    small = cfg.__class__(**{**cfg.to_dict(), "num_hidden_layers": 1, "vocab_size": 128})
    try:
        with torch.device("meta"):
            return Qwen3MoeForCausalLM(small).config._experts_implementation
    except Exception as err:  # cannot build it on meta here: said, and transformers' documented default run
        print(f"could not build the model to read its experts implementation ({err!r}); using 'grouped_mm'")
        return "grouped_mm"


def run_system(system, pm, x, idx, w, a):
    import torch

    from strop.kernels.lora.moe import lora_moe_experts
    from strop.kernels.models.moe_experts import expert_factors, expert_wrappers

    experts = pm.base_model.model.experts

    def strop_experts(xg, idx, w):
        base, wrappers = expert_wrappers(experts)
        parts = [expert_factors(wrappers[n], base) for n in ("gate_up_proj", "down_proj")]
        return lora_moe_experts(xg, idx, w, *parts)

    run = strop_experts if system.startswith("strop") else experts
    cuda = x.is_cuda
    xg = x.clone().requires_grad_()
    times, out, base = [], None, 0
    for i in range(a.warmup + a.iters):
        pm.zero_grad(set_to_none=True)
        xg.grad = None
        if cuda:
            torch.cuda.synchronize()
            if i == a.warmup:
                torch.cuda.reset_peak_memory_stats()
                base = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        with torch.autocast(x.device.type, dtype=torch.bfloat16, enabled=not a.smoke):
            out = run(xg, idx, w)
        out.float().square().mean().backward()
        if cuda:
            torch.cuda.synchronize()
        if i >= a.warmup:
            times.append(time.perf_counter() - t0)
    peak = (torch.cuda.max_memory_allocated() - base) / 2**30 if cuda else 0.0
    # copies: fp32 grads' .float() is the grad itself, which --profile's extra backward accumulates into
    grads = {n: p.grad.float().clone() for n, p in pm.named_parameters() if p.requires_grad}
    if a.profile and cuda and system.startswith("strop"):  # one more iteration, after the timed ones
        import os
        import sys

        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/lib, also under ``python -P``
        from lib.profile import KERNEL_KINDS, MOE_KERNEL_KINDS, profile_step

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                o = run(xg, idx, w)
            o.float().square().mean().backward()

        a.profiles[system] = profile_step(step, kinds=MOE_KERNEL_KINDS + KERNEL_KINDS)
    return statistics.median(times) * 1000, peak, out.detach().float(), grads


def merge_timings(a, device) -> None:
    """``--merge``: the merge kernel alone at the layer's gate/up and down stacks (rows print as they finish)."""
    import torch

    from strop.kernels.ops import moe_gemm
    from strop.kernels.ops.moe_gemm import Nf4Experts

    shapes = [(8, 64, 64), (8, 64, 32)] if a.smoke else [(128, 1536, 2048), (128, 2048, 768)]
    dtype = torch.float32 if a.smoke else torch.bfloat16
    print(
        "stack            tile (BLOCK_N, BLOCK_K, warps / code lookup): ms as tuned      kept         ms   GB/s",
        flush=True,
    )
    for e, n, k in shapes:
        gen = torch.Generator(device=device).manual_seed(0)
        q = Nf4Experts.quantize(torch.randn(e, n, k, device=device, generator=gen, dtype=dtype).mul_(0.02))
        fa = torch.randn(e, 16, k, device=device, generator=gen, dtype=dtype).mul_(0.02)
        fb = torch.randn(e, n, 16, device=device, generator=gen, dtype=dtype).mul_(0.02)
        out = torch.empty(e * n * k, device=device, dtype=dtype)
        moe_gemm._merge_into(out, q, fa, fb, 2.0)  # tunes on CUDA
        tuner = moe_gemm._TUNED_MERGE[0] if moe_gemm._TUNED_MERGE else None
        tried, kept = "-", "-"
        if tuner is not None:

            def tile(c):  # BLOCK_N x BLOCK_K x warps, then how a byte's codes are read (pairs or code book)
                lookup = "pairs" if c.kwargs.get("PAIRS") else "book"
                looped = f"/{c.kwargs['K_TILES']} tiles" if c.kwargs.get("K_TILES", 1) > 1 else ""
                return f"{c.kwargs['BLOCK_N']}x{c.kwargs['BLOCK_K']}x{c.num_warps}/{lookup}{looped}"

            tried = " ".join(f"{tile(c)}:{t[0]:.3f}" for c, t in tuner.configs_timings.items())
            kept = tile(tuner.best_config)
        times = []
        for _ in range(max(a.iters, 1) * 4):
            t0 = time.perf_counter()
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                moe_gemm._merge_into(out, q, fa, fb, 2.0)
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
            else:
                moe_gemm._merge_into(out, q, fa, fb, 2.0)
                times.append((time.perf_counter() - t0) * 1e3)
        ms = statistics.median(times)
        moved = out.numel() * out.element_size() + sum(
            t.numel() * t.element_size() for t in q.tensors().values()
        )
        print(f"[{e}, {n}, {k}] {tried}  {kept}  {ms:8.3f} {moved / ms / 1e6:6.0f}", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=16384)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--smoke", action="store_true")
    p.add_argument(
        "--profile", action="store_true", help="also profile one strop and strop-nf4 iteration (CUDA)"
    )
    p.add_argument(
        "--merge", action="store_true", help="time the stack merge kernel alone (each autotuned tile)"
    )
    a = p.parse_args()
    a.profiles = {}
    if a.smoke:
        import os

        os.environ.setdefault("TRITON_INTERPRET", "1")
        a.tokens, a.warmup, a.iters = 64, 0, 1
    device = "cpu" if a.smoke else "cuda"
    if a.merge:
        merge_timings(a, device)
        return
    pm, cfg, x, idx, w = build(a, device)
    impl = model_experts_implementation(cfg)
    res = {}
    for system, experts_impl in (("baseline", impl), ("hf-eager", "eager")):
        cfg._experts_implementation = experts_impl  # the experts module reads it on every call
        res[system] = run_system(system, pm, x, idx, w, a)
    res["strop"] = run_system("strop", pm, x, idx, w, a)
    from strop.kernels.models.moe_experts import quantize_experts

    quantize_experts(pm)
    if device == "cuda":
        import torch

        torch.cuda.empty_cache()
    res["strop-nf4"] = run_system("strop-nf4", pm, x, idx, w, a)
    ref_out, ref_grads = res["baseline"][2], res["baseline"][3]
    print(f"one Qwen3-30B-A3B MoE layer's experts, {a.tokens} tokens, forward + backward")
    print(
        f"baseline: HF + PEFT, experts_implementation={impl!r} (the model's); hf-eager: HF's per-expert loop"
    )
    print("system     ms      peak GiB   max|Δout|/max|out|   worst rel Δgrad")
    for s, (ms, peak, out, grads) in res.items():
        dout = float((out - ref_out).abs().max() / ref_out.abs().max())
        dg = max(float((grads[n] - g).norm() / g.norm().clamp_min(1e-30)) for n, g in ref_grads.items())
        print(f"{s:9} {ms:7.2f} {peak:9.2f} {dout:18.2e} {dg:17.2e}")
    for s, text in a.profiles.items():
        print(f"\n## {s}, {a.tokens} tokens, one forward + backward\n{text}")


if __name__ == "__main__":
    main()
