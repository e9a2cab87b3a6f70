"""TRL glue: ``SFTTrainer`` with its fused LM head served by strop's per-token log-prob kernel.

TRL 1.16's ``SFTTrainer`` installs ``add_fused_lm_head(model, outputs=("log_probs", "entropy", "is_top1"))`` and
trains on ``model(..., fused_lm_head=True).log_probs``; its chunked kernel runs the LM-head GEMM in the forward
and again in the backward. :func:`add_fused_logprob_head` layers a forward over TRL's that answers those calls
with :func:`strop.kernels.ops.fused_linear_logprobs.fused_linear_logprobs` (the gradient made in the forward: one
head GEMM fewer; bench/RESULTS.md, "the fused SFT head") and returns TRL's ``FusedCausalLMOutput`` with the same fields:
``loss``, ``log_probs``, ``entropy``, ``is_top1``, ``label_mask`` (``log_sum_sq_probs`` and ``mean_logits``, which
SFT does not ask for, are None). Like TRL's head it scores only the positions whose label is not -100 (its
boolean index synchronises with the host once per call, as TRL's does). Calls without ``fused_lm_head`` pass
through to TRL's forward, and so to strop's fused CE or HF's forward.

Kept on TRL's head, the reason logged once: a trainable or scaled LM head, PEFT prompt learning (at
construction), MoE router logits and a sharded (FSDP2) head (per call). Everything else — collation (TRL's collator,
handed each row's tokens as arrays), loss types, metrics, optimisation — is TRL's.

Batch widths in buckets (``shared_prompt.WIDTH_BUCKETS``). TRL's collator pads a batch to its longest row, so an
SFT job over rows of many lengths meets a new width nearly every step early on; on CUDA, SDPA runs cuDNN's kernels
first and torch builds a cuDNN graph for each new shape, forward and backward (the cost in bench/RESULTS.md, "GRPO
with a new row length at every step"). HF's ``sdpa`` on these unshared rows and saved attention's cuDNN call both
see the batch's width, so the collator pads it further, to ``shared_prompt.bucket(width)`` (the one owner of the
bucket rule, which prompt-sharing's attention uses too; :func:`shared_prompt.bucketed_width`, never past
``max_length``, nor past ``shared_prompt.BUCKET_MAX``): the job's batches then reach the model in eight widths an
octave. Exact: the added columns are padding (token ``pad_token_id``, attention mask 0, label -100, position 0),
which no real query attends to, no label scores (the loss and ``num_items_in_batch`` count the same tokens, so the
gradient is the same sum) and the token count (the attention mask's sum) leaves out. Its cost: up to 12.5% more
positions of work a step (GEMMs included). Left alone: packed and padding-free batches (one row of the packed
width), a collator with ``pad_to_multiple_of`` (the user chose the widths), and any batch with keys other than
those padded.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import Any

import torch

from ..models.hf import Swaps, previous_forward
from ..ops.fused_linear_logprobs import fused_linear_logprobs
from ._glue import (
    DeviceMetrics,
    DeviceNanFilter,
    final_logit_softcap,
    head_unsupported_reason,
    hf_model,
    width_buckets,
)
from .shared_prompt import bucketed_width

__all__ = [
    "GraphedSFTSteps",
    "StropSFTMixin",
    "add_fused_logprob_head",
    "checkpoint_without_rng_state",
    "loss_scaled_for_accumulation",
    "remove_fused_logprob_head",
    "strop_sft_trainer_class",
]

logger = logging.getLogger("strop.kernels")
_TAG = "logprob_head"
# set (in this thread) while a step graph's step runs: the fused head scores every position (see its forward)
_EVERY_POSITION = threading.local()


def _fused_output_class() -> Any:
    from trl.trainer.utils import FusedCausalLMOutput

    return FusedCausalLMOutput


def _call_reason(model: Any, kwargs: dict) -> str | None:
    """Why a fused-head call is left to TRL's head (None: strop's kernel serves it)."""
    from torch.distributed.tensor import DTensor

    if kwargs.get("output_router_logits") or getattr(
        model.config.get_text_config(), "output_router_logits", False
    ):
        return "MoE router logits"
    if isinstance(model.get_output_embeddings().weight, DTensor):
        return "a sharded (FSDP) LM head, which TRL's head gathers"
    return None


def add_fused_logprob_head(model: Any) -> None:
    """Serve ``model(..., labels=..., fused_lm_head=True)`` with strop's per-token log-prob kernel.

    ``model`` is the transformers causal LM (for PEFT, ``get_base_model()``), normally after TRL's
    ``add_fused_lm_head``, whose forward keeps every other call. Idempotent; undone by
    :func:`remove_fused_logprob_head`.
    """
    if "_strop_logprob_head" in model.__dict__:
        return
    swaps = Swaps(_TAG)
    fused_output = _fused_output_class()

    def forward(
        self, *args, fused_lm_head=False, labels=None, shift_labels=None, num_items_in_batch=None, **kwargs
    ):
        owner, previous = previous_forward(self, _TAG)
        reason = _call_reason(self, kwargs) if fused_lm_head else None
        if not (fused_lm_head and owner.active and labels is not None) or reason:
            if reason and not getattr(owner, "warned", False):
                owner.warned = True
                logger.warning("strop's fused LM head off (%s): TRL's head runs", reason)
            extra = {"fused_lm_head": True} if fused_lm_head else {}
            for key, value in (
                ("labels", labels),
                ("shift_labels", shift_labels),
                ("num_items_in_batch", num_items_in_batch),
            ):
                if value is not None:
                    extra[key] = value
            return previous(*args, **extra, **kwargs)
        kwargs["use_cache"] = False
        hidden = self.base_model(*args, **kwargs).last_hidden_state
        if shift_labels is None:  # as TRL's head: position t scores labels[t + 1]
            hidden, labels = hidden[:, :-1], labels[:, 1:]
        else:
            labels = shift_labels
        head = self.get_output_embeddings()
        hidden, labels = hidden.to(head.weight.device), labels.to(head.weight.device)
        mask = labels != -100
        dev = hidden.device.type
        dtype = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else hidden.dtype
        bias = None if head.bias is None else head.bias.to(dtype)
        softcap = final_logit_softcap(self)
        if getattr(_EVERY_POSITION, "on", False):
            # every position through the kernel, whose ignored rows give 0 and no gradient: no boolean index,
            # so no host sync (a step graph's capture), at the head's work on the unscored positions too
            logp, entropy, top1 = fused_linear_logprobs(
                hidden.flatten(0, -2).to(dtype),
                head.weight.to(dtype),
                labels.flatten(),
                bias,
                softcap=softcap,
            )
            log_probs, entropy, is_top1 = (
                logp.view(mask.shape),
                entropy.view(mask.shape),
                top1.view(mask.shape),
            )
        else:
            logp, entropy, top1 = fused_linear_logprobs(
                hidden[mask].to(dtype), head.weight.to(dtype), labels[mask], bias, softcap=softcap
            )
            # masked_scatter keeps an all-masked batch connected to the model (a differentiable zero), as TRL's does
            log_probs = logp.new_zeros(mask.shape).masked_scatter(mask, logp)
            entropy = entropy.new_zeros(mask.shape).masked_scatter(mask, entropy)
            is_top1 = torch.zeros_like(mask).masked_scatter(mask, top1)
        loss = -log_probs.sum() / (
            mask.sum().clamp(min=1) if num_items_in_batch is None else num_items_in_batch
        )
        return fused_output(loss=loss, log_probs=log_probs, entropy=entropy, is_top1=is_top1, label_mask=mask)

    swaps.forward(model, forward)
    model.__dict__["_strop_logprob_head"] = swaps


def remove_fused_logprob_head(model: Any) -> None:
    """Undo :func:`add_fused_logprob_head` (a no-op when it is not installed)."""
    swaps = model.__dict__.pop("_strop_logprob_head", None)
    if swaps is not None:
        swaps.undo()


@contextlib.contextmanager
def _every_position():
    _EVERY_POSITION.on = True
    try:
        yield
    finally:
        _EVERY_POSITION.on = False


def loss_scaled_for_accumulation(trainer, num_items_in_batch) -> bool:
    """HF's rule for whether a micro-step's loss is already divided for gradient accumulation (normalized by
    ``num_items_in_batch``, by the model or a ``compute_loss_func``); where it is not, HF's ``training_step`` divides
    it by the accumulation steps. transformers 5.24 keeps the answer as ``loss_is_scaled_for_ga``; 5.17 has no
    attribute."""
    scaled = getattr(trainer, "loss_is_scaled_for_ga", None)
    if scaled is None:
        scaled = (trainer.model_accepts_loss_kwargs and num_items_in_batch is not None) or (
            trainer.compute_loss_func is not None
        )
    return bool(scaled)


def _checkpointing_names(args) -> tuple[str, str]:
    """The training arguments' checkpointing switch and kwargs, by the names HF's ``train()`` reads (transformers 5.24
    names them ``activation_checkpointing``; 5.17 ``gradient_checkpointing``)."""
    prefix = "activation" if hasattr(args, "activation_checkpointing") else "gradient"
    return f"{prefix}_checkpointing", f"{prefix}_checkpointing_kwargs"


def _checkpointing(args) -> tuple[bool, dict]:
    """Whether HF's step checkpoints the layers, and with which kwargs."""
    on, kwargs = _checkpointing_names(args)
    return bool(getattr(args, on)), dict(getattr(args, kwargs) or {})


