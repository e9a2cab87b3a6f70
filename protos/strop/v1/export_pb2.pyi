from strop.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class ExportTargetKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EXPORT_TARGET_KIND_UNSPECIFIED: _ClassVar[ExportTargetKind]
    EXPORT_TARGET_KIND_MERGED_SAFETENSORS: _ClassVar[ExportTargetKind]
    EXPORT_TARGET_KIND_PEFT_ADAPTER: _ClassVar[ExportTargetKind]
    EXPORT_TARGET_KIND_GGUF: _ClassVar[ExportTargetKind]
    EXPORT_TARGET_KIND_GGUF_LORA: _ClassVar[ExportTargetKind]

class MergeBase(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MERGE_BASE_UNSPECIFIED: _ClassVar[MergeBase]
    MERGE_BASE_AS_TRAINED: _ClassVar[MergeBase]
    MERGE_BASE_ORIGINAL_16BIT: _ClassVar[MergeBase]

class ExportState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    EXPORT_STATE_UNSPECIFIED: _ClassVar[ExportState]
    EXPORT_STATE_QUEUED: _ClassVar[ExportState]
    EXPORT_STATE_RUNNING: _ClassVar[ExportState]
    EXPORT_STATE_SUCCEEDED: _ClassVar[ExportState]
    EXPORT_STATE_FAILED: _ClassVar[ExportState]
    EXPORT_STATE_CANCELLED: _ClassVar[ExportState]
    EXPORT_STATE_INTERRUPTED: _ClassVar[ExportState]
EXPORT_TARGET_KIND_UNSPECIFIED: ExportTargetKind
EXPORT_TARGET_KIND_MERGED_SAFETENSORS: ExportTargetKind
EXPORT_TARGET_KIND_PEFT_ADAPTER: ExportTargetKind
EXPORT_TARGET_KIND_GGUF: ExportTargetKind
EXPORT_TARGET_KIND_GGUF_LORA: ExportTargetKind
MERGE_BASE_UNSPECIFIED: MergeBase
MERGE_BASE_AS_TRAINED: MergeBase
MERGE_BASE_ORIGINAL_16BIT: MergeBase
EXPORT_STATE_UNSPECIFIED: ExportState
EXPORT_STATE_QUEUED: ExportState
EXPORT_STATE_RUNNING: ExportState
EXPORT_STATE_SUCCEEDED: ExportState
EXPORT_STATE_FAILED: ExportState
EXPORT_STATE_CANCELLED: ExportState
EXPORT_STATE_INTERRUPTED: ExportState

class ExportTarget(_message.Message):
    __slots__ = ("kind", "gguf_type", "dtype", "artifact_id", "base_gguf_type")
    KIND_FIELD_NUMBER: _ClassVar[int]
    GGUF_TYPE_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_ID_FIELD_NUMBER: _ClassVar[int]
    BASE_GGUF_TYPE_FIELD_NUMBER: _ClassVar[int]
    kind: ExportTargetKind
    gguf_type: str
    dtype: str
    artifact_id: str
    base_gguf_type: str
    def __init__(self, kind: _Optional[_Union[ExportTargetKind, str]] = ..., gguf_type: _Optional[str] = ..., dtype: _Optional[str] = ..., artifact_id: _Optional[str] = ..., base_gguf_type: _Optional[str] = ...) -> None: ...

class VerifyOptions(_message.Message):
    __slots__ = ("skip", "prompts", "heldout_texts", "question", "answer", "raw_question", "max_new_tokens", "accept_unverified")
    SKIP_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    HELDOUT_TEXTS_FIELD_NUMBER: _ClassVar[int]
    QUESTION_FIELD_NUMBER: _ClassVar[int]
    ANSWER_FIELD_NUMBER: _ClassVar[int]
    RAW_QUESTION_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ACCEPT_UNVERIFIED_FIELD_NUMBER: _ClassVar[int]
    skip: bool
    prompts: _containers.RepeatedScalarFieldContainer[str]
    heldout_texts: _containers.RepeatedScalarFieldContainer[str]
    question: str
    answer: str
    raw_question: bool
    max_new_tokens: int
    accept_unverified: bool
    def __init__(self, skip: _Optional[bool] = ..., prompts: _Optional[_Iterable[str]] = ..., heldout_texts: _Optional[_Iterable[str]] = ..., question: _Optional[str] = ..., answer: _Optional[str] = ..., raw_question: _Optional[bool] = ..., max_new_tokens: _Optional[int] = ..., accept_unverified: _Optional[bool] = ...) -> None: ...

class CreateExportRequest(_message.Message):
    __slots__ = ("adapter_artifact_id", "adapter_path", "base_model_path", "base_artifact_id", "targets", "overwrite", "verify", "name", "max_shard_bytes", "merge_base")
    ADAPTER_ARTIFACT_ID_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_PATH_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    BASE_ARTIFACT_ID_FIELD_NUMBER: _ClassVar[int]
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    OVERWRITE_FIELD_NUMBER: _ClassVar[int]
    VERIFY_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    MAX_SHARD_BYTES_FIELD_NUMBER: _ClassVar[int]
    MERGE_BASE_FIELD_NUMBER: _ClassVar[int]
    adapter_artifact_id: str
    adapter_path: str
    base_model_path: str
    base_artifact_id: str
    targets: _containers.RepeatedCompositeFieldContainer[ExportTarget]
    overwrite: bool
    verify: VerifyOptions
    name: str
    max_shard_bytes: int
    merge_base: MergeBase
    def __init__(self, adapter_artifact_id: _Optional[str] = ..., adapter_path: _Optional[str] = ..., base_model_path: _Optional[str] = ..., base_artifact_id: _Optional[str] = ..., targets: _Optional[_Iterable[_Union[ExportTarget, _Mapping]]] = ..., overwrite: _Optional[bool] = ..., verify: _Optional[_Union[VerifyOptions, _Mapping]] = ..., name: _Optional[str] = ..., max_shard_bytes: _Optional[int] = ..., merge_base: _Optional[_Union[MergeBase, str]] = ...) -> None: ...

class Comparison(_message.Message):
    __slots__ = ("reference", "max_abs_logit_delta", "mean_abs_logit_delta", "top1_agreement", "perplexity_reference", "perplexity_delta", "answer_top1_agreement", "max_abs_logit")
    REFERENCE_FIELD_NUMBER: _ClassVar[int]
    MAX_ABS_LOGIT_DELTA_FIELD_NUMBER: _ClassVar[int]
    MEAN_ABS_LOGIT_DELTA_FIELD_NUMBER: _ClassVar[int]
    TOP1_AGREEMENT_FIELD_NUMBER: _ClassVar[int]
    PERPLEXITY_REFERENCE_FIELD_NUMBER: _ClassVar[int]
    PERPLEXITY_DELTA_FIELD_NUMBER: _ClassVar[int]
    ANSWER_TOP1_AGREEMENT_FIELD_NUMBER: _ClassVar[int]
    MAX_ABS_LOGIT_FIELD_NUMBER: _ClassVar[int]
    reference: str
    max_abs_logit_delta: float
    mean_abs_logit_delta: float
    top1_agreement: float
    perplexity_reference: float
    perplexity_delta: float
    answer_top1_agreement: float
    max_abs_logit: float
    def __init__(self, reference: _Optional[str] = ..., max_abs_logit_delta: _Optional[float] = ..., mean_abs_logit_delta: _Optional[float] = ..., top1_agreement: _Optional[float] = ..., perplexity_reference: _Optional[float] = ..., perplexity_delta: _Optional[float] = ..., answer_top1_agreement: _Optional[float] = ..., max_abs_logit: _Optional[float] = ...) -> None: ...

class Verification(_message.Message):
    __slots__ = ("consumer", "positions", "max_abs_logit_delta", "mean_abs_logit_delta", "top1_agreement", "perplexity_reference", "perplexity", "perplexity_delta", "tokens_checked", "tokens_match", "token_mismatches", "chat_tokens_checked", "chat_tokens_match", "generated", "answer_checked", "answer_reproduced", "answer_top1_agreement", "answer_tokens", "problems", "passed", "notes", "as_trained", "accepted_unverified", "on_16bit_base")
    CONSUMER_FIELD_NUMBER: _ClassVar[int]
    POSITIONS_FIELD_NUMBER: _ClassVar[int]
    MAX_ABS_LOGIT_DELTA_FIELD_NUMBER: _ClassVar[int]
    MEAN_ABS_LOGIT_DELTA_FIELD_NUMBER: _ClassVar[int]
    TOP1_AGREEMENT_FIELD_NUMBER: _ClassVar[int]
    PERPLEXITY_REFERENCE_FIELD_NUMBER: _ClassVar[int]
    PERPLEXITY_FIELD_NUMBER: _ClassVar[int]
    PERPLEXITY_DELTA_FIELD_NUMBER: _ClassVar[int]
    TOKENS_CHECKED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_MATCH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_MISMATCHES_FIELD_NUMBER: _ClassVar[int]
    CHAT_TOKENS_CHECKED_FIELD_NUMBER: _ClassVar[int]
    CHAT_TOKENS_MATCH_FIELD_NUMBER: _ClassVar[int]
    GENERATED_FIELD_NUMBER: _ClassVar[int]
    ANSWER_CHECKED_FIELD_NUMBER: _ClassVar[int]
    ANSWER_REPRODUCED_FIELD_NUMBER: _ClassVar[int]
    ANSWER_TOP1_AGREEMENT_FIELD_NUMBER: _ClassVar[int]
    ANSWER_TOKENS_FIELD_NUMBER: _ClassVar[int]
    PROBLEMS_FIELD_NUMBER: _ClassVar[int]
    PASSED_FIELD_NUMBER: _ClassVar[int]
    NOTES_FIELD_NUMBER: _ClassVar[int]
    AS_TRAINED_FIELD_NUMBER: _ClassVar[int]
    ACCEPTED_UNVERIFIED_FIELD_NUMBER: _ClassVar[int]
    ON_16BIT_BASE_FIELD_NUMBER: _ClassVar[int]
    consumer: str
    positions: int
    max_abs_logit_delta: float
    mean_abs_logit_delta: float
    top1_agreement: float
    perplexity_reference: float
    perplexity: float
    perplexity_delta: float
    tokens_checked: bool
    tokens_match: bool
    token_mismatches: _containers.RepeatedScalarFieldContainer[str]
    chat_tokens_checked: bool
    chat_tokens_match: bool
    generated: str
    answer_checked: bool
    answer_reproduced: bool
    answer_top1_agreement: float
    answer_tokens: int
    problems: _containers.RepeatedScalarFieldContainer[str]
    passed: bool
    notes: _containers.RepeatedScalarFieldContainer[str]
    as_trained: Comparison
    accepted_unverified: bool
    on_16bit_base: Comparison
    def __init__(self, consumer: _Optional[str] = ..., positions: _Optional[int] = ..., max_abs_logit_delta: _Optional[float] = ..., mean_abs_logit_delta: _Optional[float] = ..., top1_agreement: _Optional[float] = ..., perplexity_reference: _Optional[float] = ..., perplexity: _Optional[float] = ..., perplexity_delta: _Optional[float] = ..., tokens_checked: _Optional[bool] = ..., tokens_match: _Optional[bool] = ..., token_mismatches: _Optional[_Iterable[str]] = ..., chat_tokens_checked: _Optional[bool] = ..., chat_tokens_match: _Optional[bool] = ..., generated: _Optional[str] = ..., answer_checked: _Optional[bool] = ..., answer_reproduced: _Optional[bool] = ..., answer_top1_agreement: _Optional[float] = ..., answer_tokens: _Optional[int] = ..., problems: _Optional[_Iterable[str]] = ..., passed: _Optional[bool] = ..., notes: _Optional[_Iterable[str]] = ..., as_trained: _Optional[_Union[Comparison, _Mapping]] = ..., accepted_unverified: _Optional[bool] = ..., on_16bit_base: _Optional[_Union[Comparison, _Mapping]] = ...) -> None: ...

class TensorTypeCount(_message.Message):
    __slots__ = ("type", "count")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    type: str
    count: int
    def __init__(self, type: _Optional[str] = ..., count: _Optional[int] = ...) -> None: ...

class QuantFallback(_message.Message):
    __slots__ = ("wanted", "written", "count", "reason", "tensors")
    WANTED_FIELD_NUMBER: _ClassVar[int]
    WRITTEN_FIELD_NUMBER: _ClassVar[int]
    COUNT_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    TENSORS_FIELD_NUMBER: _ClassVar[int]
    wanted: str
    written: str
    count: int
    reason: str
    tensors: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, wanted: _Optional[str] = ..., written: _Optional[str] = ..., count: _Optional[int] = ..., reason: _Optional[str] = ..., tensors: _Optional[_Iterable[str]] = ...) -> None: ...

