"""KL(teacher ‖ student) per token from two sets of final hidden states under one LM head, chunk by chunk.

For rows m (one per scored token) with student hidden states s_m, teacher hidden states t_m (no gradient), the LM
head W [V, H] (bias b, optional soft-cap c):

    z_m = s_m Wᵀ + b,   u_m = t_m Wᵀ + b          (→ c · tanh(· / c) under a soft-cap)
                                                  from 16-bit operands the fp32 sums, not rounded to 16 bits
                                                  (``ops.unrounded_linear``)
    KL_m = Σ_v softmax(u_m)_v · (log_softmax(u_m)_v − log_softmax(z_m)_v)       fp32
    loss = mean_m KL_m

The forward KL with the teacher first is distillation's (Hinton et al., 2015, "Distilling the Knowledge in a Neural
Network"; the "KL to the reference" of RLHF's penalty is the other direction, on the student's own samples, which
fixed answers do not give): it pulls the student's whole next-token distribution back to the teacher's where the
teacher put its mass. strop uses it to keep an adapter's model close to its base on replayed answers
(``trainer_svc/core/retention.py``), the base (adapter disabled) as the teacher, the same reference trick as DPO.

Chunking: rows go C at a time, so only [C, V] logits exist (two of them, student and teacher); each chunk runs
under activation checkpointing, so backward recomputes its logits instead of keeping every chunk's (C as the
fused linear CE sizes it, ~256 MiB of logits a chunk).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from ..ops.fused_linear_ce import default_chunk_size
from ..ops.unrounded_linear import unrounded_linear

__all__ = ["token_kl", "token_kl_reference"]


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, softcap: float | None):
    # fp32 at least (float64 stays, for the tests); from 16-bit operands the fp32 sum unrounded, as Generate decides
    # (its leads are the ones the hinge protects)
    z = unrounded_linear(hidden, weight, bias)
    return softcap * torch.tanh(z / softcap) if softcap else z


def token_kl_reference(
    student: torch.Tensor,
    teacher: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    softcap: float | None = None,
    lead_weight: float = 0.0,
    lead_cap: float = 1.0,
    lead_floor: float = 0.0,
    lead_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """mean over rows of KL(softmax(teacher logits) ‖ softmax(student logits)) from the full ``[M, V]`` logits
    (torch's ``kl_div`` with log-space targets), plus ``lead_weight`` × the mean lead hinge (:func:`token_kl`)."""
    zl = _logits(student, weight, bias, softcap)
    ul = _logits(teacher.detach(), weight, bias, softcap)
    m = max(student.shape[0], 1)
    kl = F.kl_div(zl.log_softmax(-1), ul.log_softmax(-1), log_target=True, reduction="sum") / m
    if not lead_weight:
        return kl
    return kl + lead_weight * _lead_hinge(ul, zl, lead_cap, lead_floor, lead_tokens) / m


def _lead_hinge(
    u: torch.Tensor, z: torch.Tensor, cap: float, floor: float, tokens: torch.Tensor | None
) -> torch.Tensor:
    """Σ_rows relu(clamp(teacher lead, floor, cap) − student lead) on each row's protected token: the teacher's top
    token (``tokens`` None) or the given one. A lead is the token's logit minus the best other token's."""

    def lead(x: torch.Tensor, best: torch.Tensor) -> torch.Tensor:
        return x.gather(1, best)[:, 0] - x.scatter(1, best, float("-inf")).amax(-1)

    if tokens is None:
        top2 = u.topk(2, dim=-1)
        best = top2.indices[:, :1]
        teacher_lead = top2.values[:, 0] - top2.values[:, 1]  # its lead, without a second pass over the row
    else:
        best = tokens[:, None]
        teacher_lead = lead(u, best)
    return torch.relu(teacher_lead.clamp(min=floor, max=cap) - lead(z, best)).sum()


def _chunk_kl_sum(
    student: torch.Tensor,
    teacher: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    softcap: float | None,
    lead_weight: float = 0.0,
    lead_cap: float = 1.0,
    lead_floor: float = 0.0,
    lead_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    u = _logits(teacher, weight, bias, softcap)
    z = _logits(student, weight, bias, softcap)
    log_p, log_q = u.log_softmax(-1), z.log_softmax(-1)
    total = (log_p.exp() * (log_p - log_q)).sum()
    if lead_weight:  # the lead hinge on the chunk's logits (token_kl's docstring)
        total = total + lead_weight * _lead_hinge(u, z, lead_cap, lead_floor, lead_tokens)
    return total


def token_kl(
    student: torch.Tensor,
    teacher: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    softcap: float | None = None,
    chunk_size: int | None = None,
    lead_weight: float = 0.0,
    lead_cap: float = 1.0,
    lead_floor: float = 0.0,
    lead_tokens: torch.Tensor | None = None,
) -> torch.Tensor:
    """:func:`token_kl_reference` computed ``chunk_size`` rows at a time (the fused linear CE's chunk by default).

    The lead hinge (``lead_weight`` > 0): for each row, the teacher's top token a and its lead over its next best,
    ``u_a − max_{j≠a} u_j`` (capped at ``lead_cap``), against the student's lead of the same token,
    ``z_a − max_{j≠a} z_j``: the mean of ``relu(teacher lead − student lead)``, times ``lead_weight``, is added. The
    KL barely prices a near tie that flips (0.5/0.45 swapped costs ~0.005 nats) though it changes what greedy
    decoding answers; the hinge prices exactly that, and nothing while the student leads at least as the teacher
    does (to the cap). With ``lead_floor`` > 0 the protected lead is at least the floor: where the teacher's top
    token only just leads (or ties, as bf16 logits often do), the student is asked to lead by the floor, so that its
    greedy choice there is the teacher's by a margin rounding does not flip. Computed on the same chunk's logits as
    the KL.

    Args:
        student: [M, H] hidden states of the scored positions (gradient flows here, and to a trainable head).
        teacher: [M, H] the teacher's hidden states at the same positions (treated as constants).
        weight: [V, H] the LM head; bias: [V] or None; softcap: Gemma's final_logit_softcapping, or None.
        lead_weight, lead_cap: the lead hinge's weight (0: none) and the teacher lead it protects at most (nats).
        lead_floor: the least lead it protects (nats; 0: the teacher's own lead, however small).
        lead_tokens: [M] the token each row's hinge protects (default: the teacher's top token). The token the
            teacher's own decoding chose where one did: under a tie (bf16 logits) the top token is not decided by
            the logits, and a floor must protect the chosen one.

    Returns:
        The mean KL per row (plus the weighted mean hinge), fp32, a scalar (0 for no rows, still connected to
        ``student``).
    """
    if lead_weight and lead_floor > lead_cap:
        raise ValueError(f"lead_floor {lead_floor} is above lead_cap {lead_cap}")
    m = student.shape[0]
    if m == 0:
        return student.sum() * 0.0
    c = chunk_size or default_chunk_size(m, weight.shape[0], 4)
    teacher = teacher.detach()
    total = student.new_zeros((), dtype=torch.promote_types(student.dtype, torch.float32))
    for i in range(0, m, c):
        total = total + torch.utils.checkpoint.checkpoint(
            _chunk_kl_sum,
            student[i : i + c],
            teacher[i : i + c],
            weight,
            bias,
            softcap,
            lead_weight,
            lead_cap,
            lead_floor,
            None if lead_tokens is None else lead_tokens[i : i + c],
            use_reentrant=False,
            preserve_rng_state=False,  # the chunk draws no random numbers: nothing to replay
        )
    return total / m
