"""Benchmark: strop's fused LoRA MLP and NF4 dequant against their floors and HF + PEFT (CUDA, bf16).

Workload: Llama-3.1-8B MLP (hidden 4096, intermediate 14336), 16,384 tokens, LoRA r=16 (alpha 16) on
gate/up/down with fp32 adapters under bf16 autocast, as strop trains. Each system runs in its own
process (``--system NAME``); the driver runs them all and prints a Markdown table.

    base_gemm          the floor: the three base GEMMs of the forward and the three dX GEMMs of the
                       backward, bf16, nothing else (what any frozen-base MLP must do)
    strop_bf16         lora_mlp forward + backward over a bf16 base
    strop_nf4          lora_mlp forward + backward over NF4 (double quant) bases, dequant included
    peft_bf16          HF LlamaMLP + PEFT LoRA forward + backward over a bf16 base
    peft_nf4           the same over bitsandbytes Linear4bit (NF4, double quant)
    dequant            NF4 → bf16 of the three MLP weights: strop's kernel vs bitsandbytes.dequantize_4bit; and
                       the host time of one dequantization call, its launch bound and not

Acceptance targets: strop_bf16 ≤ 1.3 × base_gemm, strop_nf4 ≤ 1.45 × base_gemm.

Usage::

    python bench/kernels_lora.py [--tokens 16384] [--iters 20] [--json PATH]

NF4 systems need bitsandbytes (for quantizing, and as the baseline); without it they are skipped.
Bandwidth counts each input byte read once and each output byte written once.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

HIDDEN, INTER, RANK = 4096, 14336, 16
SYSTEMS = ("base_gemm", "strop_bf16", "strop_nf4", "peft_bf16", "peft_nf4", "dequant")
TARGETS = {"strop_bf16": 1.30, "strop_nf4": 1.45}


def _time_ms(fn, iters: int, warmup: int = 3) -> float:
    """Median milliseconds per call of ``fn`` over ``iters`` CUDA-event-timed calls."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def _weights(gen: torch.Generator):
    dev = "cuda"
    w = {
        "gate": torch.randn(INTER, HIDDEN, generator=gen, device=dev) / HIDDEN**0.5,
        "up": torch.randn(INTER, HIDDEN, generator=gen, device=dev) / HIDDEN**0.5,
        "down": torch.randn(HIDDEN, INTER, generator=gen, device=dev) / INTER**0.5,
    }
    return {k: v.to(torch.bfloat16) for k, v in w.items()}


def _adapters(gen: torch.Generator):
    out = {}
    for name, (o, i) in {"gate": (INTER, HIDDEN), "up": (INTER, HIDDEN), "down": (HIDDEN, INTER)}.items():
        a = (torch.randn(RANK, i, generator=gen, device="cuda") / i**0.5).requires_grad_()
        b = (torch.randn(o, RANK, generator=gen, device="cuda") * 1e-2).requires_grad_()
        out[name] = (a, b)
    return out


def _nf4(w: torch.Tensor):
    import bitsandbytes as bnb

    return bnb.nn.Params4bit(
        w, requires_grad=False, quant_type="nf4", compress_statistics=True, blocksize=64
    ).to("cuda")


