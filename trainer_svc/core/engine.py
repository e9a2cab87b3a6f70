"""Running one SFT or DPO job with TRL on a session's PEFT model.

TRL's ``SFTTrainer``/``DPOTrainer`` are the engines; a callback turns their logs into step events,
publishes each checkpoint into the artifact store, and stops the loop between steps when the job is
cancelled or the service drains (saving a checkpoint at the step reached). The reference model for
DPO is the same model with the adapter disabled (or, on request, a frozen snapshot of the adapter),
so no second copy of the base weights is ever loaded.
"""

from __future__ import annotations

import logging
import math
import os
import resource
import shutil
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, fields, replace
from pathlib import Path

from strop.common.trainer_types import (
    DEFAULT_MEMORY_MODE,
    MEMORY_MODES,
    DatasetFormat,
    DpoMetrics,
    MemoryMode,
    StepMetrics,
    TrainConfig,
    TrainMethod,
)
from strop.trainer_svc.core.errors import InvalidArgument
from strop.trainer_svc.core.models import LoadedModel, repacked_4bit_layers

log = logging.getLogger("strop.trainer")

SCHEDULERS = ("linear", "cosine", "constant", "constant_with_warmup", "cosine_with_restarts", "polynomial")
OPTIMIZERS = {
    "adamw_torch": "adamw_torch",
    "adamw_torch_fused": "adamw_torch_fused",
    "adamw_8bit": "adamw_bnb_8bit",
    "paged_adamw_8bit": "paged_adamw_8bit",
    "paged_adamw_32bit": "paged_adamw_32bit",
    "sgd": "sgd",
    "adafactor": "adafactor",
}
DPO_LOSSES = (
    "sigmoid",
    "ipo",
    "hinge",
    "robust",
    "exo_pair",
    "nca_pair",
    "bco_pair",
    "sppo_hard",
    "apo_zero",
    "apo_down",
)
DPO_REFERENCES = ("base", "adapter_snapshot")


