"""GRPO benchmark (issue 37): strop's GRPO job loop vs TRL's ``GRPOTrainer`` on HF + PEFT (its transformers-generate
path), each in its own process, same settings.

Workload: the 8B Llama shape of ``bench/train_bench.py`` (its saved random model; QLoRA: NF4 double quant, bf16
compute, loaded as DESIGN.md's baseline recipe loads it), LoRA r=16 alpha=16 on all seven projections. A synthetic
verifiable task: ``--prompts`` prompts per step (chat messages of about ``--prompt-tokens`` tokens of random text,
through the saved tiny BPE tokenizer's chat template), ``--group`` completions each of at most ``--new-tokens``
tokens, temperature 1, top-p 1; the reward is 1 when the completion contains the row's letter (strop: a
``string_check`` grader with ``like``; TRL: the same test as a Python reward function). The model is random, so the
reward measures nothing here: the figures are speed and memory. GRPO loss, beta 0 (no reference pass), one update
per batch (TRL: ``per_device_train_batch_size`` = one group, ``gradient_accumulation_steps`` = prompts per step, so
both systems run one forward/backward per group and one AdamW update per batch), lr 1e-5, gradient checkpointing
(strop: the jobs' default memory mode on CUDA, which checkpoints too).

Systems:
  ``trl``    TRL ``GRPOTrainer(model=PeftModel, reward_funcs=[...], args=GRPOConfig(...))``, ``use_vllm=False``,
             bf16, ``gradient_checkpointing`` with ``use_reentrant=False``, adamw_torch; generation with the KV
             cache (``generation_kwargs={"use_cache": True}``: the saved config's ``use_cache=False`` would otherwise
             reach transformers' generate, which then runs the whole sequence at every decode step; each generate
             call's progress line says which it ran).
  ``strop``  ``strop.trainer_svc.core.grpo.run_grpo`` (the trainer job's loop) on a session of the trainer core
             loaded from the same dir (NF4 on load, kernels on), LoRA attached by the service; each group trains as
             one row with its prompt once (``trainer_svc/core/shared_prefix.py``).
  ``strop-padded``  the same with ``grpo.SHARED_PREFIX`` off: a group's samples as padded rows, the prompt once per
             sample (as TRL and strop before session 20 train).

Figures per system: end-to-end tokens/s = (prompt + completion tokens of every sequence of a step) / step wall
time (sampling, grading and training), over the steps after ``--warmup`` (their tokens over their summed time; the
s/step and the note's split are means over those steps); sampled tokens per step; GPU peak
allocated and reserved over the training steps (reset after loading). Workers print progress lines (TRL: each
generate call's seconds and the peak so far; both: each step's) as they go, and a worker past ``--timeout`` leaves its
last ones in its row. ``--smoke`` runs a tiny shape on the CPU
through the same paths: it checks the harness, not speed.

``--find-longest`` (strop alone, one prompt, ``--group`` samples): the longest prompt that fits with ``--new-tokens``
new tokens, each trial one measured step in a fresh worker process (an out-of-memory trial leaves nothing behind):
the prompt doubles from ``--find-start`` until a trial runs out of device memory, then bisects the bracket to
``--find-step`` tokens. Each trial prints its row as it ends; the search stops starting trials when ``--budget``
seconds are spent and prints the bracket to continue from (``--find-fits``/``--find-fails``).

Usage (GPU machine, after ``source bench/gpu_env.sh``)::

    python bench/grpo_bench.py --json bench/out/grpo.json              # both systems, table
    python bench/grpo_bench.py --systems strop --new-tokens 1024
    python bench/grpo_bench.py --prompts 1 --prompt-tokens 4096 --new-tokens 128 --steps 1  # long prompt
    python bench/grpo_bench.py --prompts 1 --prompt-tokens 8192 --new-tokens 64 --steps 4 --vary-prompt 200
    python bench/grpo_bench.py --find-longest --new-tokens 128 --budget 540
    python bench/grpo_bench.py --smoke
    python bench/grpo_bench.py --smoke --find-longest --find-start 32 --find-step 16 --new-tokens 4
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

# bench/ on sys.path, also under ``python -P``: the scripts import the harness as the package bench/lib
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from lib import (
    harness,
    longest,
)  # the saved 8B shape and the baseline's loading recipe; the longest-input search

LR = 1e-5
GRADER = {
    "type": "string_check",
    "name": "has_letter",
    "input": "{{sample.output_text}}",
    "reference": "{{item.letter}}",
    "operation": "like",
}


@dataclass
class Row:
    system: str
    ok: bool = True
    error: str = ""
    steps: int = 0
    prompt_tokens: float = 0.0  # mean per prompt
    completion_tokens: float = 0.0  # mean per sample
    seconds_per_step: float = 0.0
    tokens_per_s: float = 0.0  # (prompt + completion) tokens of the step's sequences / step seconds
    sampled_tokens_per_s: float = 0.0  # completion tokens / step seconds
    peak_alloc_gib: float = 0.0
    peak_reserved_gib: float = 0.0
    rewards: list[float] | None = None
    note: str = ""
    oom: bool = False  # failed by running out of device memory
    wall_s: float = 0.0  # the worker process's wall time, loading included
    profile: str = ""  # --profile: one more step under torch.profiler, summarised (bench/lib/profile.py)


def rows(n: int, prompt_tokens: int, seed: int = 0, vary: int = 0) -> list[dict]:
    """``n`` prompts rows of random text (``prompt_tokens`` tokens each, within a few, before the chat template)
    asking for the letter 'e'; with ``vary``, row i is ``(37·i) mod (vary + 1)`` tokens shorter, so consecutive
    steps train rows of other lengths (as a real job's do: its prompts and completions differ)."""
    from strop.fixtures.tokenizers_tiny import make_bpe_tokenizer

    tok = make_bpe_tokenizer()
    rng = random.Random(seed)
    out = []
    for i in range(n):
        ids = [rng.randrange(3, 640) for _ in range(prompt_tokens - (37 * i) % (vary + 1))]
        text = tok.decode(ids, skip_special_tokens=True)
        for _ in range(4):  # decoded ids re-encode longer (merges across the joins): cut to the asked length
            enc = tok(text)["input_ids"]
            if len(enc) <= prompt_tokens:
                break
            text = tok.decode(enc[: len(ids)], skip_special_tokens=True)
        out.append({"messages": [{"role": "user", "content": text}], "letter": "e"})
    return out


def mean(xs: list[float]) -> float:
    return sum(xs) / len(xs)


def rates(
    times: list[float], tokens: list[float], sampled: list[float], warmup: int
) -> tuple[int, float, float, float]:
    """(measured steps, seconds a step, tokens/s, sampled tokens/s) over the steps after ``warmup``, all from one
    statistic: the totals (tokens over the steps' summed time; the step time is their mean). A median of an even
    count taken as one element picked the slower step for the time and the faster for the rates."""
    t, n, c = times[warmup:], tokens[warmup:], sampled[warmup:]
    return len(t), mean(t), sum(n) / sum(t), sum(c) / sum(t)


def finish(
    w: harness.Workload, row: Row, times: list[float], tokens: list[float], sampled: list[float], warmup: int
) -> None:
    row.steps, row.seconds_per_step, row.tokens_per_s, row.sampled_tokens_per_s = rates(
        times, tokens, sampled, warmup
    )
    res = harness.Result(part="grpo", system=row.system, seq=0, batch=0)
    w.record_peak_memory(res)
    row.peak_alloc_gib, row.peak_reserved_gib = res.peak_alloc_gib, res.peak_reserved_gib


def run_strop(a, w: harness.Workload) -> Row:
    from strop.common.trainer_types import (
        DatasetFormat,
        GrpoConfig,
        KernelMode,
        LoadModelRequest,
        LoraConfig,
        Quantization,
        TrainConfig,
        TrainMethod,
    )
    from strop.trainer_svc.core import grpo, job_config, training
    from strop.trainer_svc.core.trainer_core import TrainerConfig, TrainerCore

    row = Row(a.worker or "strop")
    work = tempfile.mkdtemp(prefix="grpo-bench-")
    core = TrainerCore(
        TrainerConfig(
            model_root=harness.MODEL_ROOT,
            artifact_root=f"{work}/artifacts",
            state_dir=f"{work}/state",
            device="cuda:0" if w.device == "cuda" else "cpu",
        )
    )
    info = core.sessions.load(
        LoadModelRequest(
            model_path=os.path.basename(w.saved_model_dir()),
            quantization=Quantization.NF4,
            kernels=KernelMode.UNSPECIFIED,
            max_seq_length=min(harness.MAX_POSITIONS, a.prompt_tokens * 2 + a.new_tokens + 64),
        )
    )
    core.sessions.attach_lora(info.session_id, LoraConfig(r=16, alpha=16, seed=0))
    loaded = core.sessions.open(info.session_id).loaded
    timed = a.steps + a.warmup
    extra = int(a.profile and w.device == "cuda")  # the profiled step runs after the timed ones
    data = rows(a.prompts * (timed + extra), a.prompt_tokens, vary=a.vary_prompt)
    cfg = TrainConfig(
        method=TrainMethod.GRPO,
        learning_rate=LR,
        lr_scheduler="constant",
        max_steps=timed + extra,
        batch_size=a.prompts,
        seed=0,
        grpo=GrpoConfig(
            grader=json.dumps(GRADER), group_size=a.group, max_new_tokens=a.new_tokens, temperature=1.0
        ),
    )
    cfg = job_config.with_defaults(cfg, session_max_len=loaded.facts.max_seq_length, num_rows=len(data))
    cfg = grpo.check_job(cfg, DatasetFormat.PROMPTS, data, loaded.tokenizer)
    # the random model's completions score alike (their ids mostly lie outside the tiny tokenizer): train every group
    # anyway, as TRL does, so both systems do the same work
    grpo.SKIP_GROUPS_WITHOUT_SIGNAL = False
    grpo.SHARED_PREFIX = a.worker != "strop-padded"
    metrics = []
    phases = time_phases(w)
    warned = count_reference_paths()
    compiled = count_triton_compiles()

    def on_step(m) -> None:
        metrics.append(m)
        parts = ", ".join(f"{k} {v:.2f}" for k, v in phases.items())
        phases.clear()
        progress(
            f"strop step {len(metrics)}: {m.step_seconds:.1f} s (sampling {m.rl.sampling_seconds:.1f}, training "
            f"{m.rl.training_seconds:.1f}), peak alloc {peak_gib(w):.1f} GiB since the reset; seconds: {parts}; "
            f"kernels' reference-path warnings so far {len(warned)}; mean completion "
            f"{m.rl.sampled_length_mean:.1f} tokens; Triton compiles this step {len(compiled)}"
            f"{': ' + ', '.join(sorted(set(compiled))) if compiled else ''}; "
            f"{loaded.extra.get('step_memory_mode', '')}"
        )
        compiled.clear()
        if len(metrics) == a.warmup:
            w.reset_peak_memory()  # the measured steps' peaks
        if len(metrics) == timed and extra:
            import torch

            peaks.extend(
                [torch.cuda.max_memory_allocated() / 2**30, torch.cuda.max_memory_reserved() / 2**30]
            )

    peaks: list[float] = []
    if extra:
        from lib.profile import label_phases, profile_step

        label_phases(
            grpo.GrpoLoop, _sample="sample", _grade="grade", _rows="forward", _first_pass="first pass"
        )
        plain_step = grpo.GrpoLoop.step

        def step(self, i):
            if i < timed:
                return plain_step(self, i)
            out = []
            row.profile = profile_step(lambda: out.append(plain_step(self, i)))
            return out[0]

        grpo.GrpoLoop.step = step
    sinks = training.Sinks(on_step=on_step, on_checkpoint=lambda s, p: None, on_start=lambda t: None)
    if a.warmup == 0:
        w.reset_peak_memory()
    grpo.run_grpo(loaded, data, cfg, Path(work) / "job", training.JobControl(), sinks)
    metrics = metrics[:timed]
    times = [m.step_seconds for m in metrics]
    sampled = [m.rl.sampled_length_mean * a.prompts * a.group for m in metrics]
    tokens = [m.tokens_per_second * m.step_seconds for m in metrics]
    row.prompt_tokens = (tokens[-1] - sampled[-1]) / (a.prompts * a.group)
    row.completion_tokens = metrics[-1].rl.sampled_length_mean
    row.rewards = [m.rl.reward_mean for m in metrics]
    finish(w, row, times, tokens, sampled, a.warmup)
    if peaks:  # the timed steps' peaks, not the profiled step's
        row.peak_alloc_gib, row.peak_reserved_gib = peaks
    row.note = (
        f"sampling {mean([m.rl.sampling_seconds for m in metrics[a.warmup :]]):.1f} s, training "
        f"{mean([m.rl.training_seconds for m in metrics[a.warmup :]]):.1f} s a step; {loaded.facts.kernels_reason[:80]}"
    )
    return row


def time_phases(w: harness.Workload) -> dict[str, float]:
    """Seconds of the GRPO step's parts (device-synchronised), summed until the caller clears them: the sampler's
    prefill and decode (and whether it replayed a CUDA graph), the training forwards to the hidden rows, the first
    update's no-grad extras (entropy), the backward passes, the optimizer step; what is left of a step's training
    time is grading, the loss and the host-side bookkeeping."""
    import torch

    from strop.trainer_svc.core import grpo, step_ops
    from strop.trainer_svc.core.sampler import SampleStats

    out: dict[str, float] = {}

    def timed(name: str, f):
        def run(*args, **kw):
            w.sync()
            t0 = time.perf_counter()
            try:
                return f(*args, **kw)
            finally:
                w.sync()
                out[name] = out.get(name, 0.0) + time.perf_counter() - t0

        return run

    sample = grpo.sample

    def sample_with_stats(*args, **kw):
        stats = SampleStats()
        res = sample(*args, **kw, stats=stats)
        out["prefill"] = out.get("prefill", 0.0) + stats.prefill_s
        out["decode"] = out.get("decode", 0.0) + stats.decode_s
        out["decode graphed"] = float(stats.cuda_graph)
        return res

    grpo.sample = sample_with_stats
    grpo.GrpoLoop._rows = timed("forward", grpo.GrpoLoop._rows)
    grpo.GrpoLoop._first_pass = timed("first pass", grpo.GrpoLoop._first_pass)
    step_ops.optim_step = timed("optim", step_ops.optim_step)
    torch.Tensor.backward = timed(
        "backward", torch.Tensor.backward
    )  # this worker's only backward is the loss's
    return out


def count_reference_paths() -> list[str]:
    """The strop kernels' reference-path warnings (a patched forward that left a call to PEFT/HF), as logged."""
    import logging

    seen: list[str] = []

    class Count(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "reference path" in record.getMessage():
                seen.append(record.getMessage())

    logging.getLogger("strop.kernels").addHandler(Count())
    return seen


def count_triton_compiles() -> list[str]:
    """The Triton kernels compiled from here on (one name per compile: a new specialization of a kernel, such as
    a row count of another divisibility or a new constexpr; a kernel already compiled in the process is not counted),
    through Triton's post-compile hook."""
    try:
        from triton import knobs
    except ImportError:
        return []
    seen: list[str] = []
    previous = knobs.runtime.jit_post_compile_hook

    def hook(*, fn, **kw):
        seen.append(fn.name)
        return previous(fn=fn, **kw) if previous else None

    knobs.runtime.jit_post_compile_hook = hook
    return seen


def run_trl(a, w: harness.Workload) -> Row:
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    row = Row("trl")
    model = harness.attach_lora(w.load_model(qlora=True))
    tok = AutoTokenizer.from_pretrained(w.saved_model_dir())
    data = rows(a.prompts * (a.steps + a.warmup), a.prompt_tokens, vary=a.vary_prompt)
    dataset = Dataset.from_list([{"prompt": r["messages"], "letter": r["letter"]} for r in data])

    def reward(completions, letter, **kw):
        texts = [c if isinstance(c, str) else c[0]["content"] for c in completions]
        return [float(x in t) for t, x in zip(texts, letter, strict=True)]

    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="grpo-bench-trl-"),
        learning_rate=LR,
        lr_scheduler_type="constant",
        per_device_train_batch_size=a.group,
        gradient_accumulation_steps=a.prompts,
        num_generations=a.group,
        max_completion_length=a.new_tokens,
        temperature=1.0,
        top_p=1.0,
        beta=0.0,
        loss_type="grpo",
        num_iterations=1,
        max_steps=a.steps + a.warmup,
        bf16=w.device == "cuda",
        use_cpu=w.device == "cpu",
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        optim="adamw_torch",
        logging_steps=1,
        report_to="none",
        disable_tqdm=True,
        use_vllm=False,
        # the saved config says use_cache=False (training needs no cache), which transformers' generate takes
        # over TRL's generation config: every decode step would run the whole sequence again
        generation_kwargs={"use_cache": True},
        save_strategy="no",
        seed=0,
        shuffle_dataset=False,
    )
    times: list[float] = []
    gen_times: list[float] = []  # transformers generate's seconds, one entry a step
    generate = model.generate

    def timed_generate(*args, **kw):
        widths: list[
            int
        ] = []  # positions each backbone forward computes: 1 after the prefill with a KV cache

        def width(module, args, kwargs):
            x = kwargs.get("input_ids")
            x = x if x is not None else kwargs.get("inputs_embeds")
            widths.append(int(x.shape[1]) if x is not None else -1)

        hook = model.get_base_model().model.register_forward_pre_hook(width, with_kwargs=True)
        w.sync()
        t0 = time.perf_counter()
        try:
            out = generate(*args, **kw)
        finally:
            hook.remove()
        w.sync()
        gen_times.append(time.perf_counter() - t0)
        cache = (
            "KV cache"
            if max(widths[1:], default=1) == 1
            else f"NO KV cache (decode widths up to {max(widths)})"
        )
        progress(
            f"trl generate {gen_times[-1]:.1f} s ({len(widths)} forwards, {cache}), peak alloc "
            f"{peak_gib(w):.1f} GiB so far"
        )
        return out

    model.generate = timed_generate  # what TRL's transformers path calls on the unwrapped PeftModel

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            if w.device == "cuda":
                torch.cuda.synchronize()
            if state.global_step == a.warmup:
                w.reset_peak_memory()
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if w.device == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - self.t0)
            progress(
                f"trl step {len(times)}: {times[-1]:.1f} s, peak alloc {peak_gib(w):.1f} GiB since the reset"
            )

    trainer = GRPOTrainer(
        model=model,
        reward_funcs=[reward],
        args=args,
        train_dataset=dataset,
        processing_class=tok,
        callbacks=[Timer()],
    )
    # LoRA weights fp32, as the baseline recipe and the trainer service keep them
    harness.upcast_adapters_(model)
    trainer.train()
    hist = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    lengths = [h["completions/mean_length"] for h in hist]
    prompt_len = sum(
        len(
            tok.apply_chat_template(
                r["messages"], tokenize=True, add_generation_prompt=True, return_dict=True
            )["input_ids"]
        )
        for r in data
    ) / len(data)
    n = a.prompts * a.group
    tokens = [n * (prompt_len + c) for c in lengths]
    sampled = [n * c for c in lengths]
    row.prompt_tokens, row.completion_tokens = prompt_len, lengths[-1]
    row.rewards = [h.get("reward", 0.0) for h in hist]
    finish(w, row, times[: len(lengths)], tokens, sampled, a.warmup)
    if len(gen_times) == len(times):
        gen = mean(gen_times[a.warmup :])
        row.note = f"generate {gen:.1f} s, the rest (training) {row.seconds_per_step - gen:.1f} s a step"
    return row


