from strop.v1 import common_pb2 as _common_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Quantization(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    QUANTIZATION_UNSPECIFIED: _ClassVar[Quantization]
    QUANTIZATION_NF4: _ClassVar[Quantization]
    QUANTIZATION_NONE: _ClassVar[Quantization]

class KernelMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KERNEL_MODE_UNSPECIFIED: _ClassVar[KernelMode]
    KERNEL_MODE_ON: _ClassVar[KernelMode]
    KERNEL_MODE_OFF: _ClassVar[KernelMode]
    KERNEL_MODE_ON_FP8: _ClassVar[KernelMode]
    KERNEL_MODE_ON_FP8_DX: _ClassVar[KernelMode]

class SessionState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    SESSION_STATE_UNSPECIFIED: _ClassVar[SessionState]
    SESSION_STATE_LOADED: _ClassVar[SessionState]
    SESSION_STATE_READY: _ClassVar[SessionState]
    SESSION_STATE_CLOSED: _ClassVar[SessionState]
    SESSION_STATE_LOST: _ClassVar[SessionState]

class DatasetFormat(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DATASET_FORMAT_UNSPECIFIED: _ClassVar[DatasetFormat]
    DATASET_FORMAT_TEXT: _ClassVar[DatasetFormat]
    DATASET_FORMAT_MESSAGES: _ClassVar[DatasetFormat]
    DATASET_FORMAT_PROMPT_COMPLETION: _ClassVar[DatasetFormat]
    DATASET_FORMAT_PREFERENCE: _ClassVar[DatasetFormat]
    DATASET_FORMAT_TOKENS: _ClassVar[DatasetFormat]
    DATASET_FORMAT_UNPAIRED_PREFERENCE: _ClassVar[DatasetFormat]
    DATASET_FORMAT_PROMPTS: _ClassVar[DatasetFormat]

class MemoryMode(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    MEMORY_MODE_UNSPECIFIED: _ClassVar[MemoryMode]
    MEMORY_MODE_STANDARD: _ClassVar[MemoryMode]
    MEMORY_MODE_LONG_CONTEXT: _ClassVar[MemoryMode]
    MEMORY_MODE_MAX_SPEED: _ClassVar[MemoryMode]

class Parallelism(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PARALLELISM_UNSPECIFIED: _ClassVar[Parallelism]
    PARALLELISM_DDP: _ClassVar[Parallelism]
    PARALLELISM_FSDP: _ClassVar[Parallelism]

class TrainMethod(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    TRAIN_METHOD_UNSPECIFIED: _ClassVar[TrainMethod]
    TRAIN_METHOD_SFT: _ClassVar[TrainMethod]
    TRAIN_METHOD_DPO: _ClassVar[TrainMethod]
    TRAIN_METHOD_ORPO: _ClassVar[TrainMethod]
    TRAIN_METHOD_KTO: _ClassVar[TrainMethod]
    TRAIN_METHOD_SIMPO: _ClassVar[TrainMethod]
    TRAIN_METHOD_GRPO: _ClassVar[TrainMethod]

class Retention(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    RETENTION_UNSPECIFIED: _ClassVar[Retention]
    RETENTION_NONE: _ClassVar[Retention]
    RETENTION_REPLAY: _ClassVar[Retention]
    RETENTION_KL: _ClassVar[Retention]

class JobState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    JOB_STATE_UNSPECIFIED: _ClassVar[JobState]
    JOB_STATE_QUEUED: _ClassVar[JobState]
    JOB_STATE_RUNNING: _ClassVar[JobState]
    JOB_STATE_SUCCEEDED: _ClassVar[JobState]
    JOB_STATE_FAILED: _ClassVar[JobState]
    JOB_STATE_CANCELLED: _ClassVar[JobState]
    JOB_STATE_INTERRUPTED: _ClassVar[JobState]

class GrpoLoss(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    GRPO_LOSS_UNSPECIFIED: _ClassVar[GrpoLoss]
    GRPO_LOSS_GRPO: _ClassVar[GrpoLoss]
    GRPO_LOSS_DR_GRPO: _ClassVar[GrpoLoss]
    GRPO_LOSS_DAPO: _ClassVar[GrpoLoss]

class LossFn(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    LOSS_FN_UNSPECIFIED: _ClassVar[LossFn]
    LOSS_FN_CROSS_ENTROPY: _ClassVar[LossFn]
    LOSS_FN_IMPORTANCE_SAMPLING: _ClassVar[LossFn]
    LOSS_FN_PPO: _ClassVar[LossFn]
    LOSS_FN_CISPO: _ClassVar[LossFn]
    LOSS_FN_DRO: _ClassVar[LossFn]

class PrimitiveKind(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    PRIMITIVE_KIND_UNSPECIFIED: _ClassVar[PrimitiveKind]
    PRIMITIVE_KIND_FORWARD_BACKWARD: _ClassVar[PrimitiveKind]
    PRIMITIVE_KIND_FORWARD: _ClassVar[PrimitiveKind]
    PRIMITIVE_KIND_OPTIM_STEP: _ClassVar[PrimitiveKind]
    PRIMITIVE_KIND_SAMPLE: _ClassVar[PrimitiveKind]
    PRIMITIVE_KIND_SAVE_WEIGHTS: _ClassVar[PrimitiveKind]
    PRIMITIVE_KIND_SAVE_STATE: _ClassVar[PrimitiveKind]
    PRIMITIVE_KIND_LOAD_STATE: _ClassVar[PrimitiveKind]
    PRIMITIVE_KIND_SAVE_WEIGHTS_FOR_SAMPLER: _ClassVar[PrimitiveKind]

class FutureState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FUTURE_STATE_UNSPECIFIED: _ClassVar[FutureState]
    FUTURE_STATE_PENDING: _ClassVar[FutureState]
    FUTURE_STATE_RUNNING: _ClassVar[FutureState]
    FUTURE_STATE_SUCCEEDED: _ClassVar[FutureState]
    FUTURE_STATE_FAILED: _ClassVar[FutureState]
    FUTURE_STATE_CANCELLED: _ClassVar[FutureState]
QUANTIZATION_UNSPECIFIED: Quantization
QUANTIZATION_NF4: Quantization
QUANTIZATION_NONE: Quantization
KERNEL_MODE_UNSPECIFIED: KernelMode
KERNEL_MODE_ON: KernelMode
KERNEL_MODE_OFF: KernelMode
KERNEL_MODE_ON_FP8: KernelMode
KERNEL_MODE_ON_FP8_DX: KernelMode
SESSION_STATE_UNSPECIFIED: SessionState
SESSION_STATE_LOADED: SessionState
SESSION_STATE_READY: SessionState
SESSION_STATE_CLOSED: SessionState
SESSION_STATE_LOST: SessionState
DATASET_FORMAT_UNSPECIFIED: DatasetFormat
DATASET_FORMAT_TEXT: DatasetFormat
DATASET_FORMAT_MESSAGES: DatasetFormat
DATASET_FORMAT_PROMPT_COMPLETION: DatasetFormat
DATASET_FORMAT_PREFERENCE: DatasetFormat
DATASET_FORMAT_TOKENS: DatasetFormat
DATASET_FORMAT_UNPAIRED_PREFERENCE: DatasetFormat
DATASET_FORMAT_PROMPTS: DatasetFormat
MEMORY_MODE_UNSPECIFIED: MemoryMode
MEMORY_MODE_STANDARD: MemoryMode
MEMORY_MODE_LONG_CONTEXT: MemoryMode
MEMORY_MODE_MAX_SPEED: MemoryMode
PARALLELISM_UNSPECIFIED: Parallelism
PARALLELISM_DDP: Parallelism
PARALLELISM_FSDP: Parallelism
TRAIN_METHOD_UNSPECIFIED: TrainMethod
TRAIN_METHOD_SFT: TrainMethod
TRAIN_METHOD_DPO: TrainMethod
TRAIN_METHOD_ORPO: TrainMethod
TRAIN_METHOD_KTO: TrainMethod
TRAIN_METHOD_SIMPO: TrainMethod
TRAIN_METHOD_GRPO: TrainMethod
RETENTION_UNSPECIFIED: Retention
RETENTION_NONE: Retention
RETENTION_REPLAY: Retention
RETENTION_KL: Retention
JOB_STATE_UNSPECIFIED: JobState
JOB_STATE_QUEUED: JobState
JOB_STATE_RUNNING: JobState
JOB_STATE_SUCCEEDED: JobState
JOB_STATE_FAILED: JobState
JOB_STATE_CANCELLED: JobState
JOB_STATE_INTERRUPTED: JobState
GRPO_LOSS_UNSPECIFIED: GrpoLoss
GRPO_LOSS_GRPO: GrpoLoss
GRPO_LOSS_DR_GRPO: GrpoLoss
GRPO_LOSS_DAPO: GrpoLoss
LOSS_FN_UNSPECIFIED: LossFn
LOSS_FN_CROSS_ENTROPY: LossFn
LOSS_FN_IMPORTANCE_SAMPLING: LossFn
LOSS_FN_PPO: LossFn
LOSS_FN_CISPO: LossFn
LOSS_FN_DRO: LossFn
PRIMITIVE_KIND_UNSPECIFIED: PrimitiveKind
PRIMITIVE_KIND_FORWARD_BACKWARD: PrimitiveKind
PRIMITIVE_KIND_FORWARD: PrimitiveKind
PRIMITIVE_KIND_OPTIM_STEP: PrimitiveKind
PRIMITIVE_KIND_SAMPLE: PrimitiveKind
PRIMITIVE_KIND_SAVE_WEIGHTS: PrimitiveKind
PRIMITIVE_KIND_SAVE_STATE: PrimitiveKind
PRIMITIVE_KIND_LOAD_STATE: PrimitiveKind
PRIMITIVE_KIND_SAVE_WEIGHTS_FOR_SAMPLER: PrimitiveKind
FUTURE_STATE_UNSPECIFIED: FutureState
FUTURE_STATE_PENDING: FutureState
FUTURE_STATE_RUNNING: FutureState
FUTURE_STATE_SUCCEEDED: FutureState
FUTURE_STATE_FAILED: FutureState
FUTURE_STATE_CANCELLED: FutureState

class LoadModelRequest(_message.Message):
    __slots__ = ("model_path", "quantization", "dtype", "max_seq_length", "kernels", "name", "shared")
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LENGTH_FIELD_NUMBER: _ClassVar[int]
    KERNELS_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    model_path: str
    quantization: Quantization
    dtype: str
    max_seq_length: int
    kernels: KernelMode
    name: str
    shared: bool
    def __init__(self, model_path: _Optional[str] = ..., quantization: _Optional[_Union[Quantization, str]] = ..., dtype: _Optional[str] = ..., max_seq_length: _Optional[int] = ..., kernels: _Optional[_Union[KernelMode, str]] = ..., name: _Optional[str] = ..., shared: _Optional[bool] = ...) -> None: ...

class ModelFacts(_message.Message):
    __slots__ = ("model_path", "architecture", "model_type", "num_parameters", "num_trainable_parameters", "quantization", "compute_dtype", "device", "device_memory_bytes", "kernels_enabled", "kernels_reason", "max_seq_length", "vocab_size", "hidden_size", "num_layers", "has_chat_template")
    MODEL_PATH_FIELD_NUMBER: _ClassVar[int]
    ARCHITECTURE_FIELD_NUMBER: _ClassVar[int]
    MODEL_TYPE_FIELD_NUMBER: _ClassVar[int]
    NUM_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    NUM_TRAINABLE_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    QUANTIZATION_FIELD_NUMBER: _ClassVar[int]
    COMPUTE_DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    KERNELS_ENABLED_FIELD_NUMBER: _ClassVar[int]
    KERNELS_REASON_FIELD_NUMBER: _ClassVar[int]
    MAX_SEQ_LENGTH_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    HIDDEN_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    model_path: str
    architecture: str
    model_type: str
    num_parameters: int
    num_trainable_parameters: int
    quantization: str
    compute_dtype: str
    device: str
    device_memory_bytes: int
    kernels_enabled: bool
    kernels_reason: str
    max_seq_length: int
    vocab_size: int
    hidden_size: int
    num_layers: int
    has_chat_template: bool
    def __init__(self, model_path: _Optional[str] = ..., architecture: _Optional[str] = ..., model_type: _Optional[str] = ..., num_parameters: _Optional[int] = ..., num_trainable_parameters: _Optional[int] = ..., quantization: _Optional[str] = ..., compute_dtype: _Optional[str] = ..., device: _Optional[str] = ..., device_memory_bytes: _Optional[int] = ..., kernels_enabled: _Optional[bool] = ..., kernels_reason: _Optional[str] = ..., max_seq_length: _Optional[int] = ..., vocab_size: _Optional[int] = ..., hidden_size: _Optional[int] = ..., num_layers: _Optional[int] = ..., has_chat_template: _Optional[bool] = ...) -> None: ...

class Session(_message.Message):
    __slots__ = ("session_id", "name", "state", "facts", "lora", "created_at", "busy_job_id", "tenant", "instance_id", "gguf_pre_tokenizer", "gguf_pre_tokenizer_note", "shared")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    FACTS_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    BUSY_JOB_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    GGUF_PRE_TOKENIZER_FIELD_NUMBER: _ClassVar[int]
    GGUF_PRE_TOKENIZER_NOTE_FIELD_NUMBER: _ClassVar[int]
    SHARED_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    name: str
    state: SessionState
    facts: ModelFacts
    lora: _common_pb2.LoraConfig
    created_at: float
    busy_job_id: str
    tenant: str
    instance_id: str
    gguf_pre_tokenizer: str
    gguf_pre_tokenizer_note: str
    shared: bool
    def __init__(self, session_id: _Optional[str] = ..., name: _Optional[str] = ..., state: _Optional[_Union[SessionState, str]] = ..., facts: _Optional[_Union[ModelFacts, _Mapping]] = ..., lora: _Optional[_Union[_common_pb2.LoraConfig, _Mapping]] = ..., created_at: _Optional[float] = ..., busy_job_id: _Optional[str] = ..., tenant: _Optional[str] = ..., instance_id: _Optional[str] = ..., gguf_pre_tokenizer: _Optional[str] = ..., gguf_pre_tokenizer_note: _Optional[str] = ..., shared: _Optional[bool] = ...) -> None: ...

class AttachLoraRequest(_message.Message):
    __slots__ = ("session_id", "lora")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    lora: _common_pb2.LoraConfig
    def __init__(self, session_id: _Optional[str] = ..., lora: _Optional[_Union[_common_pb2.LoraConfig, _Mapping]] = ...) -> None: ...

class GetSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ListSessionsRequest(_message.Message):
    __slots__ = ("include_closed",)
    INCLUDE_CLOSED_FIELD_NUMBER: _ClassVar[int]
    include_closed: bool
    def __init__(self, include_closed: _Optional[bool] = ...) -> None: ...

class ListSessionsResponse(_message.Message):
    __slots__ = ("sessions",)
    SESSIONS_FIELD_NUMBER: _ClassVar[int]
    sessions: _containers.RepeatedCompositeFieldContainer[Session]
    def __init__(self, sessions: _Optional[_Iterable[_Union[Session, _Mapping]]] = ...) -> None: ...

class CloseSessionRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class GenerateRequest(_message.Message):
    __slots__ = ("session_id", "prompts", "max_new_tokens", "disable_adapter", "apply_chat_template")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPTS_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DISABLE_ADAPTER_FIELD_NUMBER: _ClassVar[int]
    APPLY_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    prompts: _containers.RepeatedScalarFieldContainer[str]
    max_new_tokens: int
    disable_adapter: bool
    apply_chat_template: bool
    def __init__(self, session_id: _Optional[str] = ..., prompts: _Optional[_Iterable[str]] = ..., max_new_tokens: _Optional[int] = ..., disable_adapter: _Optional[bool] = ..., apply_chat_template: _Optional[bool] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("completions",)
    COMPLETIONS_FIELD_NUMBER: _ClassVar[int]
    completions: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, completions: _Optional[_Iterable[str]] = ...) -> None: ...

class SaveAdapterRequest(_message.Message):
    __slots__ = ("session_id", "name")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    name: str
    def __init__(self, session_id: _Optional[str] = ..., name: _Optional[str] = ...) -> None: ...

class DatasetHeader(_message.Message):
    __slots__ = ("name", "format", "size_bytes", "sha256")
    NAME_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    name: str
    format: DatasetFormat
    size_bytes: int
    sha256: str
    def __init__(self, name: _Optional[str] = ..., format: _Optional[_Union[DatasetFormat, str]] = ..., size_bytes: _Optional[int] = ..., sha256: _Optional[str] = ...) -> None: ...

class UploadDatasetRequest(_message.Message):
    __slots__ = ("header", "data")
    HEADER_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    header: DatasetHeader
    data: bytes
    def __init__(self, header: _Optional[_Union[DatasetHeader, _Mapping]] = ..., data: _Optional[bytes] = ...) -> None: ...

class RegisterDatasetRequest(_message.Message):
    __slots__ = ("path", "header")
    PATH_FIELD_NUMBER: _ClassVar[int]
    HEADER_FIELD_NUMBER: _ClassVar[int]
    path: str
    header: DatasetHeader
    def __init__(self, path: _Optional[str] = ..., header: _Optional[_Union[DatasetHeader, _Mapping]] = ...) -> None: ...

class Dataset(_message.Message):
    __slots__ = ("dataset_id", "name", "format", "num_rows", "size_bytes", "sha256", "created_at", "tenant")
    DATASET_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    FORMAT_FIELD_NUMBER: _ClassVar[int]
    NUM_ROWS_FIELD_NUMBER: _ClassVar[int]
    SIZE_BYTES_FIELD_NUMBER: _ClassVar[int]
    SHA256_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    dataset_id: str
    name: str
    format: DatasetFormat
    num_rows: int
    size_bytes: int
    sha256: str
    created_at: float
    tenant: str
    def __init__(self, dataset_id: _Optional[str] = ..., name: _Optional[str] = ..., format: _Optional[_Union[DatasetFormat, str]] = ..., num_rows: _Optional[int] = ..., size_bytes: _Optional[int] = ..., sha256: _Optional[str] = ..., created_at: _Optional[float] = ..., tenant: _Optional[str] = ...) -> None: ...

class GetDatasetRequest(_message.Message):
    __slots__ = ("dataset_id",)
    DATASET_ID_FIELD_NUMBER: _ClassVar[int]
    dataset_id: str
    def __init__(self, dataset_id: _Optional[str] = ...) -> None: ...

class ListDatasetsRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListDatasetsResponse(_message.Message):
    __slots__ = ("datasets",)
    DATASETS_FIELD_NUMBER: _ClassVar[int]
    datasets: _containers.RepeatedCompositeFieldContainer[Dataset]
    def __init__(self, datasets: _Optional[_Iterable[_Union[Dataset, _Mapping]]] = ...) -> None: ...

class TrainConfig(_message.Message):
    __slots__ = ("method", "learning_rate", "lr_scheduler", "warmup_ratio", "warmup_steps", "max_steps", "num_epochs", "batch_size", "gradient_accumulation_steps", "max_length", "packing", "completion_only_loss", "optimizer", "weight_decay", "max_grad_norm", "dpo_beta", "dpo_loss_type", "checkpoint_every_steps", "seed", "gradient_checkpointing", "max_prompt_length", "dpo_reference", "memory_budget_gib", "memory_mode", "loss_on_all_tokens", "num_devices", "orpo_lambda", "kto_beta", "kto_desirable_weight", "kto_undesirable_weight", "simpo_beta", "simpo_gamma", "parallelism", "num_nodes", "retention", "retention_rows", "retention_kl", "retention_neighbours", "adapter_scale", "eval_every_steps", "keep_best_checkpoint", "eval_batch_size", "eval_rows", "grpo")
    METHOD_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    LR_SCHEDULER_FIELD_NUMBER: _ClassVar[int]
    WARMUP_RATIO_FIELD_NUMBER: _ClassVar[int]
    WARMUP_STEPS_FIELD_NUMBER: _ClassVar[int]
    MAX_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_EPOCHS_FIELD_NUMBER: _ClassVar[int]
    BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_ACCUMULATION_STEPS_FIELD_NUMBER: _ClassVar[int]
    MAX_LENGTH_FIELD_NUMBER: _ClassVar[int]
    PACKING_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_ONLY_LOSS_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    MAX_GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    DPO_BETA_FIELD_NUMBER: _ClassVar[int]
    DPO_LOSS_TYPE_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_EVERY_STEPS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    GRADIENT_CHECKPOINTING_FIELD_NUMBER: _ClassVar[int]
    MAX_PROMPT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    DPO_REFERENCE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BUDGET_GIB_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MODE_FIELD_NUMBER: _ClassVar[int]
    LOSS_ON_ALL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_DEVICES_FIELD_NUMBER: _ClassVar[int]
    ORPO_LAMBDA_FIELD_NUMBER: _ClassVar[int]
    KTO_BETA_FIELD_NUMBER: _ClassVar[int]
    KTO_DESIRABLE_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    KTO_UNDESIRABLE_WEIGHT_FIELD_NUMBER: _ClassVar[int]
    SIMPO_BETA_FIELD_NUMBER: _ClassVar[int]
    SIMPO_GAMMA_FIELD_NUMBER: _ClassVar[int]
    PARALLELISM_FIELD_NUMBER: _ClassVar[int]
    NUM_NODES_FIELD_NUMBER: _ClassVar[int]
    RETENTION_FIELD_NUMBER: _ClassVar[int]
    RETENTION_ROWS_FIELD_NUMBER: _ClassVar[int]
    RETENTION_KL_FIELD_NUMBER: _ClassVar[int]
    RETENTION_NEIGHBOURS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_SCALE_FIELD_NUMBER: _ClassVar[int]
    EVAL_EVERY_STEPS_FIELD_NUMBER: _ClassVar[int]
    KEEP_BEST_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    EVAL_BATCH_SIZE_FIELD_NUMBER: _ClassVar[int]
    EVAL_ROWS_FIELD_NUMBER: _ClassVar[int]
    GRPO_FIELD_NUMBER: _ClassVar[int]
    method: TrainMethod
    learning_rate: float
    lr_scheduler: str
    warmup_ratio: float
    warmup_steps: int
    max_steps: int
    num_epochs: float
    batch_size: int
    gradient_accumulation_steps: int
    max_length: int
    packing: bool
    completion_only_loss: bool
    optimizer: str
    weight_decay: float
    max_grad_norm: float
    dpo_beta: float
    dpo_loss_type: str
    checkpoint_every_steps: int
    seed: int
    gradient_checkpointing: bool
    max_prompt_length: int
    dpo_reference: str
    memory_budget_gib: float
    memory_mode: MemoryMode
    loss_on_all_tokens: bool
    num_devices: int
    orpo_lambda: float
    kto_beta: float
    kto_desirable_weight: float
    kto_undesirable_weight: float
    simpo_beta: float
    simpo_gamma: float
    parallelism: Parallelism
    num_nodes: int
    retention: Retention
    retention_rows: int
    retention_kl: float
    retention_neighbours: int
    adapter_scale: float
    eval_every_steps: int
    keep_best_checkpoint: bool
    eval_batch_size: int
    eval_rows: int
    grpo: GrpoConfig
    def __init__(self, method: _Optional[_Union[TrainMethod, str]] = ..., learning_rate: _Optional[float] = ..., lr_scheduler: _Optional[str] = ..., warmup_ratio: _Optional[float] = ..., warmup_steps: _Optional[int] = ..., max_steps: _Optional[int] = ..., num_epochs: _Optional[float] = ..., batch_size: _Optional[int] = ..., gradient_accumulation_steps: _Optional[int] = ..., max_length: _Optional[int] = ..., packing: _Optional[bool] = ..., completion_only_loss: _Optional[bool] = ..., optimizer: _Optional[str] = ..., weight_decay: _Optional[float] = ..., max_grad_norm: _Optional[float] = ..., dpo_beta: _Optional[float] = ..., dpo_loss_type: _Optional[str] = ..., checkpoint_every_steps: _Optional[int] = ..., seed: _Optional[int] = ..., gradient_checkpointing: _Optional[bool] = ..., max_prompt_length: _Optional[int] = ..., dpo_reference: _Optional[str] = ..., memory_budget_gib: _Optional[float] = ..., memory_mode: _Optional[_Union[MemoryMode, str]] = ..., loss_on_all_tokens: _Optional[bool] = ..., num_devices: _Optional[int] = ..., orpo_lambda: _Optional[float] = ..., kto_beta: _Optional[float] = ..., kto_desirable_weight: _Optional[float] = ..., kto_undesirable_weight: _Optional[float] = ..., simpo_beta: _Optional[float] = ..., simpo_gamma: _Optional[float] = ..., parallelism: _Optional[_Union[Parallelism, str]] = ..., num_nodes: _Optional[int] = ..., retention: _Optional[_Union[Retention, str]] = ..., retention_rows: _Optional[int] = ..., retention_kl: _Optional[float] = ..., retention_neighbours: _Optional[int] = ..., adapter_scale: _Optional[float] = ..., eval_every_steps: _Optional[int] = ..., keep_best_checkpoint: _Optional[bool] = ..., eval_batch_size: _Optional[int] = ..., eval_rows: _Optional[int] = ..., grpo: _Optional[_Union[GrpoConfig, _Mapping]] = ...) -> None: ...

class RetentionMetrics(_message.Message):
    __slots__ = ("step", "held_out", "kept", "token_agreement", "mean_nll", "replay_rows", "adapter_scale")
    STEP_FIELD_NUMBER: _ClassVar[int]
    HELD_OUT_FIELD_NUMBER: _ClassVar[int]
    KEPT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_AGREEMENT_FIELD_NUMBER: _ClassVar[int]
    MEAN_NLL_FIELD_NUMBER: _ClassVar[int]
    REPLAY_ROWS_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_SCALE_FIELD_NUMBER: _ClassVar[int]
    step: int
    held_out: int
    kept: int
    token_agreement: float
    mean_nll: float
    replay_rows: int
    adapter_scale: float
    def __init__(self, step: _Optional[int] = ..., held_out: _Optional[int] = ..., kept: _Optional[int] = ..., token_agreement: _Optional[float] = ..., mean_nll: _Optional[float] = ..., replay_rows: _Optional[int] = ..., adapter_scale: _Optional[float] = ...) -> None: ...

class TrainRequest(_message.Message):
    __slots__ = ("session_id", "dataset_id", "config", "resume_from_job_id", "name", "fail_if_busy", "validation_dataset_id")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DATASET_ID_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    RESUME_FROM_JOB_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    FAIL_IF_BUSY_FIELD_NUMBER: _ClassVar[int]
    VALIDATION_DATASET_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    dataset_id: str
    config: TrainConfig
    resume_from_job_id: str
    name: str
    fail_if_busy: bool
    validation_dataset_id: str
    def __init__(self, session_id: _Optional[str] = ..., dataset_id: _Optional[str] = ..., config: _Optional[_Union[TrainConfig, _Mapping]] = ..., resume_from_job_id: _Optional[str] = ..., name: _Optional[str] = ..., fail_if_busy: _Optional[bool] = ..., validation_dataset_id: _Optional[str] = ...) -> None: ...

class Checkpoint(_message.Message):
    __slots__ = ("step", "artifact", "train_loss", "valid_loss", "full_valid_loss", "valid_mean_token_accuracy")
    STEP_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_FIELD_NUMBER: _ClassVar[int]
    TRAIN_LOSS_FIELD_NUMBER: _ClassVar[int]
    VALID_LOSS_FIELD_NUMBER: _ClassVar[int]
    FULL_VALID_LOSS_FIELD_NUMBER: _ClassVar[int]
    VALID_MEAN_TOKEN_ACCURACY_FIELD_NUMBER: _ClassVar[int]
    step: int
    artifact: _common_pb2.Artifact
    train_loss: float
    valid_loss: float
    full_valid_loss: float
    valid_mean_token_accuracy: float
    def __init__(self, step: _Optional[int] = ..., artifact: _Optional[_Union[_common_pb2.Artifact, _Mapping]] = ..., train_loss: _Optional[float] = ..., valid_loss: _Optional[float] = ..., full_valid_loss: _Optional[float] = ..., valid_mean_token_accuracy: _Optional[float] = ...) -> None: ...

class Job(_message.Message):
    __slots__ = ("job_id", "session_id", "dataset_id", "name", "state", "config", "step", "total_steps", "error", "adapter", "last_checkpoint", "resumed_from_job_id", "created_at", "started_at", "finished_at", "last_seq", "last_loss", "queue_position", "error_code", "tenant", "instance_id", "loss_curve", "best_checkpoint", "metrics_csv", "validation_dataset_id", "last_eval")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    DATASET_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    CONFIG_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    LAST_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    RESUMED_FROM_JOB_ID_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    STARTED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_SEQ_FIELD_NUMBER: _ClassVar[int]
    LAST_LOSS_FIELD_NUMBER: _ClassVar[int]
    QUEUE_POSITION_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    LOSS_CURVE_FIELD_NUMBER: _ClassVar[int]
    BEST_CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    METRICS_CSV_FIELD_NUMBER: _ClassVar[int]
    VALIDATION_DATASET_ID_FIELD_NUMBER: _ClassVar[int]
    LAST_EVAL_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    session_id: str
    dataset_id: str
    name: str
    state: JobState
    config: TrainConfig
    step: int
    total_steps: int
    error: str
    adapter: _common_pb2.Artifact
    last_checkpoint: Checkpoint
    resumed_from_job_id: str
    created_at: float
    started_at: float
    finished_at: float
    last_seq: int
    last_loss: float
    queue_position: int
    error_code: str
    tenant: str
    instance_id: str
    loss_curve: _common_pb2.Artifact
    best_checkpoint: Checkpoint
    metrics_csv: _common_pb2.Artifact
    validation_dataset_id: str
    last_eval: EvalMetrics
    def __init__(self, job_id: _Optional[str] = ..., session_id: _Optional[str] = ..., dataset_id: _Optional[str] = ..., name: _Optional[str] = ..., state: _Optional[_Union[JobState, str]] = ..., config: _Optional[_Union[TrainConfig, _Mapping]] = ..., step: _Optional[int] = ..., total_steps: _Optional[int] = ..., error: _Optional[str] = ..., adapter: _Optional[_Union[_common_pb2.Artifact, _Mapping]] = ..., last_checkpoint: _Optional[_Union[Checkpoint, _Mapping]] = ..., resumed_from_job_id: _Optional[str] = ..., created_at: _Optional[float] = ..., started_at: _Optional[float] = ..., finished_at: _Optional[float] = ..., last_seq: _Optional[int] = ..., last_loss: _Optional[float] = ..., queue_position: _Optional[int] = ..., error_code: _Optional[str] = ..., tenant: _Optional[str] = ..., instance_id: _Optional[str] = ..., loss_curve: _Optional[_Union[_common_pb2.Artifact, _Mapping]] = ..., best_checkpoint: _Optional[_Union[Checkpoint, _Mapping]] = ..., metrics_csv: _Optional[_Union[_common_pb2.Artifact, _Mapping]] = ..., validation_dataset_id: _Optional[str] = ..., last_eval: _Optional[_Union[EvalMetrics, _Mapping]] = ...) -> None: ...

class StateChange(_message.Message):
    __slots__ = ("state", "message")
    STATE_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    state: JobState
    message: str
    def __init__(self, state: _Optional[_Union[JobState, str]] = ..., message: _Optional[str] = ...) -> None: ...

class DpoMetrics(_message.Message):
    __slots__ = ("rewards_chosen", "rewards_rejected", "reward_margin", "reward_accuracy", "logps_chosen", "logps_rejected", "log_odds_ratio", "log_odds_chosen", "nll_loss", "kl")
    REWARDS_CHOSEN_FIELD_NUMBER: _ClassVar[int]
    REWARDS_REJECTED_FIELD_NUMBER: _ClassVar[int]
    REWARD_MARGIN_FIELD_NUMBER: _ClassVar[int]
    REWARD_ACCURACY_FIELD_NUMBER: _ClassVar[int]
    LOGPS_CHOSEN_FIELD_NUMBER: _ClassVar[int]
    LOGPS_REJECTED_FIELD_NUMBER: _ClassVar[int]
    LOG_ODDS_RATIO_FIELD_NUMBER: _ClassVar[int]
    LOG_ODDS_CHOSEN_FIELD_NUMBER: _ClassVar[int]
    NLL_LOSS_FIELD_NUMBER: _ClassVar[int]
    KL_FIELD_NUMBER: _ClassVar[int]
    rewards_chosen: float
    rewards_rejected: float
    reward_margin: float
    reward_accuracy: float
    logps_chosen: float
    logps_rejected: float
    log_odds_ratio: float
    log_odds_chosen: float
    nll_loss: float
    kl: float
    def __init__(self, rewards_chosen: _Optional[float] = ..., rewards_rejected: _Optional[float] = ..., reward_margin: _Optional[float] = ..., reward_accuracy: _Optional[float] = ..., logps_chosen: _Optional[float] = ..., logps_rejected: _Optional[float] = ..., log_odds_ratio: _Optional[float] = ..., log_odds_chosen: _Optional[float] = ..., nll_loss: _Optional[float] = ..., kl: _Optional[float] = ...) -> None: ...

class GrpoConfig(_message.Message):
    __slots__ = ("grader", "group_size", "max_new_tokens", "temperature", "top_p", "kl_coef", "clip_eps_low", "clip_eps_high", "loss_type", "sequence_ratio", "tis_cap", "num_iterations")
    GRADER_FIELD_NUMBER: _ClassVar[int]
    GROUP_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_NEW_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    KL_COEF_FIELD_NUMBER: _ClassVar[int]
    CLIP_EPS_LOW_FIELD_NUMBER: _ClassVar[int]
    CLIP_EPS_HIGH_FIELD_NUMBER: _ClassVar[int]
    LOSS_TYPE_FIELD_NUMBER: _ClassVar[int]
    SEQUENCE_RATIO_FIELD_NUMBER: _ClassVar[int]
    TIS_CAP_FIELD_NUMBER: _ClassVar[int]
    NUM_ITERATIONS_FIELD_NUMBER: _ClassVar[int]
    grader: str
    group_size: int
    max_new_tokens: int
    temperature: float
    top_p: float
    kl_coef: float
    clip_eps_low: float
    clip_eps_high: float
    loss_type: GrpoLoss
    sequence_ratio: bool
    tis_cap: float
    num_iterations: int
    def __init__(self, grader: _Optional[str] = ..., group_size: _Optional[int] = ..., max_new_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., kl_coef: _Optional[float] = ..., clip_eps_low: _Optional[float] = ..., clip_eps_high: _Optional[float] = ..., loss_type: _Optional[_Union[GrpoLoss, str]] = ..., sequence_ratio: _Optional[bool] = ..., tis_cap: _Optional[float] = ..., num_iterations: _Optional[int] = ...) -> None: ...

class GraderMetrics(_message.Message):
    __slots__ = ("name", "mean_score", "pass_rate")
    NAME_FIELD_NUMBER: _ClassVar[int]
    MEAN_SCORE_FIELD_NUMBER: _ClassVar[int]
    PASS_RATE_FIELD_NUMBER: _ClassVar[int]
    name: str
    mean_score: float
    pass_rate: float
    def __init__(self, name: _Optional[str] = ..., mean_score: _Optional[float] = ..., pass_rate: _Optional[float] = ...) -> None: ...

class RlMetrics(_message.Message):
    __slots__ = ("reward_mean", "reward_std", "graders", "kl", "clip_fraction", "entropy", "sampled_length_mean", "sampled_length_max", "sampling_tokens_per_second", "training_tokens_per_second", "sampling_seconds", "training_seconds", "tis_weight_mean", "zero_std_groups", "eval_reward_mean", "eval_graders")
    REWARD_MEAN_FIELD_NUMBER: _ClassVar[int]
    REWARD_STD_FIELD_NUMBER: _ClassVar[int]
    GRADERS_FIELD_NUMBER: _ClassVar[int]
    KL_FIELD_NUMBER: _ClassVar[int]
    CLIP_FRACTION_FIELD_NUMBER: _ClassVar[int]
    ENTROPY_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_LENGTH_MEAN_FIELD_NUMBER: _ClassVar[int]
    SAMPLED_LENGTH_MAX_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    TRAINING_TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TRAINING_SECONDS_FIELD_NUMBER: _ClassVar[int]
    TIS_WEIGHT_MEAN_FIELD_NUMBER: _ClassVar[int]
    ZERO_STD_GROUPS_FIELD_NUMBER: _ClassVar[int]
    EVAL_REWARD_MEAN_FIELD_NUMBER: _ClassVar[int]
    EVAL_GRADERS_FIELD_NUMBER: _ClassVar[int]
    reward_mean: float
    reward_std: float
    graders: _containers.RepeatedCompositeFieldContainer[GraderMetrics]
    kl: float
    clip_fraction: float
    entropy: float
    sampled_length_mean: float
    sampled_length_max: int
    sampling_tokens_per_second: float
    training_tokens_per_second: float
    sampling_seconds: float
    training_seconds: float
    tis_weight_mean: float
    zero_std_groups: float
    eval_reward_mean: float
    eval_graders: _containers.RepeatedCompositeFieldContainer[GraderMetrics]
    def __init__(self, reward_mean: _Optional[float] = ..., reward_std: _Optional[float] = ..., graders: _Optional[_Iterable[_Union[GraderMetrics, _Mapping]]] = ..., kl: _Optional[float] = ..., clip_fraction: _Optional[float] = ..., entropy: _Optional[float] = ..., sampled_length_mean: _Optional[float] = ..., sampled_length_max: _Optional[int] = ..., sampling_tokens_per_second: _Optional[float] = ..., training_tokens_per_second: _Optional[float] = ..., sampling_seconds: _Optional[float] = ..., training_seconds: _Optional[float] = ..., tis_weight_mean: _Optional[float] = ..., zero_std_groups: _Optional[float] = ..., eval_reward_mean: _Optional[float] = ..., eval_graders: _Optional[_Iterable[_Union[GraderMetrics, _Mapping]]] = ...) -> None: ...

class StepMetrics(_message.Message):
    __slots__ = ("step", "total_steps", "epoch", "loss", "learning_rate", "grad_norm", "tokens_per_second", "tokens_seen", "peak_memory_bytes", "step_seconds", "dpo", "rl")
    STEP_FIELD_NUMBER: _ClassVar[int]
    TOTAL_STEPS_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    LOSS_FIELD_NUMBER: _ClassVar[int]
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    GRAD_NORM_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_SECOND_FIELD_NUMBER: _ClassVar[int]
    TOKENS_SEEN_FIELD_NUMBER: _ClassVar[int]
    PEAK_MEMORY_BYTES_FIELD_NUMBER: _ClassVar[int]
    STEP_SECONDS_FIELD_NUMBER: _ClassVar[int]
    DPO_FIELD_NUMBER: _ClassVar[int]
    RL_FIELD_NUMBER: _ClassVar[int]
    step: int
    total_steps: int
    epoch: float
    loss: float
    learning_rate: float
    grad_norm: float
    tokens_per_second: float
    tokens_seen: int
    peak_memory_bytes: int
    step_seconds: float
    dpo: DpoMetrics
    rl: RlMetrics
    def __init__(self, step: _Optional[int] = ..., total_steps: _Optional[int] = ..., epoch: _Optional[float] = ..., loss: _Optional[float] = ..., learning_rate: _Optional[float] = ..., grad_norm: _Optional[float] = ..., tokens_per_second: _Optional[float] = ..., tokens_seen: _Optional[int] = ..., peak_memory_bytes: _Optional[int] = ..., step_seconds: _Optional[float] = ..., dpo: _Optional[_Union[DpoMetrics, _Mapping]] = ..., rl: _Optional[_Union[RlMetrics, _Mapping]] = ...) -> None: ...

class EvalMetrics(_message.Message):
    __slots__ = ("step", "valid_loss", "full_valid_loss", "valid_mean_token_accuracy", "rows", "tokens", "is_full", "full_valid_mean_token_accuracy", "dpo")
    STEP_FIELD_NUMBER: _ClassVar[int]
    VALID_LOSS_FIELD_NUMBER: _ClassVar[int]
    FULL_VALID_LOSS_FIELD_NUMBER: _ClassVar[int]
    VALID_MEAN_TOKEN_ACCURACY_FIELD_NUMBER: _ClassVar[int]
    ROWS_FIELD_NUMBER: _ClassVar[int]
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    IS_FULL_FIELD_NUMBER: _ClassVar[int]
    FULL_VALID_MEAN_TOKEN_ACCURACY_FIELD_NUMBER: _ClassVar[int]
    DPO_FIELD_NUMBER: _ClassVar[int]
    step: int
    valid_loss: float
    full_valid_loss: float
    valid_mean_token_accuracy: float
    rows: int
    tokens: int
    is_full: bool
    full_valid_mean_token_accuracy: float
    dpo: DpoMetrics
    def __init__(self, step: _Optional[int] = ..., valid_loss: _Optional[float] = ..., full_valid_loss: _Optional[float] = ..., valid_mean_token_accuracy: _Optional[float] = ..., rows: _Optional[int] = ..., tokens: _Optional[int] = ..., is_full: _Optional[bool] = ..., full_valid_mean_token_accuracy: _Optional[float] = ..., dpo: _Optional[_Union[DpoMetrics, _Mapping]] = ...) -> None: ...

class LogMessage(_message.Message):
    __slots__ = ("level", "message")
    LEVEL_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    level: str
    message: str
    def __init__(self, level: _Optional[str] = ..., message: _Optional[str] = ...) -> None: ...

class JobEvent(_message.Message):
    __slots__ = ("job_id", "seq", "time", "state", "step", "checkpoint", "adapter", "log", "retention", "eval")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_FIELD_NUMBER: _ClassVar[int]
    TIME_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    LOG_FIELD_NUMBER: _ClassVar[int]
    RETENTION_FIELD_NUMBER: _ClassVar[int]
    EVAL_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    seq: int
    time: float
    state: StateChange
    step: StepMetrics
    checkpoint: Checkpoint
    adapter: _common_pb2.Artifact
    log: LogMessage
    retention: RetentionMetrics
    eval: EvalMetrics
    def __init__(self, job_id: _Optional[str] = ..., seq: _Optional[int] = ..., time: _Optional[float] = ..., state: _Optional[_Union[StateChange, _Mapping]] = ..., step: _Optional[_Union[StepMetrics, _Mapping]] = ..., checkpoint: _Optional[_Union[Checkpoint, _Mapping]] = ..., adapter: _Optional[_Union[_common_pb2.Artifact, _Mapping]] = ..., log: _Optional[_Union[LogMessage, _Mapping]] = ..., retention: _Optional[_Union[RetentionMetrics, _Mapping]] = ..., eval: _Optional[_Union[EvalMetrics, _Mapping]] = ...) -> None: ...

class WatchJobRequest(_message.Message):
    __slots__ = ("job_id", "after_seq")
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    after_seq: int
    def __init__(self, job_id: _Optional[str] = ..., after_seq: _Optional[int] = ...) -> None: ...

class GetJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class ListJobsRequest(_message.Message):
    __slots__ = ("session_id", "states")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    STATES_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    states: _containers.RepeatedScalarFieldContainer[JobState]
    def __init__(self, session_id: _Optional[str] = ..., states: _Optional[_Iterable[_Union[JobState, str]]] = ...) -> None: ...

class ListJobsResponse(_message.Message):
    __slots__ = ("jobs",)
    JOBS_FIELD_NUMBER: _ClassVar[int]
    jobs: _containers.RepeatedCompositeFieldContainer[Job]
    def __init__(self, jobs: _Optional[_Iterable[_Union[Job, _Mapping]]] = ...) -> None: ...

class CancelJobRequest(_message.Message):
    __slots__ = ("job_id",)
    JOB_ID_FIELD_NUMBER: _ClassVar[int]
    job_id: str
    def __init__(self, job_id: _Optional[str] = ...) -> None: ...

class AdamParams(_message.Message):
    __slots__ = ("learning_rate", "beta1", "beta2", "eps", "weight_decay", "grad_clip_norm")
    LEARNING_RATE_FIELD_NUMBER: _ClassVar[int]
    BETA1_FIELD_NUMBER: _ClassVar[int]
    BETA2_FIELD_NUMBER: _ClassVar[int]
    EPS_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_DECAY_FIELD_NUMBER: _ClassVar[int]
    GRAD_CLIP_NORM_FIELD_NUMBER: _ClassVar[int]
    learning_rate: float
    beta1: float
    beta2: float
    eps: float
    weight_decay: float
    grad_clip_norm: float
    def __init__(self, learning_rate: _Optional[float] = ..., beta1: _Optional[float] = ..., beta2: _Optional[float] = ..., eps: _Optional[float] = ..., weight_decay: _Optional[float] = ..., grad_clip_norm: _Optional[float] = ...) -> None: ...

class RunLora(_message.Message):
    __slots__ = ("rank", "alpha", "train_attn", "train_mlp", "train_unembed", "seed")
    RANK_FIELD_NUMBER: _ClassVar[int]
    ALPHA_FIELD_NUMBER: _ClassVar[int]
    TRAIN_ATTN_FIELD_NUMBER: _ClassVar[int]
    TRAIN_MLP_FIELD_NUMBER: _ClassVar[int]
    TRAIN_UNEMBED_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    rank: int
    alpha: float
    train_attn: bool
    train_mlp: bool
    train_unembed: bool
    seed: int
    def __init__(self, rank: _Optional[int] = ..., alpha: _Optional[float] = ..., train_attn: _Optional[bool] = ..., train_mlp: _Optional[bool] = ..., train_unembed: _Optional[bool] = ..., seed: _Optional[int] = ...) -> None: ...

class Metric(_message.Message):
    __slots__ = ("name", "value")
    NAME_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    name: str
    value: float
    def __init__(self, name: _Optional[str] = ..., value: _Optional[float] = ...) -> None: ...

class CreateTrainingRunRequest(_message.Message):
    __slots__ = ("session_id", "lora", "optimizer", "name", "from_state", "with_optimizer")
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    FROM_STATE_FIELD_NUMBER: _ClassVar[int]
    WITH_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    lora: RunLora
    optimizer: AdamParams
    name: str
    from_state: str
    with_optimizer: bool
    def __init__(self, session_id: _Optional[str] = ..., lora: _Optional[_Union[RunLora, _Mapping]] = ..., optimizer: _Optional[_Union[AdamParams, _Mapping]] = ..., name: _Optional[str] = ..., from_state: _Optional[str] = ..., with_optimizer: _Optional[bool] = ...) -> None: ...

class TrainingRun(_message.Message):
    __slots__ = ("run_id", "name", "session_id", "tenant", "base_model", "lora", "optimizer", "target_modules", "num_trainable_parameters", "step", "has_gradients", "next_seq_id", "pending_futures", "created_at", "last_activity_at", "sampler_ids", "counts")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    TENANT_FIELD_NUMBER: _ClassVar[int]
    BASE_MODEL_FIELD_NUMBER: _ClassVar[int]
    LORA_FIELD_NUMBER: _ClassVar[int]
    OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    NUM_TRAINABLE_PARAMETERS_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    HAS_GRADIENTS_FIELD_NUMBER: _ClassVar[int]
    NEXT_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    PENDING_FUTURES_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    LAST_ACTIVITY_AT_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_IDS_FIELD_NUMBER: _ClassVar[int]
    COUNTS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    name: str
    session_id: str
    tenant: str
    base_model: str
    lora: RunLora
    optimizer: AdamParams
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    num_trainable_parameters: int
    step: int
    has_gradients: bool
    next_seq_id: int
    pending_futures: int
    created_at: float
    last_activity_at: float
    sampler_ids: _containers.RepeatedScalarFieldContainer[str]
    counts: _containers.RepeatedCompositeFieldContainer[Metric]
    def __init__(self, run_id: _Optional[str] = ..., name: _Optional[str] = ..., session_id: _Optional[str] = ..., tenant: _Optional[str] = ..., base_model: _Optional[str] = ..., lora: _Optional[_Union[RunLora, _Mapping]] = ..., optimizer: _Optional[_Union[AdamParams, _Mapping]] = ..., target_modules: _Optional[_Iterable[str]] = ..., num_trainable_parameters: _Optional[int] = ..., step: _Optional[int] = ..., has_gradients: _Optional[bool] = ..., next_seq_id: _Optional[int] = ..., pending_futures: _Optional[int] = ..., created_at: _Optional[float] = ..., last_activity_at: _Optional[float] = ..., sampler_ids: _Optional[_Iterable[str]] = ..., counts: _Optional[_Iterable[_Union[Metric, _Mapping]]] = ...) -> None: ...

class GetTrainingRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class ListTrainingRunsRequest(_message.Message):
    __slots__ = ("session_id",)
    SESSION_ID_FIELD_NUMBER: _ClassVar[int]
    session_id: str
    def __init__(self, session_id: _Optional[str] = ...) -> None: ...

class ListTrainingRunsResponse(_message.Message):
    __slots__ = ("runs",)
    RUNS_FIELD_NUMBER: _ClassVar[int]
    runs: _containers.RepeatedCompositeFieldContainer[TrainingRun]
    def __init__(self, runs: _Optional[_Iterable[_Union[TrainingRun, _Mapping]]] = ...) -> None: ...

class DeleteTrainingRunRequest(_message.Message):
    __slots__ = ("run_id",)
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    def __init__(self, run_id: _Optional[str] = ...) -> None: ...

class TensorData(_message.Message):
    __slots__ = ("dtype", "shape", "float_values", "int_values")
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    SHAPE_FIELD_NUMBER: _ClassVar[int]
    FLOAT_VALUES_FIELD_NUMBER: _ClassVar[int]
    INT_VALUES_FIELD_NUMBER: _ClassVar[int]
    dtype: str
    shape: _containers.RepeatedScalarFieldContainer[int]
    float_values: _containers.RepeatedScalarFieldContainer[float]
    int_values: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, dtype: _Optional[str] = ..., shape: _Optional[_Iterable[int]] = ..., float_values: _Optional[_Iterable[float]] = ..., int_values: _Optional[_Iterable[int]] = ...) -> None: ...

class NamedTensor(_message.Message):
    __slots__ = ("name", "tensor")
    NAME_FIELD_NUMBER: _ClassVar[int]
    TENSOR_FIELD_NUMBER: _ClassVar[int]
    name: str
    tensor: TensorData
    def __init__(self, name: _Optional[str] = ..., tensor: _Optional[_Union[TensorData, _Mapping]] = ...) -> None: ...

class Datum(_message.Message):
    __slots__ = ("model_input", "loss_fn_inputs")
    MODEL_INPUT_FIELD_NUMBER: _ClassVar[int]
    LOSS_FN_INPUTS_FIELD_NUMBER: _ClassVar[int]
    model_input: _containers.RepeatedScalarFieldContainer[int]
    loss_fn_inputs: _containers.RepeatedCompositeFieldContainer[NamedTensor]
    def __init__(self, model_input: _Optional[_Iterable[int]] = ..., loss_fn_inputs: _Optional[_Iterable[_Union[NamedTensor, _Mapping]]] = ...) -> None: ...

class ForwardBackwardRequest(_message.Message):
    __slots__ = ("run_id", "seq_id", "data", "loss_fn", "loss_fn_config", "forward_only")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    LOSS_FN_FIELD_NUMBER: _ClassVar[int]
    LOSS_FN_CONFIG_FIELD_NUMBER: _ClassVar[int]
    FORWARD_ONLY_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    seq_id: int
    data: _containers.RepeatedCompositeFieldContainer[Datum]
    loss_fn: LossFn
    loss_fn_config: _containers.RepeatedCompositeFieldContainer[Metric]
    forward_only: bool
    def __init__(self, run_id: _Optional[str] = ..., seq_id: _Optional[int] = ..., data: _Optional[_Iterable[_Union[Datum, _Mapping]]] = ..., loss_fn: _Optional[_Union[LossFn, str]] = ..., loss_fn_config: _Optional[_Iterable[_Union[Metric, _Mapping]]] = ..., forward_only: _Optional[bool] = ...) -> None: ...

class DatumOutput(_message.Message):
    __slots__ = ("logprobs",)
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class ForwardBackwardOutput(_message.Message):
    __slots__ = ("loss_fn_outputs", "metrics")
    LOSS_FN_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    loss_fn_outputs: _containers.RepeatedCompositeFieldContainer[DatumOutput]
    metrics: _containers.RepeatedCompositeFieldContainer[Metric]
    def __init__(self, loss_fn_outputs: _Optional[_Iterable[_Union[DatumOutput, _Mapping]]] = ..., metrics: _Optional[_Iterable[_Union[Metric, _Mapping]]] = ...) -> None: ...

class OptimStepRequest(_message.Message):
    __slots__ = ("run_id", "seq_id", "adam_params")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    ADAM_PARAMS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    seq_id: int
    adam_params: AdamParams
    def __init__(self, run_id: _Optional[str] = ..., seq_id: _Optional[int] = ..., adam_params: _Optional[_Union[AdamParams, _Mapping]] = ...) -> None: ...

class OptimStepOutput(_message.Message):
    __slots__ = ("metrics",)
    METRICS_FIELD_NUMBER: _ClassVar[int]
    metrics: _containers.RepeatedCompositeFieldContainer[Metric]
    def __init__(self, metrics: _Optional[_Iterable[_Union[Metric, _Mapping]]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "temperature", "top_p", "top_k", "stop_token_ids", "stop_strings", "seed")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    STOP_STRINGS_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    stop_strings: _containers.RepeatedScalarFieldContainer[str]
    seed: int
    def __init__(self, max_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., stop_strings: _Optional[_Iterable[str]] = ..., seed: _Optional[int] = ...) -> None: ...

class SampleRequest(_message.Message):
    __slots__ = ("run_id", "sampler_id", "prompt", "num_samples", "params", "prompt_logprobs")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    NUM_SAMPLES_FIELD_NUMBER: _ClassVar[int]
    PARAMS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    sampler_id: str
    prompt: _containers.RepeatedScalarFieldContainer[int]
    num_samples: int
    params: SamplingParams
    prompt_logprobs: bool
    def __init__(self, run_id: _Optional[str] = ..., sampler_id: _Optional[str] = ..., prompt: _Optional[_Iterable[int]] = ..., num_samples: _Optional[int] = ..., params: _Optional[_Union[SamplingParams, _Mapping]] = ..., prompt_logprobs: _Optional[bool] = ...) -> None: ...

class SampledSequence(_message.Message):
    __slots__ = ("tokens", "logprobs", "stop_reason")
    TOKENS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    STOP_REASON_FIELD_NUMBER: _ClassVar[int]
    tokens: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedScalarFieldContainer[float]
    stop_reason: str
    def __init__(self, tokens: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[float]] = ..., stop_reason: _Optional[str] = ...) -> None: ...

class SampleOutput(_message.Message):
    __slots__ = ("sequences", "prompt_logprobs")
    SEQUENCES_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    sequences: _containers.RepeatedCompositeFieldContainer[SampledSequence]
    prompt_logprobs: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, sequences: _Optional[_Iterable[_Union[SampledSequence, _Mapping]]] = ..., prompt_logprobs: _Optional[_Iterable[float]] = ...) -> None: ...

class SaveRequest(_message.Message):
    __slots__ = ("run_id", "seq_id", "name")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    seq_id: int
    name: str
    def __init__(self, run_id: _Optional[str] = ..., seq_id: _Optional[int] = ..., name: _Optional[str] = ...) -> None: ...

class LoadStateRequest(_message.Message):
    __slots__ = ("run_id", "seq_id", "artifact_id", "with_optimizer")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    ARTIFACT_ID_FIELD_NUMBER: _ClassVar[int]
    WITH_OPTIMIZER_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    seq_id: int
    artifact_id: str
    with_optimizer: bool
    def __init__(self, run_id: _Optional[str] = ..., seq_id: _Optional[int] = ..., artifact_id: _Optional[str] = ..., with_optimizer: _Optional[bool] = ...) -> None: ...

class SaveOutput(_message.Message):
    __slots__ = ("artifact_id", "sampler_id", "step")
    ARTIFACT_ID_FIELD_NUMBER: _ClassVar[int]
    SAMPLER_ID_FIELD_NUMBER: _ClassVar[int]
    STEP_FIELD_NUMBER: _ClassVar[int]
    artifact_id: str
    sampler_id: str
    step: int
    def __init__(self, artifact_id: _Optional[str] = ..., sampler_id: _Optional[str] = ..., step: _Optional[int] = ...) -> None: ...

class Future(_message.Message):
    __slots__ = ("future_id", "run_id", "seq_id", "kind", "state", "error", "error_code", "created_at", "finished_at", "forward_backward", "optim_step", "sample", "save")
    FUTURE_ID_FIELD_NUMBER: _ClassVar[int]
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    KIND_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ERROR_CODE_FIELD_NUMBER: _ClassVar[int]
    CREATED_AT_FIELD_NUMBER: _ClassVar[int]
    FINISHED_AT_FIELD_NUMBER: _ClassVar[int]
    FORWARD_BACKWARD_FIELD_NUMBER: _ClassVar[int]
    OPTIM_STEP_FIELD_NUMBER: _ClassVar[int]
    SAMPLE_FIELD_NUMBER: _ClassVar[int]
    SAVE_FIELD_NUMBER: _ClassVar[int]
    future_id: str
    run_id: str
    seq_id: int
    kind: PrimitiveKind
    state: FutureState
    error: str
    error_code: str
    created_at: float
    finished_at: float
    forward_backward: ForwardBackwardOutput
    optim_step: OptimStepOutput
    sample: SampleOutput
    save: SaveOutput
    def __init__(self, future_id: _Optional[str] = ..., run_id: _Optional[str] = ..., seq_id: _Optional[int] = ..., kind: _Optional[_Union[PrimitiveKind, str]] = ..., state: _Optional[_Union[FutureState, str]] = ..., error: _Optional[str] = ..., error_code: _Optional[str] = ..., created_at: _Optional[float] = ..., finished_at: _Optional[float] = ..., forward_backward: _Optional[_Union[ForwardBackwardOutput, _Mapping]] = ..., optim_step: _Optional[_Union[OptimStepOutput, _Mapping]] = ..., sample: _Optional[_Union[SampleOutput, _Mapping]] = ..., save: _Optional[_Union[SaveOutput, _Mapping]] = ...) -> None: ...

class GetFutureRequest(_message.Message):
    __slots__ = ("future_id", "wait_ms")
    FUTURE_ID_FIELD_NUMBER: _ClassVar[int]
    WAIT_MS_FIELD_NUMBER: _ClassVar[int]
    future_id: str
    wait_ms: int
    def __init__(self, future_id: _Optional[str] = ..., wait_ms: _Optional[int] = ...) -> None: ...

class CancelFutureRequest(_message.Message):
    __slots__ = ("future_id",)
    FUTURE_ID_FIELD_NUMBER: _ClassVar[int]
    future_id: str
    def __init__(self, future_id: _Optional[str] = ...) -> None: ...

class WatchFuturesRequest(_message.Message):
    __slots__ = ("run_id", "after_seq_id")
    RUN_ID_FIELD_NUMBER: _ClassVar[int]
    AFTER_SEQ_ID_FIELD_NUMBER: _ClassVar[int]
    run_id: str
    after_seq_id: int
    def __init__(self, run_id: _Optional[str] = ..., after_seq_id: _Optional[int] = ...) -> None: ...
