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
construction), MoE router logits and a sharded (FSDP2) head (per call). Everything else — collation, loss types, metrics,
optimisation — is TRL's.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ..models.hf import Swaps, previous_forward
from ..ops.fused_linear_logprobs import fused_linear_logprobs
from ._glue import final_logit_softcap, head_unsupported_reason, hf_model

__all__ = ["StropSFTMixin", "add_fused_logprob_head", "remove_fused_logprob_head", "strop_sft_trainer_class"]

logger = logging.getLogger("strop.kernels")
_TAG = "logprob_head"


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
            for key, value in (("labels", labels), ("shift_labels", shift_labels), ("num_items_in_batch", num_items_in_batch)):  # fmt: skip
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
        logp, entropy, top1 = fused_linear_logprobs(
            hidden[mask].to(dtype),
            head.weight.to(dtype),
            labels[mask],
            bias,
            softcap=final_logit_softcap(self),
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


class StropSFTMixin:
    """Mix into TRL's ``SFTTrainer`` so its fused LM head runs strop's kernel (``strop_sft_trainer_class()``)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._strop_reason = head_unsupported_reason(self.accelerator, self.model, "strop's fused LM head")
        if self._strop_reason:
            logger.warning("strop's fused LM head off, TRL's runs: %s", self._strop_reason)
            return
        add_fused_logprob_head(hf_model(self.accelerator, self.model))


_TRAINER_CLASS: type | None = None


def strop_sft_trainer_class() -> type:
    """``class StropSFTTrainer(StropSFTMixin, trl.SFTTrainer)``, built on first use (TRL is imported then)."""
    global _TRAINER_CLASS
    if _TRAINER_CLASS is None:
        from trl import SFTTrainer

        _TRAINER_CLASS = type("StropSFTTrainer", (StropSFTMixin, SFTTrainer), {"__module__": __name__})
    return _TRAINER_CLASS
