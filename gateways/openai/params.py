"""``POST /v1/fine_tuning/jobs``: the request checked field by field (each refusal names its ``param``) and OpenAI's
hyperparameters resolved to a strop :class:`TrainConfig`.

``"auto"`` (or a hyperparameter left out) is strop's documented default for the method (``TRAIN_DEFAULTS``):
``n_epochs`` SFT :func:`auto_epochs` of the training rows (300 rows' worth, 1 to 10), DPO 1; ``batch_size`` SFT 4,
DPO 1; ``learning_rate_multiplier`` 1 (× strop's learning rate for the method: SFT 2e-3, DPO 5e-6); ``beta`` 0.1.
A checkpoint is taken at the end of every epoch (OpenAI's), and with a validation file the job evaluates there too.

``reinforcement`` is strop's GRPO job: the grader as OpenAI defines it (checked by ``strop.graders``), ``n_epochs``
(auto 1), ``batch_size`` (prompts a step, auto 4), ``learning_rate_multiplier`` (× 1e-5), ``compute_multiplier``
(× the 8 samples drawn for each prompt); ``eval_interval``/``eval_samples`` only "auto" (no validation file yet),
``reasoning_effort`` only "default".
"""

from __future__ import annotations

import json
import math
import random
import re
from dataclasses import dataclass, field

from strop.common.export_types import ExportTarget
from strop.common.trainer_types import (
    GRPO_DEFAULTS,
    GrpoConfig,
    Retention,
    TrainConfig,
    TrainMethod,
    auto_epochs,
    train_default,
)
from strop.gateways.openai.errors import bad

METHODS = {"supervised": TrainMethod.SFT, "dpo": TrainMethod.DPO, "reinforcement": TrainMethod.GRPO}
# the file kinds (files.Converted.kind) each method trains on
METHOD_FILE_KINDS = {
    "supervised": ("chat", "prompt_completion"),
    "dpo": ("preference",),
    "reinforcement": ("prompts",),
}
HYPERPARAMETERS = {
    "supervised": ("n_epochs", "batch_size", "learning_rate_multiplier"),
    "dpo": ("n_epochs", "batch_size", "learning_rate_multiplier", "beta"),
    "reinforcement": (
        "n_epochs",
        "batch_size",
        "learning_rate_multiplier",
        "compute_multiplier",
        "eval_interval",
        "eval_samples",
        "reasoning_effort",
    ),
}
CREATE_FIELDS = {
    "model",
    "training_file",
    "validation_file",
    "suffix",
    "seed",
    "metadata",
    "method",
    "hyperparameters",
    "integrations",
}
_SUFFIX = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
# each hyperparameter's range as OpenAI's OpenAPI spec gives it: (kind, low, high); a float's low is exclusive
RANGES = {
    "n_epochs": (int, 1, 50),
    "batch_size": (int, 1, 256),
    "learning_rate_multiplier": (float, 0.0, math.inf),
    "beta": (float, 0.0, 2.0),
    "compute_multiplier": (float, 0.0, math.inf),
    "eval_interval": (int, 1, 1 << 30),
    "eval_samples": (int, 1, 1 << 30),
}


@dataclass
class JobRequest:
    model: str
    training_file: str
    validation_file: str | None
    suffix: str | None
    seed: int
    metadata: dict[str, str] | None
    method: str  # supervised | dpo | reinforcement
    hyperparameters: dict[str, object] = field(default_factory=dict)  # as given: a number or "auto"
    grader: dict | None = None  # reinforcement: OpenAI's grader object, checked by strop.graders


def _str(body: dict, name: str, *, required: bool = False) -> str | None:
    v = body.get(name)
    if v is None:
        if required:
            raise bad(f"Missing required parameter: '{name}'.", name, "missing_required_parameter")
        return None
    if not isinstance(v, str) or not v:
        raise bad(f"'{name}' must be a non-empty string, got {type(v).__name__}", name)
    return v


def _hyper(raw, allowed: tuple[str, ...], where: str) -> dict[str, object]:
    if raw is None:
        return {}
    if not isinstance(raw, dict):
        raise bad(f"'{where}' must be an object", where)
    out = {}
    for name, value in raw.items():
        param = f"{where}.{name}"
        if name not in allowed:
            raise bad(f"Unrecognized hyperparameter '{name}' (this method takes {', '.join(allowed)})", param)
        if value is None or value == "auto":
            out[name] = "auto"
            continue
        # the effort of a reasoning model's thinking; strop samples plain answers
        if name == "reasoning_effort":
            if value != "default":
                raise bad(
                    f"'reasoning_effort' {value!r}: strop samples answers without a reasoning budget; "
                    'leave it "default"',
                    param,
                )
            out[name] = value
            continue
        kind, low, high = RANGES[name]
        ok = isinstance(value, int | float) and not isinstance(value, bool)
        if ok and kind is int:
            ok = float(value).is_integer()
        if (
            not ok
            or not math.isfinite(value)
            or not (low < value <= high if kind is float else low <= value <= high)
        ):
            span = (
                f"[{low}, {high}]" if kind is int else f"({low}, {high}]" if high < math.inf else f"> {low}"
            )
            raise bad(
                f"'{name}' must be \"auto\" or a{'n integer' if kind is int else ' number'} in {span}, "
                f"got {value!r}",
                param,
            )
        out[name] = kind(value)
    return out


