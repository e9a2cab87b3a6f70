"""Conversions between the ``tinker`` SDK's wire (its protobuf module and pydantic types) and strop's step types
(``strop.common.step_types``). Pure functions; a bad request raises :class:`WireError` (HTTP 400)."""

from __future__ import annotations

import math
import re

import numpy as np
from tinker import types as tt
from tinker.proto import tinker_public_pb2 as pb

from strop.common.step_types import (
    AdamParams,
    Datum,
    ForwardBackwardOutput,
    LossFn,
    Metric,
    NamedTensor,
    SampleOutput,
    SamplingParams,
    TensorData,
)

# Tinker's loss names strop computes; the SDK's others are refused by name (docs/step-api.md)
LOSSES = {m.wire: m for m in LossFn if m is not LossFn.UNSPECIFIED}
_NP = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,79}$")
KINDS = {"weights": "w", "sampler_weights": "s"}  # tinker path type → artifact id letter


class WireError(Exception):
    """A request the SDK sent that strop cannot serve: HTTP ``status`` with ``{"detail": message}``."""

    def __init__(self, message: str, status: int = 400):
        super().__init__(message)
        self.status = status


# ---- ids and paths ------------------------------------------------------------------------------------------


def check_name(name: str, what: str) -> str:
    if not _NAME_RE.match(name or "") or ".." in name:
        raise WireError(f"{what} {name!r} is not valid (letters, digits, '.', '_', '-'; at most 80)")
    return name


def run_key(model_id: str) -> str:
    """The artifact-id prefix of one model's checkpoints (a model id holds ':', which artifact ids may not)."""
    import hashlib

    return "tk-" + hashlib.sha256(model_id.encode()).hexdigest()[:16]


def artifact_id(model_id: str, kind: str, name: str) -> str:
    return f"{run_key(model_id)}-{KINDS[kind]}-{name}"


def tinker_path(model_id: str, kind: str, name: str) -> str:
    return f"tinker://{model_id}/{kind}/{name}"


def parse_path(path: str) -> tuple[str, str, str]:
    """``tinker://<model_id>/{weights|sampler_weights}/<name>`` → (model_id, kind, name)."""
    if not isinstance(path, str) or not path.startswith("tinker://"):
        raise WireError(f"path {path!r} is not a tinker:// path")
    parts = path[len("tinker://") :].split("/")
    if len(parts) != 3 or parts[1] not in KINDS or not parts[0]:
        raise WireError(f"path {path!r}: expected tinker://<run>/{{weights|sampler_weights}}/<name>")
    return parts[0], parts[1], check_name(parts[2], "checkpoint name")


# ---- forward_backward ---------------------------------------------------------------------------------------


