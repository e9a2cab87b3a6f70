"""The export API's dataclasses, shared by the export core and the SDK (torch-free, grpc-free).

The gRPC layer converts them to and from protobuf by field name (``strop.common.serde``); the SDK
returns them to callers, so pipelines never handle protobuf types. The core's own request types
(``TargetSpec``, ``VerifySpec``, ``ExportRequest``, its tri-state ``Verification``) keep the core's
vocabulary and convert to these with their ``to_api`` methods.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from strop.common.trainer_types import Artifact


class ExportTargetKind(enum.StrEnum):
    UNSPECIFIED = "UNSPECIFIED"
    MERGED_SAFETENSORS = "MERGED_SAFETENSORS"
    PEFT_ADAPTER = "PEFT_ADAPTER"
    GGUF = "GGUF"
    GGUF_LORA = "GGUF_LORA"


class ExportState(enum.StrEnum):
    UNSPECIFIED = "UNSPECIFIED"
    QUEUED = "QUEUED"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    INTERRUPTED = "INTERRUPTED"

    @property
    def terminal(self) -> bool:
        return self in (
            ExportState.SUCCEEDED,
            ExportState.FAILED,
            ExportState.CANCELLED,
            ExportState.INTERRUPTED,
        )


@dataclass
class ExportTarget:
    """One output of an export. Use the constructors: ``merged()``, ``peft()``, ``gguf()``, ``gguf_lora()``."""

    kind: ExportTargetKind = ExportTargetKind.UNSPECIFIED
    gguf_type: str = ""
    dtype: str = ""
    artifact_id: str = ""
    base_gguf_type: str = ""

    @classmethod
    def merged(cls, dtype: str = "", artifact_id: str = "") -> ExportTarget:
        """A merged safetensors directory vLLM and transformers load (dtype default: the base's)."""
        return cls(ExportTargetKind.MERGED_SAFETENSORS, dtype=dtype, artifact_id=artifact_id)

    @classmethod
    def peft(cls, artifact_id: str = "") -> ExportTarget:
        """A PEFT adapter directory vLLM's ``--enable-lora`` accepts."""
        return cls(ExportTargetKind.PEFT_ADAPTER, artifact_id=artifact_id)

    @classmethod
    def gguf(cls, gguf_type: str = "F16", artifact_id: str = "") -> ExportTarget:
        """A merged GGUF model: F32, F16, BF16, Q8_0 or a llama.cpp quantizer type (Q4_K_M, Q6_K, ...)."""
        return cls(ExportTargetKind.GGUF, gguf_type=gguf_type, artifact_id=artifact_id)

    @classmethod
    def gguf_lora(
        cls, lora_type: str = "F32", base_gguf_type: str = "F16", artifact_id: str = ""
    ) -> ExportTarget:
        """A GGUF LoRA adapter plus the GGUF of its unmerged base."""
        return cls(
            ExportTargetKind.GGUF_LORA,
            gguf_type=lora_type,
            base_gguf_type=base_gguf_type,
            artifact_id=artifact_id,
        )

    @classmethod
    def parse(cls, spec: str) -> ExportTarget:
        """``merged[:dtype]``, ``peft``, ``gguf[:TYPE]``, ``gguf-lora[:LORA_TYPE[:BASE_TYPE]]`` (CLI form).

        Raises:
            ValueError: an unknown target kind.
        """
        kind, _, rest = spec.partition(":")
        parts = [p for p in rest.split(":") if p]
        kind = kind.lower().replace("_", "-")
        if kind in ("merged", "merged-safetensors", "safetensors"):
            return cls.merged(*(parts[:1]))
        if kind in ("peft", "peft-adapter", "lora"):
            return cls.peft()
        if kind == "gguf":
            return cls.gguf(*(parts[:1] or ["F16"]))
        if kind == "gguf-lora":
            return cls.gguf_lora(*(parts[:2]))
        raise ValueError(
            f"unknown target {spec!r}: use merged[:dtype], peft, gguf[:TYPE], gguf-lora[:TYPE[:BASE]]"
        )


@dataclass
class VerifyOptions:
    """How an export is verified. A question/answer the adapter was trained on makes the strongest check."""

    skip: bool = False
    prompts: list[str] = field(default_factory=list)
    heldout_texts: list[str] = field(default_factory=list)
    question: str = ""
    answer: str = ""
    raw_question: bool = False
    max_new_tokens: int = 0


@dataclass
class Verification:
    """One output's figures against the merged fp32 model; each ``*_checked`` says whether its check ran."""

    consumer: str = ""
    positions: int = 0
    max_abs_logit_delta: float = 0.0
    mean_abs_logit_delta: float = 0.0
    top1_agreement: float = 0.0
    perplexity_reference: float = 0.0
    perplexity: float = 0.0
    perplexity_delta: float = 0.0
    tokens_checked: bool = False
    tokens_match: bool = False
    token_mismatches: list[str] = field(default_factory=list)
    chat_tokens_checked: bool = False
    chat_tokens_match: bool = False
    generated: str = ""
    answer_checked: bool = False
    answer_reproduced: bool = False
    answer_top1_agreement: float = 0.0
    answer_tokens: int = 0
    problems: list[str] = field(default_factory=list)
    passed: bool = False
    notes: list[str] = field(default_factory=list)


@dataclass
class ExportResult:
    target: ExportTarget = field(default_factory=ExportTarget)
    artifact: Artifact = field(default_factory=Artifact)
    verification: Verification | None = None


@dataclass
class ExportRequestInfo:
    """A ``CreateExport`` request (and, in an ``Export``, the request with defaults and ids filled in)."""

    adapter_artifact_id: str = ""
    adapter_path: str = ""
    base_model_path: str = ""
    base_artifact_id: str = ""
    targets: list[ExportTarget] = field(default_factory=list)
    overwrite: bool = False
    verify: VerifyOptions = field(default_factory=VerifyOptions)
    name: str = ""
    max_shard_bytes: int = 0


@dataclass
class Export:
    export_id: str = ""
    name: str = ""
    state: ExportState = ExportState.UNSPECIFIED
    request: ExportRequestInfo | None = None
    results: list[ExportResult] = field(default_factory=list)
    error: str = ""
    error_code: str = ""
    created_at: float = 0.0
    started_at: float = 0.0
    finished_at: float = 0.0
    last_seq: int = 0


@dataclass
class ExportStateChange:
    state: ExportState = ExportState.UNSPECIFIED
    message: str = ""


@dataclass
class ExportProgress:
    """A progress report: one per tensor written, plus phase boundaries."""

    target: str = ""
    phase: str = ""  # "resolve", "reference", "write", "quantize", "verify", "publish"
    item: str = ""
    items_done: int = 0
    items_total: int = 0
    bytes_written: int = 0
    bytes_total: int = 0


@dataclass
class ExportEvent:
    """One numbered event; exactly one of ``state``, ``progress``, ``result`` is set."""

    export_id: str = ""
    seq: int = 0
    time: float = 0.0
    state: ExportStateChange | None = None
    progress: ExportProgress | None = None
    result: ExportResult | None = None


@dataclass
class Capabilities:
    targets: list[str] = field(default_factory=list)
    gguf_types: list[str] = field(default_factory=list)
    gguf_lora_types: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    architectures: list[str] = field(default_factory=list)
    base_quantizations: list[str] = field(default_factory=list)