class QuantizationReport(_message.Message):
    __slots__ = ("role", "file", "requested", "tensor_types", "fallbacks", "summary")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    REQUESTED_FIELD_NUMBER: _ClassVar[int]
    TENSOR_TYPES_FIELD_NUMBER: _ClassVar[int]
    FALLBACKS_FIELD_NUMBER: _ClassVar[int]
    SUMMARY_FIELD_NUMBER: _ClassVar[int]
    role: str
    file: str
    requested: str
    tensor_types: _containers.RepeatedCompositeFieldContainer[TensorTypeCount]
    fallbacks: _containers.RepeatedCompositeFieldContainer[QuantFallback]
    summary: str
    def __init__(self, role: _Optional[str] = ..., file: _Optional[str] = ..., requested: _Optional[str] = ..., tensor_types: _Optional[_Iterable[_Union[TensorTypeCount, _Mapping]]] = ..., fallbacks: _Optional[_Iterable[_Union[QuantFallback, _Mapping]]] = ..., summary: _Optional[str] = ...) -> None: ...

class ExportResult(_message.Message):
    __slots__ = ("target", "artifact", "verification", "quantization")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_FIELD_NUMBER: _ClassVar[int]
    VERIFICATION_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    target: ExportTarget
    artifact: _common_pb2.Artifact
    verification: Verification
    quantization: _containers.RepeatedCompositeFieldContainer[QuantizationReport]
    def __init__(self, target: _Optional[_Union[ExportTarget, _Mapping]] = ..., artifact: _Optional[_Union[_common_pb2.Artifact, _Mapping]] = ..., verification: _Optional[_Union[Verification, _Mapping]] = ..., quantization: _Optional[_Iterable[_Union[QuantizationReport, _Mapping]]] = ...) -> None: ...

