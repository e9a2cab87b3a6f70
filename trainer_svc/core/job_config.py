"""A job's configuration: strop's defaults filled in, every value validated (InvalidArgument naming the field),
the dataset checked against the method, and rows shaped the way TRL's trainers read them."""

from __future__ import annotations

import json
import math
from dataclasses import fields, replace

from strop.common.errors import InvalidArgument
from strop.common.trainer_types import (
    ADAPTER_SCALE_AUTO,
    CHAT_RECIPE_ADAPTER_SCALE,
    CHAT_RECIPE_KL,
    CHAT_RECIPE_NEIGHBOURS,
    KL_RETENTION_WEIGHT,
    MEMORY_MODES,
    METHOD_DATASET_FORMAT,
    REFERENCE_METHODS,
    TRAIN_DEFAULTS,
    DatasetFormat,
    Retention,
    TrainConfig,
    TrainMethod,
    auto_epochs,
    train_default,
)
from strop.trainer_svc.core.datasets import uses_tools

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
MAX_RETENTION_ROWS = 110  # len(retention.REPLAY_PROMPTS); a test holds them equal
MAX_RETENTION_NEIGHBOURS = (
    8  # questions a training question's start gives (64 starts at most: 512 generations)
)


def _epochs(default: object, num_rows: int) -> float:
    if isinstance(default, str):  # "auto: ..." (TRAIN_DEFAULTS)
        return auto_epochs(num_rows) if num_rows else 1.0
    return float(default)


def _defaults_for_unset(cfg: TrainConfig, session_max_len: int, num_rows: int) -> dict[str, object]:
    """``TRAIN_DEFAULTS``' value for every field the request left unset (zero, empty or UNSPECIFIED), in the
    field's type; the defaults that depend on the job (epochs by the dataset's rows, the session's max length)
    resolved. Retention is not among them: it depends on the dataset's format (``retention_of``)."""
    derived = {"num_epochs": lambda d: _epochs(d, num_rows), "max_length": lambda d: session_max_len}
    out = {}
    for name in TRAIN_DEFAULTS:
        value = getattr(cfg, name)
        if name == "retention" or (value and getattr(value, "name", "") != "UNSPECIFIED"):
            continue
        default = train_default(name, cfg.method)
        out[name] = derived[name](default) if name in derived else type(value)(default)
    return out


def retention_of(cfg: TrainConfig, fmt: DatasetFormat, tokenizer, ranks: int = 0) -> Retention:
    """The retention a job runs with: REPLAY, KL or NONE as asked, else ``TRAIN_DEFAULTS``'s for its method where
    it applies (SFT on messages data with a chat template: the base's answers are chat messages; in one process,
    ``ranks`` or else ``cfg.ranks()``), else NONE.

    Raises:
        InvalidArgument: REPLAY or KL asked for data other than messages, or a tokenizer without a chat template.
    """
    applies = fmt is DatasetFormat.MESSAGES and bool(getattr(tokenizer, "chat_template", None))
    if cfg.retention in (Retention.REPLAY, Retention.KL) and not applies:
        raise InvalidArgument(
            f"retention {cfg.retention.value} needs messages data and a model with a chat template (the base "
            f"answers chat messages); this dataset is {fmt.value.lower()}"
            + ("" if getattr(tokenizer, "chat_template", None) else " and the model has no chat template")
        )
    if cfg.retention is not Retention.UNSPECIFIED:
        mode = cfg.retention
    else:  # a job on several ranks runs no retention (each rank would generate on its own)
        default = applies and (ranks or cfg.ranks()) == 1
        mode = Retention(train_default("retention", cfg.method)) if default else Retention.NONE
    if cfg.retention_kl and mode not in (Retention.REPLAY, Retention.KL):
        raise InvalidArgument(
            f"retention_kl weighs a KL term on the base's answers, and this job has none (retention "
            f"{mode.value}; REPLAY and KL need SFT on messages data with a chat template)"
        )
    return mode


