"""``POST /v1/fine_tuning/jobs``: the request checked field by field (each refusal names its ``param``) and OpenAI's
hyperparameters resolved to a strop :class:`TrainConfig`.

``"auto"`` (or a hyperparameter left out) is strop's documented default for the method (``TRAIN_DEFAULTS``):
``n_epochs`` SFT :func:`auto_epochs` of the training rows (300 rows' worth, 1 to 10), DPO 1; ``batch_size`` SFT 4,
DPO 1; ``learning_rate_multiplier`` 1 (× strop's learning rate for the method: SFT 1e-3, DPO 5e-6); ``beta`` 0.1.
A checkpoint is taken at the end of every epoch (OpenAI's), and with a validation file the job evaluates there too.
"""

from __future__ import annotations

import math
import random
import re
from dataclasses import dataclass, field

from strop.common.trainer_types import TrainConfig, TrainMethod, auto_epochs, train_default
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
}
CREATE_FIELDS = {
    "model", "training_file", "validation_file", "suffix", "seed", "metadata", "method", "hyperparameters",
    "integrations",
}  # fmt: skip
_SUFFIX = re.compile(r"^[A-Za-z0-9._-]{1,64}$")
# each hyperparameter's range as OpenAI's OpenAPI spec gives it: (kind, low, high); a float's low is exclusive
RANGES = {
    "n_epochs": (int, 1, 50),
    "batch_size": (int, 1, 256),
    "learning_rate_multiplier": (float, 0.0, math.inf),
    "beta": (float, 0.0, 2.0),
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
            raise bad(f"'{name}' must be \"auto\" or a{'n integer' if kind is int else ' number'} in {span}, "
                      f"got {value!r}", param)  # fmt: skip
        out[name] = kind(value)
    return out


def parse_create(body) -> JobRequest:
    if not isinstance(body, dict):
        raise bad("the request body must be a JSON object")
    for k in body:
        if k not in CREATE_FIELDS:
            raise bad(f"Unrecognized request argument supplied: {k}", k, "unknown_parameter")
    if body.get("integrations"):
        raise bad(
            "integrations are not supported: the gateway reaches no third-party service (Weights & Biases); "
            "follow a job with its events, checkpoints and result file", "integrations",
        )  # fmt: skip
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
                raise bad(f"metadata {k!r}: keys are at most 64 characters, values strings of at most 512",
                          "metadata")  # fmt: skip
    method = body.get("method")
    legacy = body.get("hyperparameters")
    if method is None:
        kind, hyper = "supervised", _hyper(legacy, HYPERPARAMETERS["supervised"], "hyperparameters")
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
            raise bad("the top-level 'hyperparameters' are for supervised jobs; put them in method."
                      f"{kind}.hyperparameters", "hyperparameters")  # fmt: skip
        conf = method.get(kind) or {}
        if not isinstance(conf, dict):
            raise bad(f"'method.{kind}' must be an object", f"method.{kind}")
        if kind == "reinforcement":
            raise bad(
                "method type 'reinforcement' is not served by this gateway yet (strop's GRPO jobs are not wired "
                "to it); use supervised or dpo", "method.type",
            )  # fmt: skip
        extra = set(conf) - {"hyperparameters"}
        if extra:
            raise bad(f"'method.{kind}.{sorted(extra)[0]}' is not a field of the {kind} method",
                      f"method.{kind}.{sorted(extra)[0]}")  # fmt: skip
        hyper = _hyper(legacy, HYPERPARAMETERS[kind], "hyperparameters")
        hyper.update(
            _hyper(conf.get("hyperparameters"), HYPERPARAMETERS[kind], f"method.{kind}.hyperparameters")
        )
    return JobRequest(
        model=_str(body, "model", required=True), training_file=_str(body, "training_file", required=True),
        validation_file=_str(body, "validation_file"), suffix=suffix, seed=seed, metadata=metadata, method=kind,
        hyperparameters=hyper,
    )  # fmt: skip


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
        method=method, learning_rate=mult * float(train_default("learning_rate", method)), num_epochs=float(epochs),
        batch_size=batch, seed=req.seed, checkpoint_every_steps=steps_per_epoch,
    )  # fmt: skip
    out: dict[str, object] = {"n_epochs": epochs, "batch_size": batch, "learning_rate_multiplier": mult}
    if method is TrainMethod.DPO:
        cfg.dpo_beta = float(pick("beta", train_default("dpo_beta", method)))
        out["beta"] = cfg.dpo_beta
    return cfg, out


CONFIG_FIELDS = ("learning_rate", "num_epochs", "batch_size", "seed", "checkpoint_every_steps", "dpo_beta")


def config_doc(cfg: TrainConfig) -> dict:
    """What the gateway stores of a job's TrainConfig (the fields it sets; the trainer defaults the rest)."""
    return {"method": cfg.method.value, **{f: getattr(cfg, f) for f in CONFIG_FIELDS}}


def config_from_doc(doc: dict) -> TrainConfig:
    return TrainConfig(method=TrainMethod(doc["method"]), **{f: doc[f] for f in CONFIG_FIELDS})


def eval_every(cfg: TrainConfig, validation: bool) -> int:
    """Evaluate at every checkpoint (each epoch's end) when the job has a validation file."""
    return cfg.checkpoint_every_steps if validation else 0