class Export(_message.Message):
    __slots__ = ("export_id", "name", "state", "request", "results", "error", "error_code", "created_at", "started_at", "finished_at", "last_seq", "tenant")
    EXPORT_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    export_id: str
    name: str
    state: ExportState
    request: CreateExportRequest
    results: _containers.RepeatedCompositeFieldContainer[ExportResult]
    error: str
    error_code: str
    created_at: float
    started_at: float
    finished_at: float
    last_seq: int
    tenant: str
    def __init__(self, export_id: _Optional[str] = ..., name: _Optional[str] = ..., state: _Optional[_Union[ExportState, str]] = ..., request: _Optional[_Union[CreateExportRequest, _Mapping]] = ..., results: _Optional[_Iterable[_Union[ExportResult, _Mapping]]] = ..., error: _Optional[str] = ..., error_code: _Optional[str] = ..., created_at: _Optional[float] = ..., started_at: _Optional[float] = ..., finished_at: _Optional[float] = ..., last_seq: _Optional[int] = ..., tenant: _Optional[str] = ...) -> None: ...

class ExportStateChange(_message.Message):
    __slots__ = ("state", "message")
    STATE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    state: ExportState
    message: str
    def __init__(self, state: _Optional[_Union[ExportState, str]] = ..., message: _Optional[str] = ...) -> None: ...

