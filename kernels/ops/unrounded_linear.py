"""A linear layer whose output is the fp32 sum of its 16-bit products, not rounded back to 16 bits.

``F.linear`` on bf16 operands accumulates in fp32 and rounds the result to bf16. For logits that rounding decides
things: between 16 and 32 a bf16 logit moves in steps of 1/8, so two tokens a few hundredths of a nat apart tie,
and an argmax takes the lower id whatever the sums say. Here the operands are the same (rounded to the compute
dtype, autocast's or the input's, as ``F.linear`` under autocast rounds them) and the sum is kept:

    z = x_c · W_cᵀ (+ b)      x_c, W_c the operands in the compute dtype c; the sum and z in fp32

On CUDA one GEMM with an fp32 output (``torch.mm(..., out_dtype=torch.float32)``, which has no derivative in
torch); the CPU has no such kernel, so the operands go to fp32, a slice of W's rows at a time (the products of
16-bit values are exact in fp32, so only the summation order differs). The backward is ``F.linear``'s on the
gradient rounded to the compute dtype: what autograd computes behind a 16-bit linear followed by ``.float()``. In
fp32 (or fp64) it is ``F.linear`` itself.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .utils import compute_dtype

__all__ = ["mm_fp32", "unrounded_linear"]

# W's rows a CPU product converts to fp32 at a time (a [rows, K] fp32 temporary)
CPU_ROWS = 8192
_HALF = (torch.bfloat16, torch.float16)


def mm_fp32(x: torch.Tensor, w: torch.Tensor, w32: torch.Tensor | None = None) -> torch.Tensor:
    """``x · wᵀ`` for 2-D 16-bit ``x`` [M, K] and ``w`` [N, K] of one dtype, summed and returned in fp32. No autograd.
    ``w32``: ``w`` already in fp32, for the CPU (a caller's copy kept between calls)."""
    with torch.autocast(x.device.type, enabled=False):
        if x.is_cuda:
            return torch.mm(x, w.t(), out_dtype=torch.float32)
        x32 = x.float()
        if w32 is not None:
            return x32 @ w32.t()
        return torch.cat(
            [x32 @ w[i : i + CPU_ROWS].float().t() for i in range(0, w.shape[0], CPU_ROWS)], dim=-1
        )


class _UnroundedLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, w32):
        ctx.save_for_backward(x, w)
        return mm_fp32(x, w, w32)

    @staticmethod
    def backward(ctx, dz):
        x, w = ctx.saved_tensors
        dz = dz.to(x.dtype)
        with torch.autocast(x.device.type, enabled=False):
            dx = dz @ w if ctx.needs_input_grad[0] else None
            dw = dz.t() @ x if ctx.needs_input_grad[1] else None
        return dx, dw, None


def unrounded_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    *,
    weight32: torch.Tensor | None = None,
) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` in the compute dtype (autocast's, else x's), its output the fp32 sum of the
    products, not rounded to a 16-bit compute dtype (the module docstring); at least fp32 out. Differentiable in x,
    weight and bias. ``weight32``: ``weight`` in the compute dtype, then in fp32 (a CPU caller's copy kept between
    calls, so the CPU converts no weight a call)."""
    dt = compute_dtype(x) if x.dtype in (torch.float32, *_HALF) else x.dtype  # autocast leaves float64 alone
    mixed = weight.dtype != x.dtype and not torch.is_autocast_enabled(
        x.device.type
    )  # F.linear raises on these
    if dt not in _HALF or mixed:
        z = F.linear(x, weight, bias)
        return z.to(torch.promote_types(z.dtype, torch.float32))
    lead = x.shape[:-1]
    z = _UnroundedLinear.apply(x.reshape(-1, x.shape[-1]).to(dt), weight.to(dt), weight32)
    z = z.reshape(*lead, weight.shape[0])
    return z if bias is None else z + bias.float()