def _tensor(name: str, t: pb.Tensor, where: str) -> TensorData:
    dt = _NP.get(t.dtype)
    if dt is None:
        raise WireError(f"{where}: dtype {pb.DType.Name(t.dtype)} is not supported (float32, int64, int32)")
    shape = [int(s) for s in t.shape]
    kind = t.WhichOneof("encoding")
    if kind == "sparse_csr":
        vals = np.frombuffer(t.sparse_csr.values, dtype=dt)
        crow = np.frombuffer(t.sparse_csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(t.sparse_csr.col_indices, dtype=np.int64)
        if len(shape) != 2 or len(crow) != shape[0] + 1 or len(col) != len(vals):
            raise WireError(f"{where}: a sparse CSR tensor needs a 2-D shape and matching indices")
        dense = np.zeros(shape, dtype=dt)
        for r in range(shape[0]):
            a, b = int(crow[r]), int(crow[r + 1])
            if not (0 <= a <= b <= len(col)) or (
                b > a and (col[a:b].min() < 0 or col[a:b].max() >= shape[1])
            ):
                raise WireError(f"{where}: sparse CSR indices out of range")
            dense[r, col[a:b]] = vals[a:b]
        arr = dense.reshape(-1)
    else:
        raw = t.dense if kind == "dense" else b""
        if len(raw) % np.dtype(dt).itemsize:
            raise WireError(f"{where}: {len(raw)} bytes is not a whole number of {np.dtype(dt).name} values")
        arr = np.frombuffer(raw, dtype=dt)
    if not shape:
        shape = [len(arr)]
    if math.prod(shape) != len(arr):
        raise WireError(f"{where}: shape {shape} does not hold {len(arr)} values")
    if dt == np.float32:
        return TensorData("float32", shape, float_values=arr.astype(np.float64).tolist())
    return TensorData("int64", shape, int_values=arr.astype(np.int64).tolist())


def forward_backward_from_proto(msg: pb.ForwardBackwardRequest) -> tuple[list[Datum], LossFn, list[Metric]]:
    """The SDK's ``ForwardBackwardRequest`` → strop datums, loss and its config (v2 first, numbers only)."""
    loss = LOSSES.get(msg.loss_fn)
    if loss is None:
        raise WireError(
            f"loss_fn {msg.loss_fn!r} is not supported by this server (supported: {', '.join(LOSSES)}; "
            "custom losses run client-side through forward_backward_custom)"
        )
    config: dict[str, float] = dict(msg.loss_fn_config.items())
    for k, v in msg.loss_fn_config_v2.items():
        if v.WhichOneof("value") == "text":
            raise WireError(f"loss_fn_config[{k!r}]: text values are not supported")
        config[k] = float(v.number)
    data = []
    for i, d in enumerate(msg.data):
        tokens: list[int] = []
        for j, c in enumerate(d.model_input):
            if c.WhichOneof("chunk") != "encoded_text":
                raise WireError(f"data[{i}].model_input.chunks[{j}]: only encoded_text chunks are supported")
            tokens.extend(np.frombuffer(c.encoded_text.tokens, dtype=np.int32).tolist())
        named = [
            NamedTensor(name, _tensor(name, t, f"data[{i}].loss_fn_inputs[{name!r}]"))
            for name, t in sorted(d.loss_fn_inputs.items())
        ]
        data.append(Datum(tokens, named))
    return data, loss, [Metric(k, v) for k, v in sorted(config.items())]


def forward_backward_output_to_proto(out: ForwardBackwardOutput, k_by_datum: list[int]) -> bytes:
    """strop's output → the SDK's protobuf ``ForwardBackwardOutput`` (one ArrayRecord, field ``logprobs``)."""
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for m in out.metrics:
        msg.metrics[m.name] = float(m.value)
    n = len(out.loss_fn_outputs)
    if n:
        rec = msg.loss_fn_outputs.add(num_datums=n)
        arrays = [np.asarray(o.logprobs, dtype=np.float32) for o in out.loss_fn_outputs]
        offsets = np.zeros(n + 1, dtype=np.int64)
        offsets[1:] = np.cumsum([a.nbytes for a in arrays])
        bt = rec.fields["logprobs"]
        bt.data = b"".join(a.tobytes() for a in arrays)
        bt.offsets = offsets.tobytes()
        bt.dtype = pb.DTYPE_FLOAT32
        k = set(k_by_datum)
        if len(k) == 1 and (kk := k.pop()) > 1:  # [N, K] targets: logprobs of shape [N, K]
            bt.trailing_shape.append(kk)
    return msg.SerializeToString()


# ---- optim_step, sampling -----------------------------------------------------------------------------------


def adam_from_wire(p: tt.AdamParams) -> AdamParams:
    return AdamParams(
        learning_rate=p.learning_rate,
        beta1=p.beta1,
        beta2=p.beta2,
        eps=p.eps,
        weight_decay=p.weight_decay,
        grad_clip_norm=p.grad_clip_norm,
    )


def prompt_tokens(prompt: tt.ModelInput) -> list[int]:
    out: list[int] = []
    for j, c in enumerate(prompt.chunks):
        if getattr(c, "type", "") != "encoded_text":
            raise WireError(f"prompt.chunks[{j}]: only encoded_text chunks are supported")
        out.extend(int(t) for t in c.tokens)
    return out


def sampling_from_wire(p: tt.SamplingParams, default_max_tokens: int) -> SamplingParams:
    stop = p.stop
    ids: list[int] = []
    strs: list[str] = []
    if isinstance(stop, str):
        strs = [stop]
    elif stop is not None:
        for s in stop:
            (strs if isinstance(s, str) else ids).append(s)
    return SamplingParams(
        max_tokens=default_max_tokens if p.max_tokens is None else int(p.max_tokens),
        temperature=float(p.temperature),
        top_p=float(p.top_p),
        top_k=int(p.top_k),
        stop_token_ids=[int(i) for i in ids],
        stop_strings=list(strs),
        seed=p.seed,
    )


def sample_output_to_proto(out: SampleOutput, prompt_logprobs: bool) -> bytes:
    msg = pb.SampleResponse()
    for s in out.sequences:
        seq = msg.sequences.add()
        seq.stop_reason = pb.STOP_REASON_LENGTH if s.stop_reason == "length" else pb.STOP_REASON_STOP
        seq.tokens = np.asarray(s.tokens, dtype=np.int32).tobytes()
        seq.logprobs = np.asarray(s.logprobs, dtype=np.float32).tobytes()
    if prompt_logprobs and out.prompt_logprobs:
        msg.prompt_logprobs = np.asarray(out.prompt_logprobs, dtype=np.float32).tobytes()
    return msg.SerializeToString()
