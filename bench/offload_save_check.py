"""Layers without recompute (offload ``save_layers``) on the GPU: link bandwidth, step time, peak memory.

A ~1B Llama shape (hidden 2048, intermediate 5632, 16 layers, 32/8 heads) in bf16 with LoRA r=16 on all
seven projections, one sequence of 16K tokens, HF + PEFT (no strop kernels, so nothing compiles), each
configuration on the same model in one process: offloaded checkpointing alone, then with 4, 8 and 15 of the
16 layers not recomputed. Also measures pinned host ↔ device copy bandwidth (1 GiB), the figure that
decides how many layers pay off. Prints a table and, with --json, writes the numbers.

    python3 bench/offload_save_check.py --json $OUT/offload_save.json
"""

from __future__ import annotations

import argparse
import json
import time

import torch

from strop.common.trainer_types import DEFAULT_TARGET_MODULES


def link_bandwidth(nbytes: int = 1 << 30) -> tuple[float, float]:
    """GB/s of a pinned host → device and device → host copy of ``nbytes`` (best of 3)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    out = []
    for src, dst in ((host, dev), (dev, host)):
        best = float("inf")
        for _ in range(3):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            best = min(best, time.perf_counter() - t0)
        out.append(nbytes / best / 1e9)
    return out[0], out[1]


def build(seq: int):
    import peft
    import transformers

    cfg = transformers.LlamaConfig(
        vocab_size=32000,
        hidden_size=2048,
        intermediate_size=5632,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        max_position_embeddings=seq,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
        use_cache=False,
    )
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)
    lora = peft.LoraConfig(
        r=16,
        lora_alpha=16,
        lora_dropout=0.0,
        target_modules=list(DEFAULT_TARGET_MODULES),
    )
    return peft.get_peft_model(model, lora).train()


def measure(model, ids, steps: int) -> dict:
    times, loss = [], None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(steps + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    timed = sorted(times[1:])
    return {
        "ms": timed[len(timed) // 2] * 1e3,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
        "loss": float(loss.detach()),
    }


def main() -> None:
    from strop.kernels.models import disable_offloaded_checkpointing, enable_offloaded_checkpointing

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", type=int, default=16384)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--saves", default="0,4,8,15")
    p.add_argument("--json")
    a = p.parse_args()
    h2d, d2h = link_bandwidth()
    print(f"{torch.cuda.get_device_name(0)}: pinned host→device {h2d:.1f} GB/s, device→host {d2h:.1f} GB/s")
    model = build(a.seq)
    ids = torch.randint(0, 32000, (1, a.seq), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
    rows = []
    for n in (int(x) for x in a.saves.split(",")):
        off = enable_offloaded_checkpointing(model, save_layers=n)
        r = measure(model, ids, a.steps)
        s = off.stats
        r.update(
            save_layers=n,
            prefetch_misses=s.prefetch_misses,
            saved_offloaded=s.saved_offloaded,
            saved_prefetched=s.saved_prefetched,
            copy_waits=s.copy_waits,
            host_peak_gib=s.peak_host_bytes / 2**30,
            host_left=s.host_bytes,
        )
        rows.append(r)
        disable_offloaded_checkpointing(model)
    base = rows[0]
    print(
        "| layers without recompute | ms/step | vs offload | peak GiB | host peak GiB | loss | misses | copy waits |"
    )
    print("|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in rows:
        print(
            f"| {r['save_layers']} | {r['ms']:.0f} | {base['ms'] / r['ms']:.3f}x | {r['peak_gib']:.2f} | "
            f"{r['host_peak_gib']:.2f} | {r['loss']:.5f} | {r['prefetch_misses']} | {r['copy_waits']} |"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"h2d_gbps": h2d, "d2h_gbps": d2h, "seq": a.seq, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