def progress(line: str) -> None:
    """A worker's progress line: the parent keeps the last of them when the worker runs out of time."""
    print("PROGRESS " + line, flush=True)


def peak_gib(w: harness.Workload) -> float:
    if w.device != "cuda":
        return 0.0
    import torch

    return torch.cuda.max_memory_allocated() / 2**30


def spawn(
    system: str,
    a,
    prompts: int | None = None,
    prompt_tokens: int | None = None,
    steps: int | None = None,
    warmup: int | None = None,
    timeout: float | None = None,
) -> Row:
    """One worker process for ``system``; the keyword arguments override ``a``'s shape for this run."""
    env = {**os.environ, "PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    if a.smoke:
        env["TRITON_INTERPRET"] = "1"
    timeout = a.timeout if timeout is None else timeout
    shape = {
        "--prompts": a.prompts if prompts is None else prompts,
        "--group": a.group,
        "--new-tokens": a.new_tokens,
        "--prompt-tokens": a.prompt_tokens if prompt_tokens is None else prompt_tokens,
        "--steps": a.steps if steps is None else steps,
        "--warmup": a.warmup if warmup is None else warmup,
        "--vary-prompt": a.vary_prompt,
    }
    cmd = [sys.executable, os.path.abspath(__file__), "--worker", system]
    cmd += [x for k, v in shape.items() for x in (k, str(v))] + (["--smoke"] if a.smoke else [])
    cmd += ["--profile"] * a.profile
    t0 = time.perf_counter()
    with tempfile.TemporaryFile("w+") as err:  # a file: a pipe nobody reads could fill and stall the worker
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=err, text=True)
        lines: list[str] = []

        # stdout line by line: progress is printed as it comes, for a device call killed outright
        def read() -> None:
            for line in proc.stdout:
                lines.append(line.rstrip("\n"))
                if line.startswith("PROGRESS "):
                    print(f"  {line[9:].strip()}", flush=True)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        try:
            proc.wait(timeout=timeout)
            timed_out = False
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            timed_out = True
        reader.join(timeout=10)
        err.seek(0)
        stderr = err.read()
    wall = time.perf_counter() - t0
    if timed_out:
        done = [line[9:] for line in lines if line.startswith("PROGRESS ")]
        return Row(
            system,
            ok=False,
            error=f"timeout after {timeout:.0f}s; " + ("; ".join(done[-3:]) or "no progress line"),
            wall_s=wall,
        )
    if a.show_stderr and stderr:
        print(f"--- {system} worker stderr (tail) ---\n{stderr[-a.show_stderr :]}", flush=True)
    for line in lines:
        if line.startswith("RESULT "):
            return Row(**{**json.loads(line[7:]), "wall_s": wall})
    tail = (stderr or "\n".join(lines))[-1500:]
    return Row(
        system,
        ok=False,
        error=f"rc={proc.returncode}: {tail}",
        oom="out of memory" in tail.lower(),
        wall_s=wall,
    )


