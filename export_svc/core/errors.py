"""The export core's domain exceptions.

Every exception derives from one of ``strop.common.errors``' classes, which name the gRPC status the
service's interceptor maps them to. The mapping, fixed for every export input problem:

| problem | exception | status |
|---|---|---|
| adapter does not fit the base (arch, module names, shapes) | ``BaseMismatch`` | INVALID_ARGUMENT |
| unknown target, GGUF type or dtype | ``UnknownFormat`` | INVALID_ARGUMENT |
| truncated or malformed safetensors / JSON input | ``CorruptInput`` | INVALID_ARGUMENT |
| only pickle weights (``*.bin``) present | ``CorruptInput`` | INVALID_ARGUMENT |
| path outside the model/artifact roots | ``InvalidArgument`` (from ``confine``) | INVALID_ARGUMENT |
| tokenizer files missing | ``MissingTokenizer`` | FAILED_PRECONDITION |
| base of an adapter cannot be resolved | ``FailedPrecondition`` | FAILED_PRECONDITION |
| the target cannot express the adapter (DoRA for vLLM, ...) | ``TargetRefused`` | FAILED_PRECONDITION |
| architecture / quantization method strop does not export | ``UnsupportedModel`` | UNIMPLEMENTED |
| a consumer (llama.cpp) rejects what was written | ``ConsumerRejected`` | INTERNAL (a bug) |
| an output fails its verification (and the request does not accept that) | ``VerificationFailed`` | FAILED_PRECONDITION |
| a client cancelled the export | ``ExportCancelled`` | CANCELLED |
"""

from __future__ import annotations

from strop.common.errors import (
    AlreadyExists,
    Cancelled,
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    StropError,
    Unavailable,
    Unimplemented,
)

__all__ = [
    "AlreadyExists",
    "BaseMismatch",
    "ConsumerRejected",
    "CorruptInput",
    "DataLoss",
    "ExportCancelled",
    "FailedPrecondition",
    "InvalidArgument",
    "MissingTokenizer",
    "NotFound",
    "ResourceExhausted",
    "StropError",
    "TargetRefused",
    "Unavailable",
    "UnknownFormat",
    "UnsupportedModel",
    "VerificationFailed",
    "WriterStateError",
]


class BaseMismatch(InvalidArgument):
    """The adapter was not trained on this base: architecture, module names or shapes differ."""


class UnknownFormat(InvalidArgument):
    """An unknown target kind, GGUF type or dtype; the message lists the valid values."""


class CorruptInput(InvalidArgument):
    """An input file is truncated or malformed (the message names the file)."""


class MissingTokenizer(FailedPrecondition):
    """Neither the adapter nor the base carries tokenizer files."""


class TargetRefused(FailedPrecondition):
    """The requested target cannot represent this adapter (e.g. DoRA for vLLM's LoRA loader)."""


class UnsupportedModel(Unimplemented):
    """An architecture or a quantization method the exporter does not handle."""


class ConsumerRejected(StropError):
    """A consumer (transformers, llama.cpp) refused an output strop wrote: a strop bug, not bad input."""


class VerificationFailed(FailedPrecondition):
    """An output was written and loaded, but does not reproduce the model (its verification's problems name
    why): nothing of the export is published unless the request accepts unverified targets."""


class ExportCancelled(Cancelled):
    """A client cancelled the export; every partial output has been discarded."""


class WriterStateError(StropError):
    """A writer was driven out of order ("expected X, got Y"): a programming error."""