EXPORT_KEY = "strop_export"  # metadata: what the export service writes of the fine-tuned model on success


def export_targets(spec: str) -> list[ExportTarget]:
    """``metadata.strop_export``: comma-separated ``merged[:dtype]``, ``peft``, ``gguf[:type]``, ``gguf_lora[:type]``
    (types as ``strop export`` takes them; the export service checks them when the export is submitted)."""
    out = []
    for item in (x.strip() for x in spec.split(",")):
        name, _, arg = item.partition(":")
        make = {
            "merged": ExportTarget.merged,
            "peft": ExportTarget.peft,
            "gguf": ExportTarget.gguf,
            "gguf_lora": ExportTarget.gguf_lora,
        }.get(name)
        if make is None or (name == "peft" and arg):
            raise bad(
                f"metadata {EXPORT_KEY!r}: {item!r} is not merged[:dtype], peft, gguf[:type] or "
                "gguf_lora[:type]",
                "metadata",
            )
        out.append(make(arg) if arg else make())
    return out


def _grader(conf: dict) -> dict:
    """The reinforcement method's grader, checked by strop's graders (the one owner of what a grader may say), each
    problem named by its field under ``method.reinforcement.grader``."""
    from strop.graders import GraderSpecError, parse_grader

    where = "method.reinforcement.grader"
    grader = conf.get("grader")
    if not isinstance(grader, dict):
        raise bad(f"Missing required parameter: '{where}' (an object)", where, "missing_required_parameter")
    try:
        parse_grader(grader, root=where)
    except GraderSpecError as exc:
        raise bad(str(exc), exc.field) from None
    return grader


def parse_create(body) -> JobRequest:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    for k in body:
        if k not in CREATE_FIELDS:
            raise bad(f"Unrecognized request argument supplied: {k}", k, "unknown_parameter")
    if body.get("integrations"):
        raise bad(
            "integrations are not supported: the gateway reaches no third-party service (Weights & Biases); "
            "follow a job with its events, checkpoints and result file",
            "integrations",
        )
    suffix = _str(body, "suffix")
    if suffix is not None and not _SUFFIX.match(suffix):
        raise bad("'suffix' must be 1 to 64 characters of letters, digits, '.', '_' or '-'", "suffix")
    seed = body.get("seed")
    if seed is None:
        seed = random.randrange(1 << 31)  # OpenAI's: a seed is generated when none is given, and reported
    elif isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < (1 << 31):
        raise bad(f"'seed' must be an integer in [0, 2147483647], got {seed!r}", "seed")
    metadata = body.get("metadata")
    if metadata is not None:
        if not isinstance(metadata, dict) or len(metadata) > 16:
            raise bad("'metadata' must be an object of at most 16 pairs", "metadata")
        for k, v in metadata.items():
            if len(k) > 64 or not isinstance(v, str) or len(v) > 512:
                raise bad(
                    f"metadata {k!r}: keys are at most 64 characters, values strings of at most 512",
                    "metadata",
                )
        if EXPORT_KEY in metadata:
            export_targets(metadata[EXPORT_KEY])
    method = body.get("method")
    legacy = body.get("hyperparameters")
    if method is None:
        kind, hyper, grader = (
            "supervised",
            _hyper(legacy, HYPERPARAMETERS["supervised"], "hyperparameters"),
            None,
        )
    else:
        if not isinstance(method, dict):
            raise bad("'method' must be an object", "method")
        kind = method.get("type")
        if kind not in METHODS:
            raise bad(
                f"'method.type' must be one of supervised, dpo, reinforcement; got {kind!r}", "method.type"
            )
        for k in method:
            if k not in ("type", kind):
                raise bad(f"'method.{k}' does not belong to method type {kind!r}", f"method.{k}")
        if legacy is not None and kind != "supervised":
            raise bad(
                "the top-level 'hyperparameters' are for supervised jobs; put them in method."
                f"{kind}.hyperparameters",
                "hyperparameters",
            )
        conf = method.get(kind) or {}
        if not isinstance(conf, dict):
            raise bad(f"'method.{kind}' must be an object", f"method.{kind}")
        grader = _grader(conf) if kind == "reinforcement" else None
        if grader is not None and body.get("validation_file") is not None:
            raise bad(
                "strop's reinforcement (GRPO) jobs evaluate no validation file yet; leave validation_file "
                "out",
                "validation_file",
            )
        extra = (
            set(conf) - {"hyperparameters", "grader"}
            if kind == "reinforcement"
            else set(conf) - {"hyperparameters"}
        )
        if extra:
            raise bad(
                f"'method.{kind}.{sorted(extra)[0]}' is not a field of the {kind} method",
                f"method.{kind}.{sorted(extra)[0]}",
            )
        hyper = _hyper(legacy, HYPERPARAMETERS[kind], "hyperparameters")
        hyper.update(
            _hyper(conf.get("hyperparameters"), HYPERPARAMETERS[kind], f"method.{kind}.hyperparameters")
        )
        for name in ("eval_interval", "eval_samples"):
            if hyper.get(name, "auto") != "auto":
                raise bad(
                    f"'{name}' evaluates a validation file, which strop's reinforcement (GRPO) jobs do not "
                    'yet; leave it "auto"',
                    f"method.reinforcement.hyperparameters.{name}",
                )
    return JobRequest(
        model=_str(body, "model", required=True),
        training_file=_str(body, "training_file", required=True),
        validation_file=_str(body, "validation_file"),
        suffix=suffix,
        seed=seed,
        metadata=metadata,
        method=kind,
        hyperparameters=hyper,
        grader=grader,
    )


