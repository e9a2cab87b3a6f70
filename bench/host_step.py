"""Host time of a training step on this CPU, kernels stubbed: strop's patched layers against HF + PEFT's (issue 39).

At the 1B shape a step's GPU work is short enough that the host's Python, autograd bookkeeping and launches per
layer can set the pace (bench/RESULTS.md, session 7: 410 ms a step against 287 ms of GPU work). This measures that
host work where it can be measured without a GPU: train_bench's loop (PEFT LoRA r=16 on the seven projections,
checkpointed layers, the trainer's standard memory mode installed as the trainer installs it, AdamW, bf16 autocast)
on a tiny Llama of the 1B parts' structure (tied embeddings) on the CPU, bf16 bases and fp32 adapters as there, with

- every tensor tiny (hidden 64, 2 × 16 tokens), so each aten op computes a few elements and its cost is mostly its
  dispatch, as a launch's is on the GPU (on a CPU without fast bf16 matmuls, ``--fp32`` keeps it so: fp32 bases,
  no autocast, so without the casts the GPU's bf16 path makes);
- every Triton launch replaced by a counter (unless ``--no-stub``): the kernels' outputs are then uninitialised
  memory and the losses meaningless, but no host decision reads them. Triton's own launch cost (argument binding,
  the driver call: ~16 µs on the H200's host, bench/RESULTS.md session 7) is not in the time; the launches are
  counted so that it can be added.

With ``--cuda`` (on the GPU machine) the same tiny model trains on the GPU, every kernel compiled and run: each
computes a few elements in a few µs, so the GPU waits on the host throughout and a step's wall time is the host's,
real launches (cuBLAS, Triton, copies) included. The layer inputs go to host memory as at the 1B shape's sizes
(``min_offload_bytes`` 0: these tiny ones would stay below the threshold).

Reported per system: ms a step at ``--layers`` and at ``--layers-small`` layers (the least of ``--steps``, the two
models' steps interleaved so that a shared CPU's load falls on both alike; on the CPU the step's thread's CPU time,
torch held to one thread, so that waits for a core on a loaded machine are not counted; with ``--cuda`` the wall time
from a synchronized start to a synchronized end), their difference per layer (the decoder layer's host time:
forward, recompute, backward, its share of the optimizer), Triton launches and aten ops a layer and step (exact
counts, whatever the load; views and other metadata ops count as aten ops but launch nothing), and with
``--cprofile`` the functions with the most own time in the larger model's step. A bench script, not a test: the
stubbed kernels compute nothing, and the tiny kernels of ``--cuda`` train nothing worth checking.

Usage::

    python3 bench/host_step.py [--systems baseline,strop-standard] [--qlora] [--fp32] [--steps 30] [--cprofile 25]
                               [--ops 25]   # also the aten ops a layer calls most, by name
    python3 bench/host_step.py --cuda [--qlora]     # on the GPU machine
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import cProfile
import os
import pstats
import sys
import tempfile
import time

# read before torch and triton load: the CPU runs strop's Triton paths interpreted (their launches stubbed below)
os.environ.setdefault("TRITON_INTERPRET", "0" if "--cuda" in sys.argv[1:] else "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lib.harness import SMOKE_1B_SHAPE, Workload, attach_lora, load_saved
from lib.train_workers import apply_memory

CUDA = "--cuda" in sys.argv[1:]  # (the flag's help: main)

# a tiny Llama of the 1B parts' structure: tied embeddings, GQA (4 heads, 2 KV heads)
SHAPE = dict(SMOKE_1B_SHAPE, hidden=64, inter=128, heads=4, kv_heads=2, head_dim=16, vocab=256)


class LaunchCounter:
    """Replaces the Triton interpreter's launch by a count (``stub``), or counts the launches it runs (on the GPU,
    the compiled kernels' launches)."""

    def __init__(self, stub: bool) -> None:
        self.stub, self.launches = stub, 0

    @contextlib.contextmanager
    def installed(self):
        if CUDA:
            from triton.runtime.jit import JITFunction as Launcher
        else:
            from triton.runtime.interpreter import InterpretedFunction as Launcher

        run = Launcher.run
        counter = self

        def counted(fn, *args, **kwargs):
            counter.launches += 1
            if counter.stub or (kwargs.get("warmup") and not CUDA):
                return None
            return run(fn, *args, **kwargs)

        Launcher.run = counted
        try:
            yield self
        finally:
            Launcher.run = run


class OpCounter(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the aten ops dispatched (a step's launches on the GPU, but for views and metadata ops)."""

    def __init__(self) -> None:
        super().__init__()
        self.names: collections.Counter[str] = collections.Counter()

    @property
    def ops(self) -> int:
        return self.names.total()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))


