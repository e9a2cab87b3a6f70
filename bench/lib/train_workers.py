"""The training benchmark's workers, one per system (``bench/train_bench.py`` spawns each in its own process):
HF + PEFT's loop, strop's patched one under the trainer's memory modes, TRL's SFTTrainer in process or through
the trainer service, and TRL's DPO/ORPO/KTO/SimPO trainers against strop's chunked losses. Each takes the
parsed arguments and the :class:`~lib.harness.Workload` and returns a :class:`~lib.harness.Result`.
"""

from __future__ import annotations

import os
import re
import time
from typing import Any, NamedTuple

from .harness import (
    MODEL_ROOT,
    PART_SHAPES,
    Result,
    Workload,
    attach_lora,
    host_peak_rss_gib,
    upcast_adapters_,
    varied_lengths,
)
from .profile import label_phases, memory_at_peak, profile_step, profile_summary, sync_sites

FAST_BUDGET_GIB = 80  # the memory-allowed mode's cap (issue 5)
# the parts whose base is NF4 (the shaped parts say so by their "qlora-" prefix)
QLORA_PARTS = (
    "qlora",
    *(p for p in PART_SHAPES if p.startswith("qlora-")),
    "context",
    "dpo",
    "orpo",
    "kto",
    "simpo",
)
# trained by TRL's preference trainers on the fixed batch of DPO pairs (run_dpo_worker, run_preference_worker)
PREFERENCE_PARTS = ("dpo", "orpo", "kto", "simpo")
# TRL's default lr 5e-6 hardly moves the margin from random weights in 8 steps (the H200 baseline's did not
# visibly move, DESIGN.md; the smoke shape's rose 0.0006 a step). Adam steps each weight by about lr whatever
# the gradient's scale and the LoRA B matrices start at zero, so early on the margin rises in proportion to
# lr (smoke: 0.011 a step at 1e-4). 1e-4 is the SFT recipe's AdamW lr; the same for every system.
DPO_LR = 1e-4


def dpo_half(smoke: bool) -> int:
    """Prompt and completion tokens of a DPO pair (--smoke: 24, the CPU runs the kernels interpreted)."""
    return 24 if smoke else 512


def profiled(a, w: Workload) -> int:
    """1 where this TRL-trainer worker profiles one extra, last step (``--profile`` on CUDA), else 0."""
    return int(bool(a.profile) and w.device == "cuda")


def trl_args(config_cls, a, w: Workload, **kw):
    """``config_cls`` (SFTConfig, DPOConfig) with what every TRL system shares: ``a.batch`` rows per step,
    warm-up + measured steps at a constant lr, non-reentrant checkpointing, a log line per step, no saving."""
    import tempfile

    return config_cls(
        output_dir=tempfile.mkdtemp(),
        per_device_train_batch_size=a.batch,
        max_steps=a.warmup + a.steps + profiled(a, w),  # the profiled step is the last, not timed
        lr_scheduler_type="constant",
        gradient_checkpointing=True,
        gradient_checkpointing_kwargs={"use_reentrant": False},
        bf16=w.device == "cuda",
        use_cpu=w.device != "cuda",
        logging_steps=1,
        report_to="none",
        save_strategy="no",
        disable_tqdm=True,
        seed=0,
        data_seed=0,
        dataloader_num_workers=0,
        **kw,
    )


class MemorySystem(NamedTuple):
    """A ``strop-<mode>…`` system's memory mode and its variants (None: the mode's row as it is)."""

    mode: Any  # MemoryMode
    save_layers: int
    attention: bool | None
    tiled: bool | None
    qkv: bool | None
    graphs: bool | None
    offload: bool | None


