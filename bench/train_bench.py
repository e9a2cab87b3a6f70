"""Training benchmark on the standard workload of DESIGN.md: HF + PEFT baseline vs strop, each in its own process.

Workload: Llama-3.1-8B shape (hidden 4096, inter 14336, 32 layers, 32/8 heads, vocab 128256), random
weights, LoRA r=16 alpha=16 on all seven projections, gradient checkpointing, seq 2048, batch 8; QLoRA
(NF4 double quant) and bf16 LoRA. The same random tokens and seed for every system.

Baseline recipe (DESIGN.md): transformers + PEFT as a user writes it — the random model saved once as a
bf16 safetensors dir and loaded with ``AutoModelForCausalLM.from_pretrained(dir, dtype=torch.bfloat16,
device_map={"": 0}, attn_implementation="sdpa")``, with ``BitsAndBytesConfig`` (NF4, double quant, bf16
compute) for the QLoRA parts (qlora, context, dpo); no prepare_model_for_kbit_training, LoRA weights fp32,
bf16 autocast, gradient checkpointing with use_reentrant=False, torch.optim.AdamW(lr=1e-4),
PYTORCH_ALLOC_CONF=expandable_segments:True. Every system loads that dir with ``load_model`` (the trainer
service with its own loader, which passes the same dtype and BitsAndBytesConfig); strop's library path is
the baseline's loop on that model after ``strop.kernels.models.patch_model(model)``.

The model shapes, the saved model, its loading and the measurements are the harness's (``bench/lib/harness.py``,
the ``Workload`` each worker is handed), the profiler toolkit is ``bench/lib/profile.py``, the workers (one per
system) are ``bench/lib/train_workers.py``; this file is the CLI and the orchestrator. The saved dir (/tmp/strop-bench-models/, tiny BPE tokenizer
beside the weights) is written once per machine by a child of the orchestrator before any worker starts, so no worker's time or memory includes it; a
later run reuses it when its config matches and its max_position_embeddings covers the longest point.
RoPE is the default type, which never reads max_position_embeddings, so that value changes nothing in any
step: it is written as 524,288 (the longest context point) once, and the config is the same for every
system and part.

DPO part: TRL DPOTrainer (baseline) vs strop's chunked DPO loss, 8B QLoRA, 4 pairs of prompt 512 +
completion 512 per step. Every step trains on the same 4 pairs (the dataset is those 4 rows, one epoch
per step), so the reward margin can trend; each step's margin is recorded and the report says whether
the last is above the first.

DPO at long context (issue 39): ``--dpo-row TOKENS --dpo-pairs N`` set the DPO part's row (prompt + completion, half
each, so a pair's prompt + chosen + rejected is 1.5× the row; default 1024) and pairs a step (default 4);
``--parts dpo --find-longest`` searches the longest row one strop system trains at ``--dpo-pairs`` (default 1) with
bench/lib/longest.py's search (a fresh worker a trial, each trial's row printed as it ends, ``--steps``/``--warmup``
steps each), and a straight-line extrapolation of the peaks to the device's memory.

ORPO, KTO and SimPO parts: the same shape and fixed batch with TRL's ORPOTrainer, KTOTrainer and
CPOTrainer(loss_type="simpo", cpo_alpha=0) on HF + PEFT (baseline) vs the same trainers on strop's chunked
losses (``strop_{orpo,kto,cpo}_trainer_class``); hyperparameters from the trainer service's defaults table
(``TRAIN_DEFAULTS``), lr ``DPO_LR``. KTO unpairs the 4 pairs into 8 rows (4 desirable, 4 undesirable: the
same 8 sequences per step, plus TRL's 8 mismatched KL rows, scored without gradients); its rate is rows/s.

Gemma part (``--parts gemma``): Gemma 3 1B's shape (hidden 1152, inter 6912, 26 layers, 4 heads / 1 KV head
of 256, vocab 262,144, tied embeddings, window 512 on five of every six layers), saved and loaded the same
way, bf16 LoRA with the same adapter config and loop; systems ``baseline``, ``strop``, ``strop-standard``.

1B parts (``--parts lora-1b,qlora-1b``, issue 39's small models): Llama 3.2 1B's shape (hidden 2048, inter 8192,
16 layers, 32 heads / 8 KV heads of 64, vocab 128,256, tied embeddings), bf16 LoRA and QLoRA, every system as in
the 8B parts; ``--batch 2`` for the 2 × 2048 point. At this size a step's GPU work is short enough that the host's
Python and launches per layer can set the pace: ``--profile`` gives the GPU's idle time in the step.

Batches of varying width (``--vary-width N``, the SFT parts): each step's rows take their lengths from
``harness.varied_lengths`` (seeded, the same for every system): the step's width uniform in [seq − N, seq], its
first row that long and the others in [seq − N, width], right-padded to the longest (attention mask 0, labels −100)
as TRL's collator pads a chat SFT job's rows; the library's loop and ``trl-lib`` (its rows sampled in order) alike,
the service not. On CUDA, SDPA runs cuDNN's kernels, which build a graph per new shape: every step's width and time
is printed, so a width's first step shows against a repeat; ms/step is the measured steps' mean (not the median)
and tokens/s their real tokens over their time. ``trl-lib…-b1``/``-b0``: strop's SFT collator rounds each batch's
width up to a bucket (``strop.kernels.trainers.shared_prompt.WIDTH_BUCKETS``) or not, whatever the library's default; the
baseline pads its batches as it is given them (it is HF + PEFT's loop, which has no collator of strop's).

Qwen3-8B and Gemma 3 4B parts (``--parts qlora-qwen3-8b,qlora-gemma3-4b``, bf16: ``lora-…``; issue 39's other
architectures): Qwen3-8B's shape (hidden 4096, inter 12288, 36 layers, 32 heads / 8 KV heads of 128, per-head q/k
RMSNorm, vocab 151,936, untied) and Gemma 3 4B's text model (hidden 2560, inter 10240, 34 layers, 8 heads / 4 KV heads
of 256, window 1024 on five of every six layers, vocab 262,208, tied), each saved and loaded the same way, every
system as in the 8B parts (``harness.PART_SHAPES``; ``--smoke``: a tiny shape of the same architecture).

FLOP accounting (stated so MFU can be checked):
    N      = parameters in matmuls per token (7 projections x layers + lm_head)
    attn   = causal attention per token, forward: 2 * 2 * layers * seq/2 * heads*head_dim (QK^T and PV, half
             masked; a sliding layer's keys per query are its window w less w²/(2·seq), not seq/2)
    model FLOPs/token    = 2N + 2N (forward, backward dX; the frozen base has no weight gradient)
                           + 3 * attn (attention forward + backward dQ, dK, dV) + LoRA (negligible, counted)
    hardware FLOPs/token = model FLOPs + 2N_layers + attn (gradient checkpointing recomputes each layer's forward;
                           scaled by the fraction of layers that recompute under budgeted recompute)
    MFU = model FLOPs/token * tokens/s / 790 TFLOP/s (the measured bf16 matmul ceiling: an 8192³ product on
    random data ran at 788 TFLOP/s on an H200 and 798 on an H100, the same Hopper chip's rates: KINDS.md of the
    device library); HFU likewise with hardware FLOPs.

Usage (on the GPU machine)::

    python bench/train_bench.py --parts qlora,lora --systems baseline,strop --steps 8 --json bench/out/train.json
    python bench/train_bench.py --parts dpo --systems baseline,strop --steps 8 --warmup 0
    python bench/train_bench.py --parts dpo --systems strop-long-context --dpo-row 32768 --dpo-pairs 1
    python bench/train_bench.py --parts dpo --systems strop-long-context --find-longest --steps 1 --warmup 0
    python bench/train_bench.py --parts orpo,kto,simpo --systems baseline,strop-standard --steps 8 --warmup 0
    python bench/train_bench.py --parts gemma --systems baseline,strop,strop-standard --profile
    python bench/train_bench.py --parts lora-1b,qlora-1b --systems baseline,strop-standard,service --batch 2
    python bench/train_bench.py --parts qlora-qwen3-8b,qlora-gemma3-4b --systems baseline,strop-standard,baseline
    python bench/train_bench.py --parts qlora --systems baseline,trl-lib-b1,trl-lib-b0 --vary-width 512
    python bench/train_bench.py --parts context --systems baseline,strop-long-context --context 65536,131072,262144,524288

Systems: ``baseline`` (HF + PEFT), ``strop`` (``patch_model``, plain checkpointing), and the trainer's memory
modes by name, each installed by ``strop.kernels.models.apply_memory_mode`` from the one table the service uses
(``strop.common.trainer_types.MEMORY_MODES``): ``strop-standard`` (checkpointed layer inputs in pinned host
memory: the trainer's default on CUDA), ``strop-standard-sN`` (the same with N evenly spaced layers not
recomputed: their saved activations go to pinned host memory and come back ahead of need; HFU counts the
recompute saved), ``strop-long-context`` (+ the MLP tiled over the sequence), ``strop-max-speed`` (budgeted
recompute under an 80 GiB budget, enforced on the process with ``torch.cuda.set_per_process_memory_fraction``:
only as many layers recompute as the budget needs; the first warm-up step calibrates),
``…-f8`` after any strop system: the frozen bases' GEMMs in FP8 (``patch_model(fp8_base=True)``, opt-in and
inexact; its MFU is nominal: bf16-equivalent FLOPs over the bf16 ceiling), ``…-f8dx``: only their backward dx GEMMs
(``fp8_base="dx"``), ``trl-lib`` (a user's script: from_pretrained + PEFT + ``patch_model`` + TRL SFTTrainer on pre-tokenized rows,
its fused LM head on strop's kernel: ``strop_sft_trainer_class``; ``trl-lib-trlhead``: with TRL's own head;
``trl-lib-svcargs``: with what the service adds in process, its optimizer, token count and gradient guard)
and ``service`` (the same through the trainer service over gRPC on localhost; ``--profile`` profiles its last
step from the client's thread: the GPU timeline is whole, the job thread's Python ops are not seen);
``service-hfloop``: the service with HF's per-step walks of the model instead of ``training.LeanStepLoop``'s.

Each (part, system) runs in a fresh subprocess (``--worker``) and prints one ``RESULT {json}`` line. Peak
memory (GPU allocated/reserved, host RSS) is reset after loading and setup, so it is the training steps'.
``--smoke`` runs a tiny shape on the CPU through the same save + from_pretrained path (fp32, NF4 with fp32
compute for the QLoRA parts; strop's kernels under ``TRITON_INTERPRET=1``): it checks the harness, not speed.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import asdict

# bench/ on sys.path, also under ``python -P``: the scripts import the harness as the package bench/lib
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lib import longest
from lib.harness import Result, workload
from lib.train_workers import (
    PREFERENCE_PARTS,
    dpo_half,
    run_dpo_worker,
    run_preference_worker,
    run_trl_worker,
    run_worker,
)

# the systems run_trl_worker trains (a trl-lib system's -b1/-b0: SFT batch widths in buckets or not)
TRL_SYSTEMS = ("service", "service-hfloop", "trl-lib", "trl-lib-trlhead", "trl-lib-svcargs")

# ------------------------------------------------------------------------------------------ orchestrator


def part_points(part: str, a) -> list[tuple[int, int]]:
    """(seq, batch) points of a part; DPO's seq is a pair's prompt + completion."""
    if part == "context":
        return [(int(s), 1) for s in a.context.split(",")]
    if part in PREFERENCE_PARTS:
        return [(a.dpo_row or 2 * dpo_half(a.smoke), a.dpo_pairs or 4)]  # 4 pairs per step by default
    return [(a.seq, a.batch)]


def spawn(part: str, system: str, seq: int, batch: int, a, timeout: float | None = None) -> Result:
    env = {**os.environ, "PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    if a.smoke:
        env["TRITON_INTERPRET"] = "1"  # strop's kernels on the CPU (read when they are first imported)
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        "--part",
        part,
        "--system",
        system,
        "--seq",
        str(seq),
        "--batch",
        str(batch),
        "--steps",
        str(a.steps),
        "--warmup",
        str(a.warmup),
        *(["--smoke"] if a.smoke else []),
        *(["--profile"] if a.profile else []),
        *(["--progress", a.progress] if a.progress else []),
        *(["--vary-width", str(a.vary_width)] if a.vary_width else []),
    ]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout or a.timeout)
    except subprocess.TimeoutExpired:
        return Result(part, system, seq, batch, ok=False, error=f"timeout after {timeout or a.timeout:.0f}s")
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return Result(**json.loads(line[7:]))
    tail = (proc.stderr or proc.stdout)[-1500:]
    oom = "OutOfMemoryError" in tail or "CUDA out of memory" in tail
    return Result(
        part,
        system,
        seq,
        batch,
        ok=False,
        error=("OOM" if oom else f"rc={proc.returncode}: {tail}"),
        build_s=time.perf_counter() - t0,
    )


def rate(r: Result) -> str:
    """tokens/s, or pairs/s (a few per second) for DPO, ORPO and SimPO (KTO: rows/s)."""
    if r.part in PREFERENCE_PARTS:
        return f"{r.tokens_per_s:.2f} {'rows' if r.part == 'kto' else 'pairs'}/s"
    return f"{r.tokens_per_s:,.0f} tok/s"


def margin_rose(r: Result) -> str:
    return "rose" if r.margins[-1] > r.margins[0] else "did not rise"


def table(results: list[Result]) -> str:
    base = {(r.part, r.seq): r for r in results if r.system == "baseline" and r.ok}
    rows = [
        "| part | system | seq x batch | speed | ms/step | peak alloc GiB | peak reserved GiB | host RSS GiB "
        "| MFU | HFU | speed vs base | mem vs base | first losses |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if not r.ok:
            rows.append(f"| {r.part} | {r.system} | {r.seq} x {r.batch} | {r.error[:60]} | | | | | | | | | |")
            continue
        b = base.get((r.part, r.seq))
        sp = f"{r.tokens_per_s / b.tokens_per_s:.2f}x" if b else "-"
        mem = f"{r.peak_alloc_gib / b.peak_alloc_gib:.2f}x" if b and b.peak_alloc_gib else "-"
        rows.append(
            f"| {r.part} | {r.system} | {r.seq} x {r.batch} | {rate(r)} | {r.ms_per_step:,.0f} | "
            f"{r.peak_alloc_gib:.1f} | {r.peak_reserved_gib:.1f} | {r.host_peak_rss_gib:.1f} | {r.mfu:.1%} | "
            f"{r.hfu:.1%} | {sp} | {mem} | {', '.join(f'{x:.4f}' for x in r.losses[:3])} |"
        )
    varied = [r for r in results if r.ok and r.step_ms]
    if varied:
        rows += [
            "",
            "Every step's batch width at the model and its time, warm-up included (--vary-width; the speed above is "
            "the measured steps' real tokens over their time, ms/step their mean):",
            "",
            "| part | system | widths | ms each step | distinct widths |",
            "|---|---|---|---|---|",
        ]
        rows += [
            f"| {r.part} | {r.system} | {', '.join(map(str, r.widths))} | "
            f"{', '.join(f'{t:,.0f}' for t in r.step_ms)} | {len(set(r.widths))} |"
            for r in varied
        ]
    dpo = [r for r in results if r.ok and r.margins]
    if dpo:
        rows += [
            "",
            "Reward margin on the fixed batch, every step (warm-up included):",
            "",
            "| part | system | margins | last > first |",
            "|---|---|---|---|",
        ]
        rows += [
            f"| {r.part} | {r.system} | {', '.join(f'{m:.5f}' for m in r.margins)} | {margin_rose(r)} |"
            for r in dpo
        ]
    return "\n".join(rows)


def find_longest_dpo(a) -> dict:
    """The longest DPO row (prompt + completion; the pair 1.5× that) ``a.systems`` (one strop system) trains at
    ``a.dpo_pairs`` pairs (default 1) without running out of device memory: bench/lib/longest.py's search, a fresh
    worker a trial. Prints each trial's row as it ends, then the result."""
    system, pairs = a.systems.split(",")[0], a.dpo_pairs or 1
    print(
        f"DPO, {system}, {pairs} pair(s) a step, {a.warmup} warm-up + {a.steps} timed step(s) a trial\n"
        "| row (prompt + completion) | pair (prompt + chosen + rejected) | result | s/step | peak alloc GiB "
        "| reserved GiB | prompt shared | margins | trial s |\n|---|---|---|---|---|---|---|---|---|",
        flush=True,
    )

    def trial(n: int, left: float) -> longest.Trial:
        t0 = time.perf_counter()
        r = spawn("dpo", system, n, pairs, a, timeout=min(a.timeout, left))
        wall = time.perf_counter() - t0
        outcome = longest.FITS if r.ok else longest.OOM if longest.is_oom(r.error) else longest.ERROR
        result = outcome if outcome != longest.ERROR else f"error: {r.error[-200:]}".replace("\n", " ")
        shared = next((ln.split(": ")[-1] for ln in r.notes.splitlines() if "prompt run once" in ln), "-")
        print(
            f"| {n:,} | {n // 2 * 3:,} | {result} | {r.ms_per_step / 1000:.1f} | {r.peak_alloc_gib:.1f} | "
            f"{r.peak_reserved_gib:.1f} | {shared} of {a.steps + a.warmup} | "
            f"{', '.join(f'{m:.3f}' for m in r.margins)} | {wall:.0f} |",
            flush=True,
        )
        return longest.Trial(outcome, wall, r)

    s = longest.find_longest_from_flags(trial, a)
    print(
        f"longest DPO row that fits at {pairs} pair(s): {s.fits:,} tokens (a pair of {s.fits // 2 * 3:,}: prompt, "
        f"chosen and rejected {s.fits // 2:,} each); {s.summary()}; continue with {s.continue_flags(a.find_start)}",
        flush=True,
    )
    peaks = [(n, t.row.peak_alloc_gib) for n, t in s.trials if t.row.ok]
    if a.smoke:
        capacity = None
    else:
        import torch

        capacity = torch.cuda.get_device_properties(0).total_memory / 2**30
    line = capacity and longest.extrapolated(peaks, capacity)
    if line:
        print(
            f"extrapolated (not measured): peak +{line[0] * 1024:.2f} GiB per 1K row tokens; {capacity:.0f} GiB "
            f"reached at a row of ~{line[1]:,} tokens",
            flush=True,
        )
    return s.as_dict()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", action="store_true")
    p.add_argument(
        "--write-model", type=int, metavar="POSITIONS", help=argparse.SUPPRESS
    )  # ensure_saved_model's
    p.add_argument("--part", default="qlora")
    p.add_argument("--system", default="baseline")
    p.add_argument("--parts", default="qlora,lora")
    p.add_argument("--systems", default="baseline,strop")
    p.add_argument("--seq", type=int, help="tokens per row (default 2048; --smoke: 64)")
    p.add_argument("--batch", type=int, help="rows per step (default 8; --smoke: 2)")
    # batch 1; a run stops at a system's first failing point, so 524288 costs time only where 262144 fits
    p.add_argument("--context", default="16384,32768,65536,131072,262144,524288")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=int, default=900)
    p.add_argument("--json")
    p.add_argument("--profile", action="store_true", help="also profile one step per system (GPU kernels)")
    p.add_argument(
        "--progress", help="append each decoder layer's start (time, peaks) to this file (SFT parts)"
    )
    p.add_argument(
        "--smoke", action="store_true", help="tiny shape on the CPU: checks the harness, not speed"
    )
    p.add_argument(
        "--dpo-row",
        type=int,
        help="preference parts: a row's prompt + completion tokens, half each (default 1024)",
    )
    p.add_argument(
        "--dpo-pairs", type=int, help="preference parts: pairs a step (default 4; --find-longest: 1)"
    )
    p.add_argument(
        "--vary-width",
        type=int,
        default=0,
        metavar="N",
        help="SFT parts: each step's rows of lengths drawn in [seq - N, seq], the batch padded to its longest",
    )
    longest.add_flags(p, unit="DPO row tokens (prompt + completion)", start=16384, max_length=262144)
    a = p.parse_args()
    w = workload(a.part, a.smoke)  # a worker's (and --write-model's) part; the orchestrator's is per part
    # --smoke: few tokens, as the Triton interpreter runs strop's kernels at ~10 s a step for 64 x 2
    a.seq = a.seq or (64 if a.smoke else 2048)
    a.batch = a.batch or (2 if a.smoke else 8)
    if a.write_model:
        w.write_saved_model(a.write_model)
        return
    if a.worker:
        try:
            if a.part == "dpo":
                res = run_dpo_worker(a, w)
            elif a.part in PREFERENCE_PARTS:
                res = run_preference_worker(a, w)
            elif re.sub(r"-b[01]$", "", a.system) in TRL_SYSTEMS:
                res = run_trl_worker(a, w)
            else:
                res = run_worker(a, w)
        except Exception as exc:  # reported, not raised: the orchestrator records it
            import traceback

            traceback.print_exc()
            oom = "OutOfMemoryError" in type(exc).__name__ or "out of memory" in str(exc)
            res = Result(a.part, a.system, a.seq, a.batch, ok=False, error="OOM" if oom else repr(exc)[:300])
        print("RESULT " + json.dumps(asdict(res)), flush=True)
        return
    parts = {part: part_points(part, a) for part in a.parts.split(",")}
    if a.vary_width and any(part in PREFERENCE_PARTS for part in parts):
        raise SystemExit("--vary-width varies SFT batches: not the preference parts")
    families: dict[str, list[str]] = {}  # the parts of each saved model (shape)
    for part in parts:
        families.setdefault(workload(part, a.smoke).saved_model_dir(), []).append(part)
    for family in families.values():
        longest_seq = max(seq for p in family for seq, _ in parts[p])
        if a.find_longest:
            longest_seq = max(longest_seq, a.find_max)
        workload(family[0], a.smoke).ensure_saved_model(longest_seq, family[0])
    if a.find_longest:
        if list(parts) != ["dpo"]:
            raise SystemExit("--find-longest searches the DPO part: --parts dpo")
        found = find_longest_dpo(a)
        if a.json:
            os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
            with open(a.json, "w") as f:
                json.dump(found, f, indent=1)
        return
    results: list[Result] = []
    for part, points in parts.items():
        for system in a.systems.split(","):
            for seq, batch in points:
                r = spawn(part, system, seq, batch, a)
                results.append(r)
                line = f"{rate(r)}, {r.peak_alloc_gib:.1f} GiB" if r.ok else r.error[:200]
                if r.ok and r.margins:
                    line += f", margin {r.margins[0]:.5f} -> {r.margins[-1]:.5f} ({margin_rose(r)})"
                print(f"{part} {system} {seq}x{batch}: {line}", flush=True)
                if part == "context" and not r.ok:
                    break  # longer contexts will not fit either
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)
    print(table(results))
    for r in results:
        if r.notes or r.profile:
            print(f"\n## {r.part} {r.system} {r.seq}x{r.batch}\n{r.notes}\n{r.profile}")


if __name__ == "__main__":
    main()