def with_defaults(cfg: TrainConfig, *, session_max_len: int) -> TrainConfig:
    """Fill zero fields with strop's defaults and validate every value (InvalidArgument naming the field)."""
    if cfg.method not in (TrainMethod.SFT, TrainMethod.DPO):
        raise InvalidArgument("config.method must be SFT or DPO")
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise InvalidArgument(f"config: {f.name} must be a finite number, got {value}")
    dpo = cfg.method is TrainMethod.DPO
    c = replace(
        cfg,
        learning_rate=cfg.learning_rate or (5e-6 if dpo else 2e-4),
        lr_scheduler=cfg.lr_scheduler or "linear",
        num_epochs=cfg.num_epochs or 1.0,
        batch_size=cfg.batch_size or 1,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps or 1,
        max_length=cfg.max_length or session_max_len,
        optimizer=cfg.optimizer or "adamw_torch",
        max_grad_norm=cfg.max_grad_norm or 1.0,
        dpo_beta=cfg.dpo_beta or 0.1,
        dpo_loss_type=cfg.dpo_loss_type or "sigmoid",
        dpo_reference=cfg.dpo_reference or "base",
        memory_mode=DEFAULT_MEMORY_MODE if cfg.memory_mode is MemoryMode.UNSPECIFIED else cfg.memory_mode,
    )
    forced = MEMORY_MODES[c.memory_mode].gradient_checkpointing
    if (
        forced is not None
    ):  # long context: offloading is a form of checkpointing; max speed: the budget decides
        c = replace(c, gradient_checkpointing=forced)
    checks = [
        (
            c.learning_rate > 0 and math.isfinite(c.learning_rate),
            f"learning_rate must be > 0, got {c.learning_rate}",
        ),
        (c.lr_scheduler in SCHEDULERS, f"lr_scheduler {c.lr_scheduler!r} is not one of {SCHEDULERS}"),
        (0.0 <= c.warmup_ratio < 1.0, f"warmup_ratio must be in [0, 1), got {c.warmup_ratio}"),
        (c.warmup_steps >= 0, f"warmup_steps must be >= 0, got {c.warmup_steps}"),
        (c.max_steps >= 0, f"max_steps must be >= 0, got {c.max_steps}"),
        (c.num_epochs > 0, f"num_epochs must be > 0, got {c.num_epochs}"),
        (1 <= c.batch_size <= 4096, f"batch_size must be in 1..4096, got {c.batch_size}"),
        (
            1 <= c.gradient_accumulation_steps <= 4096,
            f"gradient_accumulation_steps must be in 1..4096, got {c.gradient_accumulation_steps}",
        ),
        (
            8 <= c.max_length <= session_max_len,
            f"max_length must be in 8..{session_max_len} (the session's max_seq_length), got {c.max_length}",
        ),
        (c.optimizer in OPTIMIZERS, f"optimizer {c.optimizer!r} is not one of {sorted(OPTIMIZERS)}"),
        (c.weight_decay >= 0, f"weight_decay must be >= 0, got {c.weight_decay}"),
        (c.dpo_beta > 0, f"dpo_beta must be > 0, got {c.dpo_beta}"),
        (c.dpo_loss_type in DPO_LOSSES, f"dpo_loss_type {c.dpo_loss_type!r} is not one of {DPO_LOSSES}"),
        (
            c.dpo_reference in DPO_REFERENCES,
            f"dpo_reference {c.dpo_reference!r} is not one of {DPO_REFERENCES}",
        ),
        (
            c.checkpoint_every_steps >= 0,
            f"checkpoint_every_steps must be >= 0, got {c.checkpoint_every_steps}",
        ),
        (c.max_prompt_length >= 0, f"max_prompt_length must be >= 0, got {c.max_prompt_length}"),
        (not (c.packing and dpo), "packing applies to SFT only"),
        (
            math.isfinite(c.memory_budget_gib) and (c.memory_budget_gib == 0 or c.memory_budget_gib >= 1),
            f"memory_budget_gib must be 0 (90% of the device) or >= 1, got {c.memory_budget_gib}",
        ),
        (
            not c.memory_budget_gib or MEMORY_MODES[c.memory_mode].budgeted_recompute,
            "memory_budget_gib applies to memory_mode MAX_SPEED only",
        ),
    ]
    for ok, message in checks:
        if not ok:
            raise InvalidArgument(f"config: {message}")
    return c


def check_dataset_fits(method: TrainMethod, fmt: DatasetFormat, rows: list[dict], vocab_size: int) -> None:
    if method is TrainMethod.DPO and fmt is not DatasetFormat.PREFERENCE:
        raise InvalidArgument(
            f"DPO needs a preference dataset (prompt/chosen/rejected); this dataset is {fmt.value.lower()}"
        )
    if method is TrainMethod.SFT and fmt is DatasetFormat.PREFERENCE:
        raise InvalidArgument(
            "SFT needs text, messages or prompt/completion rows; this dataset is preference data"
        )
    if fmt is DatasetFormat.TOKENS:
        for i, row in enumerate(rows, 1):
            if max(row["input_ids"]) >= vocab_size:
                raise InvalidArgument(
                    f"row {i}: token id {max(row['input_ids'])} is outside the model's vocabulary of {vocab_size}"
                )


def sft_rows(rows: list[dict], fmt: DatasetFormat, completion_only: bool) -> list[dict]:
    """Rows as TRL's SFTTrainer expects them.

    With ``completion_only`` a conversation becomes conversational prompt/completion (all turns but
    the last as the prompt), so the loss falls on the final assistant answer only.
    """
    if fmt is DatasetFormat.MESSAGES and completion_only:
        return [{"prompt": r["messages"][:-1], "completion": r["messages"][-1:]} for r in rows]
    if fmt is DatasetFormat.TOKENS:  # TRL skips tokenization for rows that already hold input_ids
        return [{k: r[k] for k in ("input_ids", "completion_mask") if k in r} for r in rows]
    keys = {
        DatasetFormat.TEXT: ("text",),
        DatasetFormat.MESSAGES: ("messages",),
        DatasetFormat.PROMPT_COMPLETION: ("prompt", "completion"),
    }[fmt]
    return [{k: r[k] for k in keys} for r in rows]