def table(results: list[Row], a) -> str:
    base = next((r for r in results if r.system == "trl" and r.ok), None)
    lines = [
        f"GRPO, 8B-shape QLoRA r16: {a.prompts} prompts x {a.group} samples a step, prompt ~{a.prompt_tokens} "
        f"tokens, <= {a.new_tokens} new tokens"
        if not a.smoke
        else "smoke (tiny shape, CPU): harness only",
        "| system | steps | prompt tok | completion tok | s/step | tokens/s | vs trl | sampled tok/s | peak alloc GiB "
        "| vs trl | reserved GiB | note |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        if not r.ok:
            lines.append(f"| {r.system} | failed: {r.error[:300]} |")
            continue
        speed = f"{r.tokens_per_s / base.tokens_per_s:.2f}x" if base else "-"
        mem = f"{r.peak_alloc_gib / base.peak_alloc_gib:.2f}x" if base and base.peak_alloc_gib else "-"
        lines.append(
            f"| {r.system} | {r.steps} | {r.prompt_tokens:.0f} | {r.completion_tokens:.0f} | {r.seconds_per_step:.2f} "
            f"| {r.tokens_per_s:,.0f} | {speed} | {r.sampled_tokens_per_s:,.0f} | {r.peak_alloc_gib:.1f} | {mem} "
            f"| {r.peak_reserved_gib:.1f} | {r.note[:160]} |"
        )
    return "\n".join(lines)


def find_longest(a) -> dict:
    """The longest prompt (with ``a.new_tokens`` new tokens, one prompt x ``a.group`` samples) strop's GRPO step runs
    without running out of device memory (bench/lib/longest.py's search, one fresh worker a trial). Prints each
    trial's row, then the result."""
    print(
        "| prompt tokens asked | prompt tok | completion tok | tokens a sequence | result | peak alloc GiB "
        "| reserved GiB | s/step | trial s |\n|---|---|---|---|---|---|---|---|---|",
        flush=True,
    )

    def trial(n: int, left: float) -> longest.Trial:
        r = spawn("strop", a, prompts=1, prompt_tokens=n, steps=1, warmup=0, timeout=min(a.timeout, left))
        outcome = longest.FITS if r.ok else longest.OOM if r.oom else longest.ERROR
        result = outcome if outcome != longest.ERROR else f"error: {r.error[-200:]}".replace("\n", " ")
        print(
            f"| {n:,} | {r.prompt_tokens:,.0f} | {r.completion_tokens:,.0f} | "
            f"{r.prompt_tokens + r.completion_tokens:,.0f} | {result} | {r.peak_alloc_gib:.1f} | "
            f"{r.peak_reserved_gib:.1f} | {r.seconds_per_step:.1f} | {r.wall_s:.0f} |",
            flush=True,
        )
        return longest.Trial(outcome, r.wall_s, r)

    s = longest.find_longest_from_flags(trial, a)
    best = max(
        (t.row for n, t in s.trials if t.row.ok and n == s.fits), key=lambda r: r.prompt_tokens, default=None
    )
    seq = f"{best.prompt_tokens + best.completion_tokens:,.0f}" if best else "?"
    print(
        f"longest that fits at group {a.group} with {a.new_tokens} new tokens: prompt {s.fits:,} tokens asked "
        f"({seq} tokens a sequence, chat template included); {s.summary()}; continue with "
        f"{s.continue_flags(a.find_start)}",
        flush=True,
    )
    return s.as_dict()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", choices=["trl", "strop", "strop-padded"])
    p.add_argument("--systems", default="trl,strop")
    p.add_argument("--prompts", type=int, default=4, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="completions per prompt")
    p.add_argument("--prompt-tokens", type=int, default=128)
    p.add_argument(
        "--vary-prompt",
        type=int,
        default=0,
        metavar="N",
        help="prompt i is (37 i mod (N+1)) tokens shorter: each step trains a row of another length, as in a real job",
    )
    p.add_argument("--new-tokens", type=int, default=512)
    p.add_argument("--steps", type=int, default=3, help="measured steps")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--timeout", type=int, default=1800)
    p.add_argument("--json")
    p.add_argument("--show-stderr", type=int, default=0, metavar="CHARS")
    p.add_argument(
        "--profile",
        action="store_true",
        help="strop (CUDA): one more GRPO step under torch.profiler after the timed ones: top kernels, GPU time by "
        "kind, GPU idle by phase (sample, grade, forward, first pass) and host op",
    )
    p.add_argument(
        "--smoke", action="store_true", help="tiny shape on the CPU: checks the harness, not speed"
    )
    longest.add_flags(p, unit="prompt tokens", start=8192, max_length=harness.MAX_POSITIONS // 2)
    a = p.parse_args()
    w = harness.workload("qlora", a.smoke)
    if a.worker:
        try:
            row = run_trl(a, w) if a.worker == "trl" else run_strop(a, w)
        except Exception as exc:
            import traceback

            traceback.print_exc()
            row = Row(a.worker, ok=False, error=repr(exc)[:400], oom=longest.is_oom(exc))
        print("RESULT " + json.dumps(asdict(row)), flush=True)
        return
    w.ensure_saved_model(harness.MAX_POSITIONS, "qlora")
    if a.find_longest:
        found = find_longest(a)
        if a.json:
            os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
            with open(a.json, "w") as f:
                json.dump(found, f, indent=1)
        return
    results = []
    for system in a.systems.split(","):
        r = spawn(system, a)
        results.append(r)
        print(
            f"{system}: "
            + (f"{r.tokens_per_s:,.0f} tok/s, {r.peak_alloc_gib:.1f} GiB" if r.ok else r.error[:300]),
            flush=True,
        )
    if a.json:
        os.makedirs(os.path.dirname(a.json) or ".", exist_ok=True)
        with open(a.json, "w") as f:
            json.dump([asdict(r) for r in results], f, indent=1)
    print(table(results, a))
    for r in results:
        if r.profile:
            print(f"\n## {r.system} profiled step\n{r.profile}", flush=True)


if __name__ == "__main__":
    main()