def checkpoint_without_rng_state(args) -> None:
    """Have HF's checkpointed layers recompute without saving the RNG state (which a CUDA graph capture cannot read;
    exact for a model that draws no random numbers: ``step_graph.random_free``)."""
    _, kwargs = _checkpointing_names(args)
    setattr(args, kwargs, {**(getattr(args, kwargs) or {}), "preserve_rng_state": False})


def _plain_loss(outputs, loss_type: str, num_tokens) -> torch.Tensor:
    """TRL's plain SFT loss from the fused head's outputs: minus the log-probs (0 on ignored positions; DFT weighs each
    by its probability), summed, over the token count (at least 1)."""
    per_token_loss = -outputs.log_probs
    if loss_type == "dft":
        per_token_loss = per_token_loss * outputs.log_probs.exp().detach()
    return per_token_loss.sum() / torch.as_tensor(num_tokens).clamp(min=1)


class GraphedSFTSteps:
    """Mixed into :class:`StropSFTMixin` (under its device NaN filter): where the job's memory mode sets
    ``step_graphs`` (``_strop_step_graphs``, from the trainer), each training micro-step of TRL's plain SFT branch runs
    through a :class:`~strop.kernels.models.step_graph.StepGraph`: the forward, the loss and its backward replayed as
    one CUDA graph per batch shape once captured (the host's dispatch off a step it would otherwise pace: small models).

    The step is TRL's plain branch as :meth:`StropSFTMixin.compute_loss` computes it, and HF's ``training_step``
    around it: the loss over ``num_items_in_batch``, divided by the accumulation steps where HF divides it, its
    backward; the metrics (entropy, token accuracy, tokens) come out of the graph as device tensors and go to TRL's
    lists as the eager path's do. Two differences, both at rounding level: the fused head scores every position
    (its ignored rows give 0 and no gradient), since selecting the scored ones would make the host wait, and the
    replays' GEMMs may round as another algorithm does. A term a subclass adds to the loss and computes on its own
    (``_strop_added_loss``: the retention KL term) runs after the replay, eagerly, its backward adding into the same
    gradients. Anything else runs HF's ``training_step``, the reason logged once: another loss path (TRL's branch, an
    overridden ``compute_loss`` without such a term), several
    processes, DeepSpeed, LOMO, fp16 loss scaling, TRL's activation offloading, checkpointing that saves the RNG
    state, no ``num_items_in_batch``, batches with other keys than ``input_ids``, ``attention_mask`` and ``labels``
    (packed, padding-free), a model off CUDA. Under capture transformers builds an explicit attention mask where an
    eager step of an unpadded batch runs SDPA causal without one: the same attention by another kernel.
    """

    _strop_step_graphs = False
    _strop_graph = None
    _strop_graph_logged: str | None = None

    def _strop_graph_reason(self, model, inputs, num_items_in_batch) -> str | None:
        from accelerate.utils import DistributedType
        from transformers.training_args import OptimizerNames
        from transformers.utils import is_sagemaker_mp_enabled

        if getattr(self, "_strop_reason", None):
            return f"strop's fused head is off ({self._strop_reason})"
        if getattr(self.accelerator, "scaler", None) is not None:
            return "fp16 loss scaling (accelerate's GradScaler scales the loss it backpropagates)"
        if getattr(self.args, "activation_offloading", False):
            return "TRL's activation offloading (its context wraps HF's step)"
        on, kwargs = _checkpointing(self.args)
        if on and kwargs.get("preserve_rng_state", True):
            return "checkpointed layers save the RNG state, which a capture cannot read"
        if not self._strop_plain_path(False):
            return "TRL's loss branch is not the plain one"
        owners = [c for c in type(self).__mro__ if "compute_loss" in c.__dict__]
        # the plain branch itself, or a class right above it whose added term runs after the graph on its own
        # (``_strop_added_loss``: the retention KL term, ``trainer_svc/core/retention.py``)
        term = getattr(type(self), "_strop_added_loss", None)
        if owners[0] is StropSFTMixin:
            added = term is None
        else:  # the term the graphed step runs is the one that class's compute_loss adds
            added = owners[1:2] == [StropSFTMixin] and term is owners[0].__dict__.get("_strop_added_loss")
        if not added:
            return f"compute_loss is {type(self).compute_loss.__qualname__} (a term added to the loss)"
        if (
            self.accelerator.num_processes != 1
            or self.args.n_gpu > 1
            or self.accelerator.distributed_type != DistributedType.NO
            or is_sagemaker_mp_enabled()
        ):
            return "several processes or devices"
        if self.args.optim in (OptimizerNames.LOMO, OptimizerNames.ADALOMO):
            return "a LOMO optimizer"
        if num_items_in_batch is None:
            return "no num_items_in_batch"
        if set(inputs) != {"input_ids", "attention_mask", "labels"}:
            return f"batch keys {sorted(inputs)}"
        if next(model.parameters()).device.type != "cuda":
            return "the model is not on CUDA"
        return None

    def training_step(self, model, inputs, num_items_in_batch=None):
        if self._strop_step_graphs:
            model.train()  # (after an evaluation: the plain path is the training one)
        reason = (
            "off"
            if not self._strop_step_graphs
            else self._strop_graph_reason(model, inputs, num_items_in_batch)
        )
        if reason is not None:
            if self._strop_step_graphs and reason != self._strop_graph_logged:
                self._strop_graph_logged = reason
                logger.warning("step graphs: HF's training step runs (%s)", reason)
            return super().training_step(model, inputs, num_items_in_batch)
        if hasattr(self.optimizer, "train") and callable(self.optimizer.train):
            self.optimizer.train()
        inputs = self._prepare_inputs(inputs)
        if self._strop_graph is None:
            from strop.kernels.models.step_graph import StepGraph

            params = [p for p in model.parameters() if p.requires_grad]
            self._strop_graph = StepGraph(self._strop_graph_fn(model), params)
        scaled = loss_scaled_for_accumulation(self, num_items_in_batch)
        ids = inputs["input_ids"]
        num = torch.as_tensor(num_items_in_batch).to(ids.device, non_blocking=True)
        divisor = torch.tensor(1.0 if scaled else float(self.current_gradient_accumulation_steps)).to(
            ids.device, non_blocking=True
        )
        with self.compute_loss_context_manager():
            out = self._strop_graph.step(ids, inputs["attention_mask"], inputs["labels"], num, divisor)
        loss, num_valid, entropy_sum, num_correct, tokens = (
            t.clone() for t in out
        )  # the next replay reuses them
        added = getattr(self, "_strop_added_loss", None)
        # a term the loss adds (not reported in it): its backward on its own, after the graph's
        if added is not None:
            with self.compute_loss_context_manager():
                term = added(model)
            term.backward()
            loss = loss + (term.detach() - term.detach())  # 0, or NaN as HF's step reports a NaN term
        self._strop_metrics(num_valid, entropy_sum, num_correct, tokens)
        return loss

    def _strop_graph_fn(self, model):
        """TRL's plain branch (``StropSFTMixin.compute_loss``) on one process as a function of the batch's tensors:
        the loss (divided as HF's step divides it) and the metrics' device tensors."""
        loss_type = self.args.loss_type

        def step(input_ids, attention_mask, labels, num_items, divisor):
            with _every_position():
                outputs = model(
                    input_ids=input_ids,
                    attention_mask=attention_mask,
                    labels=labels,
                    use_cache=False,
                    fused_lm_head=True,
                )
            loss = _plain_loss(outputs, loss_type, num_items) / divisor
            return (
                loss,
                outputs.label_mask.sum(),
                outputs.entropy.detach().sum(),
                outputs.is_top1.sum(),
                attention_mask.sum(),
            )

        return step


