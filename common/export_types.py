"""The export API's dataclasses: the one request, target and result type from the SDK to the export worker.

Torch-free and grpc-free. The SDK builds and returns them; the gRPC layer converts them to and from
protobuf by field name (``strop.common.serde``); the export core takes them as they come, fills the
defaults (:func:`strop.export_svc.core.resolve.validate`) and returns them; the export service's state
database stores them with ``serde.to_dict``. No layer has its own copy.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from strop.common.trainer_types import Artifact, JobState

# Defaults of the GGUF targets, read by the SDK's constructors and by the core's validation alike.
DEFAULT_GGUF_TYPE = "F16"  # a merged GGUF model
DEFAULT_GGUF_LORA_TYPE = "F32"  # the tensors of a GGUF LoRA adapter
DEFAULT_GGUF_LORA_BASE_TYPE = "F16"  # the base GGUF written beside a GGUF LoRA adapter


class ExportTargetKind(enum.StrEnum):
    """What an export writes; :attr:`artifact_kind` names the artifact each kind publishes."""

    UNSPECIFIED = "UNSPECIFIED"
    MERGED_SAFETENSORS = "MERGED_SAFETENSORS"  # vLLM/transformers-ready merged directory
    PEFT_ADAPTER = "PEFT_ADAPTER"  # adapter dir for vLLM --enable-lora
    GGUF = "GGUF"  # merged GGUF model (F32/F16/BF16/Q8_0 or a llama.cpp quantizer type)
    GGUF_LORA = "GGUF_LORA"  # GGUF LoRA adapter + the GGUF of its (unmerged) base

    @property
    def artifact_kind(self) -> str:
        """The artifact kind this target publishes: ``merged_safetensors``, ``peft_adapter``, ``gguf``,
        ``gguf_lora`` (stored artifacts carry these names)."""
        return self.value.lower()

    @classmethod
    def known(cls) -> tuple[ExportTargetKind, ...]:
        """Every kind an export can ask for (all but UNSPECIFIED)."""
        return tuple(k for k in cls if k is not cls.UNSPECIFIED)


# An export runs through the same states, with the same guarded transitions, as a training job.
ExportState = JobState


class MergeBase(enum.StrEnum):
    """Which base weights an adapter is merged into (and the GGUF base of a GGUF LoRA is written from).

    ``AS_TRAINED`` (the default, :data:`DEFAULT_MERGE_BASE`): the weights the adapter was trained
    against. For a base the trainer quantized to NF4 on load, that is its NF4 weights re-created
    bit for bit from the 16-bit checkpoint with the settings the adapter's artifact records, and
    dequantized to fp32 (never re-quantized); for a prequantized 4-bit base its dequantized weights;
    for a 16-bit session the weights as stored. ``ORIGINAL_16BIT``: the 16-bit weights as stored,
    even when the adapter was trained on their NF4 quantization (the result's metadata says so and
    its verification shows how far that is from the model as trained).
    """

    UNSPECIFIED = "UNSPECIFIED"
    AS_TRAINED = "AS_TRAINED"
    ORIGINAL_16BIT = "ORIGINAL_16BIT"


DEFAULT_MERGE_BASE = MergeBase.AS_TRAINED


@dataclass
class ExportTarget:
    """One output of an export. Use the constructors: ``merged()``, ``peft()``, ``gguf()``, ``gguf_lora()``.

    Empty strings take the defaults: ``dtype`` the base's, ``gguf_type`` :data:`DEFAULT_GGUF_TYPE` (GGUF)
    or :data:`DEFAULT_GGUF_LORA_TYPE` (GGUF_LORA), ``base_gguf_type`` :data:`DEFAULT_GGUF_LORA_BASE_TYPE`,
    ``artifact_id`` a generated one. The export service fills them in before it accepts the export.
    """

    kind: ExportTargetKind = ExportTargetKind.UNSPECIFIED
    gguf_type: str = ""  # GGUF: F32 F16 BF16 Q8_0 Q4_K_M ...; GGUF_LORA: the adapter's tensors, F32/F16/BF16
    dtype: str = ""  # MERGED_SAFETENSORS: bfloat16 / float16 / float32
    artifact_id: str = ""
    base_gguf_type: str = ""  # GGUF_LORA: the type of the base GGUF written beside the adapter

    @classmethod
    def merged(cls, dtype: str = "", artifact_id: str = "") -> ExportTarget:
        """A merged safetensors directory vLLM and transformers load (dtype default: the base's)."""
        return cls(ExportTargetKind.MERGED_SAFETENSORS, dtype=dtype, artifact_id=artifact_id)

    @classmethod
    def peft(cls, artifact_id: str = "") -> ExportTarget:
        """A PEFT adapter directory vLLM's ``--enable-lora`` accepts."""
        return cls(ExportTargetKind.PEFT_ADAPTER, artifact_id=artifact_id)

    @classmethod
    def gguf(cls, gguf_type: str = DEFAULT_GGUF_TYPE, artifact_id: str = "") -> ExportTarget:
        """A merged GGUF model: F32, F16, BF16, Q8_0 or a llama.cpp quantizer type (Q4_K_M, Q6_K, ...)."""
        return cls(ExportTargetKind.GGUF, gguf_type=gguf_type, artifact_id=artifact_id)

    @classmethod
    def gguf_lora(
        cls,
        lora_type: str = DEFAULT_GGUF_LORA_TYPE,
        base_gguf_type: str = DEFAULT_GGUF_LORA_BASE_TYPE,
        artifact_id: str = "",
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
            return cls.gguf(*(parts[:1]))
        if kind == "gguf-lora":
            return cls.gguf_lora(*(parts[:2]))
        raise ValueError(
            f"unknown target {spec!r}: use merged[:dtype], peft, gguf[:TYPE], gguf-lora[:TYPE[:BASE]]"
        )

    @property
    def label(self) -> str:
        """How progress events, logs and result tables name the target: ``merged_safetensors:bfloat16``,
        ``peft_adapter``, ``gguf:Q4_K_M``, ``gguf_lora:F32+base:F16``."""
        kind = self.kind.artifact_kind
        if self.kind is ExportTargetKind.GGUF_LORA:
            return f"{kind}:{self.gguf_type}+base:{self.base_gguf_type}"
        detail = {ExportTargetKind.GGUF: self.gguf_type, ExportTargetKind.MERGED_SAFETENSORS: self.dtype}
        return f"{kind}:{detail[self.kind]}" if detail.get(self.kind) else kind


@dataclass
class VerifyOptions:
    """How an export is verified. A question/answer the adapter was trained on makes the strongest check.

    Empty ``prompts``/``heldout_texts`` mean the built-in prompt set and held-out text.
    """

    skip: bool = False  # no consumer verification (the structural checks still run)
    prompts: list[str] = field(default_factory=list)
    heldout_texts: list[str] = field(default_factory=list)  # perplexity text
    question: str = ""
    answer: str = ""
    raw_question: bool = False  # do not wrap the question in the tokenizer's chat template
    max_new_tokens: int = 0  # 0: the answer's length + 8
    # publish targets whose verification fails (each one's verification then says ``accepted_unverified``); by default a
    # target that fails verification fails the export and nothing is published
    accept_unverified: bool = False

    @property
    def has_probe(self) -> bool:
        """Both a question and its answer are given (greedy generation and teacher-forced agreement run)."""
        return bool(self.question and self.answer)


@dataclass
class Comparison:
    """One output's logits against a second reference: the model as trained (the session's base as
    loaded, NF4-dequantized for a quantized session, with the adapter unmerged, run by PEFT in fp32)."""

    reference: str = ""  # what the reference is, in words
    max_abs_logit_delta: float = 0.0
    mean_abs_logit_delta: float = 0.0
    top1_agreement: float = 0.0
    perplexity_reference: float = 0.0  # the as-trained model's perplexity on the held-out text
    perplexity_delta: float = 0.0  # output - as trained
    answer_top1_agreement: float | None = None  # None: no probe question/answer was given
    max_abs_logit: float = 0.0  # the as-trained model's largest |logit| on the prompts: the deltas' scale


@dataclass
class Verification:
    """One output's figures against the merged fp32 model (and, in ``as_trained``, against the model as
    trained). A check that did not run leaves its figures None ("not checked"), never False; each
    ``*_checked`` flag says the same in one bit."""

    consumer: str = ""  # "transformers", "transformers+peft", "llama.cpp", "llama.cpp+lora"
    positions: int = 0
    max_abs_logit_delta: float = 0.0
    mean_abs_logit_delta: float = 0.0
    top1_agreement: float = 0.0
    perplexity_reference: float = 0.0
    perplexity: float = 0.0
    perplexity_delta: float = 0.0
    tokens_checked: bool = False  # GGUF: llama.cpp's tokenizer compared with HF's
    tokens_match: bool | None = None  # None: not checked (merged/PEFT outputs use HF's own tokenizer)
    token_mismatches: list[str] = field(default_factory=list)
    chat_tokens_checked: bool = False
    chat_tokens_match: bool | None = None  # None: not checked
    generated: str = ""
    answer_checked: bool = False
    answer_reproduced: bool | None = None  # None: no probe question/answer was given
    answer_top1_agreement: float | None = None  # None: no probe question/answer was given
    answer_tokens: int = 0
    problems: list[str] = field(default_factory=list)  # why it did not pass: never empty when passed is False
    passed: bool = False
    # published although it did not pass, because the request set ``VerifyOptions.accept_unverified``
    accepted_unverified: bool = False
    notes: list[str] = field(default_factory=list)
    as_trained: Comparison | None = None  # None: the as-trained reference could not be built
    # PEFT dirs of an adapter trained on an NF4-on-load base: the same dir served on the 16-bit base as stored (how
    # vLLM --enable-lora and PeftModel on the checkpoint serve it) against the model as trained; None otherwise
    on_16bit_base: Comparison | None = None


@dataclass
class TensorTypeCount:
    """How many tensors of one GGML type a GGUF file holds (read back from the written file)."""

    type: str = ""  # "Q4_K", "Q5_0", "F32", ...
    count: int = 0


@dataclass
class QuantFallback:
    """Tensors written in another type than the one the file type asks of them, and why."""

    wanted: str = ""  # the type the file type asks for ("Q4_K", "Q6_K", "Q8_0")
    written: str = ""  # what was written instead ("Q5_0", "Q8_0", "F16")
    count: int = 0
    reason: str = ""
    tensors: list[str] = field(default_factory=list)


@dataclass
class QuantizationReport:
    """The tensor types a GGUF file actually holds (``gguf.GGUFReader`` on the written file), with counts,
    and every fallback with its reason. ``role``: "model", or "base"/"lora" for a GGUF LoRA target."""

    role: str = ""
    file: str = ""
    requested: str = ""  # the GGUF type asked for (Q4_K_M, F16, ...)
    tensor_types: list[TensorTypeCount] = field(default_factory=list)
    fallbacks: list[QuantFallback] = field(default_factory=list)
    summary: str = ""


@dataclass
class ExportResult:
    """One published artifact of an export, with its verification (None when verification was skipped)
    and, for GGUF targets, the quantization report of each file it wrote."""

    target: ExportTarget = field(default_factory=ExportTarget)
    artifact: Artifact = field(default_factory=Artifact)
    verification: Verification | None = None
    quantization: list[QuantizationReport] = field(default_factory=list)  # one per GGUF file written


@dataclass
class ExportRequest:
    """What to export (the ``CreateExport`` request): an adapter onto a base, to one or more targets.

    The adapter is an artifact id or a path (under the model root or the artifact root); the base a path
    under the model root, an artifact id, or, when neither is given, the base the adapter records. In an
    ``Export`` the request comes back with its defaults and artifact ids filled in.
    """

    adapter_artifact_id: str = ""
    adapter_path: str = ""
    base_model_path: str = ""
    base_artifact_id: str = ""
    targets: list[ExportTarget] = field(default_factory=list)
    overwrite: bool = False  # ignored: published artifacts are immutable (DeleteArtifact frees an id)
    verify: VerifyOptions = field(default_factory=VerifyOptions)
    name: str = ""  # also names the GGUF files
    max_shard_bytes: int = 0  # merged safetensors shards; 0: 5 GB
    merge_base: MergeBase = MergeBase.UNSPECIFIED  # UNSPECIFIED: DEFAULT_MERGE_BASE (AS_TRAINED)


@dataclass
class Export:
    export_id: str = ""
    name: str = ""
    state: ExportState = ExportState.UNSPECIFIED
    request: ExportRequest | None = None
    results: list[ExportResult] = field(default_factory=list)
    error: str = ""
    error_code: str = ""
    created_at: float = 0.0
    started_at: float = 0.0
    finished_at: float = 0.0
    last_seq: int = 0
    tenant: str = ""  # who created it (empty with authentication off); other tenants get NOT_FOUND


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