def build(system: str, layers: int, a, root: str):
    """train_bench's model for ``system`` at ``layers`` layers: saved, loaded as the baseline loads it, LoRA, patch,
    memory mode; and its optimizer."""
    dtype = torch.float32 if a.fp32 else torch.bfloat16
    device = "cuda" if CUDA else "cpu"
    w = Workload(dict(SHAPE, layers=layers), device=device, dtype=str(dtype).removeprefix("torch."))
    path = os.path.join(root, f"l{layers}-{w.dtype}")
    if not os.path.exists(path):
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(0)
        config = AutoConfig.for_model(**w.model_config(), max_position_embeddings=64)
        AutoModelForCausalLM.from_config(config, dtype=dtype).save_pretrained(path)
    model = attach_lora(load_saved(path, a.qlora, dtype, device))
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if system.startswith("strop"):
        from strop.kernels.models import patch_model

        patch_model(model)
    installed = apply_memory(w, model, system, 2, 16)
    offloader = None if installed is None or installed.memory is None else installed.memory.offloader
    if CUDA and offloader is not None:
        offloader.pool.min_offload_bytes = 0  # as the 1B shape's layer inputs (MiBs), these go to host memory
    model.train()
    # foreach: the implementation torch picks on CUDA (the CPU default is one tensor at a time)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4, foreach=True)
    return w, model, opt


def step(model, opt, data, fp32: bool = False) -> None:
    """train_bench's step (``train_step``) under bf16 autocast on the data's device, as on the GPU (the worker's is
    on there); ``fp32``: without autocast."""
    with torch.autocast(data.device.type, dtype=torch.bfloat16, enabled=not fp32):
        loss = model(input_ids=data, labels=data).loss
    loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)


def measure(
    system: str, layers: tuple[int, int], a, root: str
) -> list[tuple[float, int, int, str, collections.Counter]]:
    """For the larger and the smaller model: (ms a step by :func:`_now` (the least of ``a.steps``, the two models'
    steps interleaved so that the load of a shared CPU falls on both), Triton launches a step, aten ops a step, cProfile
    text or "", aten ops a step by name)."""
    data = torch.randint(0, SHAPE["vocab"], (2, 16), generator=torch.Generator().manual_seed(1234))
    data = data.to("cuda" if CUDA else "cpu")
    counter = LaunchCounter(a.stub)
    runs = [build(system, n, a, root)[1:] for n in layers]
    out = []
    with counter.installed():
        times: list[list[float]] = [[] for _ in runs]
        for i in range(3 + a.steps):
            for (model, opt), t in zip(runs, times, strict=True):
                t0 = _now()
                step(model, opt, data, a.fp32)
                if i >= 3:
                    t.append(_now() - t0)
        for (model, opt), t in zip(runs, times, strict=True):
            counter.launches = 0
            with OpCounter() as ops:
                step(model, opt, data, a.fp32)
            launches, text = counter.launches, ""
            if a.cprofile and not out:
                p = cProfile.Profile()
                p.enable()
                for _ in range(5):
                    step(model, opt, data, a.fp32)
                p.disable()
                buf = _Text()
                pstats.Stats(p, stream=buf).sort_stats("tottime").print_stats(a.cprofile)
                text = buf.text
            out.append((min(t) * 1e3, launches, ops.ops, text, ops.names))
    return out


def _now() -> float:
    """The step clock: on the GPU the wall time, the device's queue drained (the autograd engine runs a CUDA
    backward on a thread of its own); on the CPU the thread's CPU time."""
    if CUDA:
        torch.cuda.synchronize()
        return time.perf_counter()
    return time.thread_time()


class _Text:
    def __init__(self) -> None:
        self.text = ""

    def write(self, s: str) -> None:
        self.text += s


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--systems", default="baseline,strop-standard")
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--layers-small", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--qlora", action="store_true", help="NF4 double-quant bases (bitsandbytes on the CPU)")
    p.add_argument("--no-stub", dest="stub", action="store_false", help="run the interpreted kernels (slow)")
    p.add_argument("--cprofile", type=int, default=0, metavar="N", help="top N functions by own time")
    p.add_argument(
        "--ops", type=int, default=0, metavar="N", help="the N aten ops most called a layer, by name"
    )
    p.add_argument(
        "--fp32",
        action="store_true",
        help="fp32 bases, no autocast (no casts; for CPUs slow at bf16 matmuls)",
    )
    p.add_argument(
        "--cuda", action="store_true", help="on the GPU, kernels compiled and run (read at import)"
    )
    a = p.parse_args()
    a.stub = a.stub and not a.cuda
    torch.set_num_threads(1)
    root = tempfile.mkdtemp(prefix="strop-host-step-")
    rows = []
    print(
        f"| system | ms/step at {a.layers} layers | at {a.layers_small} | host ms a layer | Triton launches a layer "
        "| aten ops a layer | launches, ops a step |",
        flush=True,
    )
    print("|---|---:|---:|---:|---:|---:|---|", flush=True)
    for system in a.systems.split(","):
        big, small = measure(system, (a.layers, a.layers_small), a, root)
        n = a.layers - a.layers_small
        print(
            f"| {system} | {big[0]:.2f} | {small[0]:.2f} | {(big[0] - small[0]) / n:.3f} | "
            f"{(big[1] - small[1]) / n:.1f} | {(big[2] - small[2]) / n:.1f} | {big[1]}, {big[2]} |",
            flush=True,
        )
        rows.append((system, big[3]))
        if a.ops:
            per_layer = (big[4] - small[4]).most_common(a.ops)
            print(
                f"  {system}, aten ops a layer by name: " + ", ".join(f"{k} {v / n:g}" for k, v in per_layer)
            )
    for system, text in rows:
        if text:
            print(f"\n## {system}: top functions by own time, {a.layers} layers, 5 steps\n{text}")


if __name__ == "__main__":
    main()
