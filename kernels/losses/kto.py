"""Chunked KTO over (prompt, completion) final hidden states, without materialising full logits
(TRL 1.16's ``trl.KTOTrainer``; shared pieces in ``preference.py``).

KTO (label y_s, reference logps from the base model, z0 = KL estimate, detached)::

    z0         = clamp(mean over the batch of (logps(x_s, y'_s) − ref_logps(x_s, y'_s)), 0)   y' = mismatched
    desirable  w_d·(1 − σ(β(r_s − z0)));   undesirable  w_u·(1 − σ(β(z0 − r_s)))   r = logps − ref_logps
    apo_zero_unpaired: w_d·(1 − σ(βr)), w_u·σ(βr) and no z0
    loss       = nanmean over the batch

TRL's KTO entropy needs a second pass over the vocabulary and is not computed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .preference import Reduce, completion_groups, grouped_logps, identity_reduce, mean_logits

__all__ = ["KTO_LOSS_TYPES", "KTOLossOutput", "kto_kl", "kto_loss_from_logps", "strop_kto_loss"]

KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")


@dataclass
class KTOLossOutput:
    """One KTO batch: ``logps``/``ref_logps`` ``[B]`` completion sums, ``desirable`` ``[B]`` bool, ``kl`` the
    detached z0; ``logits_sum_*``/``tokens_*`` the chosen and rejected completions' mean-logit sums and counts."""

    loss: torch.Tensor
    logps: torch.Tensor
    ref_logps: torch.Tensor
    desirable: torch.Tensor
    kl: torch.Tensor
    beta: float
    logits_sum_chosen: torch.Tensor | None = None
    logits_sum_rejected: torch.Tensor | None = None
    tokens_chosen: torch.Tensor | None = None
    tokens_rejected: torch.Tensor | None = None

    def metrics(self, total: Reduce = identity_reduce) -> dict[str, float]:
        """TRL's KTO metrics (sums over the batch ÷ counts); ``total`` sums a scalar over ranks (identity: one).

        A key TRL leaves out when its count is 0 (no desirable row, say) is left out here too.
        """
        d = self.desirable
        rewards = self.beta * (self.logps - self.ref_logps).detach()
        logps = self.logps.detach()
        n_c, n_r = total(d.sum().float()).item(), total((~d).sum().float()).item()
        out: dict[str, float] = {"kl": float(self.kl.item())}
        if self.logits_sum_chosen is not None:
            tc, tr = total(self.tokens_chosen.float()).item(), total(self.tokens_rejected.float()).item()
            if tc > 0:
                out["logits/chosen"] = total(self.logits_sum_chosen).item() / tc
            if tr > 0:
                out["logits/rejected"] = total(self.logits_sum_rejected).item() / tr
        if n_c > 0:
            out["rewards/chosen"] = total(rewards[d].nansum()).item() / n_c
            out["logps/chosen"] = total(logps[d].nansum()).item() / n_c
        if n_r > 0:
            out["rewards/rejected"] = total(rewards[~d].nansum()).item() / n_r
            out["logps/rejected"] = total(logps[~d].nansum()).item() / n_r
        if n_c > 0 and n_r > 0:
            out["rewards/margins"] = out["rewards/chosen"] - out["rewards/rejected"]
        return out


def kto_loss_from_logps(
    logps: torch.Tensor,
    ref_logps: torch.Tensor,
    desirable: torch.Tensor,
    kl: torch.Tensor | None,
    *,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    loss_type: str = "kto",
) -> KTOLossOutput:
    """KTO of ``[B]`` completion log-prob sums, as TRL 1.16 computes it.

    Args:
        logps, ref_logps: ``[B]`` policy and reference completion log-probs.
        desirable: ``[B]`` bool labels.
        kl: The (gathered, clamped, detached) KL estimate z0; None for apo_zero_unpaired (0).
        beta, desirable_weight, undesirable_weight, loss_type: TRL's ``KTOConfig`` fields.
    """
    if loss_type not in KTO_LOSS_TYPES:
        raise ValueError(f"loss_type must be one of {KTO_LOSS_TYPES}, got {loss_type!r}")
    desirable = desirable.bool()
    z0 = torch.zeros((), device=logps.device) if kl is None else kl.detach().float()
    ref = ref_logps.detach().float().to(logps.device)
    ratio = logps - ref
    chosen, rejected = ratio[desirable], ratio[~desirable]
    if loss_type == "kto":
        chosen_losses = 1 - torch.sigmoid(beta * (chosen - z0))
        rejected_losses = 1 - torch.sigmoid(beta * (z0 - rejected))
    else:
        chosen_losses = 1 - torch.sigmoid(beta * chosen)
        rejected_losses = torch.sigmoid(beta * rejected)
    losses = torch.cat((desirable_weight * chosen_losses, undesirable_weight * rejected_losses))
    return KTOLossOutput(losses.nanmean(), logps, ref, desirable, z0, beta)


def kto_kl(kl_logps: torch.Tensor, ref_kl_logps: torch.Tensor) -> torch.Tensor:
    """This batch's KL term before TRL's gather and clamp: mean(logps − ref_logps) of the mismatched pairs."""
    return (kl_logps.float() - ref_kl_logps.float().to(kl_logps.device)).mean().detach()


def strop_kto_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    desirable: torch.Tensor,
    *,
    ref_logps: torch.Tensor,
    kl: torch.Tensor | None,
    bias: torch.Tensor | None = None,
    beta: float = 0.1,
    desirable_weight: float = 1.0,
    undesirable_weight: float = 1.0,
    loss_type: str = "kto",
    ignore_index: int = -100,
    chunk_size: int | None = None,
    softcap: float | None = None,
) -> KTOLossOutput:
    """KTO of a batch of (prompt, completion) hidden states without their logits.

    Args:
        hidden: ``[B, T, H]`` final hidden states.
        weight: ``[V, H]`` frozen LM head.
        labels: ``[B, T]`` unshifted completion labels.
        desirable: ``[B]`` bool labels.
        ref_logps: ``[B]`` reference completion log-probs (the base model, no grad).
        kl: z0 (e.g. ``kto_kl`` of ``sequence_logps`` of the mismatched pairs, gathered and clamped), or None.
        bias: Optional frozen ``[V]`` head bias.
        beta, desirable_weight, undesirable_weight, loss_type: TRL's ``KTOConfig`` fields.
        ignore_index: Label value that is not scored.
        chunk_size: Rows per chunk (default: ~256 MiB of logits).
        softcap: The model's final-logit soft-cap (Gemma's ``final_logit_softcapping``), or None; the
            ``logits/*`` metrics are not computed under one.

    Returns:
        A :class:`KTOLossOutput`; ``.metrics()`` gives TRL's logged values.
    """
    groups, counts = completion_groups(labels, ignore_index)
    logps = grouped_logps(
        hidden,
        weight,
        labels.clamp(min=0),
        groups,
        hidden.shape[0],
        bias,
        chunk_size=chunk_size,
        softcap=softcap,
    )
    out = kto_loss_from_logps(
        logps,
        ref_logps,
        desirable,
        kl,
        beta=beta,
        desirable_weight=desirable_weight,
        undesirable_weight=undesirable_weight,
        loss_type=loss_type,
    )
    if softcap is None:
        ml = mean_logits(hidden, weight, bias)[:, :-1] * (labels[:, 1:] != ignore_index)
        d = out.desirable
        out.logits_sum_chosen, out.logits_sum_rejected = ml[d].sum(), ml[~d].sum()
        out.tokens_chosen, out.tokens_rejected = counts[d].sum(), counts[~d].sum()
    return out