def with_retention(cfg: TrainConfig, fmt: DatasetFormat, tokenizer, ranks: int = 0) -> TrainConfig:
    """``cfg`` with its retention resolved (``retention_of``; ``ranks``: the processes the job runs in, 0:
    ``cfg.ranks()``), so the job's stored config says what it runs with. Where the request left retention unset and
    the job is SFT on messages data with a chat template in one process, this is the chat recipe: KL, and
    ``CHAT_RECIPE_KL``, ``CHAT_RECIPE_NEIGHBOURS`` and ``CHAT_RECIPE_ADAPTER_SCALE`` for the fields the request left
    0 (no scale with ``keep_best_checkpoint``, whose adapter is a checkpoint); KL asked with weight 0 gets
    ``KL_RETENTION_WEIGHT``. A resolved config resolves to itself.

    Raises:
        InvalidArgument: as ``retention_of``; neighbour questions for a job whose retention is not KL.
    """
    auto = cfg.retention is Retention.UNSPECIFIED
    mode = retention_of(cfg, fmt, tokenizer, ranks)
    if cfg.retention_neighbours and mode is not Retention.KL:
        raise InvalidArgument(
            f"retention_neighbours adds questions to the KL term alone, and this job's retention is {mode.value} "
            "(KL runs in SFT jobs on messages data, with a chat template, in one process)"
        )
    if cfg.adapter_scale == ADAPTER_SCALE_AUTO and not (
        cfg.method is TrainMethod.SFT
        and fmt is DatasetFormat.MESSAGES
        and getattr(tokenizer, "chat_template", None)
        and (ranks or cfg.ranks()) == 1
    ):
        raise InvalidArgument(
            f"adapter_scale {ADAPTER_SCALE_AUTO:g} (auto) measures the finished adapter on the job's own chat "
            "conversations: SFT on messages data with a chat template, in one process; ask a scale in 0..1"
        )
    if not (auto and mode is Retention.KL):
        return replace(cfg, retention=mode, retention_kl=retention_kl_weight(cfg, mode))
    return replace(
        cfg,
        retention=mode,
        retention_kl=cfg.retention_kl or CHAT_RECIPE_KL,
        retention_neighbours=cfg.retention_neighbours or CHAT_RECIPE_NEIGHBOURS,
        adapter_scale=cfg.adapter_scale or (0.0 if cfg.keep_best_checkpoint else CHAT_RECIPE_ADAPTER_SCALE),
    )


def retention_kl_weight(cfg: TrainConfig, mode: Retention) -> float:
    """The weight of the KL(base ‖ model) term a job adds to each step: ``retention_kl`` as asked, KL's default
    (``KL_RETENTION_WEIGHT``) where a KL job left it 0; 0 (no term) for REPLAY without it and for NONE."""
    if mode is Retention.KL:
        return cfg.retention_kl or KL_RETENTION_WEIGHT
    return cfg.retention_kl if mode is Retention.REPLAY else 0.0