@dataclass
class StopRequest:
    reason: str  # "cancel" | "interrupt"


class JobControl:
    """Shared between the job thread and RPC threads: a stop flag read between steps."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.stop: StopRequest | None = None

    def request_stop(self, reason: str) -> None:
        with self._lock:
            if self.stop is None:
                self.stop = StopRequest(reason)


@dataclass
class Sinks:
    """How the engine reports: each step's metrics, and each checkpoint directory HF wrote."""

    on_step: Callable[[StepMetrics], None]
    on_checkpoint: Callable[[int, Path], None]
    on_start: Callable[[int], None]


def _peak_memory(device: str) -> int:
    import torch

    if device.startswith("cuda"):
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _make_callback(loaded: LoadedModel, control: JobControl, sinks: Sinks, method: TrainMethod):
    from transformers import TrainerCallback

    class StropCallback(TrainerCallback):
        def __init__(self) -> None:
            self.t0 = time.perf_counter()
            self.tokens_before = 0

        def on_train_begin(self, args, state, control_, **kw):
            sinks.on_start(int(state.max_steps))

        def on_step_begin(self, args, state, control_, **kw):
            self.t0 = time.perf_counter()
            self.tokens_before = int(getattr(state, "num_input_tokens_seen", 0) or 0)

        def on_step_end(self, args, state, control_, **kw):
            if control.stop is not None:
                control_.should_training_stop = True
                control_.should_save = True  # keep the adapter and optimizer as they stand
            return control_

        def on_log(self, args, state, control_, logs=None, **kw):
            logs = logs or {}
            if "loss" not in logs:
                return
            dt = time.perf_counter() - self.t0
            tokens = int(getattr(state, "num_input_tokens_seen", 0) or 0)
            dpo = None
            if method is TrainMethod.DPO:
                dpo = DpoMetrics(
                    rewards_chosen=float(logs.get("rewards/chosen", 0.0)),
                    rewards_rejected=float(logs.get("rewards/rejected", 0.0)),
                    reward_margin=float(logs.get("rewards/margins", 0.0)),
                    reward_accuracy=float(logs.get("rewards/accuracies", 0.0)),
                    logps_chosen=float(logs.get("logps/chosen", 0.0)),
                    logps_rejected=float(logs.get("logps/rejected", 0.0)),
                )
            sinks.on_step(
                StepMetrics(
                    step=int(state.global_step),
                    total_steps=int(state.max_steps),
                    epoch=float(state.epoch or 0.0),
                    loss=float(logs["loss"]),
                    learning_rate=float(logs.get("learning_rate", 0.0)),
                    grad_norm=float(logs.get("grad_norm", 0.0) or 0.0),
                    tokens_per_second=(tokens - self.tokens_before) / dt if dt > 0 else 0.0,
                    tokens_seen=tokens,
                    peak_memory_bytes=_peak_memory(loaded.device),
                    step_seconds=dt,
                    dpo=dpo,
                )
            )

        def on_save(self, args, state, control_, **kw):
            ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if ckpt.is_dir():
                sinks.on_checkpoint(int(state.global_step), ckpt)

    return StropCallback()


class BrokenTraining(RuntimeError):
    """A step left an adapter tensor without a usable gradient, or made the loss or the adapters non-finite."""


GUARD_WINDOW_STEPS = 3  # optimizer steps within which every adapter tensor must see a non-zero gradient


def _names(names: list[str], limit: int = 6) -> str:
    shown = ", ".join(names[:limit])
    return f"{shown} (and {len(names) - limit} more)" if len(names) > limit else shown