class ExportProgress(_message.Message):
    __slots__ = ("target", "phase", "item", "items_done", "items_total", "bytes_written", "bytes_total")
    TARGET_FIELD_NUMBER: _ClassVar[int]
    PHASE_FIELD_NUMBER: _ClassVar[int]
    ITEM_FIELD_NUMBER: _ClassVar[int]
    ITEMS_DONE_FIELD_NUMBER: _ClassVar[int]
    ITEMS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    BYTES_WRITTEN_FIELD_NUMBER: _ClassVar[int]
    BYTES_TOTAL_FIELD_NUMBER: _ClassVar[int]
    target: str
    phase: str
    item: str
    items_done: int
    items_total: int
    bytes_written: int
    bytes_total: int
    def __init__(self, target: _Optional[str] = ..., phase: _Optional[str] = ..., item: _Optional[str] = ..., items_done: _Optional[int] = ..., items_total: _Optional[int] = ..., bytes_written: _Optional[int] = ..., bytes_total: _Optional[int] = ...) -> None: ...

class ExportEvent(_message.Message):
    __slots__ = ("export_id", "seq", "time", "state", "progress", "result")
    EXPORT_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    RESULT_FIELD_NUMBER: _ClassVar[int]
    export_id: str
    seq: int
    time: float
    state: ExportStateChange
    progress: ExportProgress
    result: ExportResult
    def __init__(self, export_id: _Optional[str] = ..., seq: _Optional[int] = ..., time: _Optional[float] = ..., state: _Optional[_Union[ExportStateChange, _Mapping]] = ..., progress: _Optional[_Union[ExportProgress, _Mapping]] = ..., result: _Optional[_Union[ExportResult, _Mapping]] = ...) -> None: ...