def with_defaults(cfg: TrainConfig, *, session_max_len: int, num_rows: int = 0) -> TrainConfig:
    """Fill zero fields with strop's defaults and validate every value (InvalidArgument naming the field).

    ``num_rows``: the dataset's rows, for the defaults that depend on its size (SFT's epochs: ``auto_epochs``;
    0: unknown, one epoch)."""
    if cfg.method is TrainMethod.UNSPECIFIED:
        raise InvalidArgument("config.method must be SFT, DPO, ORPO, KTO or SIMPO")
    for f in fields(cfg):
        value = getattr(cfg, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise InvalidArgument(f"config: {f.name} must be a finite number, got {value}")
    preference = cfg.method is not TrainMethod.SFT
    c = replace(cfg, **_defaults_for_unset(cfg, session_max_len, num_rows))
    c = _eval_defaults(c)
    forced = MEMORY_MODES[c.memory_mode].gradient_checkpointing
    # long context: offloading is a form of checkpointing; max speed: the budget decides
    if forced is not None:
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
        (0 <= c.num_devices <= 1024, f"num_devices must be in 0..1024, got {c.num_devices}"),
        (0 <= c.num_nodes <= 1024, f"num_nodes must be in 0..1024, got {c.num_nodes}"),
        (not (c.packing and preference), "packing applies to SFT only"),
        (c.orpo_lambda > 0, f"orpo_lambda must be > 0, got {c.orpo_lambda}"),
        (c.kto_beta > 0, f"kto_beta must be > 0, got {c.kto_beta}"),
        (c.kto_desirable_weight > 0, f"kto_desirable_weight must be > 0, got {c.kto_desirable_weight}"),
        (
            c.kto_undesirable_weight > 0,
            f"kto_undesirable_weight must be > 0, got {c.kto_undesirable_weight}",
        ),
        (c.simpo_beta > 0, f"simpo_beta must be > 0, got {c.simpo_beta}"),
        (c.simpo_gamma > 0, f"simpo_gamma must be > 0, got {c.simpo_gamma}"),
        (
            # TRL's KTOTrainer estimates the KL term from the other rows of the same batch (refused at 1)
            c.method is not TrainMethod.KTO or c.batch_size >= 2,
            f"KTO needs batch_size >= 2 (its KL estimate pairs each prompt with another row's completion), "
            f"got {c.batch_size}",
        ),
        (
            c.method in REFERENCE_METHODS or cfg.dpo_reference in ("", "base"),
            f"dpo_reference applies to DPO and KTO only ({c.method.value} has no reference model)",
        ),
        (
            math.isfinite(c.memory_budget_gib) and (c.memory_budget_gib == 0 or c.memory_budget_gib >= 1),
            f"memory_budget_gib must be 0 (90% of the device) or >= 1, got {c.memory_budget_gib}",
        ),
        (
            1 <= c.retention_rows <= MAX_RETENTION_ROWS,
            f"retention_rows must be in 1..{MAX_RETENTION_ROWS} (one a replay prompt), got {c.retention_rows}",
        ),
        (
            c.retention not in (Retention.REPLAY, Retention.KL) or c.method is TrainMethod.SFT,
            f"retention {c.retention.value} applies to SFT only ({c.method.value} trains on preferences)",
        ),
        (
            math.isfinite(c.retention_kl) and c.retention_kl >= 0,
            f"retention_kl must be a finite number >= 0, got {c.retention_kl}",
        ),
        (
            math.isfinite(c.adapter_scale)
            and (0 <= c.adapter_scale <= 1 or c.adapter_scale == ADAPTER_SCALE_AUTO),
            f"adapter_scale must be in 0..1 (1: the adapter as trained; 0: the default) or {ADAPTER_SCALE_AUTO:g} "
            f"(chosen once training ends), got {c.adapter_scale}",
        ),
        (
            not (
                (0 < c.adapter_scale < 1 or c.adapter_scale == ADAPTER_SCALE_AUTO) and c.keep_best_checkpoint
            ),
            "adapter_scale interpolates the adapter a run ends with; keep_best_checkpoint publishes a checkpoint "
            "instead: ask for one of them",
        ),
        (
            0 <= c.retention_neighbours <= MAX_RETENTION_NEIGHBOURS,
            f"retention_neighbours must be in 0..{MAX_RETENTION_NEIGHBOURS}, got {c.retention_neighbours}",
        ),
        (
            not c.retention_neighbours or c.retention in (Retention.KL, Retention.UNSPECIFIED),
            "retention_neighbours adds questions to the KL term alone: it needs retention KL",
        ),
        (
            not c.retention_kl or c.retention is not Retention.NONE,
            "retention_kl weighs a KL term on the base's answers: it needs retention REPLAY or KL, not NONE",
        ),
        (
            not c.memory_budget_gib or MEMORY_MODES[c.memory_mode].budgeted_recompute,
            "memory_budget_gib applies to memory_mode MAX_SPEED only",
        ),
    ]
    for ok, message in checks + _eval_checks(c):
        if not ok:
            raise InvalidArgument(f"config: {message}")
    return c


