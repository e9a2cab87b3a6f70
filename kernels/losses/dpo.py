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

Chunking. Only labelled positions are scored: their rows are gathered into [M, H] (M = completion tokens)
and processed C rows at a time, so only a [C, V] logits buffer exists (C sized like the fused linear CE:
~256 MiB of logits). Per chunk, the fused linear CE's Triton kernel (``kernels/fused_linear_ce.py``,
reused, with denominator 1) computes nll = logsumexp(z) − z_y in fp32 and overwrites the buffer with
∂nll/∂ℓ = softmax(z) − onehot(y) (times 1 − tanh²(ℓ/c) under a soft-cap, ℓ the head's raw logits), and
one GEMM gives g_row = ∂nll/∂h_row = (∂nll/∂ℓ) W.

Gradients in forward, not recomputed in backward. A token's log-prob depends only on its own hidden row,
and the DPO loss depends on the tokens only through the per-sequence sums, so

    ∂loss/∂h_row = −(∂loss/∂logps_s(row)) · g_row

where the first factor is one scalar per sequence that autograd computes from the small loss formula.
g_row does not depend on it, so it is computed in the forward while the chunk's logits are live, saved
([M, H] in the compute dtype, the same size as the gathered hidden rows a recomputing backward would
save), and backward is one scale per row. This costs two [C, V]×H GEMMs per chunk (logits, g); a
recomputing backward (TRL's fused LM head) costs three (logits in forward, logits again and dX in
backward). The reference pass (no grad) runs the logits GEMM only. The LM head must be frozen (LoRA
never trains it): its gradient would need the per-sequence factor inside the chunk loop.

Dtypes: logits and g_row in the compute dtype (the autocast dtype under autocast, else the head's), as
``F.linear`` produces them; log-softmax, per-token and per-sequence log-probs, loss and metrics in fp32.
On a host without CUDA (and without ``TRITON_INTERPRET=1``) the per-chunk softmax runs in torch.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from ..ops.fused_linear_ce import MAX_BLOCK_V, NUM_WARPS, default_chunk_size, fused_linear_ce_fwd_kernel
from ..ops.utils import cdiv, next_power_of_2

__all__ = [
    "LOSS_TYPES",
    "DPOLossOutput",
    "SequenceLogProbFunction",
    "chunked_dpo_loss_reference",
    "dpo_loss_from_logps",
    "dpo_loss_on_pairs",
    "sequence_logps",
    "sequence_logps_reference",
    "sequence_logps_rows",
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


def sequence_logps_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    softcap: float | None = None,
) -> torch.Tensor:
    """Per-sequence Σ log p(label) from the full ``[S, T−1, V]`` logits, upcast to fp32 (TRL's semantics),
    soft-capped as HF's Gemma forward does when ``softcap`` is given."""
    logits = F.linear(hidden[:, :-1], weight, bias).float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    targets = labels[:, 1:]
    mask = targets != ignore_index
    per_token = logits.log_softmax(-1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (per_token * mask).sum(1)


def chunked_dpo_loss_reference(
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
    softcap: float | None = None,
) -> DPOLossOutput:
    """:func:`strop_dpo_loss` computed from full logits, in plain torch."""
    logps = sequence_logps_reference(hidden, weight, labels, bias, ignore_index=ignore_index, softcap=softcap)
    ref = _reference_logps(
        ref_chosen_logps, ref_rejected_logps, ref_hidden,
        lambda h: sequence_logps_reference(h, weight, labels, bias, ignore_index=ignore_index, softcap=softcap),
    )  # fmt: skip
    return dpo_loss_on_pairs(logps, ref, labels, ignore_index, beta, loss_type, loss_weights, label_smoothing)


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
        chosen, rejected, ref_chosen, ref_rejected, beta=beta, loss_type=loss_type, loss_weights=loss_weights,
        label_smoothing=label_smoothing, chosen_tokens=chosen_tokens, rejected_tokens=rejected_tokens,
    )  # fmt: skip


# ---- chunked per-sequence log-probs ---------------------------------------------------------------------


def _use_triton(device: torch.device) -> bool:
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _nll_and_dlogits_torch(
    logits: torch.Tensor, targets: torch.Tensor, nll: torch.Tensor, grad: bool, softcap: float | None = None
) -> None:
    """The kernel's math in torch (hosts without Triton): nll rows, and logits overwritten by ∂nll/∂logits."""
    z = logits.float()
    if softcap is not None:
        t = torch.tanh(z / softcap)
        z = softcap * t
    lse = torch.logsumexp(z, dim=-1)
    nll.copy_(lse - z.gather(1, targets.unsqueeze(1)).squeeze(1))
    if grad:
        d = torch.exp(z - lse.unsqueeze(1))
        d[torch.arange(len(targets), device=z.device), targets] -= 1.0
        if softcap is not None:
            d *= 1.0 - t * t
        logits.copy_(d)


def _sequence_logps_fwd(
    rows: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    targets: torch.Tensor,
    seq_index: torch.Tensor,
    num_seqs: int,
    chunk_size: int | None,
    grad: bool,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Per-sequence log-probs [S] (fp32) and, when ``grad``, ∂nll/∂row for every row [M, H]."""
    device = rows.device
    dtype = torch.get_autocast_dtype(device.type) if torch.is_autocast_enabled(device.type) else weight.dtype
    # Outside autocast F.linear needs one dtype; under autocast it casts both to the autocast dtype. Same here.
    w = weight.to(dtype)
    b = None if bias is None else bias.to(dtype)
    m, vocab = rows.shape[0], weight.shape[0]
    nll = torch.empty(m, dtype=torch.float32, device=device)
    d_rows = torch.empty(m, rows.shape[1], dtype=dtype, device=device) if grad else None
    chunk = min(chunk_size or default_chunk_size(m, vocab, w.element_size()), max(m, 1))
    buf = torch.empty(chunk, vocab, dtype=dtype, device=device)
    ones = torch.ones((), dtype=torch.float32, device=device)  # the CE kernel's denominator: no mean here
    triton_ok = _use_triton(device)
    block_v = min(MAX_BLOCK_V, next_power_of_2(vocab))
    with torch.autocast(device.type, enabled=False):
        for start in range(0, m, chunk):
            end = min(start + chunk, m)
            x = rows[start:end].to(dtype)
            logits = buf[: end - start]
            if b is None:
                torch.mm(x, w.t(), out=logits)
            else:
                torch.addmm(b, x, w.t(), out=logits)
            if triton_ok:
                fused_linear_ce_fwd_kernel[(end - start,)](
                    logits, logits.stride(0), targets[start:end], nll[start:end], ones, vocab, -100,
                    1.0, float(softcap or 1.0), HAS_SOFTCAP=softcap is not None, COMPUTE_GRAD=grad,
                    BLOCK_V=block_v, N_BLOCKS=cdiv(vocab, block_v), num_warps=NUM_WARPS,
                )  # fmt: skip
            else:
                _nll_and_dlogits_torch(logits, targets[start:end], nll[start:end], grad, softcap)
            if grad:
                torch.mm(logits, w, out=d_rows[start:end])  # logits now hold ∂nll/∂z
    logps = torch.zeros(num_seqs, dtype=torch.float32, device=device).index_add_(
        0, seq_index, nll, alpha=-1.0
    )
    return logps, d_rows


class SequenceLogProbFunction(torch.autograd.Function):
    """``apply(rows, weight, bias, targets, seq_index, num_seqs, chunk_size[, softcap])`` → per-sequence
    log-probs [S].

    Gradients w.r.t. the rows are computed in forward (∂nll/∂row) and scaled per sequence in backward.
    """

    @staticmethod
    def forward(ctx, rows, weight, bias, targets, seq_index, num_seqs, chunk_size, softcap=None):
        grad = ctx.needs_input_grad[0]
        logps, d_rows = _sequence_logps_fwd(
            rows, weight, bias, targets, seq_index, num_seqs, chunk_size, grad, softcap
        )
        ctx.rows_dtype = rows.dtype
        ctx.save_for_backward(d_rows, seq_index)
        return logps

    @staticmethod
    def backward(ctx, grad_logps):
        d_rows, seq_index = ctx.saved_tensors
        grad_rows = None
        if ctx.needs_input_grad[0]:
            # logps_s = −Σ nll_row  ⇒  ∂L/∂row = −(∂L/∂logps_s) · ∂nll/∂row; the scale stays fp32 until the product
            scale = -grad_logps.float()[seq_index].unsqueeze(1)
            grad_rows = (d_rows.float() * scale).to(ctx.rows_dtype)
        return grad_rows, None, None, None, None, None, None, None


def _check_softcap(softcap: float | None) -> float | None:
    if softcap is not None and not (isinstance(softcap, int | float) and softcap > 0):
        raise ValueError(f"softcap must be a positive number or None, got {softcap!r}")
    return None if softcap is None else float(softcap)


def _check(
    hidden: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, bias: torch.Tensor | None
) -> None:
    if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3 or not hidden.is_floating_point():
        raise ValueError(
            f"hidden must be a float [S, T, H] tensor, got {getattr(hidden, 'shape', type(hidden))}"
        )
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2 or weight.shape[1] != hidden.shape[2]:
        raise ValueError(
            f"weight must be [V, {hidden.shape[2]}], got {getattr(weight, 'shape', type(weight))}"
        )
    if not isinstance(labels, torch.Tensor) or labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"labels must be an int64/int32 tensor, got {getattr(labels, 'dtype', type(labels))}")
    if labels.shape != hidden.shape[:2]:
        raise ValueError(f"labels must be {tuple(hidden.shape[:2])} (unshifted), got {tuple(labels.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    if torch.is_grad_enabled() and (weight.requires_grad or (bias is not None and bias.requires_grad)):
        raise ValueError(
            "the chunked DPO loss computes no LM-head gradient: freeze lm_head (LoRA does) or use "
            "chunked_dpo_loss_reference"
        )
    devices = {t.device for t in (hidden, weight, labels, bias) if t is not None}
    if len(devices) > 1:
        raise ValueError(
            f"hidden, weight, labels and bias must be on one device, got {sorted(map(str, devices))}"
        )


def sequence_logps_rows(
    rows: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    seq_index: torch.Tensor,
    num_seqs: int,
    bias: torch.Tensor | None = None,
    *,
    chunk_size: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Per-sequence log-probs from already-selected rows: ``Σ_{rows of s} log_softmax(row Wᵀ + b)[target]``.

    Args:
        rows: ``[M, H]`` hidden rows, one per scored token.
        weight: ``[V, H]`` frozen LM head.
        targets: ``[M]`` token ids in ``[0, V)``.
        seq_index: ``[M]`` int64 sequence of each row, in ``[0, num_seqs)``.
        num_seqs: S.
        bias: Optional frozen ``[V]`` head bias.
        chunk_size: Rows per chunk (default: ~256 MiB of logits).
        softcap: Soft-cap c of the logits (``c · tanh(logits / c)`` before the log-softmax), as the
            model's config has it (``final_logit_softcapping``); None for none.

    Returns:
        ``[S]`` fp32 log-probs; sequences without rows get 0.
    """
    softcap = _check_softcap(softcap)
    if rows.dim() != 2 or targets.shape != rows.shape[:1] or seq_index.shape != rows.shape[:1]:
        raise ValueError(
            f"rows [M, H], targets [M] and seq_index [M] expected, got {tuple(rows.shape)}, "
            f"{tuple(targets.shape)}, {tuple(seq_index.shape)}"
        )
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    # Out-of-range targets would be read out of bounds by the kernel; asynchronous on CUDA (no host sync).
    torch._assert_async(
        ((targets >= 0) & (targets < weight.shape[0])).all() if targets.numel() else torch.tensor(True),
        "targets must be in [0, vocab)",
    )
    return SequenceLogProbFunction.apply(
        rows, weight, bias, targets, seq_index.long(), num_seqs, chunk_size, softcap
    )


def sequence_logps(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Per-sequence Σ log p(label) of a causal LM's final hidden states, chunked (see the module docstring).

    Args:
        hidden: ``[S, T, H]`` final hidden states (after the last norm).
        weight: ``[V, H]`` frozen LM head.
        labels: ``[S, T]`` unshifted labels, ``ignore_index`` where not scored.
        bias: Optional frozen ``[V]`` head bias.
        ignore_index: Label value that is not scored.
        chunk_size: Rows per chunk (default: ~256 MiB of logits).
        softcap: The model's final-logit soft-cap (Gemma's ``final_logit_softcapping``), or None.

    Returns:
        ``[S]`` fp32, differentiable w.r.t. ``hidden``.
    """
    _check(hidden, weight, labels, bias)
    targets = labels[:, 1:]
    mask = targets != ignore_index
    # Gathering the labelled rows (one host sync for their count) skips the prompt and padding rows' GEMMs.
    rows = hidden[:, :-1][mask]
    seq_index = torch.arange(hidden.shape[0], device=hidden.device).unsqueeze(1).expand_as(mask)[mask]
    return sequence_logps_rows(
        rows, weight, targets[mask], seq_index, hidden.shape[0], bias, chunk_size=chunk_size, softcap=softcap
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

    Returns:
        A :class:`DPOLossOutput`; ``.metrics()`` gives TRL's logged values.
    """
    kw = {"ignore_index": ignore_index, "chunk_size": chunk_size, "softcap": softcap}
    logps = sequence_logps(hidden, weight, labels, bias, **kw)
    ref = _reference_logps(
        ref_chosen_logps,
        ref_rejected_logps,
        ref_hidden,
        lambda h: sequence_logps(h, weight, labels, bias, **kw),
    )
    return dpo_loss_on_pairs(logps, ref, labels, ignore_index, beta, loss_type, loss_weights, label_smoothing)
