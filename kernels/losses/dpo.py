"""Chunked DPO loss: preference optimisation over [chosen; rejected] without materialising full logits.

Forward, for a batch of 2B sequences (rows 0..B−1 chosen, B..2B−1 rejected, as TRL concatenates them),
final hidden states h [2B, T, H], a frozen LM head W [V, H] and labels y [2B, T] (−100 on prompt and
padding; unshifted, so position t is scored against y[t+1] as in HF's causal LM loss):

    z_{s,t}    = h_{s,t} Wᵀ  (→ c · tanh(z / c) with a soft-cap c: Gemma's final_logit_softcapping)
    logp_{s,t} = log_softmax(z_{s,t})[y_{s,t+1}]            fp32 log-softmax of the head's logits
    logps_s    = Σ_t logp_{s,t} over labelled positions     per-sequence sum (TRL's "logps")
    ratio_s    = logps_s − ref_logps_s                      ref_logps from the reference model
    δ          = ratio_chosen − ratio_rejected
    loss       = mean over pairs of  −logσ(βδ)                                       sigmoid (default)
                                     relu(1 − βδ)                                     hinge
                                     (ratio_c/n_c − ratio_r/n_r − 1/(2β))²            ipo (n = completion tokens)
                                     (−(1−ε)logσ(βδ) + ε logσ(−βδ)) / (1 − 2ε)        robust (ε = label_smoothing)

exactly TRL 1.16 ``DPOTrainer._compute_loss`` with ``f_divergence_type="reverse_kl"`` (a list of loss
types sums ``loss_weight · mean`` as TRL does), and the metrics it logs: rewards/chosen and
rewards/rejected (β·ratio, batch means), rewards/margins, rewards/accuracies, logps/chosen, logps/rejected.

Chunking. Only labelled positions are scored: their rows are gathered and handed to the chunked log-prob
engine (``logps.py``: a [C, V] logits buffer at a time, the fused linear CE kernel per chunk, ∂nll/∂row computed
in the forward and scaled per sequence in backward). The reference pass (no grad) runs the logits GEMM only.
The LM head must be frozen (LoRA never trains it here).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .logps import sequence_logps, sequence_logps_reference

__all__ = [
    "LOSS_TYPES",
    "DPOLossOutput",
    "chunked_dpo_loss_reference",
    "dpo_loss_from_logps",
    "dpo_loss_on_pairs",
    "strop_dpo_loss",
]

logger = logging.getLogger("strop.kernels")

LOSS_TYPES = ("sigmoid", "hinge", "ipo", "robust")


# ---- the DPO formulas (shared by the reference and the chunked path; TRL 1.16's expressions) -------------


@dataclass
class DPOLossOutput:
    """Loss, per-sequence log-probs and rewards of one DPO batch.

    Attributes:
        loss: fp32 scalar.
        chosen_logps, rejected_logps: ``[B]`` policy log-probs (differentiable).
        ref_chosen_logps, ref_rejected_logps: ``[B]`` reference log-probs.
        chosen_rewards, rejected_rewards: ``[B]`` β·(policy − reference), detached.
    """

    loss: torch.Tensor
    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor
    ref_chosen_logps: torch.Tensor
    ref_rejected_logps: torch.Tensor
    chosen_rewards: torch.Tensor
    rejected_rewards: torch.Tensor

    def metrics(self) -> dict[str, torch.Tensor]:
        """TRL's logged DPO metrics as detached scalar tensors (batch means; no host sync)."""
        c, r = self.chosen_rewards, self.rejected_rewards
        return {
            "rewards/chosen": c.mean(),
            "rewards/rejected": r.mean(),
            "rewards/accuracies": (c > r).float().mean(),
            "rewards/margins": (c - r).mean(),
            "logps/chosen": self.chosen_logps.detach().mean(),
            "logps/rejected": self.rejected_logps.detach().mean(),
        }