class WatchExportRequest(_message.Message):
    __slots__ = ("export_id", "after_seq")
    EXPORT_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    export_id: str
    after_seq: int
    def __init__(self, export_id: _Optional[str] = ..., after_seq: _Optional[int] = ...) -> None: ...

class GetExportRequest(_message.Message):
    __slots__ = ("export_id",)
    EXPORT_ID_FIELD_NUMBER: _ClassVar[int]
    export_id: str
    def __init__(self, export_id: _Optional[str] = ...) -> None: ...

class ListExportsRequest(_message.Message):
    __slots__ = ("states", "limit")
    STATES_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    states: _containers.RepeatedScalarFieldContainer[ExportState]
    limit: int
    def __init__(self, states: _Optional[_Iterable[_Union[ExportState, str]]] = ..., limit: _Optional[int] = ...) -> None: ...

class ListExportsResponse(_message.Message):
    __slots__ = ("exports",)
    EXPORTS_FIELD_NUMBER: _ClassVar[int]
    exports: _containers.RepeatedCompositeFieldContainer[Export]
    def __init__(self, exports: _Optional[_Iterable[_Union[Export, _Mapping]]] = ...) -> None: ...

class CancelExportRequest(_message.Message):
    __slots__ = ("export_id",)
    EXPORT_ID_FIELD_NUMBER: _ClassVar[int]
    export_id: str
    def __init__(self, export_id: _Optional[str] = ...) -> None: ...

class GetCapabilitiesRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class Capabilities(_message.Message):
    __slots__ = ("targets", "gguf_types", "gguf_lora_types", "dtypes", "architectures", "base_quantizations")
    TARGETS_FIELD_NUMBER: _ClassVar[int]
    GGUF_TYPES_FIELD_NUMBER: _ClassVar[int]
    GGUF_LORA_TYPES_FIELD_NUMBER: _ClassVar[int]
    DTYPES_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURES_FIELD_NUMBER: _ClassVar[int]
    BASE_QUANTIZATIONS_FIELD_NUMBER: _ClassVar[int]
    targets: _containers.RepeatedScalarFieldContainer[str]
    gguf_types: _containers.RepeatedScalarFieldContainer[str]
    gguf_lora_types: _containers.RepeatedScalarFieldContainer[str]
    dtypes: _containers.RepeatedScalarFieldContainer[str]
    architectures: _containers.RepeatedScalarFieldContainer[str]
    base_quantizations: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, targets: _Optional[_Iterable[str]] = ..., gguf_types: _Optional[_Iterable[str]] = ..., gguf_lora_types: _Optional[_Iterable[str]] = ..., dtypes: _Optional[_Iterable[str]] = ..., architectures: _Optional[_Iterable[str]] = ..., base_quantizations: _Optional[_Iterable[str]] = ...) -> None: ...

class UploadArtifactHeader(_message.Message):
    __slots__ = ("artifact_id", "kind", "metadata", "overwrite")
    class MetadataEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: str
        def __init__(self, key: _Optional[str] = ..., value: _Optional[str] = ...) -> None: ...
    ARTIFACT_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    METADATA_FIELD_NUMBER: _ClassVar[int]
    OVERWRITE_FIELD_NUMBER: _ClassVar[int]
    artifact_id: str
    kind: str
    metadata: _containers.ScalarMap[str, str]
    overwrite: bool
    def __init__(self, artifact_id: _Optional[str] = ..., kind: _Optional[str] = ..., metadata: _Optional[_Mapping[str, str]] = ..., overwrite: _Optional[bool] = ...) -> None: ...

class UploadArtifactRequest(_message.Message):
    __slots__ = ("header", "chunk")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    header: UploadArtifactHeader
    chunk: _common_pb2.FileChunk
    def __init__(self, header: _Optional[_Union[UploadArtifactHeader, _Mapping]] = ..., chunk: _Optional[_Union[_common_pb2.FileChunk, _Mapping]] = ...) -> None: ...