def _eval_defaults(c: TrainConfig) -> TrainConfig:
    """Validation's defaults: eval batches as big as training's; keep_best_checkpoint checkpoints at every eval."""
    if not c.eval_batch_size:
        c = replace(c, eval_batch_size=c.batch_size)
    if c.keep_best_checkpoint and not c.checkpoint_every_steps and c.eval_every_steps > 0:
        c = replace(c, checkpoint_every_steps=c.eval_every_steps)
    return c


def _eval_checks(c: TrainConfig) -> list[tuple[bool, str]]:
    """Validation's settings (docs/validation.md); whether the job has a validation set is the job's check."""
    every, ckpt = c.eval_every_steps, c.checkpoint_every_steps
    return [
        (every >= 0, f"eval_every_steps must be >= 0 (0: only once training ends), got {every}"),
        (1 <= c.eval_batch_size <= 4096, f"eval_batch_size must be in 1..4096, got {c.eval_batch_size}"),
        (c.eval_rows >= 0, f"eval_rows must be >= 0 (0: the whole validation set), got {c.eval_rows}"),
        (
            c.method is not TrainMethod.KTO or c.eval_batch_size >= 2,
            f"KTO needs eval_batch_size >= 2 (its KL estimate pairs rows of a batch), got {c.eval_batch_size}",
        ),
        (
            not c.keep_best_checkpoint or every > 0,
            "keep_best_checkpoint needs eval_every_steps > 0 (the candidates are the evaluated checkpoints)",
        ),
        (
            not c.keep_best_checkpoint or every <= 0 or ckpt <= 0 or every % ckpt == 0,
            f"keep_best_checkpoint needs a checkpoint at every eval step: eval_every_steps ({every}) must be a "
            f"multiple of checkpoint_every_steps ({ckpt}), or leave checkpoint_every_steps 0 (= eval_every_steps)",
        ),
    ]


def check_dataset_fits(cfg: TrainConfig, fmt: DatasetFormat, rows: list[dict], vocab_size: int) -> None:
    method = cfg.method
    if cfg.completion_only_loss and fmt is DatasetFormat.TEXT:
        raise InvalidArgument(
            "completion_only_loss needs messages or prompt/completion rows; text rows have no completion"
        )
    needs = METHOD_DATASET_FORMAT.get(method)
    if needs is DatasetFormat.PREFERENCE and fmt is not needs:
        raise InvalidArgument(
            f"{method.value} needs a preference dataset (prompt/chosen/rejected); this dataset is {fmt.value.lower()}"
        )
    if needs is None and fmt is DatasetFormat.PROMPTS:
        raise InvalidArgument(
            "SFT needs text, messages or prompt/completion rows; this dataset is prompts (conversations ending with "
            "the user's turn: nothing to imitate); train GRPO on it"
        )
    if needs is DatasetFormat.UNPAIRED_PREFERENCE and fmt is not needs:
        raise InvalidArgument(
            f"KTO needs unpaired preference rows (prompt/completion/label); this dataset is {fmt.value.lower()}"
        )
    if needs is None and fmt in (DatasetFormat.PREFERENCE, DatasetFormat.UNPAIRED_PREFERENCE):
        raise InvalidArgument(
            f"SFT needs text, messages or prompt/completion rows; this dataset is {fmt.value.lower()} data"
        )
    if cfg.retention in (Retention.REPLAY, Retention.KL) and fmt is not DatasetFormat.MESSAGES:
        raise InvalidArgument(
            f"retention {cfg.retention.value} needs messages data (the base answers the general prompts as "
            f"conversations); this dataset is {fmt.value.lower()}"
        )
    if fmt is DatasetFormat.TOKENS:
        for i, row in enumerate(rows, 1):
            if max(row["input_ids"]) >= vocab_size:
                raise InvalidArgument(
                    f"row {i}: token id {max(row['input_ids'])} is outside the model's vocabulary of {vocab_size}"
                )