class StropSFTMixin(DeviceMetrics, DeviceNanFilter, GraphedSFTSteps):
    """Mix into TRL's ``SFTTrainer`` so its fused LM head runs strop's kernel (``strop_sft_trainer_class()``), and
    its training metrics stay on the device until they are logged.

    TRL's ``compute_loss`` reads five scalars back every micro-batch (``num_valid > 0`` twice, entropy, token
    accuracy, the token count), between the forward and the backward. On TRL's plain training path this class
    computes the same loss and the same metrics as device tensors and reads them once, in ``log`` (where HF's
    Trainer has already read the loss); the logged values are TRL's to the bit. Measured on the 8B QLoRA step it
    gained nothing (the backward is launched right after those reads; bench/RESULTS.md, "TRL's SFT metrics kept on
    the device"); it stays because it is exact and leaves the host free to run ahead where the step is short. Other paths (eval,
    ``compute_loss_func``, label smoothing, MoE aux loss, sequence parallelism, ``return_outputs``) are TRL's own.

    TRL's language-modeling collator gets each row's tokens as arrays (:func:`_array_collator`: the same batches in
    a fraction of the host time between steps) and, where ``shared_prompt.WIDTH_BUCKETS`` says so, pads each
    batch's width up to a bucket.

    HF's ``logging_nan_inf_filter`` likewise runs on the device (``DeviceNanFilter``) instead of as two reads after
    every backward, which leave the GPU idle while the host runs the optimizer's Python (the profile is in
    bench/RESULTS.md, "the service path against the library path").
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.data_collator = _array_collator(
            self.data_collator, buckets=width_buckets(self), max_width=self.args.max_length
        )
        self._strop_reason = head_unsupported_reason(self.accelerator, self.model, "strop's fused LM head")
        if self._strop_reason:
            logger.warning("strop's fused LM head off, TRL's runs: %s", self._strop_reason)
            return
        add_fused_logprob_head(hf_model(self.accelerator, self.model))

    def _strop_plain_path(self, return_outputs: bool) -> bool:
        """Whether TRL's ``compute_loss`` would take its plain branch (the fused head's log-probs, nothing else)."""
        sp = getattr(self.accelerator, "parallelism_config", None)
        return (
            self.model.training
            and not return_outputs
            and self.compute_loss_func is None
            and not (self.label_smoother is not None and self.args.loss_type == "nll")
            and not self.aux_loss_enabled
            and not (sp is not None and sp.sp_backend == "deepspeed" and sp.sp_enabled)
        )

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        if not self._strop_plain_path(return_outputs):
            self._strop_fold_tokens()  # TRL's branch sets num_tokens from _total_train_tokens
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        # TRL 1.16's plain branch, step for step
        inputs["use_cache"] = False
        outputs = model(**inputs, fused_lm_head=True)
        num_tokens = outputs.label_mask.sum() if num_items_in_batch is None else num_items_in_batch
        loss = _plain_loss(outputs, self.args.loss_type, num_tokens)
        if self.args.average_tokens_across_devices and num_items_in_batch is not None:
            loss = loss * (self.accelerator.num_processes // self.get_tp_size())
        # TRL's metrics without reading them: entropy and is_top1 are 0 at ignored positions, so with no valid
        # position both sums are 0 and dividing by max(num_valid, 1) gives TRL's 0.0; else the same fp32 division
        gather = self.accelerator.gather_for_metrics
        num_valid = gather(outputs.label_mask.sum()).sum()
        entropy_sum = gather(outputs.entropy.detach().sum()).sum()
        num_correct = gather(outputs.is_top1.sum()).sum()
        if "attention_mask" in inputs:
            local = inputs["attention_mask"].sum()
        elif "position_ids" in inputs:
            position_ids = inputs["position_ids"]
            local = torch.tensor(position_ids.size(1)).to(position_ids.device, non_blocking=True)
        else:
            raise ValueError("Expected 'attention_mask' or 'position_ids' in inputs.")
        self._strop_metrics(num_valid, entropy_sum, num_correct, gather(local).sum())
        return loss

    def _strop_metrics(self, num_valid, entropy_sum, num_correct, tokens) -> None:
        """TRL's step metrics from their (gathered) device sums, kept on the device until ``log``."""
        metrics = self._metrics["train"]
        metrics["entropy"].append(entropy_sum / num_valid.clamp(min=1))
        metrics["mean_token_accuracy"].append(num_correct / num_valid.clamp(min=1))
        self._strop_hold_tokens(tokens)


