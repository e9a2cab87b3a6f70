"""Chunked CPO and SimPO over [chosen; rejected] final hidden states, without materialising full logits
(TRL 1.16's ``trl.experimental.cpo.CPOTrainer``, AlphaPO off; shared pieces in ``preference.py``).

CPO (``average`` = avg for ipo/simpo, sums otherwise; d = a_c − a_r)::

    simpo      (−(1−ε)logσ(β(d − γ/β)) − ε logσ(−β(d − γ/β)))     SimPO: with cpo_alpha = 0
    sigmoid    −(1−ε)logσ(βd) − ε logσ(−βd)
    hinge      relu(1 − βd);   ipo   (d − 1/(2β))²
    loss       = mean + cpo_alpha · nll   (nll: mean −log p over the chosen completions' tokens)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .preference import (
    GroupedLogps,
    Reduce,
    completion_groups,
    grouped_logps,
    grouped_logps_reference,
    mean_reduce,
    pair_count,
    pair_metrics,
    set_pair_mean_logits,
)

__all__ = ["CPO_LOSS_TYPES", "CPOLossOutput", "cpo_loss_from_logps", "cpo_loss_reference", "strop_cpo_loss"]

CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo")


@dataclass
class CPOLossOutput:
    """One CPO batch: ``[B]`` per-pair losses' mean plus cpo_alpha·NLL; ``chosen_logps``/``rejected_logps``
    (averaged for ipo/simpo, sums otherwise)."""

    loss: torch.Tensor
    nll_loss: torch.Tensor
    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor
    beta: float
    logits_chosen: torch.Tensor | None = None
    logits_rejected: torch.Tensor | None = None

    def metrics(self, reduce: Reduce = mean_reduce) -> dict[str, torch.Tensor]:
        """TRL's CPO metrics; ``reduce`` maps a per-pair (or scalar) tensor to its logged mean."""
        return pair_metrics(self, reduce)


def cpo_loss_from_logps(
    chosen_logps: torch.Tensor,
    rejected_logps: torch.Tensor,
    nll_loss: torch.Tensor,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
    cpo_alpha: float = 1.0,
) -> CPOLossOutput:
    """CPO's loss of ``[B]`` completion log-probs (averaged for ipo/simpo) as TRL 1.16 computes it (AlphaPO off)."""
    if loss_type not in CPO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {CPO_LOSS_TYPES}, got {loss_type!r}")
    d = chosen_logps - rejected_logps
    if loss_type in ("simpo", "sigmoid"):
        if loss_type == "simpo":
            d = d - simpo_gamma / beta
        per_pair = -F.logsigmoid(beta * d) * (1 - label_smoothing) - F.logsigmoid(-beta * d) * label_smoothing
    elif loss_type == "hinge":
        per_pair = torch.relu(1 - beta * d)
    else:  # ipo
        per_pair = (d - 1 / (2 * beta)) ** 2
    loss = per_pair.mean() + cpo_alpha * nll_loss
    return CPOLossOutput(loss, nll_loss, chosen_logps, rejected_logps, beta)


def strop_cpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    beta: float = 0.1,
    loss_type: str = "sigmoid",
    label_smoothing: float = 0.0,
    simpo_gamma: float = 0.5,
    cpo_alpha: float = 1.0,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    softcap: float | None = None,
    logps_fn: GroupedLogps = grouped_logps,
) -> CPOLossOutput:
    """CPO (SimPO: ``loss_type="simpo", cpo_alpha=0``) of [chosen; rejected] hidden states without their logits.

    Args:
        hidden: ``[2B, T, H]`` final hidden states, chosen rows first.
        weight: ``[V, H]`` frozen LM head.
        labels: ``[2B, T]`` unshifted completion labels.
        bias: Optional frozen ``[V]`` head bias.
        beta, loss_type, label_smoothing, simpo_gamma, cpo_alpha: TRL's ``CPOConfig`` fields.
        ignore_index: Label value that is not scored.
        chunk_size: Rows per chunk (default: ~256 MiB of logits).
        softcap: The model's final-logit soft-cap (Gemma's ``final_logit_softcapping``), or None; the
            ``logits/*`` metrics are not computed under one.
        logps_fn: The per-group log-prob engine (``preference.grouped_logps``; :func:`cpo_loss_reference`
            passes the full-logits one).

    Returns:
        A :class:`CPOLossOutput`; ``.metrics()`` gives TRL's logged values.
    """
    b = pair_count(hidden)
    s = 2 * b
    groups, counts = completion_groups(labels, ignore_index)
    sums = logps_fn(
        hidden, weight, labels.clamp(min=0), groups, s, bias, chunk_size=chunk_size, softcap=softcap
    )
    # TRL: nll = 0 when cpo_alpha == 0, else CrossEntropyLoss over the chosen completions (one mean)
    if cpo_alpha == 0:
        nll = torch.zeros((), device=hidden.device)
    else:
        nll = -sums[:b].sum() / counts[:b].sum().clamp(min=1)
    logps = sums / counts.clamp(min=1) if loss_type in ("ipo", "simpo") else sums
    out = cpo_loss_from_logps(
        logps[:b],
        logps[b:],
        nll,
        beta=beta,
        loss_type=loss_type,
        label_smoothing=label_smoothing,
        simpo_gamma=simpo_gamma,
        cpo_alpha=cpo_alpha,
    )
    set_pair_mean_logits(out, hidden, weight, bias, b, softcap, shifted=False)
    return out


def cpo_loss_reference(*args, **kwargs) -> CPOLossOutput:
    """:func:`strop_cpo_loss` (same arguments) from full fp32 logits."""
    return strop_cpo_loss(*args, **kwargs, logps_fn=grouped_logps_reference)
