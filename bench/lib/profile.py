"""The bench's profiler toolkit: one step under ``torch.profiler`` summarised (top GPU kernels, GPU time by kernel
kind, GPU idle time by what the host was doing), what was allocated at a step's memory peak, and ``phase:``
labels on a trainer's methods so idle time is attributed to them. CUDA only; the scripts call it for
``--profile``.
"""

from __future__ import annotations

import re
import time


def profile_step(step, kinds=None) -> str:
    """One step under torch.profiler, summarised by :func:`profile_summary` (``kinds``: :func:`gpu_timeline`'s)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    return profile_summary(prof, time.perf_counter() - t0, kinds)


def profile_summary(prof, wall: float, kinds=None) -> str:
    """A profiled step's wall and GPU busy time, the top GPU kernels by total time, and the top host ops by self
    CPU time (a step whose GPU idles waits on them: Python, launches, syncs)."""
    averages = prof.key_averages()
    events = [e for e in averages if e.device_type.name == "CUDA" and not e.key.startswith("phase:")]
    total = sum(e.self_device_time_total for e in events)
    events.sort(key=lambda e: -e.self_device_time_total)
    lines = [
        f"step {wall * 1e3:.0f} ms under the profiler; GPU busy {total / 1e3:.0f} ms in "
        f"{sum(e.count for e in events)} kernels; top 25 by self time:"
    ]
    for e in events[:25]:
        share = e.self_device_time_total / total
        lines.append(f"  {e.self_device_time_total / 1e3:8.1f} ms {share:6.1%} x{e.count:<5d} {e.key[:110]}")
    lines.extend(gpu_timeline(prof, kinds))
    host = sorted((e for e in averages if e.device_type.name == "CPU"), key=lambda e: -e.self_cpu_time_total)
    lines.append("top 15 host ops by self CPU time (total, per call):")
    for e in host[:15]:
        per = e.self_cpu_time_total / max(e.count, 1)
        lines.append(f"  {e.self_cpu_time_total / 1e3:8.1f} ms {per:8.1f} us x{e.count:<5d} {e.key[:100]}")
    return "\n".join(lines)


KERNEL_KINDS = (  # (kind, pattern over the kernel's name), first match wins
    ("copy", r"^Memcpy|^Memset"),
    ("GEMM", r"nvjet|gemm|cutlass|sm90_xmma|splitK"),
    ("attention", r"sdpa|flash|fmha|cudnn"),
    ("gather/scatter", r"index|scatter|gather"),
    ("strop triton", r"^_|fused_linear_ce"),
    ("nf4 (bitsandbytes)", r"kDequantize|kgemm_4bit"),
)

MOE_KERNEL_KINDS = (  # an MoE step's own kinds, put ahead of KERNEL_KINDS (bench/moe_bench.py, moe_experts_bench.py)
    ("grouped GEMM (experts)", r"GroupProblemShape|[Gg]rouped|group_gemm|grouped_mm"),
    ("NF4 dequant / expert merge (strop)", r"_nf4_dequant|_merge_kernel"),
    ("router: topk/sort/softmax/searchsorted", r"topk|[Ss]ort|softmax|searchsorted|bitonic|radix"),
    ("index/gather/scatter/row sum (permutation)", r"index|scatter|gather|_sum_rows"),
    ("SwiGLU (strop)", r"_swiglu"),
    ("elementwise/reduce (torch)", r"elementwise|reduce_kernel|unrolled|CatArrayBatched|fill"),
)


def gpu_timeline(prof, kinds=None) -> list[str]:
    """Where a profiled step's GPU time goes: self time and launches by kernel kind (``kinds``: (kind, name
    pattern) pairs, first match wins; :data:`KERNEL_KINDS` by default); how long the GPU computed at all (union
    of the non-copy kernels' intervals over the span from the first kernel to the last), the rest of the span
    being the GPU waiting on the host (launches, Python, syncs); and that idle time by what the host was doing
    when it began: the ``phase:`` range (``label_phases``) and the innermost host op open at that moment."""
    import bisect

    events = prof.events()
    kernels = [  # record_function ranges (the phases) are mirrored on the device timeline: not kernels
        e
        for e in events
        if e.device_type.name == "CUDA"
        and e.time_range.end > e.time_range.start
        and not e.name.startswith("phase:")
        and not getattr(e, "is_user_annotation", False)
    ]
    if not kernels:
        return []
    patterns = [(k, re.compile(pat)) for k, pat in (kinds or KERNEL_KINDS)]
    by_kind: dict[str, list[float]] = {}  # kind: [GPU µs, launches]
    spans = []
    for e in kernels:
        kind = next((k for k, pat in patterns if pat.search(e.name)), "other")
        tally = by_kind.setdefault(kind, [0.0, 0])
        tally[0] += e.time_range.end - e.time_range.start
        tally[1] += 1
        if kind != "copy":
            spans.append((e.time_range.start, e.time_range.end))
    spans.sort()
    gaps = []  # (start, length) of each stretch with no compute kernel running
    busy, cur_s, cur_e = 0.0, *spans[0]
    for s, e in spans[1:]:
        if s > cur_e:
            busy += cur_e - cur_s
            gaps.append((cur_e, s - cur_e))
            cur_s, cur_e = s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = max(e.time_range.end for e in kernels) - min(e.time_range.start for e in kernels)
    out = [
        f"GPU span {span / 1e3:.0f} ms: computing {busy / 1e3:.0f} ms, idle {(span - busy) / 1e3:.0f} ms "
        f"({(span - busy) / span:.1%}) in {len(gaps)} gaps; by kind:"
    ]
    out += [
        f"  {v / 1e3:8.1f} ms x{n:<6d} {k}" for k, (v, n) in sorted(by_kind.items(), key=lambda kv: -kv[1][0])
    ]
    cpu = sorted(
        (e for e in events if e.device_type.name == "CPU" and e.time_range.end > e.time_range.start),
        key=lambda e: e.time_range.start,
    )
    phases = [e for e in cpu if e.name.startswith("phase:")]
    starts = [e.time_range.start for e in cpu]
    by_phase: dict[str, float] = {}
    by_op: dict[str, float] = {}
    for t, length in gaps:
        open_phases = [p for p in phases if p.time_range.start <= t <= p.time_range.end]
        phase = max(open_phases, key=lambda p: p.time_range.start).name if open_phases else "phase:none"
        by_phase[phase] = by_phase.get(phase, 0.0) + length
        if length < 20:  # µs: launch latency, not worth naming
            continue
        inner, end = None, bisect.bisect_right(starts, t)
        for e in reversed(cpu[max(0, end - 400) : end]):  # the innermost op started last; 400 back is plenty
            if e.time_range.end >= t and not e.name.startswith("phase:"):
                inner = e.name
                break
        by_op[inner or "?"] = by_op.get(inner or "?", 0.0) + length
    out.append("GPU idle by the host's phase when the gap began:")
    out += [f"  {v / 1e3:8.1f} ms  {k}" for k, v in sorted(by_phase.items(), key=lambda kv: -kv[1])]
    out.append("GPU idle (gaps of 20 us or more) by the innermost host op open when the gap began, top 12:")
    out += [f"  {v / 1e3:8.1f} ms  {k[:100]}" for k, v in sorted(by_op.items(), key=lambda kv: -kv[1])[:12]]
    return out


# the innermost frame worth naming in a stack: strop's, the libraries it patches or drives, or the bench's
OUR_FRAMES = re.compile(r"strop|/kernels/|transformers/|peft/|trl/|/bench/")
# CUDA runtime calls that wait for the device (``cudaMemcpyAsync`` waits only into pageable memory, which the
# profiler does not say, so it is not counted)
SYNC_CALLS = frozenset(
    {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy"}
)


def sync_sites(step, top: int = 12) -> str:
    """Run ``step`` under torch.profiler with Python stacks and say where the host waited for the GPU: each
    synchronizing CUDA runtime call (``SYNC_CALLS``) grouped by the innermost ``OUR_FRAMES`` frame enclosing it, with
    its count and the host time spent in the call. A step of its own, not :func:`profile_step`'s: recording stacks
    adds host time to every op, which would move the GPU idle time that profile attributes."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    # no synchronize of our own inside: it would be the largest wait; the host-side calls are all that is read
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
        step()
    torch.cuda.synchronize()
    groups: dict[str, list[float]] = {}
    for ev in prof.events():
        if ev.name not in SYNC_CALLS:
            continue
        site, parent = "?", ev
        while parent is not None:
            # with_stack records Python calls as events named "file(line): function" enclosing the ops
            frame = next((f for f in (parent.stack or [parent.name]) if OUR_FRAMES.search(f)), None)
            if frame is not None:
                site = frame.split("/")[-1][:100]
                break
            parent = parent.cpu_parent
        g = groups.setdefault(f"{ev.name}: {site}", [0, 0.0])
        g[0] += 1
        g[1] += ev.cpu_time_total / 1e3
    if not groups:
        return "host waits for the GPU: none recorded in the step"
    lines = ["host waits for the GPU in the step (synchronizing CUDA calls, by the code that made them):"]
    for key, (n, ms) in sorted(groups.items(), key=lambda kv: -kv[1][1])[:top]:
        lines.append(f"  {ms:8.2f} ms x{n:<4d} {key[:150]}")
    return "\n".join(lines)


def memory_at_peak(step, top: int = 14) -> str:
    """Run ``step`` under CUDA's allocation history and say what was allocated at its peak: the blocks the step
    allocated and still held at that moment, grouped by the innermost frame in strop, transformers, peft, trl or
    bench/ (allocations from before the step, the weights and optimizer state, are the baseline)."""
    import torch

    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=1_000_000)
    try:
        step()
        torch.cuda.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][torch.cuda.current_device()]
    sizes: dict[int, int] = {}
    cur = peak = peak_at = 0
    for i, ev in enumerate(trace):
        if ev["action"] == "alloc":
            sizes[ev["addr"]] = ev["size"]
            cur += ev["size"]
            if cur > peak:
                peak, peak_at = cur, i
        elif ev["action"] == "free_requested" and ev["addr"] in sizes:  # what the allocator stops counting
            cur -= sizes.pop(ev["addr"])
    live: dict[int, dict] = {}
    for ev in trace[: peak_at + 1]:
        if ev["action"] == "alloc":
            live[ev["addr"]] = ev
        elif ev["action"] == "free_requested":
            live.pop(ev["addr"], None)
    groups: dict[str, list[int]] = {}
    for ev in live.values():
        frame = next((f for f in ev.get("frames", []) if OUR_FRAMES.search(f["filename"])), None)
        key = "?" if frame is None else f"{frame['filename'].split('/')[-1]}:{frame['line']} {frame['name']}"
        g = groups.setdefault(key, [0, 0])
        g[0] += ev["size"]
        g[1] += 1
    lines = [
        f"memory at the step's peak: {base / 2**30:.2f} GiB before the step + {peak / 2**30:.2f} GiB the step "
        f"held then ({len(live)} blocks); by innermost frame:"
    ]
    for key, (nbytes, n) in sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"  {nbytes / 2**30:7.3f} GiB x{n:<4d} {key[:110]}")
    return "\n".join(lines)


def label_phases(obj, **methods: str) -> None:
    """Wrap ``obj``'s methods (attribute name → label) in ``torch.profiler.record_function("phase:<label>")`` so
    a profiled step's idle GPU time is attributed to them (:func:`gpu_timeline`); costs nothing unprofiled."""
    import functools

    import torch

    for name, label in methods.items():
        fn = getattr(obj, name)

        def wrapped(*args, _fn=fn, _label=label, **kwargs):
            with torch.profiler.record_function(f"phase:{_label}"):
                return _fn(*args, **kwargs)

        functools.update_wrapper(wrapped, fn)
        setattr(obj, name, wrapped)
