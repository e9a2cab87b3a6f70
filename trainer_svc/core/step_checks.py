"""The step API's requests checked when submitted, before anything is queued: a bad input is INVALID_ARGUMENT
naming the field (and the datum, input and position) at fault. Plain functions over ``step_types``; the
training runs (``runs.py``) call them.
"""

from __future__ import annotations

import math

from strop.common.errors import InvalidArgument, StropError
from strop.common.step_types import AdamParams, Datum, LossFn, Metric, RunLora, SampleRequest

MAX_SAMPLE_TOKENS = 1 << 20  # num_samples × (prompt + max_tokens) of one request


def check_lora(lora: RunLora) -> None:
    if not 0 < lora.rank <= 1024:
        raise InvalidArgument(f"lora.rank must be in 1..1024, got {lora.rank}")
    if lora.alpha is not None and not (math.isfinite(lora.alpha) and lora.alpha > 0):
        raise InvalidArgument(f"lora.alpha must be a positive finite number, got {lora.alpha}")
    if not (lora.train_attn or lora.train_mlp or lora.train_unembed):
        raise InvalidArgument("lora: at least one of train_attn, train_mlp, train_unembed must be true")


def artifact_name(name: str, what: str) -> str | None:
    if not name:
        return None
    from strop.common.artifacts import check_artifact_id

    try:
        return check_artifact_id(name)
    except StropError as exc:
        raise InvalidArgument(f"{what}: {exc}") from None


def merge_adam(run_default: AdamParams, step: AdamParams | None) -> AdamParams:
    if step is None:
        return run_default
    return AdamParams(
        **{
            k: (getattr(step, k) if getattr(step, k) is not None else getattr(run_default, k))
            for k in vars(step)
        }
    )


def check_adam(adam: AdamParams, what: str) -> None:
    r = adam.resolved()
    for k, v in r.items():
        if not math.isfinite(v):
            raise InvalidArgument(f"{what}.{k} must be finite, got {v}")
    if r["learning_rate"] < 0:
        raise InvalidArgument(f"{what}.learning_rate must be >= 0, got {r['learning_rate']}")
    for k in ("beta1", "beta2"):
        if not 0.0 <= r[k] < 1.0:
            raise InvalidArgument(f"{what}.{k} must be in [0, 1), got {r[k]}")
    if r["eps"] <= 0:
        raise InvalidArgument(f"{what}.eps must be > 0, got {r['eps']}")
    if r["weight_decay"] < 0 or r["grad_clip_norm"] < 0:
        raise InvalidArgument(f"{what}.weight_decay and grad_clip_norm must be >= 0")


def loss_config(loss: LossFn, entries: list[Metric]) -> dict[str, float]:
    from strop.kernels.losses.rl import LOSSES

    spec = LOSSES[loss.wire]
    cfg = {}
    for m in entries:
        if m.name not in spec.config:
            known = ", ".join(sorted(spec.config)) or "none"
            raise InvalidArgument(
                f"loss_fn_config: unknown key {m.name!r} for {loss.wire} (its keys: {known})"
            )
        if not math.isfinite(m.value):
            raise InvalidArgument(f"loss_fn_config[{m.name!r}] must be finite, got {m.value}")
        cfg[m.name] = m.value
    return cfg


