"""Fused linear + cross-entropy: the LM-head loss without ever holding [tokens, vocab] logits.

Forward, for hidden rows x_i ∈ R^H, head W [V, H], optional bias b [V] and labels y_i:

    ℓ_i = x_i Wᵀ + b                      GEMM in the input dtype, fp32 accumulate (as F.linear)
    z_i = ℓ_i · s                          logit_scale s
    z_i = c · tanh(z_i / c)                only with softcap c
    loss_i = logsumexp(z_i) − z_i[y_i]     fp32; 0 where y_i == ignore_index
    loss = Σ_i loss_i / D                  D = #non-ignored labels (mean; at least 1, so an all-ignored
                                           batch gives loss 0 and zero gradients, not NaN), or
                                           num_items_in_batch when given, or 1 (sum)

Labels are already shifted by the caller: row i is scored against labels[i] (HF's ForCausalLMLoss shifts
inside the loss; the patched model shifts before calling this).

The tokens are processed in chunks of C rows, so only a [C, V] logits buffer exists. For each chunk a
Triton kernel runs an online-softmax pass over the vocabulary for the log-sum-exp, then a second pass
that overwrites the logits buffer with

    dℓ_ij = (softmax(z_i)_j − [j = y_i]) / D · s · (1 − tanh²(ℓ_ij s / c))    (last factor: softcap only)

and the chunk's gradients follow at once: dx_chunk = dℓ W, dW += dℓᵀ x_chunk (fp32 accumulator, only
when W requires grad), db += Σ_i dℓ_i. So the gradients are computed in the forward; saved for
backward are those gradients only (dx [N, H], and dW/db when trainable), and backward multiplies them
by grad_output. The division by D happens inside the kernel, with D read from device memory, so the
call makes no host synchronisation at all.

Dtypes: hidden and weight share one dtype (fp32/bf16/fp16); dℓ is stored in it, as torch's autograd
does when it casts the fp32 logits gradient back for F.linear's backward. Loss is an fp32 scalar.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .utils import cast_to, cdiv, check_float_tensor, check_same_device, next_power_of_2, tanh

__all__ = [
    "FusedLinearCrossEntropyFunction",
    "fused_linear_cross_entropy",
    "fused_linear_cross_entropy_bwd",
    "fused_linear_cross_entropy_fwd",
    "fused_linear_cross_entropy_reference",
]

# untuned: 256 MiB of chunk logits is 1,024 tokens at V=128,256 in bf16 — an M dimension large enough
# for the lm_head GEMM to run at full tensor-core rate, at ~6% of the 4 GiB a full bf16 logits tensor
# takes at 16,384 tokens.
_CHUNK_LOGITS_BYTES = 256 * 1024 * 1024
# untuned: 8,192 fp32 values per vocab block over 8 warps (32 per lane); V=128,256 is 16 blocks per pass.
MAX_BLOCK_V, NUM_WARPS = 8192, 8


def fused_linear_cross_entropy_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items_in_batch: int | torch.Tensor | None = None,
    logit_scale: float = 1.0,
    softcap: float | None = None,
) -> torch.Tensor:
    """``F.cross_entropy`` on fp32-upcast ``F.linear`` logits, with the fused op's exact semantics."""
    logits = F.linear(hidden, weight, bias).float()
    if logit_scale != 1.0:
        logits = logits * logit_scale
    if softcap is not None:
        logits = softcap * torch.tanh(logits / softcap)
    loss = F.cross_entropy(logits, labels, ignore_index=ignore_index, reduction="sum")
    return loss / _denominator(labels, ignore_index, reduction, num_items_in_batch, loss.device)


def _denominator(
    labels: torch.Tensor,
    ignore_index: int,
    reduction: str,
    num_items_in_batch: int | torch.Tensor | None,
    device: torch.device,
) -> torch.Tensor:
    if reduction == "sum":
        return torch.ones((), dtype=torch.float32, device=device)
    if num_items_in_batch is None:
        return (labels != ignore_index).sum().clamp(min=1).to(torch.float32)
    if isinstance(num_items_in_batch, torch.Tensor):
        return num_items_in_batch.to(device=device, dtype=torch.float32).reshape(())
    return torch.tensor(float(num_items_in_batch), dtype=torch.float32, device=device)


