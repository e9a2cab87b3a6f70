"""Chunked ORPO over [chosen; rejected] final hidden states, without materialising full logits
(TRL 1.16's ``trl.experimental.orpo.ORPOTrainer``; shared pieces in ``preference.py``).

ORPO (``beta`` = the paper's λ; avg_s = a completion's log-prob sum over its n_s tokens)::

    nll        = mean of −log p over every attended token of the chosen rows, prompt included
                 (TRL's CrossEntropyLoss over ``input_ids`` where ``attention_mask``; one mean over the batch)
    log_odds   = (avg_c − avg_r) − (log(1 − e^{avg_c}) − log(1 − e^{avg_r}))
    loss       = nll − mean(λ·logσ(log_odds))

The NLL and the completions come from one chunked pass: a chosen row's prompt is a group of its own.
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

__all__ = ["ORPOLossOutput", "orpo_loss_from_logps", "orpo_loss_reference", "strop_orpo_loss"]


@dataclass
class ORPOLossOutput:
    """One ORPO batch. ``chosen_logps``/``rejected_logps`` are ``[B]`` length-averaged (differentiable);
    ``ratio`` is ``[B]`` logσ(log_odds), ``log_odds`` ``[B]``; ``logits_*`` mean logits (scalars, or None)."""

    loss: torch.Tensor
    nll_loss: torch.Tensor
    chosen_logps: torch.Tensor
    rejected_logps: torch.Tensor
    ratio: torch.Tensor
    log_odds: torch.Tensor
    beta: float
    logits_chosen: torch.Tensor | None = None
    logits_rejected: torch.Tensor | None = None

    def metrics(self, reduce: Reduce = mean_reduce) -> dict[str, torch.Tensor]:
        """TRL's ORPO metrics; ``reduce`` maps a per-pair (or scalar) tensor to its logged mean (e.g. gather + mean)."""
        out = pair_metrics(self, reduce)
        out["log_odds_ratio"] = reduce(self.ratio.detach().mean())
        out["log_odds_chosen"] = reduce(self.log_odds.detach().mean())
        return out


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    # log(1 − eˣ) for x ≤ 0, branching at −ln 2 to avoid cancellation (as TRL does)
    return torch.where(x < -0.6931471805599453, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo_loss_from_logps(
    chosen_logps: torch.Tensor, rejected_logps: torch.Tensor, nll_loss: torch.Tensor, *, beta: float = 0.1
) -> ORPOLossOutput:
    """ORPO of length-averaged completion log-probs ``[B]`` and the chosen rows' NLL, as TRL 1.16 computes it."""
    c, r = chosen_logps.float(), rejected_logps.float()
    log_odds = (c - r) - (_log1mexp(c) - _log1mexp(r))
    ratio = F.logsigmoid(log_odds)
    loss = nll_loss - (beta * ratio).mean()
    return ORPOLossOutput(loss, nll_loss, c, r, ratio, log_odds, beta)


def strop_orpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    beta: float = 0.1,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    softcap: float | None = None,
    logps_fn: GroupedLogps = grouped_logps,
) -> ORPOLossOutput:
    """ORPO of [chosen; rejected] final hidden states without their logits (one chunked pass for both terms).

    Args:
        hidden: ``[2B, T, H]`` final hidden states, chosen rows first.
        weight: ``[V, H]`` frozen LM head.
        input_ids, attention_mask: ``[2B, T]`` (the NLL scores every attended token of the chosen rows).
        labels: ``[2B, T]`` unshifted completion labels (``ignore_index`` on prompt and padding).
        bias: Optional frozen ``[V]`` head bias.
        beta: ORPO's λ (TRL's ``ORPOConfig.beta``).
        ignore_index: Label value that is not scored.
        chunk_size: Rows per chunk (default: ~256 MiB of logits).
        softcap: The model's final-logit soft-cap (Gemma's ``final_logit_softcapping``), or None; the
            ``logits/*`` metrics are not computed under one.
        logps_fn: The per-group log-prob engine (``preference.grouped_logps``; :func:`orpo_loss_reference`
            passes the full-logits one).

    Returns:
        An :class:`ORPOLossOutput`; ``.metrics()`` gives TRL's logged values.
    """
    b = pair_count(hidden)
    s = 2 * b
    groups, counts = completion_groups(labels, ignore_index)
    # TRL's NLL scores input_ids where attended; on completion positions these are the labels (tokenize_row), so
    # a chosen row's NLL terms are its completion group plus a prompt group 2B + s.
    torch._assert_async(((labels == ignore_index) | ((labels == input_ids) & (attention_mask == 1))).all())
    prompt = (labels == ignore_index) & (attention_mask == 1)
    prompt[b:] = False
    seq = torch.arange(s, device=labels.device).unsqueeze(1)
    groups = torch.where(prompt, seq + s, groups)
    sums = logps_fn(hidden, weight, input_ids, groups, s + b, bias, chunk_size=chunk_size, softcap=softcap)
    nll_tokens = attention_mask[:b, 1:].sum()
    # TRL: one mean over the batch's chosen tokens (NaN when there are none; clamped here)
    nll = -(sums[:b].sum() + sums[s:].sum()) / nll_tokens.clamp(min=1)
    avg = sums[:s] / counts.clamp(min=1)  # TRL divides by n_s unclamped: NaN for an empty completion
    out = orpo_loss_from_logps(avg[:b], avg[b:], nll, beta=beta)
    set_pair_mean_logits(out, hidden, weight, bias, b, softcap, shifted=True)
    return out


def orpo_loss_reference(*args, **kwargs) -> ORPOLossOutput:
    """:func:`strop_orpo_loss` (same arguments) from full fp32 logits."""
    return strop_orpo_loss(*args, **kwargs, logps_fn=grouped_logps_reference)