def memory_system(system: str) -> MemorySystem | None:
    """``strop-<mode>[-sN][-aB][-tB][-qB][-oB][-gB]`` → :class:`MemorySystem`: the trainer's memory modes by the names the service uses.

    ``strop-standard`` (checkpointed layer inputs in pinned host memory, what the trainer's default mode does
    on CUDA), ``strop-long-context`` (+ the tiled MLP), ``strop-max-speed`` (budgeted recompute under
    ``FAST_BUDGET_GIB``); ``-sN``: N evenly spaced layers skip the recompute, their activations in host memory;
    ``-a1``/``-a0``: offloaded layers keep (or do not keep) their attention output for the recompute
    (``MemoryFeatures.save_attention``); ``-t1``/``-t0``: the MLPs run tiled or not (``tiled_mlp``); ``-q1``/``-q0``:
    the saved attention calls keep their q, k, v too or not (``save_qkv``); ``-o1``/``-o0``: checkpointed layer
    inputs offloaded to host memory or kept on the GPU, a plain recompute (``offload_layer_inputs``); ``-g1``/``-g0``:
    each step replays as a CUDA graph once captured or not (``step_graphs``). Each variant replaces the mode's
    value; one left out is None (the mode's row). None for ``baseline`` and ``strop`` (kernels only, plain
    checkpointing); a ``strop-<mode>`` name with its variants out of order is refused. Before 2026-12-01
    (bench/RESULTS.md)
    these were called strop-offload[-sN], strop-mem and strop-fast.
    """
    from strop.common.trainer_types import MemoryMode

    system = re.sub(r"-f8(dx)?$", "", system)  # FP8 base GEMMs (fp8_system) combine with any mode
    m = re.fullmatch(
        r"strop-(standard|long-context|max-speed)(?:-s(\d+))?(?:-a([01]))?(?:-t([01]))?(?:-q([01]))?(?:-o([01]))?(?:-g([01]))?",
        system,
    )
    if m is None:
        if re.match(r"strop-(standard|long-context|max-speed)\b", system):
            raise ValueError(f"{system}: the variants go -sN, -aB, -tB, -qB, -oB, -gB, in that order")
        return None
    attention, tiled, qkv, offload, graphs = (
        None if m.group(i) is None else m.group(i) == "1" for i in range(3, 8)
    )
    mode = MemoryMode(m.group(1).replace("-", "_").upper())
    return MemorySystem(mode, int(m.group(2) or 0), attention, tiled, qkv, graphs, offload)


def fp8_system(system: str) -> bool | str:
    """``patch_model``'s ``fp8_base`` for a system: ``strop…-f8`` True, ``strop…-f8dx`` "dx" (the opt-in FP8 GEMMs
    for the frozen bases, all or the backward's dx; inexact; MFU and HFU still count bf16-equivalent FLOPs against
    the bf16 ceiling, so they are nominal for these systems), else False."""
    if not system.startswith("strop"):
        return False
    return "dx" if system.endswith("-f8dx") else system.endswith("-f8")


def apply_memory(w: Workload, model, system: str, batch: int, seq: int):
    """Install the system's memory mode through the installer the trainer uses, the same way: the table's row
    (with the system's ``-sN``/``-aB``/``-tB``/``-qB``/``-oB``/``-gB`` variant replaced into it), the step's shape for the host-room rule,
    and MAX_SPEED's budget as a job's ``memory_budget_gib`` would give it."""
    import dataclasses

    import torch

    from strop.common.trainer_types import MEMORY_MODES, MemoryMode
    from strop.kernels.models import StepShape, apply_memory_mode

    spec = memory_system(system)
    if spec is None:
        return None
    if w.device != "cuda" and spec.mode is MemoryMode.MAX_SPEED:
        return None  # --smoke: budgeted recompute measures CUDA memory
    features = MEMORY_MODES[spec.mode]
    variant = {
        "save_layers": spec.save_layers,
        "save_attention": spec.attention,
        "tiled_mlp": spec.tiled,
        "save_qkv": spec.qkv,
        "step_graphs": spec.graphs,
        "offload_layer_inputs": spec.offload,
    }
    # an unset variant (None) keeps the row's value; -a0/-q0 (False) and -s0 replace it as set
    features = dataclasses.replace(features, **{k: v for k, v in variant.items() if v is not None})
    budget = FAST_BUDGET_GIB * 2**30 if features.budgeted_recompute else 0
    if w.device == "cuda" and budget:
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, budget / total))
    smoke = {} if w.device == "cuda" else {"offload_cpu_tensors": True, "min_offload_bytes": 0}  # --smoke
    return apply_memory_mode(
        model, features, step=StepShape(batch, seq), budget_bytes=budget, device=w.device, **smoke
    )