def _make_guard(model):
    """A callback that fails the job the moment training is broken, naming the tensors and why.

    Checked at every optimizer step: each trainable tensor has a gradient, every gradient is finite, the
    loss is finite, every adapter is finite after the update. Within the first ``GUARD_WINDOW_STEPS``
    steps every trainable tensor must also see a non-zero gradient at least once. A LoRA ``A`` whose ``B``
    is exactly zero has an exactly zero gradient by construction (dA = s·xᵀ(g·B)); such steps are
    excused, so a fresh adapter (B = 0) or a first warm-up step at lr 0 is not mistaken for a cut graph.
    The per-tensor max |·| is one fused ``_foreach_norm(inf)`` and one host sync per step.
    """
    import torch
    from transformers import TrainerCallback

    def max_abs(tensors) -> list[float]:
        return torch.stack(torch._foreach_norm(tensors, float("inf"))).float().cpu().tolist()

    class GradientGuard(TrainerCallback):
        def __init__(self) -> None:
            self.params: list[tuple[str, torch.nn.Parameter]] = []
            self.steps = 0
            self.never_nonzero: set[str] = set()
            self.unexcused_zero: set[str] = set()
            self.partner: dict[str, torch.Tensor] = {}

        def on_train_begin(self, args, state, control, **kw):
            self.params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
            self.never_nonzero = {n for n, _ in self.params}
            by_name = dict(self.params)
            self.partner = {n: by_name[n.replace("lora_A", "lora_B")] for n in by_name if "lora_A" in n}

        def on_pre_optimizer_step(self, args, state, control, **kw):
            self.steps += 1
            step = state.global_step + 1
            missing = [n for n, p in self.params if p.grad is None]
            if missing:
                raise BrokenTraining(
                    f"step {step}: {len(missing)} of {len(self.params)} trainable tensors got no gradient "
                    f"(the graph from the loss does not reach them): {_names(missing)}"
                )
            grads = max_abs([p.grad for _, p in self.params])
            bad = [n for (n, _), g in zip(self.params, grads, strict=True) if not math.isfinite(g)]
            if bad:
                raise BrokenTraining(
                    f"step {step}: non-finite gradients in {len(bad)} of {len(self.params)} trainable tensors: "
                    f"{_names(bad)} (lower the learning rate, or check the data and max_grad_norm)"
                )
            if self.steps > GUARD_WINDOW_STEPS:
                return
            zero = [n for (n, _), g in zip(self.params, grads, strict=True) if g == 0.0]
            self.never_nonzero &= set(zero)
            for n in zero:
                partner = self.partner.get(n)
                if partner is None or bool(partner.detach().any()):
                    self.unexcused_zero.add(n)
            if self.steps == GUARD_WINDOW_STEPS:
                self._check_window(step)

        def on_optimizer_step(self, args, state, control, **kw):
            values = max_abs([p.detach() for _, p in self.params])
            bad = [n for (n, _), v in zip(self.params, values, strict=True) if not math.isfinite(v)]
            if bad:
                raise BrokenTraining(
                    f"step {state.global_step + 1}: the optimizer step made {len(bad)} adapter tensors "
                    f"non-finite: {_names(bad)} (the learning rate or weight decay is too large)"
                )

        def on_log(self, args, state, control, logs=None, **kw):
            loss = (logs or {}).get("loss")
            if loss is not None and not math.isfinite(float(loss)):
                raise BrokenTraining(f"step {state.global_step}: the loss is {loss}")

        def on_train_end(self, args, state, control, **kw):
            if 0 < self.steps < GUARD_WINDOW_STEPS:
                self._check_window(state.global_step)

        def _check_window(self, step: int) -> None:
            dead = sorted(self.never_nonzero & self.unexcused_zero)
            if dead:
                raise BrokenTraining(
                    f"by step {step}: {len(dead)} of {len(self.params)} trainable tensors got only zero "
                    f"gradients (no signal reaches them): {_names(dead)}"
                )

    return GradientGuard()


