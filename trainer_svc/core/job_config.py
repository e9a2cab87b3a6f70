"""A job's configuration: strop's defaults filled in, every value validated (InvalidArgument naming the field),
the dataset checked against the method, and rows shaped the way TRL's trainers read them."""

from __future__ import annotations

import math
from dataclasses import fields, replace

from strop.common.errors import InvalidArgument
from strop.common.trainer_types import (
    DEFAULT_MEMORY_MODE,
    MEMORY_MODES,
    DatasetFormat,
    MemoryMode,
    TrainConfig,
    TrainMethod,
)

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
        (0 <= c.seed < 2**32, f"seed must be in 0..2**32-1, got {c.seed}"),
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
