"""Fused linear per-token log-probabilities (TRL's fused LM head contract) with the gradient made in the forward.

For hidden rows x_i ∈ R^H, head W [V, H], optional bias b [V] and targets y_i (already shifted):

    ℓ_i = x_i Wᵀ + b                       GEMM in the input dtype, fp32 accumulate, stored in the input dtype
    z_i = c · tanh(ℓ_i / c)                only with softcap c
    logp_i    = z_i[y_i] − logsumexp(z_i)  fp32; 0 where y_i == ignore_index
    entropy_i = logsumexp(z_i) − Σ_j p_ij z_ij                  (p_i = softmax(z_i)), a metric: no gradient
    is_top1_i = z_i[y_i] ≥ max_j z_ij  and  z_i[y_i] > max_{j < y_i} z_ij   (the first argmax, TRL's tie rule)

TRL's ``ChunkedLogProbFunction`` (``trl.trainer.utils.add_fused_lm_head``) runs the head GEMM twice on every
chunk: once in the forward for the statistics and again in the backward, where the upstream gradient g_i is
known, for the logits gradient. Here the forward runs it once: since logp_i depends on x_i alone,

    ∂L/∂x_i = g_i · ∂logp_i/∂x_i = g_i · (onehot(y_i) − p_i) W · (1 − tanh²(ℓ_i / c))   (last factor: softcap)

so the forward overwrites each chunk's logits with e_i = (p_i − onehot(y_i)) · (1 − tanh²) — the
cross-entropy kernel's gradient at denominator 1 (``fused_linear_ce_fwd_kernel``, the same pass) — and
makes d_i = e_i W at once; backward is dx_i = −g_i · d_i, one fp32 product rounded once to the input dtype.
One head GEMM fewer per step (the 8B model's [16,384 × 4,096] × [4,096 × 128,256]: 17 TFLOP), and no fp32
[N, H] accumulator. Saved for backward: d [N, H] in the input dtype.

Not covered (the caller keeps TRL's head): a trainable head or bias (dW needs g before the GEMM), a
temperature or logit scale, and an entropy gradient — backward raises if a loss uses ``entropy``.

Dtypes: hidden and weight share one dtype; log-probs and entropy are fp32, ``is_top1`` bool.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .fused_linear_ce import MAX_BLOCK_V, NUM_WARPS, default_chunk_size
from .utils import cast_to, cdiv, check_float_tensor, check_same_device, next_power_of_2, tanh

__all__ = [
    "FusedLinearLogprobsFunction",
    "fused_linear_logprobs",
    "fused_linear_logprobs_fwd",
    "fused_linear_logprobs_reference",
]


def fused_linear_logprobs_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    softcap: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(log_probs, entropy, is_top1) on fp32-upcast ``F.linear`` logits; zeros (False) at ignored targets."""
    z = F.linear(hidden, weight, bias).float()
    if softcap is not None:
        z = softcap * torch.tanh(z / softcap)
    valid = targets != ignore_index
    t = targets.clamp(min=0).unsqueeze(1)
    logz = torch.logsumexp(z, -1)
    z_t = z.gather(1, t).squeeze(1)
    logp = (z_t - logz) * valid
    entropy = (logz - (torch.softmax(z, -1) * z).sum(-1)) * valid
    cols = torch.arange(z.shape[1], device=z.device)
    before = torch.where(cols[None, :] < t, z, float("-inf")).amax(-1)
    top1 = (z_t >= z.amax(-1)) & (z_t > before) & valid
    return logp, entropy.detach(), top1


