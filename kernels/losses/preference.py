"""Chunked ORPO, CPO/SimPO and KTO losses: reference-free and unpaired preference optimisation over final hidden
states, without materialising full logits.

All three are functions of per-sequence log-prob sums, which :mod:`strop.kernels.losses.logps` computes chunk by
chunk with the gradient taken in the forward (``sequence_logps``/``sequence_logps_rows``: one [C, V] logits
buffer, the fused-CE Triton kernel, ∂loss/∂h_row = −(∂loss/∂logps_s)·g_row). That holds for any loss whose
dependence on the tokens goes through per-group sums; here a group is a sequence's completion or, for ORPO's
NLL, a chosen sequence's prompt. The formulas are TRL 1.16's (``trl.experimental.orpo.ORPOTrainer``,
``trl.experimental.cpo.CPOTrainer``, ``trl.KTOTrainer``), with S = 2B sequences [chosen; rejected], n_s
completion tokens, logps_s = Σ log p over them and avg_s = logps_s / n_s:

ORPO (``beta`` = the paper's λ)::

    nll        = mean of −log p over every attended token of the chosen rows, prompt included
                 (TRL's CrossEntropyLoss over ``input_ids`` where ``attention_mask``; one mean over the batch)
    log_odds   = (avg_c − avg_r) − (log(1 − e^{avg_c}) − log(1 − e^{avg_r}))
    loss       = nll − mean(λ·logσ(log_odds))

CPO (``average`` = avg for ipo/simpo, sums otherwise; d = a_c − a_r)::

    simpo      (−(1−ε)logσ(β(d − γ/β)) − ε logσ(−β(d − γ/β)))     SimPO: with cpo_alpha = 0
    sigmoid    −(1−ε)logσ(βd) − ε logσ(−βd)
    hinge      relu(1 − βd);   ipo   (d − 1/(2β))²
    loss       = mean + cpo_alpha · nll   (nll: mean −log p over the chosen completions' tokens)

KTO (label y_s, reference logps from the base model, z0 = KL estimate, detached)::

    z0         = clamp(mean over the batch of (logps(x_s, y'_s) − ref_logps(x_s, y'_s)), 0)   y' = mismatched
    desirable  w_d·(1 − σ(β(r_s − z0)));   undesirable  w_u·(1 − σ(β(z0 − r_s)))   r = logps − ref_logps
    apo_zero_unpaired: w_d·(1 − σ(βr)), w_u·σ(βr) and no z0
    loss       = nanmean over the batch

A final-logit soft-cap (Gemma's ``final_logit_softcapping``: z → c·tanh(z/c)) is applied inside the chunk loop
by ``sequence_logps_rows``, as HF's forward applies it to the logits.

Metrics are the keys each TRL trainer logs. ``logits/*`` (mean logit) needs no logits either: the mean over the
vocabulary of h·Wᵀ + b is h·mean(W) + mean(b), one [S·T, H]×[H] product (``mean_logits``; not under a soft-cap,
whose mean is not linear in h). TRL's KTO entropy
needs a second pass over the vocabulary and is not computed.

Each ``strop_*_loss`` has a ``*_reference`` twin with the same signature that scores full fp32 logits in plain
torch; the formulas are shared.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .logps import sequence_logps_rows

__all__ = [
    "CPO_LOSS_TYPES",
    "KTO_LOSS_TYPES",
    "CPOLossOutput",
    "KTOLossOutput",
    "ORPOLossOutput",
    "cpo_loss_from_logps",
    "cpo_loss_reference",
    "grouped_logps",
    "grouped_logps_reference",
    "kto_kl",
    "kto_loss_from_logps",
    "mean_logits",
    "orpo_loss_from_logps",
    "orpo_loss_reference",
    "strop_cpo_loss",
    "strop_kto_loss",
    "strop_orpo_loss",
]

CPO_LOSS_TYPES = ("sigmoid", "hinge", "ipo", "simpo")
KTO_LOSS_TYPES = ("kto", "apo_zero_unpaired")

Reduce = Callable[[torch.Tensor], torch.Tensor]
_MEAN_BLOCK = 8192  # vocabulary rows per block of mean_logits' column sums (8192 × 4096 fp32: 128 MiB)


def _mean(t: torch.Tensor) -> torch.Tensor:
    return t.mean()


def _identity(t: torch.Tensor) -> torch.Tensor:
    return t


# ---- grouped per-token log-prob sums ----------------------------------------------------------------------


def _grouped_rows(targets: torch.Tensor, groups: torch.Tensor, num_groups: int):
    if targets.shape != groups.shape or targets.dim() != 2:
        raise ValueError(
            f"targets and groups must both be [S, T], got {tuple(targets.shape)}, {tuple(groups.shape)}"
        )
    mask = groups[:, 1:] >= 0
    torch._assert_async(
        (groups < num_groups).all() if groups.numel() else torch.tensor(True), "groups must be < num_groups"
    )
    return mask, targets[:, 1:][mask], groups[:, 1:][mask].long()


def grouped_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    groups: torch.Tensor,
    num_groups: int,
    bias: torch.Tensor | None = None,
    *,
    chunk_size: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Σ log_softmax(h[s, t] Wᵀ + b)[targets[s, t+1]] per group ``groups[s, t+1]`` (−1: not scored), chunked.

    ``sequence_logps`` is the case groups = sequence index where labelled; a group may also be any other set of
    positions (ORPO scores chosen prompts for its NLL). The rows are gathered and scored by
    :func:`~strop.kernels.losses.logps.sequence_logps_rows`, so the gradient is computed in the forward.

    Args:
        hidden: ``[S, T, H]`` final hidden states.
        weight: ``[V, H]`` frozen LM head.
        targets: ``[S, T]`` unshifted token ids (read where the group is ≥ 0).
        groups: ``[S, T]`` int group of each position, −1 where not scored, else in ``[0, num_groups)``.
        num_groups: G.
        bias: Optional frozen ``[V]`` head bias.
        chunk_size: Rows per chunk (default: ~256 MiB of logits).
        softcap: The model's final-logit soft-cap c (``c · tanh(logits / c)``, Gemma), or None.

    Returns:
        ``[G]`` fp32 sums, differentiable w.r.t. ``hidden``.
    """
    if hidden.dim() != 3 or hidden.shape[:2] != targets.shape:
        raise ValueError(
            f"hidden must be [S, T, H] over targets {tuple(targets.shape)}, got {tuple(hidden.shape)}"
        )
    if torch.is_grad_enabled() and (weight.requires_grad or (bias is not None and bias.requires_grad)):
        raise ValueError(
            "the chunked preference losses compute no LM-head gradient: freeze lm_head (LoRA does)"
        )
    mask, rows_targets, seq_index = _grouped_rows(targets, groups, num_groups)
    rows = hidden[:, :-1][mask]
    return sequence_logps_rows(
        rows, weight, rows_targets, seq_index, num_groups, bias, chunk_size=chunk_size, softcap=softcap
    )