def _peak(fn) -> float:
    """Peak allocated GiB above what was allocated before ``fn`` ran."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - before) / 2**30


def _host_us_a_dequant(calls: int = 3000) -> tuple[float, float]:
    """Host µs a call of ``dequantize_shared`` (what the LoRA functions call), its launch bound (the default:
    ``nf4.BoundLaunch``'s replay) and through Triton's binding (``nf4.BIND_LAUNCHES = False``), each the least of two
    runs; on a 256 × 256 weight, whose dequantization the GPU finishes before the next call is issued, so the time is
    the host's. Every output is checked against bitsandbytes'."""
    import bitsandbytes.functional as bnbf

    from strop.kernels.ops import nf4

    p = _nf4(torch.randn(256, 256, device="cuda", dtype=torch.bfloat16))
    ref = bnbf.dequantize_4bit(p, p.quant_state)
    best = {True: float("inf"), False: float("inf")}
    try:
        for bind in (True, False, True, False):
            nf4.BIND_LAUNCHES = bind
            for _ in range(50):
                nf4.dequantize_shared(p, torch.bfloat16)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(calls):
                out = nf4.dequantize_shared(p, torch.bfloat16)
            best[bind] = min(best[bind], (time.perf_counter() - t) / calls * 1e6)
            torch.cuda.synchronize()
            assert torch.equal(out, ref)
    finally:
        nf4.BIND_LAUNCHES = True
    return best[True], best[False]


def run_system(system: str, tokens: int, iters: int) -> dict:
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(tokens, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16).requires_grad_()
    dout = torch.randn(tokens, HIDDEN, generator=gen, device="cuda").to(torch.bfloat16)
    w = _weights(gen)
    gemm_flops = 6 * 2 * tokens * HIDDEN * INTER

    if system == "base_gemm":
        xd = x.detach()

        def step():
            e, _g = xd @ w["gate"].t(), xd @ w["up"].t()
            h = e  # the floor counts GEMMs only; any [N, I] operand of the right shape will do
            _ = h @ w["down"].t()
            dh = dout @ w["down"]
            dx = dh @ w["gate"]
            dx.addmm_(dh, w["up"])

        ms = _time_ms(step, iters)
        return {"ms": ms, "tflops": gemm_flops / ms / 1e9, "peak_gib": _peak(step)}

    if system in ("strop_bf16", "strop_nf4"):
        from strop.kernels.lora import lora_mlp

        ad = _adapters(gen)
        bases = {k: (_nf4(v) if system == "strop_nf4" else v) for k, v in w.items()}
        if system == "strop_nf4":
            del w
        projs = [(bases[k], *ad[k], 1.0, None) for k in ("gate", "up", "down")]

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = lora_mlp(x, *projs)
            out.backward(dout)
            x.grad = None
            for a, b in ad.values():
                a.grad = b.grad = None

        ms = _time_ms(step, iters)
        return {"ms": ms, "tflops": gemm_flops / ms / 1e9, "peak_gib": _peak(step)}

    if system in ("peft_bf16", "peft_nf4"):
        import peft
        from transformers import LlamaConfig
        from transformers.models.llama.modeling_llama import LlamaMLP

        cfg = LlamaConfig(hidden_size=HIDDEN, intermediate_size=INTER, hidden_act="silu")
        mlp = LlamaMLP(cfg).to("cuda", torch.bfloat16)
        with torch.no_grad():
            for k in ("gate", "up", "down"):
                getattr(mlp, f"{k}_proj").weight.copy_(w[k])
        if system == "peft_nf4":
            import bitsandbytes as bnb

            for k in ("gate", "up", "down"):
                lin = getattr(mlp, f"{k}_proj")
                q = bnb.nn.Linear4bit(
                    lin.in_features,
                    lin.out_features,
                    bias=False,
                    compute_dtype=torch.bfloat16,
                    compress_statistics=True,
                    quant_type="nf4",
                )
                q.weight = bnb.nn.Params4bit(
                    lin.weight.data.cpu(), requires_grad=False, quant_type="nf4", compress_statistics=True
                )
                setattr(mlp, f"{k}_proj", q.to("cuda"))
            del w
        mlp.requires_grad_(False)
        config = peft.LoraConfig(
            r=RANK, lora_alpha=RANK, lora_dropout=0.0, target_modules=["gate_proj", "up_proj", "down_proj"]
        )
        mlp = peft.inject_adapter_in_model(config, mlp)
        for n, p in mlp.named_parameters():
            if "lora_" in n:
                p.data = p.data.float()  # fp32 adapters, as strop and the DESIGN baseline
                p.requires_grad_(True)

        def step():
            with torch.autocast("cuda", dtype=torch.bfloat16):
                out = mlp(x)
            out.backward(dout)
            x.grad = None
            for p in mlp.parameters():
                p.grad = None

        ms = _time_ms(step, iters)
        return {"ms": ms, "tflops": gemm_flops / ms / 1e9, "peak_gib": _peak(step)}

    if system == "dequant":
        import bitsandbytes.functional as bnbf

        from strop.kernels.ops.nf4 import nf4_dequantize

        params = [_nf4(v) for v in w.values()]
        outs = [torch.empty(p.quant_state.shape, dtype=torch.bfloat16, device="cuda") for p in params]
        n = sum(p.quant_state.shape[0] * p.quant_state.shape[1] for p in params)
        qs0 = params[0].quant_state
        absmax_bytes = sum(p.quant_state.absmax.numel() for p in params) * qs0.absmax.element_size()
        moved = n // 2 + absmax_bytes + 2 * n  # packed + absmax in, bf16 out

        def strop():
            for p, o in zip(params, outs, strict=True):
                nf4_dequantize(p, p.quant_state, out=o)

        def bnb_deq():
            for p, o in zip(params, outs, strict=True):
                bnbf.dequantize_4bit(p, p.quant_state, out=o)

        # bit-exactness at the real size, while we are here
        for p in params:
            assert torch.equal(nf4_dequantize(p, p.quant_state), bnbf.dequantize_4bit(p, p.quant_state))
        ms_s, ms_b = _time_ms(strop, iters), _time_ms(bnb_deq, iters)
        bound, unbound = _host_us_a_dequant()
        return {
            "ms": ms_s,
            "bnb_ms": ms_b,
            "gbps": moved / ms_s / 1e6,
            "bnb_gbps": moved / ms_b / 1e6,
            "host_us": bound,
            "host_us_unbound": unbound,
        }

    raise ValueError(f"unknown system {system!r}")


def _subprocess(system: str, args) -> dict:
    cmd = [
        sys.executable,
        __file__,
        "--system",
        system,
        "--tokens",
        str(args.tokens),
        "--iters",
        str(args.iters),
    ]
    proc = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTORCH_ALLOC_CONF": "expandable_segments:True"},
    )
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-3:]
        return {"error": " | ".join(tail)}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _table(results: dict, tokens: int) -> str:
    floor = results.get("base_gemm", {}).get("ms")
    lines = [
        f"LoRA MLP, Llama-3.1-8B shapes, {tokens:,} tokens, r={RANK}, bf16 ({torch.cuda.get_device_name()})",
        "",
        "| system | ms (fwd+bwd) | × base GEMMs | target | GEMM TFLOP/s | peak GiB |",
        "|---|---|---|---|---|---|",
    ]
    for name in ("base_gemm", "strop_bf16", "strop_nf4", "peft_bf16", "peft_nf4"):
        r = results.get(name)
        if r is None:
            continue
        if "error" in r:
            lines.append(f"| {name} | skipped: {r['error'][:80]} | | | | |")
            continue
        ratio = r["ms"] / floor if floor else float("nan")
        target = TARGETS.get(name)
        verdict = "" if target is None else (f"≤ {target} ✓" if ratio <= target else f"≤ {target} ✗")
        lines.append(
            f"| {name} | {r['ms']:.2f} | {ratio:.3f} | {verdict} | {r['tflops']:.0f} | {r['peak_gib']:.2f} |"
        )
    d = results.get("dequant")
    if d is not None:
        lines += ["", "| NF4 → bf16, three MLP weights | ms | GB/s |", "|---|---|---|"]
        if "error" in d:
            lines.append(f"| skipped: {d['error'][:80]} | | |")
        else:
            lines.append(f"| strop nf4_dequantize | {d['ms']:.3f} | {d['gbps']:.0f} |")
            lines.append(f"| bitsandbytes dequantize_4bit | {d['bnb_ms']:.3f} | {d['bnb_gbps']:.0f} |")
            lines.append(
                f"\nHost time a dequantize_shared call: {d['host_us']:.1f} µs, the launch bound; "
                f"{d['host_us_unbound']:.1f} µs through Triton's binding."
            )
            if floor:
                lines.append(
                    f"\nDequant share of strop_nf4 (two passes: forward and backward): {2 * d['ms']:.2f} ms, {2 * d['ms'] / floor:.1%} of the base GEMMs."
                )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--json", metavar="PATH", help="write the numbers here")
    parser.add_argument("--system", choices=SYSTEMS, help="run one system in this process (internal)")
    parser.add_argument("--systems", default=",".join(SYSTEMS), help="comma-separated subset to run")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("kernels_lora.py needs a CUDA GPU")
    if args.system:
        print(json.dumps(run_system(args.system, args.tokens, args.iters)))
        return
    results = {}
    for system in args.systems.split(","):
        t = time.time()
        results[system] = _subprocess(system, args)
        print(f"{system}: {results[system]} ({time.time() - t:.0f} s)", file=sys.stderr)
    print(_table(results, args.tokens))
    if args.json:
        meta = {
            "gpu": torch.cuda.get_device_name(),
            "torch": torch.__version__,
            "tokens": args.tokens,
            "hidden": HIDDEN,
            "intermediate": INTER,
            "rank": RANK,
            "targets": TARGETS,
        }
        with open(args.json, "w") as f:
            json.dump({"meta": meta, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