def validate_data(
    data: list[Datum], loss: LossFn, *, vocab_size: int, max_length: int
) -> list[dict[str, list]]:
    """Every datum checked against the loss's inputs (``rl.LOSSES``); the per-token inputs by name.

    Raises:
        InvalidArgument: naming the datum, the input and the position at fault.
    """
    from strop.kernels.losses.rl import LOSSES

    spec = LOSSES[loss.wire]
    if not data:
        raise InvalidArgument("data: at least one datum is required")
    out = []
    for i, d in enumerate(data):
        n = len(d.model_input)
        if n == 0:
            raise InvalidArgument(f"data[{i}].model_input is empty")
        if n > max_length:
            raise InvalidArgument(
                f"data[{i}].model_input has {n} tokens; the session's max_seq_length is {max_length}"
            )
        bad = next((j for j, t in enumerate(d.model_input) if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidArgument(
                f"data[{i}].model_input[{bad}] = {d.model_input[bad]} is outside the vocabulary [0, {vocab_size})"
            )
        names = [t.name for t in d.loss_fn_inputs]
        dup = next((x for x in names if names.count(x) > 1), None)
        if dup:
            raise InvalidArgument(f"data[{i}].loss_fn_inputs: {dup!r} given twice")
        inputs = d.inputs()
        allowed = set(spec.required) | set(spec.optional)
        unknown = sorted(set(inputs) - allowed)
        if unknown:
            raise InvalidArgument(
                f"data[{i}].loss_fn_inputs: {unknown[0]!r} is not an input of {loss.wire} (it reads "
                f"{', '.join(spec.required + spec.optional)})"
            )
        missing = [k for k in spec.required if k not in inputs]
        if missing:
            raise InvalidArgument(f"data[{i}].loss_fn_inputs: {loss.wire} needs {missing[0]!r}")
        values: dict[str, list] = {}
        # cross_entropy scores K candidates per position when target_tokens (and weights) are [N, K] (Tinker's
        # top-K distillation); every other input is [N]
        k = _candidates(inputs.get("target_tokens"), n) if loss is LossFn.CROSS_ENTROPY else 1
        for name, t in inputs.items():
            field_ = f"data[{i}].loss_fn_inputs[{name!r}]"
            want_int = name == "target_tokens"
            shape = [n, k] if k > 1 and name in ("target_tokens", "weights") else [n]
            if t.shape and list(t.shape) != shape:
                raise InvalidArgument(
                    f"{field_} has shape {list(t.shape)}; expected {shape} (one per model_input token"
                    + (f", {k} candidates each)" if len(shape) == 2 else ")")
                )
            n_values = n * (shape[1] if len(shape) == 2 else 1)
            vals = t.int_values if want_int else t.float_values
            if (want_int and t.float_values) or (not want_int and t.int_values):
                raise InvalidArgument(f"{field_} must be {'int64' if want_int else 'float32'}")
            if len(vals) != n_values:
                raise InvalidArgument(
                    f"{field_} has {len(vals)} values; expected {n_values} ({'×'.join(map(str, shape))})"
                )
            if want_int:
                bad = next((j for j, v in enumerate(vals) if not 0 <= v < vocab_size), None)
                if bad is not None:
                    raise InvalidArgument(
                        f"{field_}[{bad}] = {vals[bad]} is outside the vocabulary [0, {vocab_size})"
                    )
            else:
                bad = next((j for j, v in enumerate(vals) if not math.isfinite(v)), None)
                if bad is not None:
                    raise InvalidArgument(f"{field_}[{bad}] is {vals[bad]}; values must be finite")
            values[name] = list(vals)
        out.append(values)
    ks = {len(v["target_tokens"]) // len(d.model_input) for v, d in zip(out, data, strict=True)}
    if len(ks) > 1:
        raise InvalidArgument(
            f"data: every datum needs the same number of target candidates, got {sorted(ks)}"
        )
    keys = set(out[0])
    ragged = next((i for i, v in enumerate(out) if set(v) != keys), None)
    if ragged is not None:
        raise InvalidArgument(
            f"data[{ragged}].loss_fn_inputs names other inputs than data[0]'s ({sorted(keys)})"
        )
    return out


def _candidates(t, n: int) -> int:
    """K of a [N, K] ``target_tokens`` (1 for [N] or no shape)."""
    if t is None or len(t.shape) != 2 or t.shape[0] != n or t.shape[1] < 1:
        return 1
    return int(t.shape[1])


def check_sample(req: SampleRequest, facts) -> None:
    if not req.prompt:
        raise InvalidArgument("prompt is empty")
    bad = next((j for j, t in enumerate(req.prompt) if not 0 <= t < facts.vocab_size), None)
    if bad is not None:
        raise InvalidArgument(
            f"prompt[{bad}] = {req.prompt[bad]} is outside the vocabulary [0, {facts.vocab_size})"
        )
    p = req.params
    if req.num_samples < 1:
        raise InvalidArgument(f"num_samples must be >= 1, got {req.num_samples}")
    if p.max_tokens < 1:
        raise InvalidArgument(f"params.max_tokens must be >= 1, got {p.max_tokens}")
    if len(req.prompt) + p.max_tokens > facts.max_seq_length:
        raise InvalidArgument(
            f"prompt ({len(req.prompt)} tokens) + params.max_tokens ({p.max_tokens}) exceed the session's "
            f"max_seq_length {facts.max_seq_length}"
        )
    if req.num_samples * (len(req.prompt) + p.max_tokens) > MAX_SAMPLE_TOKENS:
        raise InvalidArgument(f"num_samples × (prompt + max_tokens) is above {MAX_SAMPLE_TOKENS} tokens")
    if not (math.isfinite(p.temperature) and p.temperature >= 0):
        raise InvalidArgument(f"params.temperature must be finite and >= 0, got {p.temperature}")
    if not (0 < p.top_p <= 1):
        raise InvalidArgument(f"params.top_p must be in (0, 1], got {p.top_p}")
    if p.top_k == 0 or p.top_k < -1:
        raise InvalidArgument(f"params.top_k must be -1 (off) or >= 1, got {p.top_k}")
    bad = next((t for t in p.stop_token_ids if not 0 <= t < facts.vocab_size), None)
    if bad is not None:
        raise InvalidArgument(f"params.stop_token_ids: {bad} is outside the vocabulary")