def _loss_types(loss_type: str | Sequence[str]) -> list[str]:
    types_ = [loss_type] if isinstance(loss_type, str) else list(loss_type)
    bad = [t for t in types_ if t not in LOSS_TYPES]
    if not types_ or bad:
        raise ValueError(f"loss_type must be one or more of {LOSS_TYPES}, got {loss_type!r}")
    return types_


def dpo_loss_from_logps(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    ref_chosen_logps: torch.Tensor,
    ref_rejected_logps: torch.Tensor,
    *,
    beta: float = 0.1,
    loss_type: str | Sequence[str] = "sigmoid",
    loss_weights: Sequence[float] | None = None,
    label_smoothing: float = 0.0,
    chosen_tokens: torch.Tensor | None = None,
    rejected_tokens: torch.Tensor | None = None,
) -> DPOLossOutput:
    """The DPO loss of per-sequence log-probs, as TRL 1.16 computes it (reverse KL).

    Args:
        chosen_logps, rejected_logps: ``[B]`` policy log-probs.
        ref_chosen_logps, ref_rejected_logps: ``[B]`` reference log-probs.
        beta: The β of DPO (IPO's τ).
        loss_type: One of :data:`LOSS_TYPES` or a list of them.
        loss_weights: One weight per loss type (default 1 each).
        label_smoothing: ε of the robust loss, in [0, 0.5).
        chosen_tokens, rejected_tokens: ``[B]`` completion-token counts (IPO's length normalisation).

    Returns:
        A :class:`DPOLossOutput`.
    """
    types_ = _loss_types(loss_type)
    weights = [1.0] * len(types_) if loss_weights is None else list(loss_weights)
    if len(weights) != len(types_):
        raise ValueError(f"{len(types_)} loss types but {len(weights)} loss_weights")
    if not beta > 0:
        raise ValueError(f"beta must be positive, got {beta}")
    if "robust" in types_ and not 0.0 <= label_smoothing < 0.5:
        raise ValueError(f"robust DPO needs 0 <= label_smoothing < 0.5, got {label_smoothing}")
    chosen_logratios = chosen_logps - ref_chosen_logps
    rejected_logratios = rejected_logps - ref_rejected_logps
    delta = chosen_logratios - rejected_logratios
    loss: Any = 0.0
    for kind, weight in zip(types_, weights, strict=True):
        if kind == "sigmoid":
            per_seq = -F.logsigmoid(beta * delta)
        elif kind == "hinge":
            per_seq = torch.relu(1 - beta * delta)
        elif kind == "ipo":
            if chosen_tokens is None or rejected_tokens is None:
                raise ValueError("ipo needs chosen_tokens and rejected_tokens (completion lengths)")
            chosen_avg = chosen_logratios / chosen_tokens.clamp(min=1.0)
            rejected_avg = rejected_logratios / rejected_tokens.clamp(min=1.0)
            per_seq = (chosen_avg - rejected_avg - 1 / (2 * beta)) ** 2
        else:  # robust
            clean = -(1 - label_smoothing) * F.logsigmoid(beta * delta)
            flipped = -label_smoothing * F.logsigmoid(-beta * delta)
            per_seq = (clean - flipped) / (1 - 2 * label_smoothing)
        loss = loss + per_seq.mean() * weight
    return DPOLossOutput(
        loss=loss,
        chosen_logps=chosen_logps,
        rejected_logps=rejected_logps,
        ref_chosen_logps=ref_chosen_logps,
        ref_rejected_logps=ref_rejected_logps,
        chosen_rewards=beta * chosen_logratios.detach(),
        rejected_rewards=beta * rejected_logratios.detach(),
    )


# ---- reference: full logits ---------------------------------------------------------------------------------


def _reference_logps(ref_chosen, ref_rejected, ref_hidden, compute) -> torch.Tensor:
    if ref_hidden is not None:
        if ref_chosen is not None or ref_rejected is not None:
            raise ValueError("give either ref_hidden or ref_chosen_logps/ref_rejected_logps, not both")
        with torch.no_grad():
            return compute(ref_hidden)
    if ref_chosen is None or ref_rejected is None:
        raise ValueError(
            "the reference log-probs are needed: ref_chosen_logps and ref_rejected_logps, or ref_hidden"
        )
    return torch.cat([ref_chosen, ref_rejected]).detach().float()