def run_worker(a, w: Workload) -> Result:
    import torch

    res = Result(part=a.part, system=a.system, seq=a.seq, batch=a.batch)
    t0 = time.perf_counter()
    model = attach_lora(w.load_model(a.part in QLORA_PARTS))
    checkpointing = {"use_reentrant": False}
    if getattr(memory_system(a.system), "graphs", None):
        from strop.kernels.models.step_graph import random_free

        # as the trainer does with step graphs: no RNG state to save, which a capture cannot read
        if random_free(model):
            checkpointing["preserve_rng_state"] = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing)
    if a.system.startswith("strop"):
        from strop.kernels.models import patch_model

        res.notes = str(patch_model(model, fp8_base=fp8_system(a.system)))
    installed = apply_memory(w, model, a.system, a.batch, a.seq)
    model.train()
    if a.progress:
        log_layer_progress(w, model, a.progress)
    res.build_s = time.perf_counter() - t0
    if a.vary_width:
        batches = varied_batches(a, w, w.shape["vocab"])
        res.widths = [b["input_ids"].shape[1] for b in batches]
    else:
        g = torch.Generator(device=w.device).manual_seed(1234)
        data = torch.randint(0, w.shape["vocab"], (a.batch, a.seq), device=w.device, generator=g)
        batches = [{"input_ids": data, "labels": data}] * (a.warmup + a.steps)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    graph = step_graph(model) if installed is not None and installed.features.step_graphs else None
    res.notes += w.reset_peak_memory()
    times, starts = [], []
    window = HostWindow()
    for batch in batches:
        starts.append(time.perf_counter())
        w.sync()
        ts = time.perf_counter()
        loss = train_step(w, model, opt, batch, graph)
        w.sync()
        times.append(time.perf_counter() - ts)
        window.mark()
        res.losses.append(round(float(loss.detach()), 5))
        if installed is not None and installed.step_end() is not None:
            res.notes += f"\nbudgeted recompute: {installed.recompute.plan}"
            res.notes += w.reset_peak_memory()  # the peak reported is the planned steps'
    starts.append(time.perf_counter())
    res.notes += wall_note(starts, a.warmup, times) + window.note(a.warmup, a.steps, "the sync after a step")
    w.record_peak_memory(res)
    if graph is not None:
        res.notes += f"\nstep graphs: {graph.stats.replayed} steps replayed, {graph.stats.eager} eager"
        res.notes += "".join(f"; eager: {why}" for why in graph.reasons.values())
    if installed is not None:
        res.notes += "\n" + str(installed)  # after training: what was offloaded
        if installed.memory is not None and installed.memory.offloader is not None:
            res.notes += f"\n{installed.memory.offloader!r}"
    if a.profile and w.device == "cuda":
        res.profile = profile_step(lambda: train_step(w, model, opt, batches[-1], graph))
        try:
            res.profile += "\n" + memory_at_peak(lambda: train_step(w, model, opt, batches[-1], graph))
        except Exception as exc:  # a diagnostic: its failure must not lose the measured run
            res.profile += f"\nmemory at peak: not recorded ({exc!r})"
        try:
            res.profile += "\n" + sync_sites(lambda: train_step(w, model, opt, batches[-1], graph))
        except Exception as exc:  # a diagnostic, as above
            res.profile += f"\nhost waits: not recorded ({exc!r})"
    recompute = 1.0
    plan = installed.recompute.plan if installed is not None and installed.recompute is not None else None
    if plan is not None:
        recompute = 1 - plan.uncheckpointed / plan.layers
    saved_layers = getattr(memory_system(a.system), "save_layers", 0)
    if saved_layers:  # never the last layer
        recompute = 1 - min(saved_layers, w.shape["layers"] - 1) / w.shape["layers"]
    if a.vary_width:
        real = [int(b["attention_mask"].sum()) for b in batches]
        w.record_varied_speed(res, times, a.warmup, real, recompute)
    else:
        w.record_speed(res, times, a.warmup, a.batch * a.seq, recompute)
    return res


def varied_batches(a, w: Workload, vocab: int) -> list[dict]:
    """``--vary-width``: each step's batch for the library's loop (HF + PEFT and strop alike), rows of random ids
    of ``varied_lengths``' lengths right-padded to the step's longest, as TRL's collator pads the same rows: id 0,
    attention mask 0 and label -100 on the padding."""
    import torch

    g = torch.Generator().manual_seed(1234)
    out = []
    for lengths in varied_lengths(a.seq, a.vary_width, a.batch, a.warmup + a.steps):
        width = max(lengths)
        mask = (torch.arange(width)[None, :] < torch.tensor(lengths)[:, None]).long()
        ids = torch.randint(0, vocab, (len(lengths), width), generator=g) * mask
        batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)}
        out.append({k: v.to(w.device) for k, v in batch.items()})
    return out