def _token_arrays(example: dict[str, Any]) -> dict[str, Any]:
    """``example`` with its token lists (``input_ids``, ``labels``) as int64 arrays where numpy reads them as such.

    TRL's collator turns each into a tensor with ``torch.tensor``, which reads a Python list element by element and
    an array in one copy; for a list of Python ints both give the same int64 tensor. Any other value (a list numpy
    reads as another dtype: bools, floats, ints past int64; an empty list, which ``torch.tensor`` makes float32) is
    left as it is, so TRL's collator sees what it would have seen."""
    import numpy as np

    out = dict(example)
    for key in ("input_ids", "labels"):
        value = out.get(key)
        if isinstance(value, list) and value and type(value[0]) is int:
            array = np.asarray(value)
            if array.dtype == np.int64 and array.ndim == 1:
                out[key] = array
    return out


def _array_collator(collator: Any, buckets: bool = False, max_width: int | None = None) -> Any:
    """TRL's language-modeling collator (exactly that class, as ``SFTTrainer`` builds it) as one that hands it each
    row's tokens as arrays (:func:`_token_arrays`): the same batches, collated in a fraction of the host time. The
    collation runs between two optimizer steps while the GPU has nothing queued (HF's Trainer read the loss at the
    log), so its host time is the GPU's idle time (bench/RESULTS.md: "The service's time between steps").
    ``buckets``: each batch's width then padded up to a bucket (:func:`bucketed_width`, ``max_width`` its cap),
    except for padding-free (packed) batches and a collator with ``pad_to_multiple_of``.
    Any other collator is returned unchanged."""
    import dataclasses

    from trl.trainer.sft_trainer import DataCollatorForLanguageModeling

    if type(collator) is not DataCollatorForLanguageModeling:
        return collator
    bucketed = buckets and not collator.padding_free and collator.pad_to_multiple_of is None

    class ArrayRowsCollator(DataCollatorForLanguageModeling):
        def torch_call(self, examples: list[dict[str, Any]]) -> dict[str, Any]:
            batch = super().torch_call([_token_arrays(e) for e in examples])
            return bucketed_width(batch, self.pad_token_id, max_width) if bucketed else batch

    return ArrayRowsCollator(**{f.name: getattr(collator, f.name) for f in dataclasses.fields(collator)})


_TRAINER_CLASS: type | None = None


def strop_sft_trainer_class() -> type:
    """``class StropSFTTrainer(StropSFTMixin, trl.SFTTrainer)``, built on first use (TRL is imported then)."""
    global _TRAINER_CLASS
    if _TRAINER_CLASS is None:
        from trl import SFTTrainer

        _TRAINER_CLASS = type("StropSFTTrainer", (StropSFTMixin, SFTTrainer), {"__module__": __name__})
    return _TRAINER_CLASS
