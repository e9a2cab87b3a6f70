"""The trainer API's dataclasses, shared by the core and the SDK (torch-free, grpc-free).

The gRPC layer converts them to and from protobuf by field name (``strop.common.serde``); the SDK
returns them to callers, so pipelines never handle protobuf types.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

# the memory modes' enum and their one table live in memory_modes.py; the API names them from here too
from strop.common.memory_modes import (  # noqa: F401
    DEFAULT_MEMORY_MODE,
    MEMORY_MODES,
    MemoryFeatures,
    MemoryMode,
)

DEFAULT_TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


class Quantization(enum.StrEnum):
    UNSPECIFIED = "UNSPECIFIED"
    NF4 = "NF4"
    NONE = "NONE"


class KernelMode(enum.StrEnum):
    UNSPECIFIED = "UNSPECIFIED"
    ON = "ON"
    OFF = "OFF"
    ON_FP8 = "ON_FP8"  # ON, with the frozen bases' GEMMs in FP8 (opt-in, inexact: kernels/ops/fp8.py)
    ON_FP8_DX = "ON_FP8_DX"  # ON, with the frozen bases' backward dx GEMMs in FP8 (forward exact)


# the kernel modes that run FP8 base GEMMs → patch_model's fp8_base
FP8_KERNEL_MODES: dict[KernelMode, bool | str] = {KernelMode.ON_FP8: True, KernelMode.ON_FP8_DX: "dx"}


class SessionState(enum.StrEnum):
    LOADED = "LOADED"
    READY = "READY"
    CLOSED = "CLOSED"
    LOST = "LOST"


class DatasetFormat(enum.StrEnum):
    UNSPECIFIED = "UNSPECIFIED"
    TEXT = "TEXT"
    MESSAGES = "MESSAGES"
    PROMPT_COMPLETION = "PROMPT_COMPLETION"
    PREFERENCE = "PREFERENCE"
    TOKENS = "TOKENS"
    UNPAIRED_PREFERENCE = "UNPAIRED_PREFERENCE"  # prompt/completion/label (KTO)
    PROMPTS = "PROMPTS"  # messages ending with a user turn, plus the reference fields a grader reads (GRPO)


class TrainMethod(enum.StrEnum):
    UNSPECIFIED = "UNSPECIFIED"
    SFT = "SFT"
    DPO = "DPO"
    ORPO = "ORPO"
    KTO = "KTO"
    SIMPO = "SIMPO"
    GRPO = "GRPO"


# The methods that train on preferences and stream ``StepMetrics.dpo``; which of them score against a reference
# model (the base with the adapter disabled, or a frozen snapshot: ``dpo_reference``).
PREFERENCE_METHODS = frozenset({TrainMethod.DPO, TrainMethod.ORPO, TrainMethod.KTO, TrainMethod.SIMPO})
REFERENCE_METHODS = frozenset({TrainMethod.DPO, TrainMethod.KTO})
# The dataset format each method trains on (SFT: every other format).
METHOD_DATASET_FORMAT = {
    TrainMethod.DPO: DatasetFormat.PREFERENCE,
    TrainMethod.ORPO: DatasetFormat.PREFERENCE,
    TrainMethod.SIMPO: DatasetFormat.PREFERENCE,
    TrainMethod.KTO: DatasetFormat.UNPAIRED_PREFERENCE,
    TrainMethod.GRPO: DatasetFormat.PROMPTS,
}


class Retention(enum.StrEnum):
    """How an SFT job keeps what the base model knows (``trainer_svc/core/retention.py``)."""

    UNSPECIFIED = "UNSPECIFIED"  # job_config.with_retention: KL (the chat recipe) on chat data, else NONE
    NONE = "NONE"
    # before training, the base (adapter disabled) answers general prompts greedily; those conversations are
    # mixed into the training rows (``retention_rows`` of them)
    REPLAY = "REPLAY"
    # before training, the base answers the same general prompts (``retention_rows`` of them, finished or not);
    # every step adds ``retention_kl`` (0: KL_RETENTION_WEIGHT) times KL(base ‖ model) over a batch of those
    # answers' next-token distributions; they are not trained on (no cross-entropy on them)
    KL = "KL"


class Parallelism(enum.StrEnum):
    """How a job on several devices splits the work (``num_devices`` > 1; ``trainer_svc/core/fsdp.py``)."""

    UNSPECIFIED = "UNSPECIFIED"  # DDP
    DDP = "DDP"  # every rank holds the whole base; the adapters' gradients are averaged
    FSDP = "FSDP"  # FSDP2: the frozen base (16-bit or 4-bit) and the adapters sharded over the ranks


class JobState(enum.StrEnum):
    """A training job's state (and an export's: ``export_types.ExportState`` is this enum)."""

    UNSPECIFIED = "UNSPECIFIED"
    QUEUED = "QUEUED"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    INTERRUPTED = "INTERRUPTED"

    @property
    def terminal(self) -> bool:
        return self in TERMINAL_STATES


TERMINAL_STATES = frozenset({JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.INTERRUPTED})
# Guarded transitions: anything else is a bug and raises.
JOB_TRANSITIONS: dict[JobState, frozenset[JobState]] = {
    JobState.QUEUED: frozenset({JobState.RUNNING, JobState.FAILED, JobState.CANCELLED, JobState.INTERRUPTED}),
    JobState.RUNNING: frozenset(
        {JobState.SUCCEEDED, JobState.FAILED, JobState.CANCELLED, JobState.INTERRUPTED}
    ),
}
RESUMABLE_STATES = frozenset({JobState.CANCELLED, JobState.INTERRUPTED, JobState.FAILED, JobState.SUCCEEDED})


@dataclass
class ArtifactFile:
    name: str = ""
    size_bytes: int = 0
    sha256: str = ""


@dataclass
class Artifact:
    artifact_id: str = ""
    kind: str = ""
    path: str = ""
    sha256: str = ""
    size_bytes: int = 0
    files: list[ArtifactFile] = field(default_factory=list)
    metadata: dict[str, str] = field(default_factory=dict)
    created_at: float = 0.0


@dataclass
class LoraConfig:
    r: int = 16
    alpha: float = 32.0  # the facts recipe's (r 16, alpha 32); TRAIN_DEFAULTS' comment says how it was chosen
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: list(DEFAULT_TARGET_MODULES))
    use_rslora: bool = False
    seed: int = 0
    train_router: bool = False  # MoE models: the router trains too (PEFT modules_to_save); frozen by default


@dataclass
class ModelFacts:
    model_path: str = ""
    architecture: str = ""
    model_type: str = ""
    num_parameters: int = 0
    num_trainable_parameters: int = 0
    quantization: str = ""
    compute_dtype: str = ""
    device: str = ""
    device_memory_bytes: int = 0
    kernels_enabled: bool = False
    kernels_reason: str = ""
    max_seq_length: int = 0
    vocab_size: int = 0
    hidden_size: int = 0
    num_layers: int = 0
    has_chat_template: bool = False


@dataclass
class LoadModelRequest:
    model_path: str = ""
    quantization: Quantization = Quantization.UNSPECIFIED
    dtype: str = ""
    max_seq_length: int = 0
    kernels: KernelMode = KernelMode.UNSPECIFIED
    name: str = ""
    # every tenant may create training runs on it; only an admin loads one (see Sessions.open)
    shared: bool = False


@dataclass
class SessionInfo:
    session_id: str = ""
    name: str = ""
    state: SessionState = SessionState.LOADED
    facts: ModelFacts = field(default_factory=ModelFacts)
    lora: LoraConfig | None = None
    created_at: float = 0.0
    busy_job_id: str = ""
    tenant: str = ""  # who created it (empty with authentication off); other tenants get NOT_FOUND
    instance_id: str = ""  # the trainer instance (pod) whose device holds it: call that instance to use it
    # llama.cpp's pre-tokenizer for GGUF exports, predicted at load (strop.common.pretokenizers.predict);
    # empty when none is predicted, and the note then says whether a GGUF export will be refused
    gguf_pre_tokenizer: str = ""
    gguf_pre_tokenizer_note: str = ""
    shared: bool = False  # loaded shared: every tenant sees it and may create training runs on it


@dataclass
class DatasetHeader:
    name: str = ""
    format: DatasetFormat = DatasetFormat.UNSPECIFIED
    size_bytes: int = 0  # UploadDataset: what the client sends (0: not stated)
    sha256: str = ""


@dataclass
class DatasetInfo:
    dataset_id: str = ""
    name: str = ""
    format: DatasetFormat = DatasetFormat.UNSPECIFIED
    num_rows: int = 0
    size_bytes: int = 0
    sha256: str = ""
    created_at: float = 0.0
    tenant: str = ""


# What a zero/empty TrainConfig field becomes on the trainer (``job_config.with_defaults``); the CLI's --help and the
# docs/trainer.md show the same table. Per method where they differ: SFT's learning rate, batch, epochs, retention and
# replay rows are the setting bench/recipe_facts.py chose by measurement (the figures: bench/RESULTS.md and
# docs/trainer.md, "Teaching facts"). SFT on messages data with a chat template retains by default (CHAT_RECIPE_*
# below): it costs a generation pass before training, a KL batch a step and an evaluation after the job, and it is
# what keeps the base's general answers while the facts are learned. DPO's is TRL's (a preference shift is slower than SFT by design:
# raise it, or train more steps, when 10 steps show no margin). ORPO, KTO and SimPO take DPO's learning rate, and
# TRL's defaults for their own hyperparameters (ORPO's lambda is TRL's ORPOConfig.beta) but SimPO's beta: TRL's
# CPOConfig beta 0.1 is for CPO's sigmoid loss; SimPO's reward is a length-normalised log-prob and the SimPO paper
# trains with beta 2.0.
TRAIN_DEFAULTS: dict[str, object] = {
    "learning_rate": {"SFT": 2e-3, "DPO": 5e-6, "ORPO": 5e-6, "KTO": 5e-6, "SIMPO": 5e-6, "GRPO": 1e-5},
    "lr_scheduler": "linear",
    # SFT: enough passes over the rows to train on SFT_AUTO_EPOCHS_ROWS of them, 1 to SFT_AUTO_EPOCHS_MAX (auto_epochs)
    "num_epochs": {
        "SFT": "auto: 300 rows' worth, 1 to 10",
        "DPO": 1.0,
        "ORPO": 1.0,
        "KTO": 1.0,
        "SIMPO": 1.0,
        "GRPO": 1.0,
    },
    # GRPO: prompts per step (each sampled GrpoConfig.group_size times)
    "batch_size": {"SFT": 4, "DPO": 1, "ORPO": 1, "KTO": 1, "SIMPO": 1, "GRPO": 4},
    "gradient_accumulation_steps": 1,
    "max_length": "the session's max_seq_length",
    "optimizer": "adamw_torch",
    "max_grad_norm": 1.0,
    "dpo_beta": 0.1,
    "dpo_loss_type": "sigmoid",
    "dpo_reference": "base",
    "orpo_lambda": 0.1,
    "kto_beta": 0.1,
    "kto_desirable_weight": 1.0,
    "kto_undesirable_weight": 1.0,
    "simpo_beta": 2.0,
    "simpo_gamma": 0.5,
    "memory_mode": DEFAULT_MEMORY_MODE.value,
    # SFT on messages data with a chat template, single-process (job_config.with_retention): KL, with the chat
    # recipe's weight, neighbour questions and adapter scale (CHAT_RECIPE_*) where the request leaves them 0; NONE
    # for other data and methods
    "retention": {
        "SFT": "KL",
        "DPO": "NONE",
        "ORPO": "NONE",
        "KTO": "NONE",
        "SIMPO": "NONE",
        "GRPO": "NONE",
    },
    "retention_rows": 110,  # every built-in replay prompt
}

# retention KL's weight when the request leaves retention_kl 0 (with REPLAY, 0 means no KL term): the weight that
# still taught every fact in the measurements (heavier weights kept a few more general answers and held the facts
# back; bench/RESULTS.md, "the KL term alone")
KL_RETENTION_WEIGHT = 2.0

# The chat recipe: what an SFT job on messages data with a chat template runs with when its request leaves retention
# unset (and these fields 0): retention KL at this weight, this many neighbour questions for each start of the
# dataset's questions, and the finished adapter interpolated this far from the base toward the trained model
# (adapter_scale). Chosen with bench/recipe_facts.py on SmolLM2-135M-Instruct (bench/RESULTS.md and docs/trainer.md,
# "Teaching facts"): 30 new facts learned while the base keeps its right general answers.
CHAT_RECIPE_KL = 3.0
CHAT_RECIPE_NEIGHBOURS = 4

# adapter_scale's "choose by measurement": once a run completes, the finished adapter is tried at each of
# AUTO_ADAPTER_SCALES in turn (descending) on up to AUTO_SCALE_ROWS of the job's own training conversations,
# teacher-forced, and ends at the smallest scale before the first that reproduces fewer of their assistant messages
# word for word than the adapter as trained, or fewer of their tokens by more than AUTO_SCALE_TOKEN_SLACK of its
# count (the smallest move from the base that still fits what was taught; training/scale_adapter); the interval
# between that scale and the first that fits worse is then halved AUTO_SCALE_REFINE times (to 0.1 / 2**REFINE)
ADAPTER_SCALE_AUTO = -1.0
AUTO_ADAPTER_SCALES = (0.9, 0.8, 0.7, 0.6, 0.5)
AUTO_SCALE_ROWS = 64
AUTO_SCALE_TOKEN_SLACK = 0.01
AUTO_SCALE_REFINE = 2
# the chat recipe's adapter scale: chosen for each job by measurement on its own rows (auto keeps what the adapter as
# trained reproduces of them by construction, where a fixed scale may not; bench/RESULTS.md, docs/trainer.md)
CHAT_RECIPE_ADAPTER_SCALE = ADAPTER_SCALE_AUTO


def scale_text(scale: float) -> str:
    """An adapter_scale as a person writes it: "auto" for ADAPTER_SCALE_AUTO, else the number."""
    return "auto" if scale == ADAPTER_SCALE_AUTO else f"{scale:g}"


# A few dozen rows of facts need about ten passes before greedy answers repeat them (bench/RESULTS.md, "Teaching
# facts"); a dataset of thousands of rows, one. SFT's default epochs go between the two by the dataset's size.
SFT_AUTO_EPOCHS_ROWS = 300
SFT_AUTO_EPOCHS_MAX = 10


def auto_epochs(num_rows: int) -> float:
    """SFT's default ``num_epochs`` for a dataset of ``num_rows`` rows: ceil(300 / rows), between 1 and 10."""
    return float(max(1, min(SFT_AUTO_EPOCHS_MAX, -(-SFT_AUTO_EPOCHS_ROWS // max(num_rows, 1)))))


def train_default(name: str, method: TrainMethod) -> object:
    """The default of TrainConfig field ``name`` for ``method`` (see ``TRAIN_DEFAULTS``)."""
    value = TRAIN_DEFAULTS[name]
    return value[method.value] if isinstance(value, dict) else value


class GrpoLoss(enum.StrEnum):
    """How a GRPO step aggregates each token's term into its loss (trainer.proto cites each definition)."""

    UNSPECIFIED = "UNSPECIFIED"  # GRPO
    GRPO = (
        "GRPO"  # each sequence's token mean, averaged over sequences; advantages divided by the group's std
    )
    DR_GRPO = "DR_GRPO"  # token sum / (sequences x max_new_tokens); advantages not divided by the std
    DAPO = "DAPO"  # token sum / tokens of the step; advantages divided by the group's std


# What a zero GrpoConfig field becomes (``job_config.with_defaults``): TRL's GRPOConfig defaults where it has them
# (epsilon 0.2 both sides, beta 0, one iteration, temperature 1, top_p 1), group size 8 (TRL's num_generations),
# 256 new tokens (TRL's max_completion_length), the truncated-IS cap 2 (Yao et al. 2025's C).
GRPO_DEFAULTS: dict[str, object] = {
    "group_size": 8,
    "max_new_tokens": 256,
    "temperature": 1.0,
    "top_p": 1.0,
    "kl_coef": 0.0,
    "clip_eps_low": 0.2,
    "clip_eps_high": 0.2,
    "loss_type": "GRPO",
    "tis_cap": 2.0,
    "num_iterations": 1,
}


@dataclass
class GrpoConfig:
    """GRPO's settings (trainer.proto's GrpoConfig); zero fields take ``GRPO_DEFAULTS``."""

    grader: str = ""  # the OpenAI grader object, as JSON
    group_size: int = 0
    max_new_tokens: int = 0
    temperature: float = 0.0
    top_p: float = 0.0
    kl_coef: float = 0.0
    clip_eps_low: float = 0.0
    clip_eps_high: float = 0.0
    loss_type: GrpoLoss = GrpoLoss.UNSPECIFIED
    sequence_ratio: bool = False  # GSPO's sequence-level ratio
    tis_cap: float = 0.0  # negative: no truncated-IS correction
    num_iterations: int = 0


@dataclass
class TrainConfig:
    """Hyperparameters. Zero/empty fields take the defaults of ``TRAIN_DEFAULTS`` (see ``with_defaults``)."""

    method: TrainMethod = TrainMethod.UNSPECIFIED
    learning_rate: float = 0.0
    lr_scheduler: str = ""
    warmup_ratio: float = 0.0
    warmup_steps: int = 0
    max_steps: int = 0
    num_epochs: float = 0.0
    batch_size: int = 0
    gradient_accumulation_steps: int = 0
    max_length: int = 0
    packing: bool = False
    completion_only_loss: bool = False
    optimizer: str = ""
    weight_decay: float = 0.0
    max_grad_norm: float = 0.0
    dpo_beta: float = 0.0
    dpo_loss_type: str = ""
    checkpoint_every_steps: int = 0
    seed: int = 0
    gradient_checkpointing: bool = False
    max_prompt_length: int = 0
    dpo_reference: str = ""
    memory_mode: MemoryMode = MemoryMode.UNSPECIFIED
    memory_budget_gib: float = 0.0
    loss_on_all_tokens: bool = False
    num_devices: int = 0  # > 1: DDP over that many processes on the trainer's node (dist_worker)
    orpo_lambda: float = 0.0
    kto_beta: float = 0.0
    kto_desirable_weight: float = 0.0
    kto_undesirable_weight: float = 0.0
    simpo_beta: float = 0.0
    simpo_gamma: float = 0.0
    parallelism: Parallelism = Parallelism.UNSPECIFIED  # num_devices > 1: DDP (UNSPECIFIED) or FSDP
    num_nodes: int = 0  # > 1: nodes of num_devices processes each (an operator's job, not the service's)
    retention: Retention = Retention.UNSPECIFIED
    # REPLAY, KL: how many of the base's answers are mixed in or scored (at most one a replay prompt)
    retention_rows: int = 0
    # REPLAY: weight of a KL(base ‖ model) term on the replayed answers, added to each step's loss (0: none);
    # KL: the weight of that term, the answers out of the cross-entropy (0: KL_RETENTION_WEIGHT; CHAT_RECIPE_KL
    # under the chat recipe)
    retention_kl: float = 0.0
    # KL: for each distinct start of the training questions (their first words), this many questions of that form
    # the base writes and answers, scored by the KL term with the replay prompts' answers (0: none;
    # CHAT_RECIPE_NEIGHBOURS under the chat recipe)
    retention_neighbours: int = 0
    # the job's final adapter interpolated toward the base: every LoRA B factor times this, once training ends
    # (0: CHAT_RECIPE_ADAPTER_SCALE, auto, under the chat recipe, else 1, the adapter as trained; 1: as trained;
    # ADAPTER_SCALE_AUTO: chosen once training ends);
    # checkpoints stay as trained, so a resumed job continues the same run
    adapter_scale: float = 0.0
    # validation (a job's validation dataset; docs/validation.md): evaluate every N steps (0: once training ends)
    eval_every_steps: int = 0
    keep_best_checkpoint: bool = False  # the job's adapter is the evaluated checkpoint of least valid_loss
    eval_batch_size: int = 0  # rows per eval batch; 0: batch_size
    eval_rows: int = 0  # the periodic valid_loss covers the set's first eval_rows rows; 0: all of them
    grpo: GrpoConfig | None = None  # GRPO: grader, sampling and loss

    def ranks(self) -> int:
        """Processes the job trains on: num_nodes × num_devices (0 counts as 1)."""
        return max(self.num_nodes, 1) * max(self.num_devices, 1)


@dataclass
class Checkpoint:
    step: int = 0
    artifact: Artifact | None = None
    train_loss: float = 0.0  # the loss of the step it was taken at
    valid_loss: float | None = None  # the job's evaluation at this step, if it evaluated here
    full_valid_loss: float | None = None  # set when that evaluation covered the whole validation set
    valid_mean_token_accuracy: float | None = None  # SFT


@dataclass
class EvalMetrics:
    """One evaluation of a job's validation set (trainer.proto's EvalMetrics says what each loss is)."""

    step: int = 0
    valid_loss: float = 0.0  # over the eval_rows sample (the whole set when eval_rows is 0)
    full_valid_loss: float = 0.0  # over the whole set; meaningful when is_full
    valid_mean_token_accuracy: float | None = None  # SFT
    rows: int = 0
    tokens: int = 0
    is_full: bool = False
    full_valid_mean_token_accuracy: float | None = None  # SFT, when is_full
    dpo: DpoMetrics | None = None  # preference methods


@dataclass
class JobInfo:
    job_id: str = ""
    session_id: str = ""
    dataset_id: str = ""
    name: str = ""
    state: JobState = JobState.QUEUED
    config: TrainConfig = field(default_factory=TrainConfig)
    step: int = 0
    total_steps: int = 0
    error: str = ""
    adapter: Artifact | None = None
    last_checkpoint: Checkpoint | None = None
    resumed_from_job_id: str = ""
    created_at: float = 0.0
    started_at: float = 0.0
    finished_at: float = 0.0
    last_seq: int = 0
    last_loss: float = 0.0
    queue_position: int = 0  # QUEUED: 1 = next to start on the device; 0 otherwise
    # FAILED: the status a retry would meet — INVALID_ARGUMENT (fix the input: e.g. a learning rate that makes the
    # adapters non-finite), RESOURCE_EXHAUSTED (out of device memory), INTERNAL (a fault of the service)
    error_code: str = ""
    tenant: str = ""
    instance_id: str = ""  # the trainer instance (pod) that runs it; cancel it there
    loss_curve: Artifact | None = None  # PNG of loss by step (``loss.png``), stored as the job ends
    best_checkpoint: Checkpoint | None = None  # keep_best_checkpoint: what the job's adapter is
    metrics_csv: Artifact | None = (
        None  # ``metrics.csv`` (OpenAI's result-file columns), stored as the job ends
    )
    validation_dataset_id: str = ""
    last_eval: EvalMetrics | None = None


@dataclass
class DpoMetrics:
    """Every preference method's step metrics (DPO, ORPO, KTO, SimPO) as its TRL trainer logs them; what a
    method does not log stays 0 (trainer.proto says which method logs what)."""

    rewards_chosen: float = 0.0
    rewards_rejected: float = 0.0
    reward_margin: float = 0.0
    reward_accuracy: float = 0.0
    logps_chosen: float = 0.0
    logps_rejected: float = 0.0
    log_odds_ratio: float = 0.0
    log_odds_chosen: float = 0.0
    nll_loss: float = 0.0
    kl: float = 0.0


@dataclass
class GraderMetrics:
    name: str = ""
    mean_score: float = 0.0
    pass_rate: float = 0.0  # share of samples with score >= the grader's own pass_threshold


@dataclass
class RlMetrics:
    """A GRPO step's metrics (trainer.proto's RlMetrics says what each is)."""

    reward_mean: float = 0.0
    reward_std: float = 0.0
    graders: list[GraderMetrics] = field(default_factory=list)
    kl: float = 0.0
    clip_fraction: float = 0.0
    entropy: float = 0.0
    sampled_length_mean: float = 0.0
    sampled_length_max: int = 0
    sampling_tokens_per_second: float = 0.0
    training_tokens_per_second: float = 0.0
    sampling_seconds: float = 0.0
    training_seconds: float = 0.0
    tis_weight_mean: float = 0.0
    zero_std_groups: float = 0.0
    eval_reward_mean: float | None = None
    eval_graders: list[GraderMetrics] = field(default_factory=list)


@dataclass
class StepMetrics:
    step: int = 0
    total_steps: int = 0
    epoch: float = 0.0
    loss: float = 0.0
    learning_rate: float = 0.0
    grad_norm: float = 0.0
    tokens_per_second: float = 0.0
    tokens_seen: int = 0
    peak_memory_bytes: int = 0
    step_seconds: float = 0.0
    dpo: DpoMetrics | None = None
    rl: RlMetrics | None = None  # GRPO


@dataclass
class RetentionMetrics:
    """The forgetting metric of an SFT job (``trainer_svc/core/retention.py``): the base's greedy answers to held-out
    general prompts, checked teacher-forced on the model after training."""

    step: int = 0
    held_out: int = 0  # held-out answers the base finished within the limit (the metric's denominator)
    kept: int = 0  # of them, the answers the trained model still gives word for word (every token its top-1)
    token_agreement: float = 0.0  # share of their tokens that are still the model's top-1
    mean_nll: float = 0.0  # mean over answers of the per-token negative log-likelihood (nats)
    replay_rows: int = 0  # base answers mixed into the training rows (REPLAY)
    adapter_scale: float = 0.0  # the scale the job's adapter ended with (1: as trained; auto: the one chosen)


@dataclass
class StateChange:
    state: JobState = JobState.QUEUED
    message: str = ""


@dataclass
class LogMessage:
    level: str = "info"
    message: str = ""


@dataclass
class JobEvent:
    """One numbered record of a job. Exactly one of the payload fields is set."""

    job_id: str = ""
    seq: int = 0
    time: float = 0.0
    state: StateChange | None = None
    step: StepMetrics | None = None
    checkpoint: Checkpoint | None = None
    adapter: Artifact | None = None
    log: LogMessage | None = None
    retention: RetentionMetrics | None = None
    eval: EvalMetrics | None = None

    @property
    def kind(self) -> str:
        for name in ("state", "step", "checkpoint", "adapter", "log", "retention", "eval"):
            if getattr(self, name) is not None:
                return name
        return ""
