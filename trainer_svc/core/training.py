"""Running one SFT, DPO, ORPO, KTO or SimPO job with TRL on a session's PEFT model.

TRL's ``SFTTrainer``/``DPOTrainer``/``ORPOTrainer``/``KTOTrainer``/``CPOTrainer`` (SimPO is its ``loss_type="simpo"``
without the BC term: ``trl_preference_config``) are the engines (with the kernels on, DPO, ORPO, KTO and SimPO
run strop's chunked losses inside them: ``strop_dpo_trainer_class``, ``strop_preference_trainer_class``); a
callback turns their logs into step events, publishes each checkpoint into the artifact store, and stops the
loop between steps when the job is cancelled or the service drains (saving a checkpoint at the step reached).
The reference model for DPO and KTO is the same model with the adapter disabled (or, on request, a frozen
snapshot of the adapter), so no second copy of the base weights is ever loaded.
"""

from __future__ import annotations

import logging
import os
import resource
import shutil
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from strop.common.errors import InvalidArgument
from strop.common.trainer_types import (
    ADAPTER_SCALE_AUTO,
    AUTO_ADAPTER_SCALES,
    AUTO_SCALE_REFINE,
    AUTO_SCALE_ROWS,
    AUTO_SCALE_TOKEN_SLACK,
    MEMORY_MODES,
    PREFERENCE_METHODS,
    REFERENCE_METHODS,
    DatasetFormat,
    DpoMetrics,
    EvalMetrics,
    Retention,
    RetentionMetrics,
    StepMetrics,
    TrainConfig,
    TrainMethod,
)
from strop.trainer_svc.core import fsdp, job_config, moe, retention
from strop.trainer_svc.core.evaluation import (
    Evaluator,
    Validating,
    ValidationSet,
    eval_dataset,
    eval_schedule,
)
from strop.trainer_svc.core.guard import BrokenTraining, make_guard, names
from strop.trainer_svc.core.job_config import OPTIMIZERS, sft_rows
from strop.trainer_svc.core.model_loading import LoadedModel, drop_inference_weights, repacked_4bit_layers

log = logging.getLogger("strop.trainer")


@dataclass
class StopRequest:
    reason: str  # "cancel" | "interrupt"


class JobControl:
    """Shared between the job thread and RPC threads: a stop flag read between steps, until the run completes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.stop: StopRequest | None = None
        self.completed = False

    def request_stop(self, reason: str) -> None:
        with self._lock:
            if self.stop is None and not self.completed:
                self.stop = StopRequest(reason)

    def complete(self) -> bool:
        """Latch a run that ended without a stop as completed: a stop asked from here on is too late to change what
        the job ends with (its adapter, already final or scaled, and its SUCCEEDED). True when the run completed."""
        with self._lock:
            self.completed = self.stop is None
            return self.completed


@dataclass
class Sinks:
    """How the engine reports: each step's metrics, and each checkpoint directory HF wrote."""

    on_step: Callable[[StepMetrics], None]
    on_checkpoint: Callable[[int, Path], None]
    on_start: Callable[[int], None]
    on_retention: Callable[[RetentionMetrics], None] | None = None  # the forgetting metric (SFT on messages)
    on_eval: Callable[[EvalMetrics], None] | None = None  # each evaluation of the validation set


class StepEventsOffThread:
    """A job's sinks with each step's ``on_step`` run on a writer thread, in order, while the job thread goes on.

    HF's Trainer reads the loss at every step's log, so when the step's event is stored (a database commit,
    synced to disk) and the next batch collated, the GPU has nothing queued: that host time is GPU idle time
    between steps (bench/RESULTS.md: "The service's time between steps"). On the writer thread the
    commit overlaps the next step's launches (sqlite and the PostgreSQL driver release the GIL while they wait).
    Every other sink first waits for the step events before it, and :meth:`wait` (at the end of the run) for all,
    so the job's events keep the order of the calls; a failed step write is raised on the job thread at the next
    sink call or at :meth:`wait`. Each write runs in the job thread's context (its log lines carry the job's id).
    """

    def __init__(self, sinks: Sinks) -> None:
        from concurrent.futures import ThreadPoolExecutor

        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="strop-step-events")
        self._pending: list = []
        self._sinks = sinks

    def _submit_step(self, metrics: StepMetrics) -> None:
        import contextvars

        self._raise_failed()
        self._pending.append(self._pool.submit(contextvars.copy_context().run, self._sinks.on_step, metrics))

    def _raise_failed(self) -> None:
        done = [f for f in self._pending if f.done()]
        self._pending = [f for f in self._pending if not f.done()]
        for f in done:
            f.result()  # a write's exception, on the job thread

    def wait(self) -> None:
        """Until every step event given so far is stored; raises the first failed write's exception."""
        pending, self._pending = self._pending, []
        for f in pending:
            f.result()

    def _after_steps(self, sink: Callable | None) -> Callable | None:
        if sink is None:
            return None

        def call(*args):
            self.wait()
            return sink(*args)

        return call

    def sinks(self) -> Sinks:
        s = self._sinks
        return Sinks(
            on_step=self._submit_step,
            on_checkpoint=self._after_steps(s.on_checkpoint),
            on_start=self._after_steps(s.on_start),
            on_retention=self._after_steps(s.on_retention),
            on_eval=self._after_steps(s.on_eval),
        )

    def close(self) -> None:
        """Wait for the writes and stop the thread (without raising: for a ``finally``)."""
        self._pool.shutdown(wait=True)


def _peak_memory(device: str) -> int:
    import torch

    if device.startswith("cuda"):
        return int(torch.cuda.max_memory_allocated(device))
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


