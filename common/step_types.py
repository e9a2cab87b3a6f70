"""The step API's types (training runs, primitives, futures): one set of dataclasses from the SDK to the device
worker, converted to and from ``strop.v1`` messages by field name (``strop.common.serde``). No torch here.

Names follow the Tinker SDK 0.38 wire (docs/design/tinker-wire.md) so the gateway maps them field for field:
``Datum{model_input, loss_fn_inputs}``, ``TensorData{dtype, shape, …}``, ``AdamParams{learning_rate, beta1, beta2,
eps, weight_decay, grad_clip_norm}``, ``SamplingParams{max_tokens, temperature, top_p, top_k, stop…, seed}``.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class LossFn(enum.StrEnum):
    """Tinker's built-in losses; ``strop.kernels.losses.rl.LOSSES`` computes each, keyed by :attr:`wire`."""

    UNSPECIFIED = "UNSPECIFIED"
    CROSS_ENTROPY = "CROSS_ENTROPY"
    IMPORTANCE_SAMPLING = "IMPORTANCE_SAMPLING"
    PPO = "PPO"
    CISPO = "CISPO"
    DRO = "DRO"

    @property
    def wire(self) -> str:
        """Tinker's name (``cross_entropy``, ``ppo``, …)."""
        return self.value.lower()

    @classmethod
    def parse(cls, name: str | LossFn) -> LossFn:
        """A loss by Tinker's name or the enum; ValueError naming the choices otherwise."""
        if isinstance(name, LossFn):
            return name
        try:
            return cls[str(name).upper()] if str(name).upper() != "UNSPECIFIED" else cls[""]
        except KeyError:
            choices = ", ".join(m.wire for m in cls if m is not cls.UNSPECIFIED)
            raise ValueError(f"unknown loss_fn {name!r}; one of {choices}") from None


class PrimitiveKind(enum.StrEnum):
    UNSPECIFIED = "UNSPECIFIED"
    FORWARD_BACKWARD = "FORWARD_BACKWARD"
    FORWARD = "FORWARD"
    OPTIM_STEP = "OPTIM_STEP"
    SAMPLE = "SAMPLE"
    SAVE_WEIGHTS = "SAVE_WEIGHTS"
    SAVE_STATE = "SAVE_STATE"
    LOAD_STATE = "LOAD_STATE"
    SAVE_WEIGHTS_FOR_SAMPLER = "SAVE_WEIGHTS_FOR_SAMPLER"


class FutureState(enum.StrEnum):
    UNSPECIFIED = "UNSPECIFIED"
    PENDING = "PENDING"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"

    @property
    def done(self) -> bool:
        return self in (FutureState.SUCCEEDED, FutureState.FAILED, FutureState.CANCELLED)


# Tinker's AdamParams defaults (types/optimizer.py of SDK 0.38): the one place every layer reads them from.
ADAM_DEFAULTS = {
    "learning_rate": 1e-4,
    "beta1": 0.9,
    "beta2": 0.95,
    "eps": 1e-12,
    "weight_decay": 0.0,
    "grad_clip_norm": 0.0,
}
# LoRA alpha for a wire that carries only the rank (Tinker's SDK LoraConfig has rank, seed, train_unembed,
# train_mlp, train_attn and no alpha: tinker src/tinker/types/lora_config.py). 32 is what Tinker's own cookbook
# documents for its adapters ("lora_alpha | 32", tinker-cookbook tinker_cookbook/weights/README.md, "LoRA Rank and
# Alpha"; hyperparam_utils.get_lora_lr_over_full_finetune_lr(lora_alpha=32)) and SkyRL tx's "tinker default".
DEFAULT_RUN_LORA_ALPHA = 32.0


@dataclass
class AdamParams:
    """AdamW's hyperparameters for one step; None takes ``ADAM_DEFAULTS`` (decoupled weight decay; a
    ``grad_clip_norm`` of 0 means no clipping, otherwise the global norm is clipped to it)."""

    learning_rate: float | None = None
    beta1: float | None = None
    beta2: float | None = None
    eps: float | None = None
    weight_decay: float | None = None
    grad_clip_norm: float | None = None

    def resolved(self) -> dict[str, float]:
        return {
            k: (ADAM_DEFAULTS[k] if getattr(self, k) is None else float(getattr(self, k)))
            for k in ADAM_DEFAULTS
        }


@dataclass
class RunLora:
    """A run's adapter: Tinker's LoRA config (rank, seed and which parts train) plus strop's alpha."""

    rank: int = 32
    alpha: float | None = None  # None: DEFAULT_RUN_LORA_ALPHA
    train_attn: bool = True
    train_mlp: bool = True
    train_unembed: bool = False  # a LoRA on lm_head; its log-probs take the recomputing chunked path
    seed: int | None = None  # None: drawn at random (and reported in the run)


@dataclass
class CreateTrainingRun:
    session_id: str = ""
    lora: RunLora | None = None
    optimizer: AdamParams | None = None  # the run's defaults for OptimStep fields left unset
    name: str = ""
    from_state: str = ""  # a run-state artifact id: the adapter (and with with_optimizer, Adam's state, step)
    with_optimizer: bool = True