@triton.jit
def fused_linear_ce_fwd_kernel(
    logits_ptr,
    logits_row_stride,
    labels_ptr,
    loss_ptr,
    denom_ptr,
    n_cols,
    ignore_index,
    logit_scale,
    softcap,
    HAS_SOFTCAP: tl.constexpr,
    COMPUTE_GRAD: tl.constexpr,
    BLOCK_V: tl.constexpr,
    N_BLOCKS: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * logits_row_stride
    label = tl.load(labels_ptr + row).to(tl.int64)
    valid = label != ignore_index
    offs = tl.arange(0, BLOCK_V)

    # Pass 1: running max m and running Σexp(z − m) over the vocabulary (online softmax).
    m = float("-inf")
    d = 0.0
    for i in range(N_BLOCKS):  # constexpr bound: triton 3.6's interpreter cannot loop to a runtime one
        cols = i * BLOCK_V + offs
        mask = cols < n_cols
        z = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32) * logit_scale
        if HAS_SOFTCAP:
            z = softcap * tanh(z / softcap)
        z = tl.where(mask, z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z, axis=0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
        m = m_new
    lse = m + tl.log(d)

    z_label = tl.load(row_ptr + tl.where(valid, label, 0)).to(tl.float32) * logit_scale
    if HAS_SOFTCAP:
        z_label = softcap * tanh(z_label / softcap)
    tl.store(loss_ptr + row, tl.where(valid, lse - z_label, 0.0))

    # Pass 2: overwrite the logits with dloss/dlogits (this row only; each element read before written).
    if COMPUTE_GRAD:
        row_scale = tl.where(valid, 1.0 / tl.load(denom_ptr), 0.0) * logit_scale
        for i in range(N_BLOCKS):
            cols = i * BLOCK_V + offs
            mask = cols < n_cols
            z = tl.load(row_ptr + cols, mask=mask, other=0.0).to(tl.float32) * logit_scale
            scale = row_scale
            if HAS_SOFTCAP:
                t = tanh(z / softcap)
                z = softcap * t
                scale = scale * (1.0 - t * t)
            grad = (tl.exp(z - lse) - tl.where(cols == label, 1.0, 0.0)) * scale
            tl.store(row_ptr + cols, cast_to(grad, logits_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _fused_linear_ce_bwd_kernel(grad_ptr, out_ptr, grad_output_ptr, n, BLOCK_SIZE: tl.constexpr):
    # out = grad · grad_output in fp32, rounded once: grad_output is read from device memory (no host
    # sync) and never rounded to a bf16 scalar first, so e.g. a 1/3 loss scale stays exact to fp32.
    offs = tl.program_id(0).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = offs < n
    scale = tl.load(grad_output_ptr).to(tl.float32)
    g = tl.load(grad_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + offs, cast_to(g * scale, out_ptr.dtype.element_ty), mask=mask)


def _check(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None,
    reduction: str,
    num_items_in_batch: int | torch.Tensor | None,
    softcap: float | None,
    chunk_size: int | None,
) -> None:
    check_float_tensor(hidden, "hidden", ndim=2)
    check_float_tensor(weight, "weight", ndim=2)
    if bias is not None:
        check_float_tensor(bias, "bias", ndim=1)
    if not isinstance(labels, torch.Tensor) or labels.dtype not in (torch.int64, torch.int32):
        raise TypeError(
            f"labels must be an int64 or int32 tensor, got {getattr(labels, 'dtype', type(labels))}"
        )
    check_same_device(hidden=hidden, weight=weight, labels=labels, bias=bias)
    if hidden.dtype != weight.dtype or (bias is not None and bias.dtype != weight.dtype):
        raise TypeError(f"hidden ({hidden.dtype}), weight ({weight.dtype}) and bias must share one dtype")
    if hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"hidden [N, {hidden.shape[1]}] and weight [V, {weight.shape[1]}] differ in H")
    if labels.shape != (hidden.shape[0],):
        raise ValueError(f"labels must be [{hidden.shape[0]}] (already shifted), got {tuple(labels.shape)}")
    if bias is not None and bias.shape != (weight.shape[0],):
        raise ValueError(f"bias must be [{weight.shape[0]}], got {tuple(bias.shape)}")
    if reduction not in ("mean", "sum"):
        raise ValueError(
            f"reduction must be 'mean' or 'sum' (gradients are computed in forward), got {reduction!r}"
        )
    if reduction == "sum" and num_items_in_batch is not None:
        raise ValueError(
            "num_items_in_batch is the denominator of reduction='mean'; it has no meaning for 'sum'"
        )
    if isinstance(num_items_in_batch, int | float) and num_items_in_batch <= 0:
        raise ValueError(f"num_items_in_batch must be positive, got {num_items_in_batch}")
    if softcap is not None and not softcap > 0:
        raise ValueError(f"softcap must be positive or None, got {softcap}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive number of tokens, got {chunk_size}")


def default_chunk_size(n_tokens: int, vocab: int, itemsize: int) -> int:
    rows = max(1, _CHUNK_LOGITS_BYTES // (vocab * itemsize))
    return min(max(n_tokens, 1), 1 << (rows.bit_length() - 1))


@functools.cache
def _fused_fp32_addmm_works(device: torch.device) -> bool:
    """Whether ``addmm(acc, a, b, out_dtype=fp32, out=acc)`` accumulates bf16 GEMMs correctly here.

    Checked once per device (one host sync per process): the overload is CUDA-only, new in torch 2.8,
    and has had bugs with ``out=`` (pytorch#154086). Where it fails, a fp32 temporary is used instead.
    """
    gen = torch.Generator(device=device).manual_seed(0)
    a, b = (torch.randn(s, device=device, generator=gen).to(torch.bfloat16) for s in ((48, 24), (24, 40)))
    acc = torch.randn(48, 40, device=device, generator=gen)
    expected = acc + a.float() @ b.float()
    try:
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    except (RuntimeError, TypeError):
        return False
    return bool(torch.allclose(acc, expected, rtol=1e-4, atol=1e-4))


def _accumulate_weight_grad(acc: torch.Tensor, dlogits: torch.Tensor, x: torch.Tensor) -> None:
    """acc[V, H] (fp32) += dlogitsᵀ x with the GEMM's fp32 sum never rounded to bf16."""
    if dlogits.dtype == torch.float32:
        acc.addmm_(dlogits.t(), x)
    elif acc.is_cuda and _fused_fp32_addmm_works(acc.device):
        torch.addmm(acc, dlogits.t(), x, out_dtype=torch.float32, out=acc)
    elif acc.is_cuda:
        acc.add_(torch.mm(dlogits.t(), x, out_dtype=torch.float32))  # a [V, H] fp32 temporary
    else:  # CPU (tests): no out_dtype kernel; the chunk's product is rounded once to the input dtype
        acc.add_(torch.mm(dlogits.t(), x))


def fused_linear_cross_entropy_fwd(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items_in_batch: int | torch.Tensor | None = None,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    chunk_size: int | None = None,
    grad_hidden: bool = True,
    grad_weight: bool = False,
    grad_bias: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]:
    """Loss and (for grad_output = 1) the requested gradients, chunk by chunk.

    Returns:
        ``(loss, d_hidden or None, d_weight or None, d_bias or None)``; loss is an fp32 scalar, the
        gradients are in their tensors' dtypes.
    """
    _check(hidden, weight, labels, bias, reduction, num_items_in_batch, softcap, chunk_size)
    n_tokens, vocab = hidden.shape[0], weight.shape[0]
    device, dtype = hidden.device, hidden.dtype
    # A label outside [0, V) would read out of bounds; this check is asynchronous on CUDA (no host sync).
    torch._assert_async(
        ((labels == ignore_index) | ((labels >= 0) & (labels < vocab))).all(),
        "labels must be in [0, vocab) or equal ignore_index",
    )
    denom = _denominator(labels, ignore_index, reduction, num_items_in_batch, device)
    compute_grad = grad_hidden or grad_weight or grad_bias
    chunk = chunk_size or default_chunk_size(n_tokens, vocab, hidden.element_size())
    chunk = min(chunk, max(n_tokens, 1))
    loss_rows = torch.empty(n_tokens, dtype=torch.float32, device=device)
    d_hidden = torch.empty(hidden.shape, dtype=dtype, device=device) if grad_hidden else None
    d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=device) if grad_weight else None
    d_bias = torch.zeros(vocab, dtype=torch.float32, device=device) if grad_bias else None
    logits_buf = torch.empty(chunk, vocab, dtype=dtype, device=device)
    block_v = min(MAX_BLOCK_V, next_power_of_2(vocab))
    for start in range(0, n_tokens, chunk):
        end = min(start + chunk, n_tokens)
        x = hidden[start:end]
        logits = logits_buf[: end - start]
        if bias is None:
            torch.mm(x, weight.t(), out=logits)
        else:
            torch.addmm(bias, x, weight.t(), out=logits)
        fused_linear_ce_fwd_kernel[(end - start,)](
            logits,
            logits.stride(0),
            labels[start:end],
            loss_rows[start:end],
            denom,
            vocab,
            ignore_index,
            float(logit_scale),
            float(softcap or 1.0),
            HAS_SOFTCAP=softcap is not None,
            COMPUTE_GRAD=compute_grad,
            BLOCK_V=block_v,
            N_BLOCKS=cdiv(vocab, block_v),
            num_warps=NUM_WARPS,
        )
        # From here `logits` holds dloss/dlogits for the chunk.
        if grad_hidden:
            torch.mm(logits, weight, out=d_hidden[start:end])
        if grad_weight:
            _accumulate_weight_grad(d_weight, logits, x)
        if grad_bias:
            d_bias += logits.sum(0, dtype=torch.float32)
    loss = loss_rows.sum() / denom
    return (
        loss,
        d_hidden,
        d_weight.to(weight.dtype) if grad_weight else None,
        d_bias.to(bias.dtype) if grad_bias else None,
    )


def fused_linear_cross_entropy_bwd(
    grad_output: torch.Tensor, *grads: torch.Tensor | None
) -> tuple[torch.Tensor | None, ...]:
    """Scale the contiguous gradients computed in forward by the scalar grad_output.

    Out of place, so a graph kept with ``retain_graph=True`` can be backpropagated again.
    """
    if grad_output.numel() != 1:
        raise ValueError(f"grad_output must be a scalar, got shape {tuple(grad_output.shape)}")
    grad_output = grad_output.to(torch.float32).reshape(1)
    scaled = []
    for g in grads:
        if g is None:
            scaled.append(None)
            continue
        out = torch.empty_like(g)
        if g.numel():
            # untuned: a plain streaming scale, 4,096 elements per program.
            _fused_linear_ce_bwd_kernel[(cdiv(g.numel(), 4096),)](
                g, out, grad_output, g.numel(), BLOCK_SIZE=4096
            )
        scaled.append(out)
    return tuple(scaled)


class FusedLinearCrossEntropyFunction(torch.autograd.Function):
    """Autograd wrapper: gradients come from the forward; backward only scales them by grad_output.

    ``options`` holds :func:`fused_linear_cross_entropy_fwd`'s keyword arguments, including which of
    ``grad_hidden``/``grad_weight``/``grad_bias`` to compute.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        labels: torch.Tensor,
        bias: torch.Tensor | None,
        options: dict,
    ) -> torch.Tensor:
        loss, d_hidden, d_weight, d_bias = fused_linear_cross_entropy_fwd(
            hidden, weight, labels, bias, **options
        )
        ctx.save_for_backward(d_hidden, d_weight, d_bias)
        return loss

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, grad_output: torch.Tensor):
        d_hidden, d_weight, d_bias = fused_linear_cross_entropy_bwd(grad_output, *ctx.saved_tensors)
        return d_hidden, d_weight, None, d_bias, None


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    ignore_index: int = -100,
    reduction: str = "mean",
    num_items_in_batch: int | torch.Tensor | None = None,
    logit_scale: float = 1.0,
    softcap: float | None = None,
    chunk_size: int | None = None,
) -> torch.Tensor:
    """Cross-entropy of ``hidden @ weight.T + bias`` against ``labels`` without materialising the logits.

    Args:
        hidden: ``[N, H]`` final hidden states (flattened over batch and time).
        weight: ``[V, H]`` LM head; its gradient is computed (fp32-accumulated) only if it requires grad.
        labels: ``[N]`` int64/int32 targets, already shifted so row i predicts labels[i].
        bias: Optional ``[V]`` head bias.
        ignore_index: Label value that contributes neither loss nor gradient.
        reduction: ``"mean"`` (over non-ignored tokens, or over ``num_items_in_batch``) or ``"sum"``.
        num_items_in_batch: Denominator for ``"mean"`` shared by all micro-batches of a gradient
            accumulation step, so their summed gradients equal the large batch's exactly.
        logit_scale: Multiplier applied to the logits before the softmax.
        softcap: If given, logits become ``softcap * tanh(logits / softcap)`` (after scaling).
        chunk_size: Tokens per chunk; default sizes the chunk logits to about 256 MiB.

    Returns:
        The fp32 scalar loss.
    """
    grad_on = torch.is_grad_enabled()
    options = {
        "ignore_index": ignore_index,
        "reduction": reduction,
        "num_items_in_batch": num_items_in_batch,
        "logit_scale": logit_scale,
        "softcap": softcap,
        "chunk_size": chunk_size,
        "grad_hidden": grad_on and hidden.requires_grad,
        "grad_weight": grad_on and weight.requires_grad,
        "grad_bias": grad_on and bias is not None and bias.requires_grad,
    }
    return FusedLinearCrossEntropyFunction.apply(hidden, weight, labels, bias, options)
