"""What the chunked preference losses share (Liger's ``fused_linear_preference`` in strop's shape): per-group
log-prob sums over final hidden states, the mean logit without the logits, and the [chosen; rejected] pair
helpers. Each loss has its own small file: DPO ``dpo.py``, ORPO ``orpo.py``, CPO/SimPO ``cpo.py``, KTO ``kto.py``.

The losses are functions of per-sequence log-prob sums, which :mod:`strop.kernels.losses.logps` computes chunk by
chunk with the gradient taken in the forward (``sequence_logps``/``sequence_logps_rows``: one [C, V] logits
buffer, the fused-CE Triton kernel, ∂loss/∂h_row = −(∂loss/∂logps_s)·g_row). That holds for any loss whose
dependence on the tokens goes through per-group sums; here a group is a sequence's completion or, for ORPO's
NLL, a chosen sequence's prompt. The formulas are TRL 1.16's, with S = 2B sequences [chosen; rejected], n_s
completion tokens, logps_s = Σ log p over them and avg_s = logps_s / n_s.

A final-logit soft-cap (Gemma's ``final_logit_softcapping``: z → c·tanh(z/c)) is applied inside the chunk loop
by ``sequence_logps_rows``, as HF's forward applies it to the logits.

Metrics are the keys each TRL trainer logs. ``logits/*`` (mean logit) needs no logits either: the mean over the
vocabulary of h·Wᵀ + b is h·mean(W) + mean(b), one [S·T, H]×[H] product (``mean_logits``; not under a soft-cap,
whose mean is not linear in h).

Each paired ``strop_*_loss`` takes its log-prob engine as ``logps_fn``; its ``*_reference`` twin is the same
function with ``grouped_logps_reference``, which scores full fp32 logits in plain torch.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from .logps import sequence_logps_rows

__all__ = [
    "GroupedLogps",
    "Reduce",
    "completion_groups",
    "grouped_logps",
    "grouped_logps_reference",
    "identity_reduce",
    "mean_logits",
    "mean_reduce",
    "pair_count",
    "pair_metrics",
    "set_pair_mean_logits",
]

Reduce = Callable[[torch.Tensor], torch.Tensor]
GroupedLogps = Callable[..., torch.Tensor]  # grouped_logps or grouped_logps_reference
_MEAN_BLOCK = 8192  # vocabulary rows per block of mean_logits' column sums (8192 × 4096 fp32: 128 MiB)


def mean_reduce(t: torch.Tensor) -> torch.Tensor:
    """A metric's default reduction on one rank: the mean."""
    return t.mean()


def identity_reduce(t: torch.Tensor) -> torch.Tensor:
    """A metric's default total on one rank: the value itself."""
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


def completion_groups(labels: torch.Tensor, ignore_index: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Group = sequence index on labelled positions; and each sequence's completion-token count."""
    seq = torch.arange(labels.shape[0], device=labels.device).unsqueeze(1).expand_as(labels)
    groups = torch.where(labels != ignore_index, seq, -1)
    return groups, (labels[:, 1:] != ignore_index).sum(1)


# ---- paired losses (ORPO, CPO): [chosen; rejected] rows -----------------------------------------------------


def pair_count(hidden: torch.Tensor) -> int:
    """B of ``[2B, T, H]`` [chosen; rejected] hidden states."""
    s = hidden.shape[0]
    if s % 2:
        raise ValueError(f"expected [chosen; rejected] pairs, got {s} sequences")
    return s // 2


def pair_metrics(out, reduce: Reduce) -> dict[str, torch.Tensor]:
    """The metrics TRL's ORPO and CPO trainers both log (rewards = β·logps), in their order, from an ORPO or
    CPO output (``orpo.ORPOLossOutput``, ``cpo.CPOLossOutput``)."""
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


def set_pair_mean_logits(out, hidden, weight, bias, b: int, softcap: float | None, *, shifted: bool) -> None:
    """``out.logits_chosen``/``logits_rejected``: the mean logit of each half, over every position (TRL's
    ORPO: ``all_logits[:, :-1]``, ``shifted``; CPO: all of them). Not under a soft-cap, whose logits' mean is
    not linear in h."""
    if softcap is None:
        ml = mean_logits(hidden, weight, bias)
        if shifted:
            ml = ml[:, :-1]
        out.logits_chosen, out.logits_rejected = ml[:b].mean(), ml[b:].mean()
