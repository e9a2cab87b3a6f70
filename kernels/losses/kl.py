"""KL(teacher ‖ student) per token from two sets of final hidden states under one LM head, chunk by chunk.

For rows m (one per scored token) with student hidden states s_m, teacher hidden states t_m (no gradient), the LM
head W [V, H] (bias b, optional soft-cap c):

    z_m = s_m Wᵀ + b,   u_m = t_m Wᵀ + b          (→ c · tanh(· / c) under a soft-cap)
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

__all__ = ["token_kl", "token_kl_reference"]


def _logits(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, softcap: float | None):
    z = F.linear(hidden, weight, bias)
    z = z.to(torch.promote_types(z.dtype, torch.float32))  # fp32 at least (float64 stays, for the tests)
    return softcap * torch.tanh(z / softcap) if softcap else z


def token_kl_reference(
    student: torch.Tensor,
    teacher: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    softcap: float | None = None,
) -> torch.Tensor:
    """mean over rows of KL(softmax(teacher logits) ‖ softmax(student logits)) from the full ``[M, V]`` logits
    (torch's ``kl_div`` with log-space targets)."""
    z = _logits(student, weight, bias, softcap).log_softmax(-1)
    u = _logits(teacher.detach(), weight, bias, softcap).log_softmax(-1)
    return F.kl_div(z, u, log_target=True, reduction="sum") / max(student.shape[0], 1)


def _chunk_kl_sum(
    student: torch.Tensor,
    teacher: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    softcap: float | None,
) -> torch.Tensor:
    log_p = _logits(teacher, weight, bias, softcap).log_softmax(-1)
    log_q = _logits(student, weight, bias, softcap).log_softmax(-1)
    return (log_p.exp() * (log_p - log_q)).sum()


def token_kl(
    student: torch.Tensor,
    teacher: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    softcap: float | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """:func:`token_kl_reference` computed ``chunk_size`` rows at a time (the fused linear CE's chunk by default).

    Args:
        student: [M, H] hidden states of the scored positions (gradient flows here, and to a trainable head).
        teacher: [M, H] the teacher's hidden states at the same positions (treated as constants).
        weight: [V, H] the LM head; bias: [V] or None; softcap: Gemma's final_logit_softcapping, or None.

    Returns:
        The mean KL per row, fp32, a scalar (0 for no rows, still connected to ``student``).
    """
    m = student.shape[0]
    if m == 0:
        return student.sum() * 0.0
    c = chunk_size or default_chunk_size(m, weight.shape[0], 4)
    teacher = teacher.detach()
    total = student.new_zeros((), dtype=torch.promote_types(student.dtype, torch.float32))
    for i in range(0, m, c):
        total = total + torch.utils.checkpoint.checkpoint(
            _chunk_kl_sum, student[i : i + c], teacher[i : i + c], weight, bias, softcap, use_reentrant=False
        )
    return total / m