@dataclass
class TrainingRunInfo:
    run_id: str = ""
    name: str = ""
    session_id: str = ""
    tenant: str = ""
    base_model: str = ""
    lora: RunLora = field(default_factory=RunLora)
    optimizer: AdamParams = field(default_factory=AdamParams)
    target_modules: list[str] = field(default_factory=list)
    num_trainable_parameters: int = 0
    step: int = 0  # optimizer steps taken
    has_gradients: bool = False
    next_seq_id: int = 1  # the seq id a request without one gets
    pending_futures: int = 0
    created_at: float = 0.0
    last_activity_at: float = 0.0
    sampler_ids: list[str] = field(default_factory=list)
    counts: list[Metric] = field(default_factory=list)  # primitives run, by kind


@dataclass
class TensorData:
    """A per-token loss input: ``int_values`` for int64 (``target_tokens``), ``float_values`` for float32;
    ``shape`` [N] (one value per position of ``model_input``)."""

    dtype: str = "float32"
    shape: list[int] = field(default_factory=list)
    float_values: list[float] = field(default_factory=list)
    int_values: list[int] = field(default_factory=list)

    @property
    def values(self) -> list:
        return self.int_values if self.dtype == "int64" else self.float_values


@dataclass
class NamedTensor:
    name: str = ""
    tensor: TensorData = field(default_factory=TensorData)


@dataclass
class Datum:
    """Token ids, and per-token loss inputs aligned with them: position i predicts ``target_tokens[i]``."""

    model_input: list[int] = field(default_factory=list)
    loss_fn_inputs: list[NamedTensor] = field(default_factory=list)

    @classmethod
    def of(cls, model_input: list[int], **inputs: list) -> Datum:
        """``Datum.of(tokens, target_tokens=[…], weights=[…])``: ints for target_tokens, floats otherwise; nested
        lists for [N, K] (cross_entropy over K candidates per position)."""
        named = []
        for name, values in inputs.items():
            vals = list(values)
            shape = [len(vals)]
            if vals and isinstance(
                vals[0], list | tuple
            ):  # [N, K]: cross_entropy's K candidates per position
                shape = [len(vals), len(vals[0])]
                vals = [v for row in vals for v in row]
            if name == "target_tokens":
                t = TensorData("int64", shape, int_values=[int(v) for v in vals])
            else:
                t = TensorData("float32", shape, float_values=[float(v) for v in vals])
            named.append(NamedTensor(name, t))
        return cls(list(model_input), named)

    def inputs(self) -> dict[str, TensorData]:
        return {n.name: n.tensor for n in self.loss_fn_inputs}


@dataclass
class Metric:
    name: str = ""
    value: float = 0.0


@dataclass
class ForwardBackwardRequest:
    run_id: str = ""
    seq_id: int = 0  # 0: the next one of the run
    data: list[Datum] = field(default_factory=list)
    loss_fn: LossFn = LossFn.CROSS_ENTROPY
    loss_fn_config: list[Metric] = field(default_factory=list)
    forward_only: bool = False


@dataclass
class DatumOutput:
    logprobs: list[float] = field(default_factory=list)


@dataclass
class ForwardBackwardOutput:
    loss_fn_outputs: list[DatumOutput] = field(default_factory=list)
    metrics: list[Metric] = field(default_factory=list)  # keys "name:reduction" (Tinker's: loss:sum)


@dataclass
class OptimStepRequest:
    run_id: str = ""
    seq_id: int = 0
    adam_params: AdamParams | None = None


@dataclass
class OptimStepOutput:
    metrics: list[Metric] = field(default_factory=list)


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: list[int] = field(default_factory=list)
    stop_strings: list[str] = field(default_factory=list)
    seed: int | None = None


@dataclass
class SampleRequest:
    run_id: str = ""  # the run's live adapter, or
    sampler_id: str = ""  # a snapshot from SaveWeightsForSampler
    prompt: list[int] = field(default_factory=list)
    num_samples: int = 1
    params: SamplingParams = field(default_factory=SamplingParams)
    prompt_logprobs: bool = False


@dataclass
class SampledSequence:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stop_reason: str = ""  # "stop" | "length"


@dataclass
class SampleOutput:
    sequences: list[SampledSequence] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)  # NaN at position 0 (no prediction)


@dataclass
class SaveRequest:
    run_id: str = ""
    seq_id: int = 0
    name: str = ""  # the artifact id (SaveWeights, SaveState) or snapshot name; "" picks one


@dataclass
class LoadStateRequest:
    run_id: str = ""
    seq_id: int = 0
    artifact_id: str = ""
    with_optimizer: bool = True


@dataclass
class SaveOutput:
    artifact_id: str = ""  # the artifact written ("" for a snapshot kept only in memory)
    sampler_id: str = ""  # SaveWeightsForSampler: the snapshot Sample reads
    step: int = 0


@dataclass
class Future:
    future_id: str = ""
    run_id: str = ""
    seq_id: int = 0
    kind: PrimitiveKind = PrimitiveKind.UNSPECIFIED
    state: FutureState = FutureState.PENDING
    error: str = ""
    error_code: str = ""  # the gRPC code name of a failure (INVALID_ARGUMENT: the request; INTERNAL: ours)
    created_at: float = 0.0
    finished_at: float = 0.0
    forward_backward: ForwardBackwardOutput | None = None
    optim_step: OptimStepOutput | None = None
    sample: SampleOutput | None = None
    save: SaveOutput | None = None
