"""What replaying a captured step would give the 1B shape (issue 39), before building it into the trainer.

At the Llama-3.2-1B shape and 2 × 2048 tokens a train_bench profile of strop's step found the GPU computing 54 of 163
ms with no waits on it (bench/RESULTS.md, session 29): the host's dispatch set the pace there, and trimming ops a layer
cannot reach the issue's "host time under 10% of the step". CUDA graphs replay a captured forward and backward with
one launch each. This asks, on the GPU:

- does strop's patched model (its Triton kernels, PEFT LoRA r=16 on the seven projections, bf16 autocast) capture
  under ``torch.cuda.make_graphed_callables`` as a whole model (forward + backward; the optimizer stays eager:
  torch's fused AdamW, a few launches), without checkpointing, with HF's checkpointing, and with the trainer's
  default memory mode (layer inputs offloaded to pinned host memory by strop's checkpoint);
- the same with strop's own :class:`~strop.kernels.models.step_graph.StepGraph` (``stepgraph*``: the forward and
  the backward as one graph captured by hand, gradients accumulated into kept ``.grad``, the capture thread-local and
  without emptying the allocators; torch's checkpoint then without its RNG state, which a capture cannot read): what
  the trainer would use;
- how long a step takes graphed against eager, in how much memory;
- whether the graphed model trains the same: the losses of the same steps from the same init and data.

Every variant builds the same random model (seed 0) in its own process (``--variant``, the orchestrator spawns
them), so one failed capture does not take the others with it and each peak is its own. A capture that fails
reports its exception's last lines. The model is train_bench's saved 1B model (``lora-1b``; ``--qlora``: NF4 on load,
``qlora-1b``), so its eager rows compare with train_bench's. A bench script, not a test.

Usage (repository root, on the GPU machine)::

    python3 bench/graph_step.py [--batch 2] [--seq 2048] [--steps 8] [--warmup 3]
        [--variants eager,graphed,stepgraph,eager-ckpt,graphed-ckpt,stepgraph-ckpt,eager-standard,...] [--qlora]
    python3 bench/graph_step.py --smoke --variants eager,stepgraph,eager-ckpt,eager-standard --seq 16
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback

# read before torch and triton load: --smoke runs the eager variants on this CPU, strop's Triton paths interpreted
SMOKE = "--smoke" in sys.argv[1:]
if SMOKE:
    os.environ.setdefault("TRITON_INTERPRET", "1")
DEVICE = "cpu" if SMOKE else "cuda"
VARIANTS = "eager,graphed,stepgraph,eager-ckpt,graphed-ckpt,stepgraph-ckpt,eager-standard,graphed-standard,stepgraph-standard"

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lib.harness import attach_lora, workload  # noqa: E402
from lib.train_workers import apply_memory  # noqa: E402


def build(batch: int, seq: int, variant: str, qlora: bool):
    """train_bench's saved 1B model (``lora-1b``/``qlora-1b``, loaded as the baseline recipe loads it) with its
    LoRA, strop's kernels, and the variant's checkpointing or the trainer's memory mode, installed as train_bench
    installs them. B is made non-zero so that every LoRA factor gets a gradient from the first step."""
    import torch

    from strop.kernels.models import patch_model

    w = workload("qlora-1b" if qlora else "lora-1b", SMOKE)
    torch.manual_seed(0)  # the LoRA A init: the same in every variant
    model = attach_lora(w.load_model(qlora))
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(0.01 * torch.randn(p.shape, generator=gen, device=DEVICE))
    report = patch_model(model, device=DEVICE)
    if variant.endswith("-ckpt") or variant.endswith("-standard"):
        # StepGraph's capture cannot read the RNG state torch's checkpoint saves by default; nothing here is random
        kwargs = {"use_reentrant": False, "preserve_rng_state": not variant.startswith("stepgraph")}
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    installed = (
        apply_memory(w, model, "strop-standard", batch, seq) if variant.endswith("-standard") else None
    )
    model.train()
    return model, report, installed, w.shape["vocab"]


class LossOf:
    """The model's loss on ``ids`` (labels = ids) under bf16 autocast without its weight cache (graph capture
    refuses the cache; eager runs the same way so that both compute alike)."""

    def __init__(self, model) -> None:
        self.model = model

    def __call__(self, ids):
        import torch

        with torch.autocast(DEVICE, dtype=torch.bfloat16, cache_enabled=False):
            return self.model(input_ids=ids, labels=ids).loss


def run_variant(a) -> dict:
    import torch
    import transformers.masking_utils as masking

    # Rows of one sequence each (no packing): transformers' check of the position ids for packed sequences reads a
    # GPU value (a sync) and, while a stream is capturing, skips that read and builds an explicit mask instead, so
    # a captured attention would run masked where eager runs causal. The batches here are never packed: say so,
    # in every variant alike (what a trainer that knows its collation would do).
    masking.find_packed_sequence_indices = lambda position_ids: None

    out: dict = {"variant": a.variant}
    model, report, installed, vocab = build(a.batch, a.seq, a.variant, a.qlora)
    out["kernels"] = str(report.summary())
    g = torch.Generator(device=DEVICE).manual_seed(1234)
    batches = [
        torch.randint(0, vocab, (a.batch, a.seq), device=DEVICE, generator=g)
        for _ in range(a.warmup + a.steps)
    ]
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-4, fused=not SMOKE)
    sync = torch.cuda.synchronize if not SMOKE else (lambda: None)
    loss_of = LossOf(model)
    step_fn = loss_of
    stepgraph = None
    if a.variant.startswith("stepgraph"):
        from strop.kernels.models.step_graph import StepGraph

        stepgraph = StepGraph(loss_of, params, warmup=2)
    if a.variant.startswith("graphed"):
        t0 = time.perf_counter()
        try:
            step_fn = graphed(model, loss_of, batches[0])
        except Exception as exc:
            out["capture_error"] = "".join(traceback.format_exception(exc))[-3000:]
            return out
        out["capture_s"] = round(time.perf_counter() - t0, 2)
    sync()
    if not SMOKE:
        torch.cuda.reset_peak_memory_stats()
    times, losses = [], []
    for ids in batches:
        sync()
        t0 = time.perf_counter()
        if stepgraph is None:
            opt.zero_grad(set_to_none=True)
            loss = step_fn(ids)
            loss.backward()
        else:  # the graph accumulates into gradients it keeps: zeroed in place
            stepgraph.zero_grads()
            loss = stepgraph.step(ids)[0]
        opt.step()
        sync()
        times.append(time.perf_counter() - t0)
        losses.append(round(float(loss.detach()), 5))
    measured = sorted(times[a.warmup :])
    out["ms_step_median"] = round(1e3 * measured[len(measured) // 2], 2)
    out["ms_steps"] = [round(1e3 * t, 1) for t in times]
    out["tok_s"] = round(a.batch * a.seq / measured[len(measured) // 2])
    out["peak_alloc_gib"] = 0.0 if SMOKE else round(torch.cuda.max_memory_allocated() / 2**30, 3)
    out["losses"] = losses
    if installed is not None:
        out["installed"] = str(installed)
    if stepgraph is not None:
        out["stepgraph"] = {
            "replayed": stepgraph.stats.replayed,
            "eager": stepgraph.stats.eager,
            "reasons": list(stepgraph.reasons.values()),
        }
    return out


def graphed(model, loss_of, sample_ids):
    """The whole model's forward + backward as one graphed callable: the parameters that train are its inputs, so
    autograd accumulates their gradients from the backward graph's static outputs, eagerly."""
    import torch

    class Whole(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = model

        def forward(self, ids):
            return loss_of(ids)

    whole = Whole()
    return torch.cuda.make_graphed_callables(whole, (sample_ids,), num_warmup_iters=3)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--variants", default=VARIANTS)
    p.add_argument(
        "--qlora", action="store_true", help="NF4 double-quant bases (bitsandbytes), as QLoRA loads them"
    )
    p.add_argument("--variant", help="(internal) run this one variant in this process, print its JSON")
    p.add_argument(
        "--smoke", action="store_true", help="eager variants on this CPU at a tiny shape (read at import)"
    )
    p.add_argument("--timeout", type=int, default=240, help="seconds a variant's process may take")
    a = p.parse_args()
    if a.variant:
        print("RESULT " + json.dumps(run_variant(a)), flush=True)
        return
    workload("lora-1b", a.smoke).ensure_saved_model(a.seq, "lora-1b")  # one saved model, both parts
    rows = []
    for variant in a.variants.split(","):
        cmd = [
            sys.executable,
            os.path.abspath(__file__),
            "--variant",
            variant,
            *(["--smoke"] if a.smoke else []),
        ]
        cmd += [
            "--batch",
            str(a.batch),
            "--seq",
            str(a.seq),
            "--steps",
            str(a.steps),
            "--warmup",
            str(a.warmup),
            *(["--qlora"] if a.qlora else []),
        ]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=a.timeout)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
            row = json.loads(line[7:]) if line else {"variant": variant, "error": proc.stderr[-3000:]}
        except subprocess.TimeoutExpired:
            row = {"variant": variant, "error": f"timed out after {a.timeout} s"}
        rows.append(row)
        print(json.dumps(row), flush=True)
    base = "QLoRA (NF4 bases)" if a.qlora else "bf16 LoRA"
    print(f"\n1B shape, {a.batch} x {a.seq}, {base} r16, {a.steps} steps after {a.warmup}")
    print("| variant | ms/step (median) | tok/s | peak alloc GiB | capture s / steps replayed | losses |")
    print("|---|---:|---:|---:|---:|---|")
    for r in rows:
        if "ms_step_median" in r:
            sg = r.get("stepgraph")
            how = (
                r.get("capture_s", "-")
                if sg is None
                else f"{sg['replayed']} of {sg['replayed'] + sg['eager']}"
            )
            print(
                f"| {r['variant']} | {r['ms_step_median']} | {r['tok_s']:,} | {r['peak_alloc_gib']} | "
                f"{how} | {r['losses'][:5]} |"
            )
            if sg and sg["reasons"]:
                print(f"|   eager: {sg['reasons'][-1][:200]} | | | | | |")
        else:
            why = (r.get("capture_error") or r.get("error") or "").strip().splitlines()
            print(f"| {r['variant']} | failed: {why[-1] if why else '?'} | | | | |")


if __name__ == "__main__":
    main()
