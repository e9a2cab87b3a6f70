"""Memory check on the 8B QLoRA shape at batch 1: plain HF checkpointing vs strop's memory features.

For each sequence length and system, one fresh process loads the Llama-3.1-8B-shape model with random
weights, NF4 double-quantized on load (``bench/lib/harness.py``'s saved dir and ``load_model``, written
once per machine before any point runs), attaches LoRA r=16 on all seven projections, and runs two
training steps (bf16 autocast, AdamW on the LoRA weights; the first warms the allocators, pinned host
memory included). Reported per point: peak allocated and reserved GPU memory over both steps, host RSS
before the steps and at peak (its high-water mark reset after loading), host bytes held by offloaded
activations (strop's own accounting), and the second step's time.

Systems:
    hf      transformers + PEFT, gradient checkpointing (use_reentrant=False): DESIGN.md's baseline recipe
    patch   hf + ``strop.kernels.models.patch_model`` (fused kernels, chunked CE), plain checkpointing
    strop   patch + ``strop.kernels.models.memory.enable_memory_features`` (offloaded checkpointing, tiled MLP)
            (``patch_model`` is skipped, with a note, where it is not importable)

Usage (on the GPU machine; each point is its own subprocess, an OOM is reported as such)::

    python bench/memory_check.py --seq 16384,65536,131072,262144 --systems hf,strop
    python bench/memory_check.py --seq 262144 --systems strop --tiled-mlp-chunks auto --json bench/out/mem.json

Host RSS counts what the process maps: pinned host buffers for offloaded activations appear in it (torch's
pinned allocator rounds each block up to a power of two, so RSS can exceed the offloaded bytes).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass

# bench/ on sys.path, also under ``python -P``: the scripts import the harness as the package bench/lib
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lib import harness  # the saved 8B shape and the baseline's loading recipe

SYSTEMS = ("hf", "patch", "strop")


@dataclass
class Point:
    system: str
    seq: int
    ok: bool = True
    error: str = ""
    peak_alloc_gib: float = 0.0
    peak_reserved_gib: float = 0.0
    rss_before_gib: float = 0.0
    rss_peak_gib: float = 0.0
    offload_host_peak_gib: float = 0.0
    step_s: float = 0.0
    loss: float = 0.0
    notes: str = ""


def _rss_now_gib() -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 2**20
    return 0.0


def run_worker(a: argparse.Namespace) -> Point:
    import torch

    w = harness.workload("qlora", smoke=False)

    point = Point(a.system, a.seq)
    notes = []
    model = harness.attach_lora(w.load_model(qlora=True))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    report = None
    if a.system in ("patch", "strop"):
        try:
            from strop.kernels.models import patch_model
        except ImportError as e:
            notes.append(f"patch_model not importable ({e})")
        else:
            patch_model(model)
            notes.append("patch_model")
    if a.system == "strop":
        from strop.kernels.models.memory import enable_memory_features

        chunks = a.tiled_mlp_chunks if a.tiled_mlp_chunks in ("auto", None) else int(a.tiled_mlp_chunks)
        report = enable_memory_features(model, tiled_mlp_chunks=chunks)
        notes.append(f"memory features: {report.summary()}")
    model.train()
    gen = torch.Generator(device="cuda").manual_seed(1234)
    ids = torch.randint(0, w.shape["vocab"], (1, a.seq), device="cuda", generator=gen)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    if note := w.reset_peak_memory().strip():
        notes.append(note)
    point.rss_before_gib = _rss_now_gib()
    for _ in range(2):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        point.step_s = time.perf_counter() - t0
        point.loss = float(loss.detach())
    point.peak_alloc_gib = torch.cuda.max_memory_allocated() / 2**30
    point.peak_reserved_gib = torch.cuda.max_memory_reserved() / 2**30
    point.rss_peak_gib = harness.host_peak_rss_gib()
    if report is not None and report.offloader is not None:
        point.offload_host_peak_gib = report.offloader.stats.peak_host_bytes / 2**30
        notes.append(f"offload stats: {report.offloader!r}")
    point.notes = "; ".join(notes)
    return point


def spawn(system: str, seq: int, a: argparse.Namespace) -> Point:
    env = {**os.environ, "PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", "--system", system, "--seq", str(seq)]
    cmd += ["--tiled-mlp-chunks", str(a.tiled_mlp_chunks)]
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout)
    except subprocess.TimeoutExpired:
        return Point(system, seq, ok=False, error=f"timeout after {a.timeout}s")
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return Point(**json.loads(line[7:]))
    tail = (proc.stderr or proc.stdout)[-1500:]
    oom = "OutOfMemoryError" in tail or "out of memory" in tail
    return Point(system, seq, ok=False, error="OOM" if oom else f"rc={proc.returncode}: {tail}")


def table(points: list[Point]) -> str:
    rows = [
        "| seq | system | peak alloc GiB | peak reserved GiB | host RSS before / peak GiB | offloaded host peak GiB "
        "| step s | loss |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for p in points:
        if not p.ok:
            rows.append(f"| {p.seq:,} | {p.system} | {p.error[:60]} | | | | | |")
            continue
        rows.append(
            f"| {p.seq:,} | {p.system} | {p.peak_alloc_gib:.1f} | {p.peak_reserved_gib:.1f} | "
            f"{p.rss_before_gib:.1f} / {p.rss_peak_gib:.1f} | {p.offload_host_peak_gib:.1f} | {p.step_s:.2f} | "
            f"{p.loss:.4f} |"
        )
    return "\n".join(rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq", default="16384,65536", help="comma-separated sequence lengths (batch 1)")
    p.add_argument("--systems", default="hf,strop", help=f"comma-separated, from {SYSTEMS}")
    p.add_argument("--tiled-mlp-chunks", default="auto", help="'auto' or a chunk count for the strop system")
    p.add_argument("--timeout", type=int, default=1200)
    p.add_argument("--json")
    p.add_argument("--worker", action="store_true")
    p.add_argument("--system", default="hf")
    a = p.parse_args()
    if a.worker:
        a.seq = int(a.seq)
        try:
            point = run_worker(a)
        except Exception as exc:  # reported, not raised: the parent records it
            import traceback

            traceback.print_exc()
            oom = "OutOfMemoryError" in type(exc).__name__ or "out of memory" in str(exc)
            point = Point(a.system, a.seq, ok=False, error="OOM" if oom else repr(exc)[:300])
        print("RESULT " + json.dumps(asdict(point)), flush=True)
        return
    systems = a.systems.split(",")
    unknown = sorted(set(systems) - set(SYSTEMS))
    if unknown:
        p.error(f"unknown systems {unknown}; choose from {SYSTEMS}")
    harness.workload("qlora", smoke=False).ensure_saved_model(max(int(s) for s in a.seq.split(",")), "qlora")
    points = []
    for system in systems:
        for seq in (int(s) for s in a.seq.split(",")):
            point = spawn(system, seq, a)
            points.append(point)
            status = (
                f"{point.peak_alloc_gib:.1f} GiB, {point.step_s:.2f} s" if point.ok else point.error[:200]
            )
            print(f"{system} {seq}: {status}", flush=True)
            if not point.ok and point.error == "OOM":
                break  # longer sequences will not fit either
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump([asdict(x) for x in points], f, indent=1)
    print(table(points))


if __name__ == "__main__":
    main()