def grouped_logps_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    groups: torch.Tensor,
    num_groups: int,
    bias: torch.Tensor | None = None,
    *,
    chunk_size: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """:func:`grouped_logps` from the full ``[S, T−1, V]`` fp32 logits (soft-capped as HF's forward does)."""
    mask, _, _ = _grouped_rows(targets, groups, num_groups)
    logits = F.linear(hidden[:, :-1], weight, bias).float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    logp = logits.log_softmax(-1)
    per_token = logp.gather(-1, targets[:, 1:].clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return torch.zeros(num_groups, dtype=torch.float32, device=hidden.device).index_add(
        0, groups[:, 1:][mask].long(), per_token[mask]
    )


@torch.no_grad()
def mean_logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``[S, T]`` fp32 mean over the vocabulary of each position's logits, h·mean(W) + mean(b), without them."""
    # fp32 column sums a block of vocabulary rows at a time: an upcast copy of an 8B head would be 2 GiB
    w_sum = torch.zeros(weight.shape[1], dtype=torch.float32, device=weight.device)
    for start in range(0, weight.shape[0], _MEAN_BLOCK):
        w_sum += weight[start : start + _MEAN_BLOCK].sum(0, dtype=torch.float32)
    w_mean = w_sum / weight.shape[0]
    out = (hidden.detach().reshape(-1, hidden.shape[-1]) @ w_mean.to(hidden.dtype)).float()
    if bias is not None:
        out = out + bias.mean(dtype=torch.float32)
    return out.view(hidden.shape[:-1])


def _completion_groups(labels: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group = sequence index on labelled positions; and each sequence's completion-token count."""
    seq = torch.arange(labels.shape[0], device=labels.device).unsqueeze(1).expand_as(labels)
    groups = torch.where(labels != ignore_index, seq, -1)
    return groups, (labels[:, 1:] != ignore_index).sum(1)


# ---- paired losses (ORPO, CPO): [chosen; rejected] rows -----------------------------------------------------


def _pair_count(hidden: torch.Tensor) -> int:
    """B of ``[2B, T, H]`` [chosen; rejected] hidden states."""
    s = hidden.shape[0]
    if s % 2:
        raise ValueError(f"expected [chosen; rejected] pairs, got {s} sequences")
    return s // 2


def _pair_metrics(out: ORPOLossOutput | CPOLossOutput, reduce: Reduce) -> dict[str, torch.Tensor]:
    """The metrics TRL's ORPO and CPO trainers both log (rewards = β·logps), in their order."""
    c, r = out.beta * out.chosen_logps.detach(), out.beta * out.rejected_logps.detach()
    metrics = {
        "rewards/chosen": reduce(c),
        "rewards/rejected": reduce(r),
        "rewards/accuracies": reduce((c > r).float()),
        "rewards/margins": reduce(c - r),
        "logps/rejected": reduce(out.rejected_logps.detach()),
        "logps/chosen": reduce(out.chosen_logps.detach()),
    }
    if out.logits_chosen is not None and out.logits_rejected is not None:
        metrics["logits/rejected"] = reduce(out.logits_rejected)
        metrics["logits/chosen"] = reduce(out.logits_chosen)
    metrics["nll_loss"] = reduce(out.nll_loss.detach())
    return metrics


def _set_pair_mean_logits(out, hidden, weight, bias, b: int, head_kw: dict, *, shifted: bool) -> None:
    """``out.logits_chosen``/``logits_rejected``: the mean logit of each half, over every position (TRL's
    ORPO: ``all_logits[:, :-1]``, ``shifted``; CPO: all of them). Not under a soft-cap, whose logits' mean is
    not linear in h."""
    if head_kw.get("softcap") is None:
        ml = mean_logits(hidden, weight, bias)
        if shifted:
            ml = ml[:, :-1]
        out.logits_chosen, out.logits_rejected = ml[:b].mean(), ml[b:].mean()


# ---- ORPO --------------------------------------------------------------------------------------------------


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

    def metrics(self, reduce: Reduce = _mean) -> dict[str, torch.Tensor]:
        """TRL's ORPO metrics; ``reduce`` maps a per-pair (or scalar) tensor to its logged mean (e.g. gather + mean)."""
        out = _pair_metrics(self, reduce)
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


def _orpo(logps_fn, hidden, weight, input_ids, attention_mask, labels, bias, beta, ignore_index, head_kw):
    b = _pair_count(hidden)
    s = 2 * b
    groups, counts = _completion_groups(labels, ignore_index)
    # TRL's NLL scores input_ids where attended; on completion positions these are the labels (tokenize_row), so
    # a chosen row's NLL terms are its completion group plus a prompt group 2B + s.
    torch._assert_async(((labels == ignore_index) | ((labels == input_ids) & (attention_mask == 1))).all())
    prompt = (labels == ignore_index) & (attention_mask == 1)
    prompt[b:] = False
    seq = torch.arange(s, device=labels.device).unsqueeze(1)
    groups = torch.where(prompt, seq + s, groups)
    sums = logps_fn(hidden, weight, input_ids, groups, s + b, bias, **head_kw)
    nll_tokens = attention_mask[:b, 1:].sum()
    # TRL: one mean over the batch's chosen tokens (NaN when there are none; clamped here)
    nll = -(sums[:b].sum() + sums[s:].sum()) / nll_tokens.clamp(min=1)
    avg = sums[:s] / counts.clamp(min=1)  # TRL divides by n_s unclamped: NaN for an empty completion
    out = orpo_loss_from_logps(avg[:b], avg[b:], nll, beta=beta)
    _set_pair_mean_logits(out, hidden, weight, bias, b, head_kw, shifted=True)
    return out


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

    Returns:
        An :class:`ORPOLossOutput`; ``.metrics()`` gives TRL's logged values.
    """
    head_kw = dict(chunk_size=chunk_size, softcap=softcap)
    return _orpo(
        grouped_logps, hidden, weight, input_ids, attention_mask, labels, bias, beta, ignore_index, head_kw
    )


def orpo_loss_reference(hidden, weight, input_ids, attention_mask, labels, bias=None, *, beta=0.1,
                        ignore_index=-100, chunk_size=None, softcap=None) -> ORPOLossOutput:  # fmt: skip
    """:func:`strop_orpo_loss` from full fp32 logits."""
    return _orpo(grouped_logps_reference, hidden, weight, input_ids, attention_mask, labels, bias, beta,
                 ignore_index, dict(softcap=softcap))  # fmt: skip


# ---- CPO / SimPO -------------------------------------------------------------------------------------------


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

    def metrics(self, reduce: Reduce = _mean) -> dict[str, torch.Tensor]:
        """TRL's CPO metrics; ``reduce`` maps a per-pair (or scalar) tensor to its logged mean."""
        return _pair_metrics(self, reduce)


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


def _cpo(logps_fn, hidden, weight, labels, bias, beta, loss_type, label_smoothing, simpo_gamma, cpo_alpha,
         ignore_index, head_kw) -> CPOLossOutput:  # fmt: skip
    b = _pair_count(hidden)
    s = 2 * b
    groups, counts = _completion_groups(labels, ignore_index)
    sums = logps_fn(hidden, weight, labels.clamp(min=0), groups, s, bias, **head_kw)
    # TRL: nll = 0 when cpo_alpha == 0, else CrossEntropyLoss over the chosen completions (one mean)
    if cpo_alpha == 0:
        nll = torch.zeros((), device=hidden.device)
    else:
        nll = -sums[:b].sum() / counts[:b].sum().clamp(min=1)
    logps = sums / counts.clamp(min=1) if loss_type in ("ipo", "simpo") else sums
    out = cpo_loss_from_logps(
        logps[:b], logps[b:], nll, beta=beta, loss_type=loss_type, label_smoothing=label_smoothing,
        simpo_gamma=simpo_gamma, cpo_alpha=cpo_alpha,
    )  # fmt: skip
    _set_pair_mean_logits(out, hidden, weight, bias, b, head_kw, shifted=False)
    return out


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

    Returns:
        A :class:`CPOLossOutput`; ``.metrics()`` gives TRL's logged values.
    """
    return _cpo(grouped_logps, hidden, weight, labels, bias, beta, loss_type, label_smoothing, simpo_gamma,
                cpo_alpha, ignore_index, dict(chunk_size=chunk_size, softcap=softcap))  # fmt: skip


def cpo_loss_reference(hidden, weight, labels, bias=None, *, beta=0.1, loss_type="sigmoid", label_smoothing=0.0,
                       simpo_gamma=0.5, cpo_alpha=1.0, ignore_index=-100, chunk_size=None,
                       softcap=None) -> CPOLossOutput:  # fmt: skip
    """:func:`strop_cpo_loss` from full fp32 logits."""
    return _cpo(grouped_logps_reference, hidden, weight, labels, bias, beta, loss_type, label_smoothing,
                simpo_gamma, cpo_alpha, ignore_index, dict(softcap=softcap))  # fmt: skip


# ---- KTO ---------------------------------------------------------------------------------------------------


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

    def metrics(self, total: Reduce = _identity) -> dict[str, float]:
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


def _kto(logps_fn, hidden, weight, labels, desirable, ref_logps, kl, bias, beta, desirable_weight,
         undesirable_weight, loss_type, ignore_index, head_kw) -> KTOLossOutput:  # fmt: skip
    groups, counts = _completion_groups(labels, ignore_index)
    logps = logps_fn(hidden, weight, labels.clamp(min=0), groups, hidden.shape[0], bias, **head_kw)
    out = kto_loss_from_logps(
        logps, ref_logps, desirable, kl, beta=beta, desirable_weight=desirable_weight,
        undesirable_weight=undesirable_weight, loss_type=loss_type,
    )  # fmt: skip
    if head_kw.get("softcap") is None:
        ml = mean_logits(hidden, weight, bias)[:, :-1] * (labels[:, 1:] != ignore_index)
        d = out.desirable
        out.logits_sum_chosen, out.logits_sum_rejected = ml[d].sum(), ml[~d].sum()
        out.tokens_chosen, out.tokens_rejected = counts[d].sum(), counts[~d].sum()
    return out


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
    return _kto(grouped_logps, hidden, weight, labels, desirable, ref_logps, kl, bias, beta, desirable_weight,
                undesirable_weight, loss_type, ignore_index, dict(chunk_size=chunk_size, softcap=softcap))  # fmt: skip