def sft_rows(rows: list[dict], fmt: DatasetFormat, cfg: TrainConfig, tokenizer) -> tuple[list[dict], bool]:
    """Rows as TRL's SFTTrainer expects them, and whether the loss is masked to their completion part.

    Which tokens the loss covers (every assistant message is what the OpenAI fine-tuning API trains on):

    ===================  ==============================  ==========================  ===================
    data                 default                         ``completion_only_loss``    ``loss_on_all_tokens``
    ===================  ==============================  ==========================  ===================
    messages             assistant messages (weight≠0)   the last assistant message  every token
    prompt/completion    the completion                  the completion              every token
    text                 every token                     (refused)                   every token
    tokens               ``completion_mask`` if given    ``completion_mask``         every token
    ===================  ==============================  ==========================  ===================
    """
    if fmt is DatasetFormat.TOKENS:  # TRL skips tokenization for rows that already hold input_ids
        keep = ("input_ids",) if cfg.loss_on_all_tokens else ("input_ids", "completion_mask")
        return [{k: r[k] for k in keep if k in r} for r in rows], not cfg.loss_on_all_tokens
    if fmt is DatasetFormat.TEXT:
        return [{"text": r["text"]} for r in rows], False
    if fmt is DatasetFormat.PROMPT_COMPLETION:
        return [
            {"prompt": r["prompt"], "completion": r["completion"]} for r in rows
        ], not cfg.loss_on_all_tokens
    if any(uses_tools(r) for r in rows):  # tokenized here, with the row's tools passed to the template
        if cfg.loss_on_all_tokens:
            return [
                {
                    "input_ids": _chat_ids(
                        tokenizer, r["messages"], generation_prompt=False, tools=r.get("tools")
                    )
                }
                for r in rows
            ], False
        return [
            assistant_masked(
                r["messages"], tokenizer, tools=r.get("tools"), last_only=cfg.completion_only_loss
            )
            for r in rows
        ], True
    if cfg.loss_on_all_tokens:
        return [{"messages": _plain(r["messages"])} for r in rows], False
    if cfg.completion_only_loss:  # conversational prompt/completion: all turns but the last are the prompt
        return [
            {"prompt": _plain(r["messages"][:-1]), "completion": _plain(r["messages"][-1:])} for r in rows
        ], True
    return [assistant_masked(r["messages"], tokenizer) for r in rows], True


def _plain(messages: list[dict]) -> list[dict]:
    """Messages as the chat template reads them: role and content, and the function-calling fields where present
    (tool calls' JSON-string ``arguments`` as objects, the form Hugging Face's tool templates render)."""
    out = []
    for m in messages:
        msg = {"role": m["role"], "content": m.get("content") or ""}
        if "tool_calls" in m:
            msg["tool_calls"] = [
                {
                    **c,
                    "type": "function",
                    "function": {**c["function"], "arguments": _arguments(c["function"].get("arguments"))},
                }
                for c in m["tool_calls"]
            ]
        for k in ("tool_call_id", "name"):
            if m["role"] == "tool" and k in m:
                msg[k] = m[k]
        out.append(msg)
    return out


def _arguments(args) -> dict:
    return json.loads(args) if isinstance(args, str) else args


def _chat_ids(
    tokenizer, messages: list[dict], *, generation_prompt: bool, tools: list | None = None
) -> list[int]:
    # As TRL tokenizes a conversation (``trl.data_utils._tokenize``): the template's own special tokens only.
    out = tokenizer.apply_chat_template(
        _plain(messages),
        tools=tools,
        tokenize=True,
        return_dict=True,
        add_generation_prompt=generation_prompt,
    )
    return list(out["input_ids"])