@triton.jit
def _fused_linear_logprobs_fwd_kernel(
    logits_ptr,
    logits_row_stride,
    targets_ptr,
    logp_ptr,
    entropy_ptr,
    top1_ptr,
    n_cols,
    ignore_index,
    softcap,
    HAS_SOFTCAP: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
    N_BLOCKS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_row_stride
    target = tl.load(targets_ptr + row).to(tl.int64)
    valid = target != ignore_index
    offs = tl.arange(0, BLOCK_V)

    # One online pass: running max m, d = Σ exp(z − m), s = Σ exp(z − m) · z, and the max before the target.
    m = float("-inf")
    d = 0.0
    s = 0.0
    before = float("-inf")
    for i in range(N_BLOCKS):  # constexpr bound: triton 3.6's interpreter cannot loop to a runtime one
        cols = i * BLOCK_V + offs
        mask = cols < n_cols
        z = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if HAS_SOFTCAP:
            z = softcap * tanh(z / softcap)
        z = tl.where(mask, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=0))
        e = tl.exp(z - m_new)
        rescale = tl.exp(m - m_new)
        d = d * rescale + tl.sum(e, axis=0)
        s = s * rescale + tl.sum(tl.where(mask, e * z, 0.0), axis=0)
        before = tl.maximum(before, tl.max(tl.where(cols < target, z, float("-inf")), axis=0))
        m = m_new
    lse = m + tl.log(d)
    z_t = tl.load(row_ptr + tl.where(valid, target, 0)).to(tl.float32)
    if HAS_SOFTCAP:
        z_t = softcap * tanh(z_t / softcap)
    tl.store(logp_ptr + row, tl.where(valid, z_t - lse, 0.0))
    tl.store(entropy_ptr + row, tl.where(valid, lse - s / d, 0.0))
    tl.store(top1_ptr + row, (valid & (z_t >= m) & (z_t > before)).to(tl.int8))

    # Second pass: overwrite the logits with e = (softmax − onehot) · (1 − tanh²) (0 on an ignored row).
    if COMPUTE_GRAD:
        row_scale = tl.where(valid, 1.0, 0.0)
        for i in range(N_BLOCKS):
            cols = i * BLOCK_V + offs
            mask = cols < n_cols
            z = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            scale = row_scale
            if HAS_SOFTCAP:
                t = tanh(z / softcap)
                z = softcap * t
                scale = scale * (1.0 - t * t)
            grad = (tl.exp(z - lse) - tl.where(cols == target, 1.0, 0.0)) * scale
            tl.store(row_ptr + cols, cast_to(grad, logits_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _row_scale_kernel(d_ptr, g_ptr, out_ptr, n_cols, BLOCK: tl.constexpr):
    # out_i = −g_i · d_i in fp32, rounded once to the output dtype
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    g = tl.load(g_ptr + row).to(tl.float32)
    x = tl.load(d_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * n_cols + cols, cast_to(-g * x, out_ptr.dtype.element_ty), mask=mask)


def _check(hidden, weight, targets, bias, softcap, chunk_size) -> None:
    check_float_tensor(hidden, "hidden", ndim=2)
    check_float_tensor(weight, "weight", ndim=2)
    if bias is not None:
        check_float_tensor(bias, "bias", ndim=1)
    if not isinstance(targets, torch.Tensor) or targets.dtype not in (torch.int64, torch.int32):
        raise TypeError(
            f"targets must be an int64 or int32 tensor, got {getattr(targets, 'dtype', type(targets))}"
        )
    check_same_device(hidden=hidden, weight=weight, targets=targets, bias=bias)
    if hidden.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        raise TypeError(f"hidden ({hidden.dtype}), weight ({weight.dtype}) and bias must share one dtype")
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden [N, {hidden.shape[1]}] and weight [V, {weight.shape[1]}] differ in H")
    if targets.shape != (hidden.shape[0],):
        raise ValueError(f"targets must be [{hidden.shape[0]}] (already shifted), got {tuple(targets.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive or None, got {softcap}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of tokens, got {chunk_size}")


def fused_linear_logprobs_fwd(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    softcap: float | None = None,
    chunk_size: int | None = None,
    grad_hidden: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(log_probs, entropy, is_top1, d or None), chunk by chunk; d_i = (p_i − onehot) W, i.e. −∂logp_i/∂x_i."""
    _check(hidden, weight, targets, bias, softcap, chunk_size)
    n_tokens, vocab = hidden.shape[0], weight.shape[0]
    device, dtype = hidden.device, hidden.dtype
    torch._assert_async(  # asynchronous on CUDA: no host sync
        ((targets == ignore_index) | ((targets >= 0) & (targets < vocab))).all(),
        "targets must be in [0, vocab) or equal ignore_index",
    )
    chunk = min(chunk_size or default_chunk_size(n_tokens, vocab, hidden.element_size()), max(n_tokens, 1))
    logp = torch.empty(n_tokens, dtype=torch.float32, device=device)
    entropy = torch.empty(n_tokens, dtype=torch.float32, device=device)
    top1 = torch.empty(n_tokens, dtype=torch.int8, device=device)
    d = torch.empty(hidden.shape, dtype=dtype, device=device) if grad_hidden else None
    logits_buf = torch.empty(chunk, vocab, dtype=dtype, device=device)
    block_v = min(MAX_BLOCK_V, next_power_of_2(vocab))
    for start in range(0, n_tokens, chunk):
        end = min(start + chunk, n_tokens)
        logits = logits_buf[: end - start]
        if bias is None:
            torch.mm(hidden[start:end], weight.t(), out=logits)
        else:
            torch.addmm(bias, hidden[start:end], weight.t(), out=logits)
        _fused_linear_logprobs_fwd_kernel[(end - start,)](
            logits,
            logits.stride(0),
            targets[start:end],
            logp[start:end],
            entropy[start:end],
            top1[start:end],
            vocab,
            ignore_index,
            float(softcap or 1.0),
            HAS_SOFTCAP=softcap is not None,
            COMPUTE_GRAD=grad_hidden,
            BLOCK_V=block_v,
            N_BLOCKS=cdiv(vocab, block_v),
            num_warps=NUM_WARPS,
        )
        if grad_hidden:  # `logits` now holds e = (p − onehot)(1 − tanh²) for the chunk
            torch.mm(logits, weight, out=d[start:end])
    return logp, entropy, top1.bool(), d


def fused_linear_logprobs_bwd(grad_logp: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """dx = −grad_logp[:, None] · d, out of place (a retained graph can be backpropagated again)."""
    out = torch.empty_like(d)
    if d.numel():
        g = grad_logp.to(torch.float32).contiguous()
        block = min(4096, next_power_of_2(d.shape[1]))  # untuned: a streaming scale
        _row_scale_kernel[(d.shape[0], cdiv(d.shape[1], block))](d, g, out, d.shape[1], BLOCK=block)
    return out


class FusedLinearLogprobsFunction(torch.autograd.Function):
    """Autograd wrapper: ∂logp/∂x comes from the forward; backward scales it row by row."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, bias, options: dict):
        ctx.set_materialize_grads(False)
        logp, entropy, top1, d = fused_linear_logprobs_fwd(hidden, weight, targets, bias, **options)
        ctx.save_for_backward(d)
        ctx.mark_non_differentiable(top1)
        return logp, entropy, top1

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy, _grad_top1):
        if grad_entropy is not None:
            raise RuntimeError(
                "strop's fused LM head returns the entropy as a metric without a gradient; a loss that uses it "
                "needs TRL's head (build the trainer without strop's SFT class)"
            )
        (d,) = ctx.saved_tensors
        if grad_logp is None or d is None:
            return None, None, None, None, None
        return fused_linear_logprobs_bwd(grad_logp, d), None, None, None, None


def fused_linear_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    softcap: float | None = None,
    chunk_size: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per-token ``(log_probs, entropy, is_top1)`` of ``hidden @ weight.T + bias`` without the [N, V] logits.

    Args:
        hidden: ``[N, H]`` final hidden states; its gradient is made in the forward when it requires grad.
        weight: ``[V, H]`` LM head, frozen (a head that requires grad is refused: its gradient needs the
            upstream gradient before the GEMM).
        targets: ``[N]`` int64/int32 next-token ids (already shifted).
        bias: Optional frozen ``[V]`` head bias.
        ignore_index: Target value whose outputs are 0 (False) and whose gradient is 0.
        softcap: If given, logits become ``softcap * tanh(logits / softcap)``.
        chunk_size: Tokens per chunk; default sizes the chunk logits to about 256 MiB.

    Returns:
        fp32 ``log_probs`` [N] (differentiable), fp32 ``entropy`` [N] (a metric: backward raises if a loss uses
        it), bool ``is_top1`` [N].
    """
    grad_on = torch.is_grad_enabled()
    if grad_on and (weight.requires_grad or (bias is not None and bias.requires_grad)):
        raise ValueError("fused_linear_logprobs needs a frozen head: its weight gradient is not made here")
    options = {
        "ignore_index": ignore_index,
        "softcap": softcap,
        "chunk_size": chunk_size,
        "grad_hidden": grad_on and hidden.requires_grad,
    }
    return FusedLinearLogprobsFunction.apply(hidden, weight, targets, bias, options)