# DpoMetrics field <- the key TRL's preference trainers log it under (each logs the ones its loss has)
PREFERENCE_LOG_KEYS = {
    "rewards_chosen": "rewards/chosen",
    "rewards_rejected": "rewards/rejected",
    "reward_margin": "rewards/margins",
    "reward_accuracy": "rewards/accuracies",
    "logps_chosen": "logps/chosen",
    "logps_rejected": "logps/rejected",
    "log_odds_ratio": "log_odds_ratio",
    "log_odds_chosen": "log_odds_chosen",
    "nll_loss": "nll_loss",
    "kl": "kl",
}


class DeviceTokenCount:
    """Mixed into every job's TRL trainer class: HF's ``include_num_input_tokens_seen`` count held on the device
    until it is logged.

    HF's Trainer adds each micro-batch's token count to ``state.num_input_tokens_seen`` with ``.item()`` right
    after ``training_step`` has launched the backward: the host waits there for the whole backward, and the GPU
    then idles while the host runs the gradient clipping and the optimizer's Python. Here each count is the same
    tensor HF reads (the attention mask's sum, else the non-pad ids, else every id; gathered over the processes),
    kept unread; they are added to the state (one read) where the loop has already read the loss, in ``log``, and
    before a checkpoint writes the state. The step events (``tokens_seen``, tokens/s) and the saved state hold the
    same integers as HF's count.
    """

    def _track_num_input_tokens(self, inputs) -> None:
        import torch

        mode = self.args.include_num_input_tokens_seen
        name = getattr(self.model, "main_input_name", "input_ids")
        pad = getattr(self.processing_class, "pad_token_id", None)
        if mode == "no" or name not in inputs:
            return super()._track_num_input_tokens(inputs)  # nothing to count, or HF's warning
        if mode != "non_padding":
            count = inputs[name].numel()
        elif "attention_mask" in inputs:
            count = inputs["attention_mask"].sum()
        elif pad is not None:
            count = (inputs[name] != pad).sum()
        else:
            return super()._track_num_input_tokens(inputs)  # HF warns and counts every id
        count = torch.as_tensor(count, device=self.args.device, dtype=torch.int64)
        self.__dict__.setdefault("_strop_input_tokens", []).append(self.accelerator.gather(count).sum())

    def _strop_fold_input_tokens(self) -> None:
        pending = self.__dict__.get("_strop_input_tokens")
        if pending:
            import torch

            self.state.num_input_tokens_seen += int(torch.stack(pending).sum())
            pending.clear()

    def log(self, logs: dict[str, float], *args, **kwargs) -> None:
        self._strop_fold_input_tokens()
        super().log(logs, *args, **kwargs)

    def _save_checkpoint(self, *args, **kwargs):
        self._strop_fold_input_tokens()
        return super()._save_checkpoint(*args, **kwargs)


class LeanStepLoop:
    """Mixed into every job's TRL trainer class: HF's per-step walks over the whole model done with a fraction of the
    Python, with the same effects.

    Each step HF's loop calls ``model.train()`` (in ``training_step``: a recursion over every module, ~2,700 in an
    8B PEFT model, each flag set through ``nn.Module.__setattr__``), ``floating_point_ops`` (``num_parameters``: every
    module and parameter walked again, for ``total_flos``), the gradient clipping and, after the optimizer step,
    ``model.zero_grad()`` (both read every parameter's ``.grad``, a 4-bit base's through bitsandbytes' Python
    ``__torch_function__``). ``zero_grad`` and the next step's ``train()`` run after the step's one host read (the
    gradient guard's), while the GPU has nothing queued; the library path's plain loop does none of this
    (bench/RESULTS.md: "the service's host work a step"). During ``train``:

    - the model's ``train(True)`` returns at once when every module is already in training mode (checked over the
      modules listed at its first call); otherwise, and for ``train(False)``/``eval()``, it is the model's own;
    - its ``zero_grad()`` sets each parameter's gradient to None as ``nn.Module.zero_grad`` does, reading ``.grad``
      with subclass dispatch off (for a property read bitsandbytes' override returns what torch returns);
    - the FLOP count's parameter count (``num_parameters(exclude_embeddings=True)``, which no step changes) is taken
      once: HF's ``6 × input ids × parameters``, the same integers in the state;
    - a single-process job's clipping is handed the parameters that hold a gradient (read as ``zero_grad`` reads
      them): those torch's ``clip_grad_norm_`` keeps of ``model.parameters()``, in order, so the same norm.

    The lists are taken at the first call of each, inside the loop, after accelerate has prepared the model (FSDP2
    replaces the parameters then). A model accelerate wraps (DDP) gets HF's calls on the wrapper, unchanged.
    """

    # False: HF's loop as HF runs it (the bench's service-hfloop and the equal-effects test's reference)
    enabled: bool = True

    def train(self, *args, **kwargs):
        from accelerate.utils import DistributedType
        from transformers import Trainer
        from transformers.utils import is_sagemaker_mp_enabled

        # decided once a train(): the clipping's own list where one process clips; the FLOP count's parameters
        # counted once where HF's count is the one in use
        self._strop_clip_params = (
            []
            if self.enabled
            and self.accelerator.distributed_type == DistributedType.NO
            and not is_sagemaker_mp_enabled()
            else None
        )
        hfs = getattr(super().floating_point_ops, "__func__", None) is Trainer.floating_point_ops
        self._strop_flops = hfs and self.enabled and hasattr(self.model, "num_parameters")
        self._strop_flop_params = None
        if not self.enabled:
            return super().train(*args, **kwargs)
        model = self.model
        installed = {"train": self._strop_lean_train(model), "zero_grad": self._strop_lean_zero_grad(model)}
        before = {name: model.__dict__.get(name) for name in installed}
        model.__dict__.update(installed)
        try:
            return super().train(*args, **kwargs)
        finally:
            for name, previous in before.items():
                if previous is None:
                    model.__dict__.pop(name, None)
                else:
                    model.__dict__[name] = previous

    @staticmethod
    def _strop_lean_train(model):
        own = model.train  # the model's train as it stands (its class's, or an instance's)
        modules: list = []

        def train(mode: bool = True):
            if not modules:
                modules.extend(model.modules())
            if mode and all(m.training for m in modules):
                return model
            return own(mode)

        return train

    @staticmethod
    def _strop_lean_zero_grad(model):
        import torch

        own = model.zero_grad
        params: list = []

        def zero_grad(set_to_none: bool = True) -> None:
            if not set_to_none or getattr(model, "_is_replica", False):
                return own(set_to_none)  # zeroing in place, or a replica (torch warns): the model's own
            if not params:
                params.extend(model.parameters())
            with torch._C.DisableTorchFunctionSubclass():
                for p in params:
                    if p.grad is not None:
                        p.grad = None
            return None

        return zero_grad

    def _clip_grad_norm(self, model):
        params = getattr(self, "_strop_clip_params", None)
        if params is None:
            return super()._clip_grad_norm(model)
        import torch

        if not params:
            params.extend(model.parameters())
        with torch._C.DisableTorchFunctionSubclass():
            with_grads = [p for p in params if p.grad is not None]
        # the parameters torch's clip_grad_norm_ keeps of model.parameters() (those with a gradient), in order
        return self.accelerator.clip_grad_norm_(with_grads, self.args.max_grad_norm)

    def floating_point_ops(self, inputs) -> int:
        name = getattr(self.model, "main_input_name", "input_ids")
        if not getattr(self, "_strop_flops", False) or name not in inputs:
            return super().floating_point_ops(inputs)  # a trainer's own count, or HF's 0
        if self._strop_flop_params is None:
            self._strop_flop_params = self.model.num_parameters(exclude_embeddings=True)
        return 6 * inputs[name].numel() * self._strop_flop_params