def wall_note(marks: list[float], warmup: int, times: list[float]) -> str:
    """A note line: the median wall time from one measured step's mark to the next (``marks``: a time at each
    step's start and one after the last, or each step event's arrival after the warm-up's last) beside the
    median step time reported; their difference is the host work between steps that the step time leaves out."""
    walls = sorted(b - a for a, b in zip(marks[warmup:], marks[warmup + 1 :], strict=False))
    measured = sorted(times[warmup:])
    if not walls or not measured:
        return ""
    wall, step = walls[len(walls) // 2], measured[len(measured) // 2]
    return f"\nwall between steps: median {wall * 1e3:.1f} ms (step time {step * 1e3:.1f} ms)"


def log_layer_progress(w: Workload, model, path: str) -> None:
    """Append a line to ``path`` as each decoder layer ends its forward and as backward reaches it (before its
    recompute), after a device sync: the time, the peak GPU memory so far and the host's peak RSS. A step too
    long for the caller's time limit still leaves how far it got and the peaks on the way."""
    import torch

    from strop.kernels.models.hf import checkpoint_layers, unwrap_peft

    t0 = time.perf_counter()

    def log(i: int, kind: str) -> None:
        w.sync()
        peak = torch.cuda.max_memory_allocated() / 2**30 if w.device == "cuda" else 0.0
        with open(path, "a") as f:
            f.write(
                f"{time.perf_counter() - t0:9.1f} s  layer {i:2d} {kind:8s}  GPU peak {peak:6.1f} GiB  "
                f"host peak RSS {host_peak_rss_gib():6.1f} GiB\n"
            )

    def hook(i):
        def post(module, args, out):
            log(i, "forward")
            h = out[0] if isinstance(out, tuple) else out
            if isinstance(h, torch.Tensor) and h.requires_grad:
                h.register_hook(lambda g: log(i, "backward"))

        return post

    for i, layer in enumerate(checkpoint_layers(unwrap_peft(model))):
        layer.register_forward_hook(hook(i))


# a batch's tensors, in the order a step graph takes them
_STEP_KEYS = ("input_ids", "labels", "attention_mask")


def step_graph(model):
    """A :class:`~strop.kernels.models.step_graph.StepGraph` of ``model``'s loss on a batch's tensors (``-g1``)."""
    from strop.kernels.models.step_graph import StepGraph

    def loss(*tensors):
        return model(**dict(zip(_STEP_KEYS, tensors, strict=False))).loss

    return StepGraph(loss, [p for p in model.parameters() if p.requires_grad])


def train_step(w: Workload, model, opt, batch: dict, graph=None):
    """One optimizer step on ``batch`` (``input_ids``, ``labels``, with ``--vary-width`` an ``attention_mask``);
    through ``graph`` (:func:`step_graph`) where given: its replay, once captured, runs the forward and backward."""
    import torch

    with torch.autocast(w.device, dtype=torch.bfloat16, enabled=w.device == "cuda"):
        if graph is None:
            loss = model(**batch).loss
        else:
            loss = graph.step(*(batch[k] for k in _STEP_KEYS if k in batch))[0]
    if graph is None:
        loss.backward()
    opt.step()
    opt.zero_grad(set_to_none=True)  # a step graph binds its gradients again before its next replay
    return loss


def run_trl_worker(a, w: Workload) -> Result:
    """SFT through TRL on the saved model: ``trl-lib`` in-process (a user's script: from_pretrained, PEFT,
    ``patch_model``, offloaded checkpointing, SFTTrainer) or ``service`` through the trainer service over
    gRPC on localhost (whose standard memory mode on CUDA offloads the checkpointed inputs the same way).

    Both train the same pre-tokenized rows (batch x seq random ids) with gradient checkpointing, AdamW
    lr 1e-4, bf16, fp32 adapters; the service reports each step's time in its events.
    """
    import tempfile

    import torch

    res = Result(part=a.part, system=a.system, seq=a.seq, batch=a.batch)
    t0 = time.perf_counter()
    g = torch.Generator().manual_seed(1234)
    if a.vary_width:  # the rows of each step in turn (the trainer samples them in order)
        steps = a.warmup + a.steps + profiled(a, w)
        lengths = [n for step in varied_lengths(a.seq, a.vary_width, a.batch, steps) for n in step]
        rows = [{"input_ids": torch.randint(0, 640, (n,), generator=g).tolist()} for n in lengths]
    else:
        ids = torch.randint(0, 640, (a.batch, a.seq), generator=g)  # ids of the saved tiny tokenizer
        rows = [{"input_ids": ids[i].tolist()} for i in range(a.batch)] * (a.warmup + a.steps)
    qlora = a.part in QLORA_PARTS
    times: list[float] = []
    arrivals: list[float] = []  # the service: each step event's arrival at the client
    if a.system in ("service", "service-hfloop"):
        if a.vary_width:
            raise ValueError("--vary-width: the service's dataset order is its own; run trl-lib")
        import logging

        from strop.client import KernelMode, LoraConfig, Quantization, TrainConfig, TrainerClient, TrainMethod
        from strop.trainer_svc.core.trainer_core import TrainerConfig
        from strop.trainer_svc.server import start

        class KeepMemoryMode(logging.Handler):
            """The memory mode the job installed (``training`` logs it), kept for the notes."""

            def emit(self, record):
                if record.getMessage().startswith("memory mode"):
                    res.notes += "\n" + record.getMessage()

        if a.system == "service-hfloop":
            hf_step_loop()
        window = HostWindow().after_guard_read()
        trainer_log = logging.getLogger("strop.trainer")
        trainer_log.addHandler(KeepMemoryMode(logging.INFO))
        trainer_log.setLevel(min(trainer_log.getEffectiveLevel(), logging.INFO))
        work = tempfile.mkdtemp()
        service = start(
            TrainerConfig(model_root=MODEL_ROOT, artifact_root=work + "/a", state_dir=work + "/s")
        )
        with TrainerClient(f"127.0.0.1:{service.port}") as tc:
            s = tc.load_model(
                os.path.basename(w.saved_model_dir()),
                dtype=w.dtype,
                quantization=Quantization.NF4 if qlora else Quantization.NONE,
                kernels=KernelMode.UNSPECIFIED,
            )
            s = tc.attach_lora(s.session_id, LoraConfig(r=16, alpha=16))
            res.notes = s.facts.kernels_reason
            ds = tc.upload_dataset(rows)
            res.build_s = time.perf_counter() - t0
            cfg = TrainConfig(
                method=TrainMethod.SFT,
                learning_rate=1e-4,
                lr_scheduler="constant",
                batch_size=a.batch,
                max_length=a.seq,
                max_steps=a.warmup + a.steps + profiled(a, w),  # the profiled step is the last, not timed
                gradient_checkpointing=True,
                optimizer="adamw_torch",
                seed=0,
            )
            res.notes += w.reset_peak_memory()  # the service trains in this process: the same readers apply
            prof = None
            for e in tc.train(s.session_id, ds.dataset_id, cfg):
                if e.step is not None and e.step.step > a.warmup + a.steps:  # the profiled step has ended
                    try:  # a diagnostic: its failure must not lose the measured run
                        prof.__exit__(None, None, None)
                        res.profile = profile_summary(prof, e.step.step_seconds)
                    except Exception as exc:
                        res.profile = f"profile not recorded ({exc!r})"
                elif e.step is not None:
                    arrivals.append(time.perf_counter())
                    res.losses.append(round(e.step.loss, 5))
                    times.append(e.step.step_seconds)
                    if profiled(a, w) and e.step.step == a.warmup + a.steps:
                        # from the client's thread, as the job thread starts the next step: CUPTI sees every
                        # kernel of the process, so the GPU timeline (idle time, kernel kinds) is the step's
                        from torch.profiler import ProfilerActivity, profile

                        prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                        prof.__enter__()
                elif e.state is not None and e.state.state.value == "FAILED":
                    raise RuntimeError(e.state.message)
            w.record_peak_memory(res)
            # the warm-up's last event and each measured step's: the marks between the measured steps
            res.notes += wall_note(arrivals[a.warmup - 1 :], 0, times[a.warmup :]) if a.warmup else ""
            res.notes += window.note(a.warmup, a.steps, "the guard's read")
        service.stop(grace=1.0)
    else:
        from datasets import Dataset
        from transformers import AutoTokenizer
        from trl import SFTConfig, SFTTrainer

        from strop.kernels.models import patch_model
        from strop.kernels.trainers import shared_prompt, strop_sft_trainer_class

        system, buckets = re.fullmatch(r"(.*?)(?:-b([01]))?", a.system).groups()
        if buckets is not None:  # -b1/-b0: SFT batch widths in buckets or not, whatever the library's default
            shared_prompt.WIDTH_BUCKETS = buckets == "1"
        model = attach_lora(w.load_model(qlora))
        res.notes = str(patch_model(model))
        memory = apply_memory(
            w, model, "strop-standard", a.batch, a.seq
        )  # the service's default mode on CUDA
        # TRL's SFTTrainer with its fused LM head on strop's kernel; trl-lib-trlhead: TRL's own head (before 2026-12-03)
        trainer_cls = SFTTrainer if system == "trl-lib-trlhead" else strop_sft_trainer_class()
        # trl-lib-svcargs: what the service adds to the in-process run (its optimizer name, its token count and
        # its gradient guard), to tell those from the service's threads and gRPC
        svc = system == "trl-lib-svcargs"
        extra = dict(optim="adamw_torch", include_num_input_tokens_seen="non_padding") if svc else {}
        if a.vary_width:
            extra["train_sampling_strategy"] = "sequential"
        trainer = trainer_cls(
            model=model,
            args=trl_args(SFTConfig, a, w, learning_rate=1e-4, max_length=a.seq, **extra),
            train_dataset=Dataset.from_list(rows),
            processing_class=AutoTokenizer.from_pretrained(w.saved_model_dir()),
            callbacks=[w.step_timer(times, res if profiled(a, w) else None)],
        )
        if svc:
            from strop.trainer_svc.core.guard import make_guard

            trainer.add_callback(make_guard(model))
        real: list[int] = []  # --vary-width: each batch's real tokens, as its width is recorded
        if a.vary_width:
            collate = trainer.data_collator

            def recorded(examples):
                batch = collate(examples)
                res.widths.append(batch["input_ids"].shape[1])
                real.append(int(batch["attention_mask"].sum()))
                return batch

            trainer.data_collator = recorded
        upcast_adapters_(model)
        res.build_s = time.perf_counter() - t0
        res.notes += w.reset_peak_memory()
        trainer.train()
        w.record_peak_memory(res)
        res.notes += "\n" + str(memory)
        res.losses = [round(float(h["loss"]), 5) for h in trainer.state.log_history if "loss" in h]
        if a.vary_width:
            w.record_varied_speed(res, times, a.warmup, real, 1.0)
            return res
    w.record_speed(res, times, a.warmup, a.batch * a.seq, 1.0)
    return res


class HostWindow:
    """The host time from a step's drain of the device to the next step's first forward op, ms a step, recorded as
    a worker trains: from :meth:`mark` (the library's loop: its sync after the step; the service: the end of the
    callbacks' ``on_optimizer_step``, the gradient guard's read, which waits for the optimizer step,
    :meth:`after_guard_read`) to the input embedding's forward. The GPU has only the next batch's small copies over
    it, so on the GPU it is idle time a step (bench/RESULTS.md: "the service's host work a step"). Wraps
    ``nn.Embedding.forward`` (and for the service HF's callback handler) in this worker's process."""

    def __init__(self) -> None:
        import torch

        self.gaps: list[float] = []
        self._read: float | None = None
        embedding = torch.nn.Embedding.forward

        def first_op(module, *args, **kwargs):
            if self._read is not None:
                self.gaps.append((time.perf_counter() - self._read) * 1e3)
                self._read = None
            return embedding(module, *args, **kwargs)

        torch.nn.Embedding.forward = first_op

    def mark(self) -> None:
        self._read = time.perf_counter()

    def after_guard_read(self) -> HostWindow:
        from transformers.trainer_callback import CallbackHandler

        on_optimizer_step = CallbackHandler.on_optimizer_step

        def after_read(handler, *args, **kwargs):
            out = on_optimizer_step(handler, *args, **kwargs)
            self.mark()
            return out

        CallbackHandler.on_optimizer_step = after_read
        return self

    def note(self, warmup: int, steps: int, since: str) -> str:
        """The median over the windows before measured steps 2… (each window ends at the next step's forward)."""
        measured = sorted(self.gaps[warmup : warmup + steps - 1])
        if not measured:
            return ""
        median = measured[len(measured) // 2]
        return f"\nhost window ({since} to the next step's embedding, the GPU with nothing queued): median {median:.2f} ms"


def hf_step_loop() -> None:
    """``service-hfloop``: the service as it was before ``training.LeanStepLoop``, HF's per-step walks of the model
    (``model.train()``, ``zero_grad()``, ``floating_point_ops``, the clipping's parameter list) as HF runs them, to
    measure what the trimmed loop gains in the same run (the test of their equal effects:
    tests/trainer_svc/test_step_host_work.py)."""
    from strop.trainer_svc.core import training

    training.LeanStepLoop.enabled = False


def dpo_dataset(n_rows: int, prompt_tokens: int, completion_tokens: int):
    """Preference rows of about ``prompt_tokens`` + ``completion_tokens`` with the tiny BPE tokenizer.

    The 8B-shape model has no tokenizer of its own; the tiny byte-level BPE's ids are a subset of its
    vocabulary, and every system gets the same rows, so the work per step is identical.
    """
    from datasets import Dataset

    from strop.fixtures.corpus import sentences
    from strop.fixtures.tokenizers_tiny import make_bpe_tokenizer

    tok = make_bpe_tokenizer()
    text = " ".join(sentences(40 * n_rows * (prompt_tokens + 2 * completion_tokens) // 64, seed=7))
    ids = tok(text)["input_ids"]
    rows, pos = [], 0
    for _ in range(n_rows):
        parts = []
        for n in (prompt_tokens, completion_tokens, completion_tokens):
            parts.append(tok.decode(ids[pos : pos + n]))
            pos += n
        rows.append({"prompt": parts[0], "chosen": parts[1], "rejected": parts[2]})
    return tok, Dataset.from_list(rows)


def train_preference(
    w: Workload, res: Result, a, trainer, model, t0: float, times: list[float], rows: int
) -> None:
    """Apply ``a.system``'s memory features, train, and record into ``res`` the build time (since ``t0``), peak
    memory, per-step losses and reward margins (NaN where a step logs none) and ``rows`` per second."""
    # as the trainer sizes a preference step: two rows per pair (KTO: each row and its KL row) of max_length
    memory = apply_memory(w, model, a.system, 2 * a.batch, trainer.args.max_length)
    res.build_s = time.perf_counter() - t0
    res.notes += w.reset_peak_memory()
    label_phases(trainer, compute_loss="loss and its forwards")
    label_phases(trainer.accelerator, backward="backward")
    if hasattr(trainer, "_strop_reference_hidden"):
        label_phases(trainer, _strop_reference_hidden="reference forward")
    trainer.train()
    w.record_peak_memory(res)
    if memory is not None:
        res.notes += "\n" + str(memory)  # after training: what was offloaded
    logs = [h for h in trainer.state.log_history if "loss" in h]
    res.losses = [round(float(h["loss"]), 5) for h in logs]
    res.margins = [round(float(h.get("rewards/margins", float("nan"))), 5) for h in logs]
    w.record_speed(res, times, a.warmup, rows, None)


def run_dpo_worker(a, w: Workload) -> Result:
    """TRL DPOTrainer on HF + PEFT (baseline, as TRL users run it) vs strop's DPO path, 8B QLoRA.

    ``a.batch`` pairs (4) of prompt 512 + completion 512, the same pairs every step: the dataset is those
    rows, so each step is one epoch over them (in shuffled order, the same mean loss). Gradient
    checkpointing, lr ``DPO_LR``, reference = the base with the adapter disabled, TRL's default for a PEFT
    model (the same for both systems). strop: ``patch_model`` + the chunked DPO loss
    (``strop_dpo_trainer_class``) with fp32 adapters, as the trainer service runs it.
    """
    from trl import DPOConfig, DPOTrainer

    res = Result(part="dpo", system=a.system, seq=a.seq, batch=a.batch)
    t0 = time.perf_counter()
    model = attach_lora(w.load_model(qlora=True))
    half = a.seq // 2
    tok, data = dpo_dataset(a.batch, half, half)
    trainer_cls = DPOTrainer
    strop = a.system.startswith("strop")
    if strop:
        from strop.kernels.models import patch_model
        from strop.kernels.trainers import strop_dpo_trainer_class

        res.notes = str(patch_model(model))
        trainer_cls = strop_dpo_trainer_class()
    times: list[float] = []
    trainer = trainer_cls(
        model=model,
        ref_model=None,
        args=trl_args(DPOConfig, a, w, learning_rate=DPO_LR, beta=0.1, max_length=2 * half),
        train_dataset=data,
        processing_class=tok,
        callbacks=[w.step_timer(times, res if profiled(a, w) else None)],
    )
    if strop:
        upcast_adapters_(model)
    train_preference(w, res, a, trainer, model, t0, times, a.batch)  # pairs per second for this part
    if strop:
        res.notes += f"\nbatches with each pair's prompt run once: {trainer.strop_shared_batches}"
    return res


def preference_trainer(part: str):
    """(TRL trainer, its config, strop's trainer class builder, config fields) of an ORPO, KTO or SimPO part."""
    from strop.common.trainer_types import TRAIN_DEFAULTS as D
    from strop.kernels import trainers

    if part == "orpo":
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        # ORPOConfig.beta is the paper's λ
        return ORPOTrainer, ORPOConfig, trainers.strop_orpo_trainer_class, dict(beta=D["orpo_lambda"])
    if part == "simpo":
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        fields = dict(loss_type="simpo", cpo_alpha=0.0, beta=D["simpo_beta"], simpo_gamma=D["simpo_gamma"])
        return CPOTrainer, CPOConfig, trainers.strop_cpo_trainer_class, fields
    from trl import KTOConfig, KTOTrainer

    fields = dict(
        beta=D["kto_beta"],
        desirable_weight=D["kto_desirable_weight"],
        undesirable_weight=D["kto_undesirable_weight"],
    )
    return KTOTrainer, KTOConfig, trainers.strop_kto_trainer_class, fields


def run_preference_worker(a, w: Workload) -> Result:
    """TRL's ORPO / KTO / SimPO trainer on HF + PEFT (baseline) vs the same trainer on strop's chunked loss, 8B
    QLoRA, ``a.batch`` pairs of prompt 512 + completion 512 (KTO: their 2·``a.batch`` rows), the same every
    step; the rest as ``run_dpo_worker`` (KTO's reference: the base with the adapter disabled)."""
    res = Result(part=a.part, system=a.system, seq=a.seq, batch=a.batch)
    t0 = time.perf_counter()
    model = attach_lora(w.load_model(qlora=True))
    half = a.seq // 2
    tok, data = dpo_dataset(a.batch, half, half)
    rows = a.batch
    if a.part == "kto":
        from datasets import Dataset

        unpaired = [
            {"prompt": r["prompt"], "completion": r[k], "label": k == "chosen"}
            for r in data
            for k in ("chosen", "rejected")
        ]
        data, rows = Dataset.from_list(unpaired), 2 * a.batch
    trainer_cls, config_cls, strop_class, fields = preference_trainer(a.part)
    strop = a.system.startswith("strop")
    if strop:
        from strop.kernels.models import patch_model

        res.notes = str(patch_model(model))
        trainer_cls = strop_class()
    times: list[float] = []
    args = trl_args(config_cls, a, w, learning_rate=DPO_LR, max_length=2 * half, **fields)
    args.per_device_train_batch_size = rows
    trainer = trainer_cls(
        model=model,
        args=args,
        train_dataset=data,
        processing_class=tok,
        callbacks=[w.step_timer(times, res if profiled(a, w) else None)],
    )
    if a.part == "kto" and "ref" in getattr(model, "peft_config", {}):
        model.delete_adapter("ref")  # the reference is the base (adapter disabled), as in the trainer service
        model.set_adapter("default")
    if strop:
        upcast_adapters_(model)
        if getattr(trainer, "_strop_reason", None):
            res.notes += f"\nchunked loss off: {trainer._strop_reason}"
    train_preference(w, res, a, trainer, model, t0, times, rows)  # pairs (KTO: rows) per second
    return res