def _training_args(cfg: TrainConfig, loaded: LoadedModel, work_dir: Path) -> dict:
    on_cuda = loaded.device.startswith("cuda")
    warmup = cfg.warmup_steps if cfg.warmup_steps else cfg.warmup_ratio
    return dict(
        output_dir=str(work_dir),
        per_device_train_batch_size=cfg.batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        learning_rate=cfg.learning_rate,
        lr_scheduler_type=cfg.lr_scheduler,
        warmup_steps=warmup,
        max_steps=cfg.max_steps if cfg.max_steps > 0 else -1,
        num_train_epochs=cfg.num_epochs,
        optim=OPTIMIZERS[cfg.optimizer],
        weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.max_grad_norm if cfg.max_grad_norm > 0 else 0.0,
        seed=cfg.seed,
        data_seed=cfg.seed,
        logging_steps=1,
        save_strategy="steps" if cfg.checkpoint_every_steps > 0 else "no",
        save_steps=cfg.checkpoint_every_steps or 500,
        save_total_limit=1,
        report_to="none",
        disable_tqdm=True,
        bf16=on_cuda and loaded.facts.compute_dtype == "bfloat16",
        fp16=on_cuda and loaded.facts.compute_dtype == "float16",
        use_cpu=not on_cuda,
        gradient_checkpointing=cfg.gradient_checkpointing,
        # also without checkpointing: max_speed turns it on for some layers, and TRL re-enables it with these
        # kwargs around every DPO reference pass
        gradient_checkpointing_kwargs={"use_reentrant": False},
        dataloader_num_workers=0,
        include_num_input_tokens_seen="non_padding",
        dataset_num_proc=None,
    )