def _make_callback(loaded: LoadedModel, control: JobControl, sinks: Sinks, method: TrainMethod):
    from transformers import TrainerCallback

    class StropCallback(TrainerCallback):
        def __init__(self) -> None:
            self.t0 = time.perf_counter()
            self.tokens_before = 0

        def on_train_begin(self, args, state, control_, **kw):
            sinks.on_start(int(state.max_steps))

        def on_step_begin(self, args, state, control_, **kw):
            self.t0 = time.perf_counter()
            self.tokens_before = int(getattr(state, "num_input_tokens_seen", 0) or 0)

        def on_step_end(self, args, state, control_, **kw):
            if control.stop is not None:
                control_.should_training_stop = True
                control_.should_save = True  # keep the adapter and optimizer as they stand
            return control_

        def on_log(self, args, state, control_, logs=None, **kw):
            logs = logs or {}
            if "loss" not in logs:
                return
            dt = time.perf_counter() - self.t0
            tokens = int(getattr(state, "num_input_tokens_seen", 0) or 0)
            dpo = None
            if method in PREFERENCE_METHODS:
                dpo = DpoMetrics(**{f: float(logs.get(key, 0.0)) for f, key in PREFERENCE_LOG_KEYS.items()})
            sinks.on_step(
                StepMetrics(
                    step=int(state.global_step),
                    total_steps=int(state.max_steps),
                    epoch=float(state.epoch or 0.0),
                    loss=float(logs["loss"]),
                    learning_rate=float(logs.get("learning_rate", 0.0)),
                    grad_norm=float(logs.get("grad_norm", 0.0) or 0.0),
                    tokens_per_second=(tokens - self.tokens_before) / dt if dt > 0 else 0.0,
                    tokens_seen=tokens,
                    peak_memory_bytes=_peak_memory(loaded.device),
                    step_seconds=dt,
                    dpo=dpo,
                )
            )

        def on_save(self, args, state, control_, **kw):
            ckpt = Path(args.output_dir) / f"checkpoint-{state.global_step}"
            if ckpt.is_dir():
                sinks.on_checkpoint(int(state.global_step), ckpt)

    return StropCallback()


def _training_args(cfg: TrainConfig, loaded: LoadedModel, work_dir: Path) -> dict:
    on_cuda = loaded.device.startswith("cuda")
    warmup = cfg.warmup_steps if cfg.warmup_steps else cfg.warmup_ratio
    return dict(
        output_dir=str(work_dir),
        per_device_train_batch_size=cfg.batch_size,
        per_device_eval_batch_size=cfg.eval_batch_size or cfg.batch_size,
        gradient_accumulation_steps=cfg.gradient_accumulation_steps,
        learning_rate=cfg.learning_rate,
        lr_scheduler_type=cfg.lr_scheduler,
        warmup_steps=warmup,
        max_steps=cfg.max_steps if cfg.max_steps > 0 else -1,
        num_train_epochs=cfg.num_epochs,
        optim=OPTIMIZERS[cfg.optimizer],
        weight_decay=cfg.weight_decay,
        max_grad_norm=cfg.max_grad_norm if cfg.max_grad_norm > 0 else 0.0,
        seed=cfg.seed,
        data_seed=cfg.seed,
        logging_steps=1,
        save_strategy="steps" if cfg.checkpoint_every_steps > 0 else "no",
        save_steps=cfg.checkpoint_every_steps or 500,
        save_total_limit=1,
        report_to="none",
        disable_tqdm=True,
        # a bf16 session computes under bf16 autocast on any device (fp32 adapters over a bf16 base, as on CUDA)
        bf16=loaded.autocast_dtype() == "bfloat16",
        fp16=loaded.autocast_dtype() == "float16",
        use_cpu=not on_cuda,
        gradient_checkpointing=cfg.gradient_checkpointing,
        # also without checkpointing: max_speed turns it on for some layers, and TRL re-enables it with these
        # kwargs around every DPO reference pass
        gradient_checkpointing_kwargs={"use_reentrant": False},
        dataloader_num_workers=0,
        include_num_input_tokens_seen="non_padding",
        dataset_num_proc=None,
        **fsdp.training_args(cfg, loaded.model),  # FSDP2 for a job on ranks that asks for it; else nothing
    )