def resolve(req: JobRequest, num_rows: int) -> tuple[TrainConfig, dict[str, object]]:
    """The job's TrainConfig and its hyperparameters as OpenAI reports them (every "auto" resolved)."""
    method = METHODS[req.method]
    h = req.hyperparameters

    def pick(name, default):
        v = h.get(name, "auto")
        return default if v == "auto" else v

    default_epochs = (
        auto_epochs(num_rows) if method is TrainMethod.SFT else train_default("num_epochs", method)
    )
    epochs = int(pick("n_epochs", int(default_epochs)))
    batch = int(pick("batch_size", train_default("batch_size", method)))
    mult = float(pick("learning_rate_multiplier", 1.0))
    steps_per_epoch = max(1, -(-num_rows // batch))
    cfg = TrainConfig(
        method=method,
        learning_rate=mult * float(train_default("learning_rate", method)),
        num_epochs=float(epochs),
        batch_size=batch,
        seed=req.seed,
        checkpoint_every_steps=steps_per_epoch,
        # an OpenAI job trains on its file as asked (no retention knob in that API): not strop's chat recipe, whose
        # scaled final adapter would also differ from the job's last epoch checkpoint at the same step
        retention=Retention.NONE,
    )
    out: dict[str, object] = {"n_epochs": epochs, "batch_size": batch, "learning_rate_multiplier": mult}
    if method is TrainMethod.DPO:
        cfg.dpo_beta = float(pick("beta", train_default("dpo_beta", method)))
        out["beta"] = cfg.dpo_beta
    if method is TrainMethod.GRPO:
        # compute_multiplier scales the samples drawn for each prompt (GRPO's group), strop's default 8 at 1
        compute = float(pick("compute_multiplier", 1.0))
        group = max(2, round(int(GRPO_DEFAULTS["group_size"]) * compute))
        cfg.grpo = GrpoConfig(grader=json.dumps(req.grader), group_size=group)
        out.update(
            compute_multiplier=compute, eval_interval="auto", eval_samples="auto", reasoning_effort="default"
        )
    return cfg, out


# the trainer's fields a request's fields become (the trainer's InvalidArgument starts with the field it names)
TRAINER_FIELDS = (("config.grpo.grader", "method.reinforcement.grader"),)


def request_field(message: str) -> tuple[str, str | None]:
    """A trainer's INVALID_ARGUMENT ``message`` with the field it starts with written as the request's field, and
    that field; ``(message, None)`` when it names no field the request sets."""
    head, sep, rest = message.partition(":")
    for ours, theirs in TRAINER_FIELDS:
        if sep and (head == ours or head.startswith(ours + ".")):
            field = theirs + head[len(ours) :]
            return field + sep + rest, field
    return message, None


CONFIG_FIELDS = ("learning_rate", "num_epochs", "batch_size", "seed", "checkpoint_every_steps", "dpo_beta")


def config_doc(cfg: TrainConfig) -> dict:
    """What the gateway stores of a job's TrainConfig (the fields it sets; the trainer defaults the rest)."""
    grpo = {"grader": cfg.grpo.grader, "group_size": cfg.grpo.group_size} if cfg.grpo else None
    return {"method": cfg.method.value, **{f: getattr(cfg, f) for f in CONFIG_FIELDS}, "grpo": grpo}


def config_from_doc(doc: dict) -> TrainConfig:
    grpo = GrpoConfig(**doc["grpo"]) if doc.get("grpo") else None
    return TrainConfig(method=TrainMethod(doc["method"]), grpo=grpo, **{f: doc[f] for f in CONFIG_FIELDS})


def eval_every(cfg: TrainConfig, validation: bool) -> int:
    """Evaluate at every checkpoint (each epoch's end) when the job has a validation file."""
    return cfg.checkpoint_every_steps if validation else 0
