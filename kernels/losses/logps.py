"""The chunked log-prob engine: log p(target) of a causal LM's final hidden states, chunk by chunk, so the full
``[tokens, vocab]`` logits never exist. One engine for every loss over log-probs (DPO, ORPO, KTO, SimPO in
``dpo.py`` and ``preference.py``; the step API's cross-entropy and RL losses in ``rl.py``), in Liger's
chunked-loss shape: this file walks the hidden rows, each loss is a small function of what it returns.

For rows h [M, H] (one per scored token), a frozen LM head W [V, H] (bias b, optional soft-cap c) and targets y:

    z_m     = h_m Wᵀ + b            (→ c · tanh(z / c) with a soft-cap: Gemma's final_logit_softcapping)
    logp_m  = log_softmax(z_m)[y_m]   fp32
    logps_s = Σ_{m in s} logp_m       per group s (a sequence for DPO; each row its own group for per-token
                                      log-probs, ``token_logps_rows``)

Chunking. The rows are processed C at a time, so only a [C, V] logits buffer exists (C sized like the fused
linear CE: ~256 MiB of logits). Per chunk, the fused linear CE's Triton kernel (``kernels/ops/fused_linear_ce.py``,
reused, with denominator 1) computes nll = logsumexp(z) − z_y in fp32 and overwrites the buffer with
∂nll/∂z = softmax(z) − onehot(y) (times 1 − tanh²(ℓ/c) under a soft-cap, ℓ the head's raw logits), and one GEMM
gives g_m = ∂nll/∂h_m = (∂nll/∂z) W.

Gradients in forward, not recomputed in backward. A row's log-prob depends only on that row, and any loss
of the group sums depends on a row only through its group's sum, so ∂loss/∂h_m = −(∂loss/∂logps_s(m)) · g_m:
g_m is computed in the forward while the chunk's logits are live and saved ([M, H] in the compute dtype, the
size of the gathered rows a recomputing backward would save), and backward is one scale per row. Two
[C, V]×H GEMMs per chunk (logits, g) instead of a recomputing backward's three. The LM head must be frozen
here (its gradient would need the per-group factor inside the chunk loop); a LoRA on the head (the step API's
``train_unembed``) goes through ``token_logps_trainable_head``, chunked with the chunk recomputed in backward.

Dtypes: logits and g in the compute dtype (the autocast dtype under autocast, else the head's), as ``F.linear``
produces them; log-softmax and log-probs in fp32. On a host without CUDA (and without ``TRITON_INTERPRET=1``)
the per-chunk softmax runs in torch.
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F
import torch.utils.checkpoint

from ..ops.fused_linear_ce import MAX_BLOCK_V, NUM_WARPS, default_chunk_size, fused_linear_ce_fwd_kernel
from ..ops.utils import cdiv, next_power_of_2, upload

__all__ = [
    "SequenceLogProbFunction",
    "sequence_logps",
    "sequence_logps_reference",
    "sequence_logps_rows",
    "token_logps_reference",
    "token_logps_rows",
    "token_logps_trainable_head",
]


# ---- reference: full logits ---------------------------------------------------------------------------------


def sequence_logps_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    chunk_size: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Per-sequence Σ log p(label) from the full ``[S, T−1, V]`` logits, upcast to fp32 (TRL's semantics),
    soft-capped as HF's Gemma forward does when ``softcap`` is given. ``chunk_size`` is unused: it takes
    :func:`sequence_logps`' arguments."""
    logits = F.linear(hidden[:, :-1], weight, bias).float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    targets = labels[:, 1:]
    mask = targets != ignore_index
    per_token = logits.log_softmax(-1).gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    return (per_token * mask).sum(1)


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
                    logits,
                    logits.stride(0),
                    targets[start:end],
                    nll[start:end],
                    ones,
                    vocab,
                    -100,
                    1.0,
                    float(softcap or 1.0),
                    HAS_SOFTCAP=softcap is not None,
                    COMPUTE_GRAD=grad,
                    BLOCK_V=block_v,
                    N_BLOCKS=cdiv(vocab, block_v),
                    num_warps=NUM_WARPS,
                )
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
            "the chunked log-prob engine computes no LM-head gradient: freeze lm_head, or use "
            "token_logps_trainable_head (a LoRA on the head)"
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
    host_labels: torch.Tensor | None = None,
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
        host_labels: ``labels`` in host memory, where the caller has them: the scored rows are found there, so the
            device's queue is not waited on for their count (``labels`` on the device is then not read).

    Returns:
        ``[S]`` fp32, differentiable w.r.t. ``hidden``.
    """
    _check(hidden, weight, labels, bias)
    if host_labels is not None:
        if host_labels.shape != labels.shape:
            raise ValueError(f"host_labels {tuple(host_labels.shape)} are not labels' {tuple(labels.shape)}")
        s, t = labels.shape
        seq, col = (host_labels[:, 1:] != ignore_index).nonzero(as_tuple=True)
        rows = hidden.reshape(s * t, hidden.shape[-1]).index_select(0, upload(seq * t + col, hidden.device))
        return sequence_logps_rows(
            rows,
            weight,
            upload(host_labels[seq, col + 1], hidden.device),
            upload(seq, hidden.device),
            s,
            bias,
            chunk_size=chunk_size,
            softcap=softcap,
        )
    targets = labels[:, 1:]
    mask = targets != ignore_index
    # Gathering the labelled rows (one host sync for their count) skips the prompt and padding rows' GEMMs.
    rows = hidden[:, :-1][mask]
    seq_index = torch.arange(hidden.shape[0], device=hidden.device).unsqueeze(1).expand_as(mask)[mask]
    return sequence_logps_rows(
        rows, weight, targets[mask], seq_index, hidden.shape[0], bias, chunk_size=chunk_size, softcap=softcap
    )


def token_logps_reference(
    rows: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    softcap: float | None = None,
) -> torch.Tensor:
    """Per-row log p(target) from the full ``[M, V]`` logits in fp32 (what :func:`token_logps_rows` computes)."""
    logits = F.linear(rows, weight, bias).float()
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    return logits.log_softmax(-1).gather(-1, targets.long().unsqueeze(-1)).squeeze(-1)


def token_logps_rows(
    rows: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    chunk_size: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Per-row ``log_softmax(row Wᵀ + b)[target]`` ([M] fp32, differentiable w.r.t. ``rows``): the engine with
    every row its own group, so a per-token loss (the RL losses) scales each row's saved gradient by its own
    factor in backward."""
    index = torch.arange(rows.shape[0], device=rows.device)
    return sequence_logps_rows(
        rows, weight, targets, index, rows.shape[0], bias, chunk_size=chunk_size, softcap=softcap
    )


def token_logps_trainable_head(
    rows: torch.Tensor,
    head: Callable[[torch.Tensor], torch.Tensor],
    targets: torch.Tensor,
    *,
    chunk_rows: int = 1024,
    softcap: float | None = None,
) -> torch.Tensor:
    """Per-row log p(target) through a head with trainable parameters (a LoRA on ``lm_head``), ``chunk_rows``
    rows at a time: each chunk's logits are recomputed in backward (``torch.utils.checkpoint``), so only one
    chunk's ``[C, V]`` logits is alive at once, and autograd reaches the head's own parameters."""

    def chunk(h: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        z = head(h).float()
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        return z.log_softmax(-1).gather(-1, y.long().unsqueeze(-1)).squeeze(-1)

    out = []
    for start in range(0, rows.shape[0], chunk_rows):
        h, y = rows[start : start + chunk_rows], targets[start : start + chunk_rows]
        if torch.is_grad_enabled():
            out.append(torch.utils.checkpoint.checkpoint(chunk, h, y, use_reentrant=False))
        else:
            out.append(chunk(h, y))
    return torch.cat(out) if out else rows.new_zeros(0, dtype=torch.float32)