def build_trainer(
    loaded: LoadedModel,
    rows: list[dict],
    fmt: DatasetFormat,
    cfg: TrainConfig,
    work_dir: Path,
    control: JobControl,
    sinks: Sinks,
    callbacks: Sequence = (),
    validation: ValidationSet | None = None,
):
    """A TRL trainer for this job, with strop's callback installed (and HF's log printer removed), then
    ``callbacks`` (a distributed job's stop agreement, ``dist_worker``); with a ``validation`` set, its evaluations
    (``evaluation``)."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer = _build_trl_trainer(loaded, rows, fmt, cfg, work_dir, control, sinks, validation)
    if validation is not None:
        Evaluator(cfg, sinks.on_eval or (lambda m: None), PREFERENCE_LOG_KEYS).attach(trainer)
        trainer.add_callback(eval_schedule(cfg.eval_every_steps))
    from strop.kernels.models.hf import keep_trainable_fp32

    keep_trainable_fp32(loaded.model)  # TRL casts adapters to bf16 on 4-bit bases
    fsdp.gather_as_stored(trainer)  # an FSDP job computes what one process computes
    trainer.add_callback(make_guard(loaded.model))
    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)
    for cb in callbacks:
        trainer.add_callback(cb)
    return trainer


def quiet_dataset_progress() -> None:
    """TRL prepares each job's dataset with datasets' map/filter, whose progress bars ("Tokenizing train
    dataset", "Dropping fully masked examples") would land in the service log once per job; the job's own
    events say it all."""
    import datasets

    datasets.disable_progress_bars()


def _build_trl_trainer(
    loaded: LoadedModel,
    rows: list[dict],
    fmt: DatasetFormat,
    cfg: TrainConfig,
    work_dir: Path,
    control: JobControl,
    sinks: Sinks,
    validation: ValidationSet | None = None,
):
    from datasets import Dataset

    quiet_dataset_progress()
    args = _training_args(cfg, loaded, work_dir)
    callback = _make_callback(loaded, control, sinks, cfg.method)

    def held_out(shape: Callable[[list[dict]], list[dict]], trainer_cls: type) -> tuple[type, dict]:
        """The trainer class (with the token count held on the device and HF's per-step walks of the model
        trimmed) and its eval_dataset kwarg: the validation rows shaped like the training rows."""
        counting = type(trainer_cls.__name__, (LeanStepLoop, DeviceTokenCount, trainer_cls), {})
        if validation is None:
            return counting, {}
        validating = type(trainer_cls.__name__, (Validating, counting), {})
        return validating, {"eval_dataset": eval_dataset(shape(validation.rows))}

    if cfg.method is TrainMethod.SFT:
        from trl import SFTConfig, SFTTrainer

        sft, masked = sft_rows(rows, fmt, cfg, loaded.tokenizer)
        sft_args = SFTConfig(
            **args,
            max_length=cfg.max_length,
            packing=cfg.packing,
            eval_packing=False,  # validation rows one a sequence: eval_rows counts rows
            completion_only_loss=masked,
            dataset_text_field="text",
            **moe_loss_args(loaded),
        )
        dataset = Dataset.from_list(sft)
        trainer_cls = SFTTrainer
        if loaded.facts.kernels_enabled:
            # TRL's fused LM head answered by strop's per-token log-prob kernel (one head GEMM fewer a step)
            from strop.kernels.trainers import strop_sft_trainer_class

            trainer_cls = strop_sft_trainer_class()
        trainer_cls, eval_kw = held_out(lambda r: sft_rows(r, fmt, cfg, loaded.tokenizer)[0], trainer_cls)
        return trainer_cls(
            model=loaded.model,
            args=sft_args,
            train_dataset=dataset,
            processing_class=loaded.tokenizer,
            callbacks=[callback],
            **eval_kw,
        )
    if cfg.method is not TrainMethod.DPO:
        trainer = _build_preference_trainer(loaded, rows, cfg, args, callback, held_out)
        _use_reference(trainer, cfg)
        return trainer
    from trl import DPOConfig, DPOTrainer

    dpo_args = DPOConfig(**args, beta=cfg.dpo_beta, loss_type=[cfg.dpo_loss_type], max_length=cfg.max_length)
    dataset = Dataset.from_list(preference_rows(rows, cfg.method))
    if loaded.facts.kernels_enabled:
        # strop's chunked DPO loss: per-token log-probs chunk by chunk, gradients computed in the forward.
        from strop.kernels.trainers import strop_dpo_trainer_class

        trainer_cls = strop_dpo_trainer_class()
    else:
        trainer_cls = DPOTrainer
    trainer_cls, eval_kw = held_out(lambda r: preference_rows(r, cfg.method), trainer_cls)
    trainer = trainer_cls(
        model=loaded.model,
        ref_model=None,
        args=dpo_args,
        train_dataset=dataset,
        processing_class=loaded.tokenizer,
        callbacks=[callback],
        **eval_kw,
    )
    _use_reference(trainer, cfg)
    return trainer


def moe_loss_args(loaded: LoadedModel) -> dict:
    """A mixture of experts' load-balancing loss as its config says (``trainer_svc/core/moe.py``): TRL's SFTTrainer
    would otherwise add it whenever the config has a coefficient, even with ``output_router_logits`` false."""
    if moe.moe_arch(loaded.model.config) is None:
        return {}
    return {"router_aux_loss_coef": moe.aux_loss_coef(loaded.model.config)}


def _use_reference(trainer, cfg: TrainConfig) -> None:
    peft_model = trainer.accelerator.unwrap_model(trainer.model)
    if cfg.dpo_reference == "base" and "ref" in getattr(peft_model, "peft_config", {}):
        # TRL's DPO and KTO trainers snapshot the adapter as the reference; strop's default reference is the base
        # model (adapter disabled), which TRL falls back to when no "ref" adapter exists.
        peft_model.delete_adapter("ref")
        peft_model.set_adapter("default")


def trl_preference_config(cfg: TrainConfig, args: dict):
    """The TRL trainer class and its config for an ORPO, KTO or SimPO job (``args``: ``_training_args``)."""
    if cfg.method in (TrainMethod.ORPO, TrainMethod.SIMPO):
        # their batches hold chosen_/rejected_ columns, no input_ids, which is what HF counts tokens by (it warns
        # every step and counts none): _PairTokens counts them instead; their collator needs every column kept
        args = {**args, "include_num_input_tokens_seen": "no", "remove_unused_columns": False}
    if cfg.method is TrainMethod.ORPO:
        from trl.experimental.orpo import ORPOConfig, ORPOTrainer

        # TRL's ORPOConfig.beta is the paper's lambda (the odds-ratio term's weight)
        return ORPOTrainer, ORPOConfig(**args, beta=cfg.orpo_lambda, max_length=cfg.max_length)
    if cfg.method is TrainMethod.SIMPO:
        from trl.experimental.cpo import CPOConfig, CPOTrainer

        # SimPO is CPO's simpo loss without CPO's behaviour-cloning (NLL) term
        simpo = CPOConfig(
            **args,
            loss_type="simpo",
            cpo_alpha=0.0,
            beta=cfg.simpo_beta,
            simpo_gamma=cfg.simpo_gamma,
            max_length=cfg.max_length,
        )
        return CPOTrainer, simpo
    if cfg.method is TrainMethod.KTO:
        from trl import KTOConfig, KTOTrainer

        kto = KTOConfig(
            **args,
            beta=cfg.kto_beta,
            desirable_weight=cfg.kto_desirable_weight,
            undesirable_weight=cfg.kto_undesirable_weight,
            max_length=cfg.max_length,
        )
        return KTOTrainer, kto
    raise ValueError(f"not an ORPO, KTO or SimPO job: {cfg.method}")


def strop_preference_trainer_class(method: TrainMethod) -> type:
    """The TRL trainer of ``trl_preference_config`` with strop's chunked loss mixed in (SimPO: CPO's)."""
    from strop.kernels import trainers

    builders = {
        TrainMethod.ORPO: trainers.strop_orpo_trainer_class,
        TrainMethod.SIMPO: trainers.strop_cpo_trainer_class,
        TrainMethod.KTO: trainers.strop_kto_trainer_class,
    }
    if method not in builders:
        raise ValueError(f"not an ORPO, KTO or SimPO job: {method}")
    return builders[method]()


def preference_rows(rows: list[dict], method: TrainMethod) -> list[dict]:
    """Rows as the TRL trainer of ``method`` reads them."""
    keys = (
        ("prompt", "completion", "label") if method is TrainMethod.KTO else ("prompt", "chosen", "rejected")
    )
    return [{k: r[k] for k in keys} for r in rows]


class _PairTokens:
    """Counts the non-padding tokens of each chosen and rejected row into ``state.num_input_tokens_seen``
    (what HF's own count gives SFT, DPO and KTO jobs), so ORPO and SimPO steps report tokens/s."""

    def training_step(self, model, inputs, *args, **kwargs):
        masks = [inputs[k] for k in ("chosen_attention_mask", "rejected_attention_mask") if k in inputs]
        self.state.num_input_tokens_seen += int(sum(int(m.sum()) for m in masks))
        return super().training_step(model, inputs, *args, **kwargs)


def _build_preference_trainer(
    loaded: LoadedModel, rows: list[dict], cfg: TrainConfig, args: dict, callback, held_out: Callable
):
    from datasets import Dataset

    trainer_cls, trl_args = trl_preference_config(cfg, args)
    if loaded.facts.kernels_enabled:
        # strop's chunked losses on the hidden states (never full logits, gradients computed in the forward)
        # inside the same TRL trainer and config
        trainer_cls = strop_preference_trainer_class(cfg.method)
    if cfg.method in (TrainMethod.ORPO, TrainMethod.SIMPO):
        trainer_cls = type(trainer_cls.__name__, (_PairTokens, trainer_cls), {})
    kwargs = {"ref_model": None} if cfg.method in REFERENCE_METHODS else {}
    trainer_cls, eval_kw = held_out(lambda r: preference_rows(r, cfg.method), trainer_cls)
    kwargs.update(eval_kw)
    return trainer_cls(
        model=loaded.model,
        args=trl_args,
        train_dataset=Dataset.from_list(preference_rows(rows, cfg.method)),
        processing_class=loaded.tokenizer,
        callbacks=[callback],
        **kwargs,
    )


def cleanup_reference_adapter(loaded: LoadedModel) -> None:
    """Remove a DPO snapshot adapter so later jobs and exports see only the trained one."""
    model = loaded.model
    if "ref" in getattr(model, "peft_config", {}):
        model.delete_adapter("ref")
        model.set_adapter("default")


def _install_memory_mode(loaded: LoadedModel, cfg: TrainConfig, trainer):
    """What the job's memory mode installs (``MEMORY_MODES``), on CUDA with the kernels; None elsewhere."""
    if not (loaded.device.startswith("cuda") and loaded.facts.kernels_enabled):
        return None
    from transformers import TrainerCallback

    from strop.kernels.models import StepShape, apply_memory_mode

    # preference methods: chosen and rejected rows (KTO: each row and its KL row)
    rows = cfg.batch_size * (1 if cfg.method is TrainMethod.SFT else 2)
    installed = apply_memory_mode(
        loaded.model,
        cfg.memory_mode,
        step=StepShape(rows, cfg.max_length, bool(cfg.gradient_checkpointing)),
        budget_bytes=int(cfg.memory_budget_gib * 2**30),
        device=loaded.device,
    )
    log.info("%s", installed)
    if installed.features.step_graphs and hasattr(trainer, "_strop_graph_reason"):
        if installed.memory is not None and installed.memory.offloader is not None:
            # its pinned host copies and their events cannot be captured; an aborted capture would leave the
            # offloader mid-step (bench/graph_step.py's stepgraph-standard asks whether it can)
            log.warning("step graphs off: the layer inputs are offloaded to host memory")
        else:
            trainer._strop_step_graphs = True  # SFT's micro-steps replay as CUDA graphs (GraphedSFTSteps)
            from strop.kernels.models.step_graph import random_free

            if random_free(loaded.model):
                from strop.kernels.trainers.sft import checkpoint_without_rng_state

                checkpoint_without_rng_state(trainer.args)
    if installed.recompute is not None:

        class PlanAfterFirstStep(TrainerCallback):
            def on_step_end(self, args, state, control_, **kw):
                plan = installed.step_end()
                if plan is not None:
                    log.info("budgeted recompute: %s", plan)
                    trainer._strop_graph = None  # graphs of the layout before the plan: captured again

        trainer.add_callback(PlanAfterFirstStep())
    return installed


def _admit_by_device_memory(
    loaded: LoadedModel, cfg: TrainConfig, trainer, installed, kl: retention.ReplayKL | None = None
) -> None:
    """On CUDA, refuse a job whose estimated step (``admission``) exceeds the device memory free for it; a
    budgeted mode (MAX_SPEED) plans its own recompute within its budget instead."""
    if not loaded.device.startswith("cuda") or MEMORY_MODES[cfg.memory_mode].budgeted_recompute:
        return
    import torch

    from strop.trainer_svc.core import admission

    offloaded = (
        installed is not None and installed.memory is not None and installed.memory.offloader is not None
    )
    shape = dict(
        longest_row=admission.longest_row(trainer.train_dataset) or cfg.max_length,
        n_trainable=sum(p.numel() for p in loaded.model.parameters() if p.requires_grad),
        checkpointed=bool(cfg.gradient_checkpointing) or offloaded,
        offloaded=offloaded,
        kernels=loaded.facts.kernels_enabled,
        expert_lora=moe.expert_lora(loaded.model.config, loaded.lora),
        nf4_experts=moe.holds_nf4_experts(loaded.model),
        kl_tokens=max((ids.numel() for ids, _, _ in kl.batches), default=0) if kl is not None else 0,
        kl_cached_tokens=sum(at.numel() for _, _, at in kl.batches) if kl is not None else 0,
    )
    est = admission.estimate(loaded.model.config, cfg, **shape)
    # a single-process job whose AdamW does not fit with its moments on the device may keep them in host memory
    host = None
    if cfg.optimizer in admission.HOST_MOMENT_OPTIMIZERS and cfg.ranks() == 1:
        from strop.kernels.models.memory import host_available_bytes

        room = host_available_bytes()
        if admission.host_has_room_for_moments(shape["n_trainable"], room, MEMORY_MODES[cfg.memory_mode]):
            host = admission.estimate(loaded.model.config, cfg, host_adam_moments=True, **shape)
    dev = torch.device(loaded.device)
    free, _ = torch.cuda.mem_get_info(dev)
    free += torch.cuda.memory_reserved(dev) - torch.cuda.memory_allocated(dev)  # cached, reusable by this job
    free -= (
        loaded.pending_device_bytes
    )  # a base in host memory that FSDP2 moves onto the device when it shards it
    if admission.admit(est, free, host):
        admission.hold_adam_moments_on_host(trainer)


def _retention_before(loaded: LoadedModel, cfg: TrainConfig, fmt: DatasetFormat, rows: list[dict]):
    """Before an SFT job on messages data with REPLAY or KL: the base's reproducible answers to the held-out prompts
    (for the forgetting metric), the replay rows to mix into the training rows (REPLAY), and the rows the KL term
    scores (REPLAY: the replay rows; KL: every answer, finished or not, none of them trained on); (None, [], [])
    without retention."""
    mode = cfg.retention  # resolved by with_retention at the top of run_training
    if mode not in (Retention.REPLAY, Retention.KL):
        return None, [], []
    base = retention.base_answers(loaded, retention.HELD_OUT_PROMPTS)
    held_out = retention.reproducible(base, retention.answer_hits(loaded, base, disable_adapter=True))
    prompts = retention.REPLAY_PROMPTS[: cfg.retention_rows]
    answers = retention.base_answers(loaded, prompts)
    if mode is Retention.KL:
        scored = retention.kl_rows(answers, cfg.retention_rows)
        log.info(
            "retention KL: %d of %d base answers scored by the KL term (%.1f s)",
            len(scored),
            len(prompts),
            answers.seconds,
        )
        if cfg.retention_neighbours:
            questions = [_first_user_text(r) for r in rows]
            neighbours = retention.neighbour_prompts(
                loaded,
                [q for q in questions if q],
                cfg.retention_neighbours,
                seed=cfg.seed,
                exclude=set(questions) | set(retention.HELD_OUT_PROMPTS) | set(prompts),
            )
            if neighbours:  # a base that wrote no question ending in "?" adds none
                near = retention.base_answers(loaded, neighbours)
                scored += retention.kl_rows(near, len(neighbours))
            log.info("retention KL neighbour questions (%d): %s", len(neighbours), neighbours)
        return held_out, [], scored
    replay = retention.replay_rows(answers, cfg.retention_rows)
    log.info(
        "retention REPLAY: %d of %d base answers mixed in (%.1f s)",
        len(replay),
        len(prompts),
        answers.seconds,
    )
    return held_out, replay, replay


def _first_user_text(row: dict) -> str:
    """A messages row's first user message as text ("" if none or not text)."""
    for m in row.get("messages", ()):
        if m.get("role") == "user":
            return m["content"] if isinstance(m.get("content"), str) else ""
    return ""


def _scaled_factors(loaded: LoadedModel):
    """What ``scale_adapter`` moves, as (tensor, its base or None): every LoRA B factor (and B bias, embedding B) of
    the active adapter, scaled toward 0; every parameter of a module trained whole (an MoE's router with
    train_router), moved toward its base's."""
    from peft.tuners.lora import LoraLayer
    from peft.utils import ModulesToSaveWrapper

    for module in loaded.model.modules():
        if isinstance(module, ModulesToSaveWrapper):
            for name in module.active_adapters:
                if name in module.modules_to_save:
                    pairs = zip(
                        module.modules_to_save[name].parameters(),
                        module.original_module.parameters(),
                        strict=True,
                    )
                    yield from pairs
            continue
        if not isinstance(module, LoraLayer):
            continue
        for name in module.active_adapters:
            if name in module.lora_B:
                b = module.lora_B[name]
                yield b.weight, None
                if b.bias is not None:  # PEFT's lora_bias: part of the B product's output
                    yield b.bias, None
            if name in getattr(module, "lora_embedding_B", {}):
                yield module.lora_embedding_B[name], None


def scale_adapter(loaded: LoadedModel, scale: float) -> int:
    """Multiply every LoRA B factor of the session's active adapter by ``scale`` in place: the adapted model becomes
    W + scale · ΔW layer by layer (ΔW = s·B·A is linear in B), the base interpolated toward the fine-tuned model as
    in weight-space ensembling (WiSE-FT, Wortsman et al., CVPR 2022), without a change of alpha that an exporter or
    a server would have to carry. ``scale`` 0 or 1: the adapter as trained. Returns how many tensors were moved."""
    import torch

    count = 0
    if not 0 < scale < 1:
        return count
    with torch.no_grad():
        for tensor, base in _scaled_factors(loaded):
            if base is None:
                tensor.mul_(scale)
            else:
                tensor.lerp_(base.to(tensor.dtype), 1 - scale)
            count += 1
    log.info("adapter interpolated toward the base: %d tensors x %g", count, scale)
    return count


@dataclass
class ScaleChoice:
    """``choose_adapter_scale``'s result: the scale the adapter ends at, and for each scale tried (1 first) the
    assistant messages reproduced word for word and the top-1 tokens, of ``messages`` and ``tokens``."""

    scale: float
    tried: list[tuple[float, int, int]]
    messages: int
    tokens: int

    def summary(self) -> str:
        return f"adapter_scale {self.scale:g} of " + ", ".join(
            f"{s:g}: {m}/{self.messages} messages, {t}/{self.tokens} tokens" for s, m, t in self.tried
        )


def fit_sample(rows: list[dict], count: int = AUTO_SCALE_ROWS) -> list[dict]:
    """Up to ``count`` of a job's training conversations, evenly spaced through them (deterministic)."""
    if len(rows) <= count:
        return list(rows)
    return [rows[i * len(rows) // count] for i in range(count)]


def choose_adapter_scale(loaded: LoadedModel, rows: list[dict], cfg: TrainConfig) -> ScaleChoice:
    """adapter_scale "auto" (``ADAPTER_SCALE_AUTO``): the finished adapter at 1 and then at each of
    ``AUTO_ADAPTER_SCALES`` (descending), teacher-forced on ``fit_sample(rows)`` of the job's own training
    conversations (``retention.conversation_hits``); the adapter ends scaled (``scale_adapter``, the same product as
    a fixed scale) by the smallest scale before the first that reproduces fewer assistant messages word for word
    than 1 does, or fewer top-1 tokens by more than ``AUTO_SCALE_TOKEN_SLACK`` of 1's, that interval then halved
    ``AUTO_SCALE_REFINE`` times (a scale between that fits is kept): the least of the trained update that still fits
    what the job taught, so the rest of the base is moved as little as it can be."""
    import torch

    sample = fit_sample(rows)

    def measure(scale: float) -> tuple[float, int, int, int, int]:
        res = retention.conversation_hits(
            loaded, sample, last_only=cfg.completion_only_loss, max_length=cfg.max_length
        )
        return (
            scale,
            sum(sum(whole) for _, whole in res),
            sum(h[0] for h, _ in res),
            sum(len(whole) for _, whole in res),
            sum(h[1] for h, _ in res),
        )

    try:
        first = measure(1.0)
    except (InvalidArgument, torch.OutOfMemoryError) as e:
        # the run is complete: a fit that cannot be measured (a template that masks these rows only with
        # loss_on_all_tokens, a row too long for the device) leaves the adapter as trained, not the job failed
        log.warning("adapter_scale auto: the fit could not be measured (%s); the adapter stays as trained", e)
        return ScaleChoice(1.0, [], 0, 0)
    if not first[4]:  # nothing to measure: no scale can be shown to fit
        log.info(
            "adapter_scale auto: the sampled rows have no assistant tokens; the adapter stays as trained"
        )
        return ScaleChoice(1.0, [first[:3]], 0, 0)
    with torch.no_grad():
        saved = [(t, t.detach().clone()) for t, _ in _scaled_factors(loaded)]
    tried: list[tuple[float, int, int]] = [first[:3]]

    def fits(scale: float) -> bool:
        scale_adapter(loaded, scale)
        try:
            now = measure(scale)
        finally:  # the adapter as trained again, whatever the measurement did
            with torch.no_grad():
                for t, copy in saved:
                    t.copy_(copy)
        tried.append(now[:3])
        return now[1] >= first[1] and now[2] >= (1 - AUTO_SCALE_TOKEN_SLACK) * first[2]

    chosen, worse = 1.0, None
    try:
        for scale in AUTO_ADAPTER_SCALES:
            if not fits(scale):
                worse = scale
                break
            chosen = scale
        for _ in range(AUTO_SCALE_REFINE if worse is not None else 0):
            # the grid's step halved between the last scale that fits and the first that does not
            mid = round((chosen + worse) / 2, 6)
            if fits(mid):
                chosen = mid
            else:
                worse = mid
    except (InvalidArgument, torch.OutOfMemoryError) as e:
        # as for the first measurement: the job is complete; the adapter ends at the last scale shown to fit
        log.warning("adapter_scale auto: a try could not be measured (%s); ending at %g", e, chosen)
    scale_adapter(loaded, chosen)
    choice = ScaleChoice(chosen, tried, first[3], first[4])
    log.info("%s", choice.summary())
    return choice


def _distributed_world() -> int:
    """The processes of the torch.distributed group this process belongs to (1 outside one)."""
    import torch.distributed as dist

    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def run_training(
    loaded: LoadedModel,
    rows: list[dict],
    fmt: DatasetFormat,
    cfg: TrainConfig,
    work_dir: Path,
    control: JobControl,
    sinks: Sinks,
    resume_from: Path | None = None,
    callbacks: Sequence = (),
    validation: ValidationSet | None = None,
) -> int:
    """Train to completion or until stopped, evaluating ``validation`` on its schedule; returns the step reached."""
    # a training operator's rank may be launched without num_devices / num_nodes: its world says how many there are
    ranks = max(cfg.ranks(), _distributed_world())
    # a job's retention is resolved already (in one process; as NONE on several); a library call's here
    cfg = job_config.with_retention(cfg, fmt, loaded.tokenizer, ranks)
    work_dir.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    drop_inference_weights(loaded)  # Generate's dequantized copy: training computes from the 4-bit weights
    packed = repacked_4bit_layers(loaded.model)
    if packed:
        raise BrokenTraining(
            f"{len(packed)} 4-bit layers are in bitsandbytes' CPU inference layout, which has no backward: "
            f"{names(packed)}"
        )
    held_out, replayed, scored = None, 0, []
    taught = rows  # the job's own rows (adapter_scale auto measures the fit on them, not on replayed answers)
    chat_sft = (
        cfg.method is TrainMethod.SFT and fmt is DatasetFormat.MESSAGES and loaded.tokenizer.chat_template
    )
    if chat_sft and ranks > 1:
        # each rank would generate on its own (an FSDP rank's base is not whole yet): not done on several ranks
        log.info(
            "retention (replay, the forgetting metric) runs in single-process jobs only; this job has %d ranks",
            ranks,
        )
    elif chat_sft:
        held_out, replay, scored = _retention_before(loaded, cfg, fmt, rows)
        rows, replayed = rows + replay, len(replay)
        drop_inference_weights(loaded)  # the base's answers were generated from it: not held through training
    if loaded.device.startswith("cuda"):
        import torch

        torch.cuda.reset_peak_memory_stats(loaded.device)
    # the pool's thread starts at the first step event: nothing to close if building the trainer fails
    events = StepEventsOffThread(sinks)
    sinks = events.sinks()
    trainer = build_trainer(loaded, rows, fmt, cfg, work_dir, control, sinks, callbacks, validation)
    weight = cfg.retention_kl if scored else 0.0  # resolved by with_retention: the weight the job runs with
    if weight:
        batch = retention.kl_batch(len(scored), len(rows), cfg.batch_size)
        log.info("retention KL term: %d answers, %d a step, weight %g", len(scored), batch, weight)
        kl = retention.ReplayKL(scored, loaded.tokenizer, weight, batch, loaded.device)
        retention.add_replay_kl(trainer, kl)
    else:
        kl = None
    installed = None
    try:
        installed = _install_memory_mode(
            loaded, cfg, trainer
        )  # inside the try: a failed install is cleaned up
        _admit_by_device_memory(loaded, cfg, trainer, installed, kl)
        trainer.train(resume_from_checkpoint=str(resume_from) if resume_from else None)
        events.wait()  # every step event stored (or its write's error raised) before the job's next events
        step = int(trainer.state.global_step)
        # a completed run's adapter is scaled (a cancelled one stays as trained, like its checkpoint)
        scale = 1.0
        if control.complete():
            if cfg.adapter_scale == ADAPTER_SCALE_AUTO:
                scale = choose_adapter_scale(loaded, taught, cfg).scale
            elif scale_adapter(loaded, cfg.adapter_scale):
                scale = cfg.adapter_scale
        if held_out is not None and sinks.on_retention is not None:
            f = retention.forgetting(loaded, held_out)
            log.info("forgetting metric: %d of %d held-out base answers kept", f.kept, f.held_out)
            sinks.on_retention(
                RetentionMetrics(step, f.held_out, f.kept, f.token_agreement, f.mean_nll, replayed, scale)
            )
        elif cfg.adapter_scale == ADAPTER_SCALE_AUTO and sinks.on_retention is not None:
            # no forgetting metric without retention: the event says the scale chosen
            sinks.on_retention(RetentionMetrics(step, replay_rows=replayed, adapter_scale=scale))
        return step
    finally:
        events.close()
        if installed is not None:
            installed.remove()
        loaded.model.train(False)
        cleanup_reference_adapter(loaded)
        del trainer
        shutil.rmtree(work_dir, ignore_errors=True)