def dpo_loss_on_pairs(
    logps, ref, labels, ignore_index, beta, loss_type, loss_weights, label_smoothing
) -> DPOLossOutput:
    """:func:`dpo_loss_from_logps` on [chosen; rejected] stacks of per-sequence log-probs and their labels."""
    if logps.shape[0] % 2 or ref.shape != logps.shape:
        raise ValueError(
            f"expected [chosen; rejected] pairs: {logps.shape[0]} policy and {ref.shape[0]} reference sequences"
        )
    tokens = (labels != ignore_index).sum(1)  # TRL's completion_mask.sum(1), for IPO
    chosen, rejected = logps.chunk(2)
    ref_chosen, ref_rejected = ref.chunk(2)
    chosen_tokens, rejected_tokens = tokens.chunk(2)
    return dpo_loss_from_logps(
        chosen,
        rejected,
        ref_chosen,
        ref_rejected,
        beta=beta,
        loss_type=loss_type,
        loss_weights=loss_weights,
        label_smoothing=label_smoothing,
        chosen_tokens=chosen_tokens,
        rejected_tokens=rejected_tokens,
    )


def strop_dpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    *,
    ref_chosen_logps: torch.Tensor | None = None,
    ref_rejected_logps: torch.Tensor | None = None,
    ref_hidden: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    beta: float = 0.1,
    loss_type: str | Sequence[str] = "sigmoid",
    loss_weights: Sequence[float] | None = None,
    label_smoothing: float = 0.0,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    softcap: float | None = None,
    logps_fn: Callable[..., torch.Tensor] = sequence_logps,
) -> DPOLossOutput:
    """DPO loss of [chosen; rejected] final hidden states without materialising their logits.

    Args:
        hidden: ``[2B, T, H]`` policy final hidden states, chosen rows first.
        weight: ``[V, H]`` frozen LM head.
        labels: ``[2B, T]`` unshifted labels (−100 on prompt and padding).
        ref_chosen_logps, ref_rejected_logps: ``[B]`` reference log-probs (e.g. precomputed), or
        ref_hidden: ``[2B, T, H]`` reference final hidden states (scored with the same head, no grad).
        bias: Optional frozen ``[V]`` head bias.
        beta: DPO β.
        loss_type: One of :data:`LOSS_TYPES` (TRL's names) or a list of them.
        loss_weights: Weights of the listed loss types.
        label_smoothing: ε of the robust loss.
        ignore_index: Label value that is not scored.
        chunk_size: Rows per chunk (default: ~256 MiB of logits).
        softcap: The model's final-logit soft-cap (Gemma's ``final_logit_softcapping``), or None.
        logps_fn: The per-sequence log-prob engine (``logps.sequence_logps``;
            :func:`chunked_dpo_loss_reference` passes the full-logits one).

    Returns:
        A :class:`DPOLossOutput`; ``.metrics()`` gives TRL's logged values.
    """
    kw = {"ignore_index": ignore_index, "chunk_size": chunk_size, "softcap": softcap}
    logps = logps_fn(hidden, weight, labels, bias, **kw)
    ref = _reference_logps(
        ref_chosen_logps, ref_rejected_logps, ref_hidden, lambda h: logps_fn(h, weight, labels, bias, **kw)
    )
    return dpo_loss_on_pairs(logps, ref, labels, ignore_index, beta, loss_type, loss_weights, label_smoothing)


def chunked_dpo_loss_reference(*args, **kwargs) -> DPOLossOutput:
    """:func:`strop_dpo_loss` (same arguments) computed from full logits, in plain torch."""
    return strop_dpo_loss(*args, **kwargs, logps_fn=sequence_logps_reference)