def build_trainer(
    loaded: LoadedModel,
    rows: list[dict],
    fmt: DatasetFormat,
    cfg: TrainConfig,
    work_dir: Path,
    control: JobControl,
    sinks: Sinks,
):
    """A TRL trainer for this job, with strop's callback installed (and HF's log printer removed)."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer = _build_trl_trainer(loaded, rows, fmt, cfg, work_dir, control, sinks)
    keep_adapter_fp32(loaded.model)
    trainer.add_callback(_make_guard(loaded.model))
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    return trainer


def _build_trl_trainer(
    loaded: LoadedModel,
    rows: list[dict],
    fmt: DatasetFormat,
    cfg: TrainConfig,
    work_dir: Path,
    control: JobControl,
    sinks: Sinks,
):
    from datasets import Dataset

    args = _training_args(cfg, loaded, work_dir)
    callback = _make_callback(loaded, control, sinks, cfg.method)
    if cfg.method is TrainMethod.SFT:
        from trl import SFTConfig, SFTTrainer

        sft_args = SFTConfig(
            **args,
            max_length=cfg.max_length,
            packing=cfg.packing,
            completion_only_loss=True if cfg.completion_only_loss else None,
            dataset_text_field="text",
        )
        dataset = Dataset.from_list(sft_rows(rows, fmt, cfg.completion_only_loss))
        return SFTTrainer(
            model=loaded.model,
            args=sft_args,
            train_dataset=dataset,
            processing_class=loaded.tokenizer,
            callbacks=[callback],
        )
    from trl import DPOConfig, DPOTrainer

    dpo_args = DPOConfig(**args, beta=cfg.dpo_beta, loss_type=[cfg.dpo_loss_type], max_length=cfg.max_length)
    dataset = Dataset.from_list([{k: r[k] for k in ("prompt", "chosen", "rejected")} for r in rows])
    if loaded.facts.kernels_enabled:
        # strop's chunked DPO loss: per-token log-probs chunk by chunk, gradients computed in the forward.
        from strop.kernels.trainers import strop_dpo_trainer_class

        trainer_cls = strop_dpo_trainer_class()
    else:
        trainer_cls = DPOTrainer
    trainer = trainer_cls(
        model=loaded.model,
        ref_model=None,
        args=dpo_args,
        train_dataset=dataset,
        processing_class=loaded.tokenizer,
        callbacks=[callback],
    )
    peft_model = trainer.accelerator.unwrap_model(trainer.model)
    if cfg.dpo_reference == "base" and "ref" in getattr(peft_model, "peft_config", {}):
        # TRL snapshots the adapter as the reference; strop's default reference is the base model
        # (adapter disabled), which TRL falls back to when no "ref" adapter exists.
        peft_model.delete_adapter("ref")
        peft_model.set_adapter("default")
    return trainer


def keep_adapter_fp32(model) -> None:
    """Undo TRL's bf16 cast of LoRA weights on quantized bases (before the optimizer exists).

    TRL follows the QLoRA paper and casts adapters to bf16; at small learning rates bf16 swallows
    the updates (the DPO margin then does not move), so strop keeps adapters and optimizer state fp32.
    """
    import torch

    for p in model.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()


def cleanup_reference_adapter(loaded: LoadedModel) -> None:
    """Remove a DPO snapshot adapter so later jobs and exports see only the trained one."""
    model = loaded.model
    if "ref" in getattr(model, "peft_config", {}):
        model.delete_adapter("ref")
        model.set_adapter("default")


def _host_available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _host_has_room(loaded: LoadedModel, cfg: TrainConfig) -> bool:
    """Whether one step's checkpointed layer inputs fit in half the host's available memory."""
    hf_cfg = loaded.model.config
    layers = int(getattr(hf_cfg, "num_hidden_layers", 0) or 0)
    hidden = int(getattr(hf_cfg, "hidden_size", 0) or 0)
    rows = cfg.batch_size * (2 if cfg.method is TrainMethod.DPO else 1)  # DPO: chosen and rejected rows
    itemsize = loaded.model.get_input_embeddings().weight.element_size()  # the residual stream's dtype
    need = layers * rows * cfg.max_length * hidden * itemsize
    available = _host_available_bytes()
    if need > available // 2:
        log.info("%.1f GiB of layer inputs, %.1f GiB host available", need / 2**30, available / 2**30)
        return False
    return True


def _install_memory_mode(loaded: LoadedModel, cfg: TrainConfig, trainer):
    """What the job's memory mode installs (``MEMORY_MODES``), on CUDA with the kernels; None elsewhere."""
    if not (loaded.device.startswith("cuda") and loaded.facts.kernels_enabled):
        return None
    import torch
    from transformers import TrainerCallback

    from strop.kernels.models import apply_memory_mode

    features = MEMORY_MODES[cfg.memory_mode]
    budget = 0
    if features.budgeted_recompute:
        total = torch.cuda.get_device_properties(torch.device(loaded.device)).total_memory
        budget = int(cfg.memory_budget_gib * 2**30) or int(features.default_budget_fraction * total)
        if budget > total:
            log.warning("memory_budget_gib %.1f exceeds the device's %.1f GiB: planning for the device",
                        budget / 2**30, total / 2**30)  # fmt: skip
            budget = total
    allow_offload = cfg.gradient_checkpointing and _host_has_room(loaded, cfg)
    installed = apply_memory_mode(
        loaded.model, cfg.memory_mode, budget_bytes=budget, allow_offload=allow_offload
    )
    log.info("%s", installed)
    if installed.recompute is not None:

        class PlanAfterFirstStep(TrainerCallback):
            def on_step_end(self, args, state, control_, **kw):
                plan = installed.step_end()
                if plan is not None:
                    log.info("budgeted recompute: %s", plan)

        trainer.add_callback(PlanAfterFirstStep())
    return installed


def run_training(
    loaded: LoadedModel,
    rows: list[dict],
    fmt: DatasetFormat,
    cfg: TrainConfig,
    work_dir: Path,
    control: JobControl,
    sinks: Sinks,
    resume_from: Path | None = None,
) -> int:
    """Train to completion or until stopped; returns the global step reached."""
    work_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    packed = repacked_4bit_layers(loaded.model)
    if packed:
        raise BrokenTraining(
            f"{len(packed)} 4-bit layers are in bitsandbytes' CPU inference layout, which has no backward: "
            f"{_names(packed)}"
        )
    if loaded.device.startswith("cuda"):
        import torch

        torch.cuda.reset_peak_memory_stats(loaded.device)
    trainer = build_trainer(loaded, rows, fmt, cfg, work_dir, control, sinks)
    installed = None
    try:
        installed = _install_memory_mode(
            loaded, cfg, trainer
        )  # inside the try: a failed install is cleaned up
        trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
        return int(trainer.state.global_step)
    finally:
        if installed is not None:
            installed.remove()
        loaded.model.train(False)
        cleanup_reference_adapter(loaded)
        del trainer
        shutil.rmtree(work_dir, ignore_errors=True)