_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": "strop_probe_lookup",
        "description": "Look a word up.",
        "parameters": {"type": "object", "properties": {"word": {"type": "string"}}, "required": ["word"]},
    },
}
_PROBE_CALL = [
    {"role": "user", "content": "Look the word up."},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_probe",
                "type": "function",
                "function": {"name": "strop_probe_lookup", "arguments": '{"word": "zebrafinchprobe"}'},
            }
        ],
    },
]


def _renders(tokenizer, messages: list[dict], tools: list, needle: str) -> bool:
    try:
        text = tokenizer.apply_chat_template(_plain(messages), tools=tools, tokenize=False)
    except Exception:  # a template that fails on tools (a Jinja error of its own) does not render them
        return False
    return needle in text


def check_tools_rendered(rows: list[dict], tokenizer, what: str = "") -> None:
    """Refuse chat rows with function calling (``tools``, ``tool_calls``) that the model's chat template would drop.

    The probe renders a tiny conversation: the tool's name must appear once ``tools`` is passed, and a call's
    arguments once an assistant message calls it.

    Raises:
        InvalidArgument: naming the first such row and what the template leaves out.
    """
    found = [(i, r) for i, r in enumerate(rows, 1) if uses_tools(r)]
    if not found:
        return
    if not getattr(tokenizer, "chat_template", None):
        raise InvalidArgument(
            f"{what}row {found[0][0]}: function calling needs a chat template; the model has none"
        )
    tools_ok = _renders(tokenizer, _PROBE_CALL[:1], [_PROBE_TOOL], "strop_probe_lookup")
    calls_ok = _renders(tokenizer, _PROBE_CALL, [_PROBE_TOOL], "zebrafinchprobe")
    for i, r in found:
        if "tools" in r and not tools_ok:
            raise InvalidArgument(
                f"{what}row {i}: the model's chat template does not render tools (the row's 'tools' would be "
                "dropped); train on a model whose template renders them, or drop 'tools'"
            )
        if not calls_ok and any("tool_calls" in m for m in r["messages"]):
            raise InvalidArgument(
                f"{what}row {i}: the model's chat template does not render tool calls (assistant 'tool_calls' "
                "would be dropped); train on a model whose template renders them, or drop the calls"
            )


def assistant_masked(
    messages: list[dict], tokenizer, *, tools: list | None = None, last_only: bool = False
) -> dict:
    """A conversation tokenized with its chat template and a mask of 1 on the tokens of its assistant messages.

    Assistant message i spans from the end of the conversation before it rendered with the generation prompt
    (``<|im_start|>assistant\n``, …) to the end of the conversation up to and including it, so the message's
    end-of-turn token is trained (the model learns to stop); an assistant message's tool calls are in its span,
    a ``tool`` message's result is not. ``tools`` go to the template as its ``tools``; ``last_only`` masks the
    last message only (``completion_only_loss``). Spans are found on token ids: where the shorter
    rendering stops being a prefix of the whole one (as TRL's ``common_prefix_length`` does for one completion).
    A template that renders an earlier part of a conversation differently once more turns follow cannot be
    masked this way: InvalidArgument, naming the way out (``loss_on_all_tokens``).
    """
    ids = _chat_ids(tokenizer, messages, generation_prompt=False, tools=tools)
    mask = [0] * len(ids)
    for i, m in enumerate(messages):
        if m["role"] != "assistant" or m.get("weight", 1) == 0 or (last_only and i < len(messages) - 1):
            continue
        start = _common_prefix(_chat_ids(tokenizer, messages[:i], generation_prompt=True, tools=tools), ids)
        upto = _chat_ids(tokenizer, messages[: i + 1], generation_prompt=False, tools=tools)
        end = _common_prefix(upto, ids)
        if end < len(upto):
            raise InvalidArgument(
                f"the chat template renders a conversation's first {i + 1} messages differently once more "
                "follow, so its assistant messages cannot be masked; train with loss_on_all_tokens or "
                "completion_only_loss"
            )
        mask[start:end] = [1] * (end - start)
    return {"input_ids": ids, "completion_mask": mask}


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n
