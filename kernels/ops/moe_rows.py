"""A mixture-of-experts layer's routed rows: each token's k copies gathered into expert order, and the adjoint, each
token's k rows summed back, without atomics.

With ``order`` the stable sort of the T·k routed copies by expert, copy j of the sorted rows is token
``order[j] // k``; ``inv`` (the inverse permutation) gives, for token t's i-th choice, the sorted row ``inv[t·k + i]``.

    gather:   xs[j] = x[order[j] // k]                 [T·k, H]   (torch's index_select)
    combine:  y[t]  = Σ_i out[inv[t·k + i]]            [T, H]     (``_sum_rows_kernel``: k rows read, one written)

Each is the other's backward: the gather's gradient is the combine of dxs, the combine's the gather of dy. The sum
runs in fp32 over i = 0..k−1 and is rounded once to the output dtype; torch's ``index_add_`` (HF's scatter, and the
gather's autograd backward, ``index_put_`` with accumulation) adds the k rows into a 16-bit output one atomic add
at a time, rounding at each, and its bf16 atomics are the slowest kernels of a layer's permutation.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .nf4 import _use_kernel
from .utils import cast_to, cdiv, interpreter_rows

__all__ = ["combine_rows", "gather_rows", "sum_rows", "sum_rows_reference"]

_BLOCK_T, _BLOCK_H, _NUM_WARPS = 8, 256, 4


@triton.jit
def _sum_rows_kernel(
    src_ptr, idx_ptr, dst_ptr, T, H, src_stride, dst_stride,
    K: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    rt = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    rh = tl.program_id(1).to(tl.int64) * BLOCK_H + tl.arange(0, BLOCK_H)
    t_mask = rt < T
    mask = t_mask[:, None] & (rh < H)[None, :]
    acc = tl.zeros((BLOCK_T, BLOCK_H), dtype=tl.float32)
    for i in tl.static_range(K):
        row = tl.load(idx_ptr + rt * K + i, mask=t_mask, other=0).to(tl.int64)
        acc += tl.load(src_ptr + row[:, None] * src_stride + rh[None, :], mask=mask, other=0.0).to(tl.float32)
    tl.store(
        dst_ptr + rt[:, None] * dst_stride + rh[None, :], cast_to(acc, dst_ptr.dtype.element_ty), mask=mask
    )


def sum_rows_reference(src: torch.Tensor, idx: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    """:func:`sum_rows` in torch: the k rows gathered, summed in fp32, rounded once."""
    return src[idx].view(idx.numel() // k, k, -1).float().sum(1).to(dtype)


def sum_rows(src: torch.Tensor, idx: torch.Tensor, k: int, dtype: torch.dtype) -> torch.Tensor:
    """``dst[t] = Σ_{i<k} src[idx[t·k + i]]`` [T, H] in ``dtype``, T = len(idx) / k, summed in fp32, rounded once."""
    t = idx.numel() // k
    if src.stride(-1) != 1:
        src = src.contiguous()
    dst = torch.empty(t, src.shape[1], dtype=dtype, device=src.device)
    if dst.numel() == 0:
        return dst
    if not _use_kernel(src.device):  # off the GPU and the interpreter: the same sum in torch
        return dst.copy_(sum_rows_reference(src, idx, k, dtype))
    block_t = max(_BLOCK_T, interpreter_rows(t, _BLOCK_H))
    grid = (cdiv(t, block_t), cdiv(src.shape[1], _BLOCK_H))
    _sum_rows_kernel[grid](
        src, idx, dst, t, src.shape[1], src.stride(0), dst.stride(0),
        K=k, BLOCK_T=block_t, BLOCK_H=_BLOCK_H, num_warps=_NUM_WARPS,
    )  # fmt: skip
    return dst


class _GatherRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, token, inv, k):
        ctx.save_for_backward(inv)
        ctx.k, ctx.dtype = k, x.dtype
        return x.index_select(0, token)

    @staticmethod
    def backward(ctx, dxs):
        (inv,) = ctx.saved_tensors
        return sum_rows(dxs, inv, ctx.k, ctx.dtype), None, None, None


class _CombineRows(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, token, inv, k, dtype, compute=True):
        # token is kept on ctx, not saved: nothing after the down projection's GEMM then saves a tensor in an MoE
        # layer, so torch's non-reentrant checkpoint stops the layer's recompute after that GEMM, before this sum
        # (which the backward does not read). The routing recomputes identically.
        ctx.token, ctx.dtype = token, out.dtype
        # a recompute that reads nothing of the sum but its graph (combine_rows' output_unused)
        if not compute:
            return out.new_empty(inv.shape[0] // k, out.shape[1], dtype=dtype)
        return sum_rows(out, inv, k, dtype)

    @staticmethod
    def backward(ctx, dy):
        return dy.to(ctx.dtype).index_select(0, ctx.token), None, None, None, None, None


def gather_rows(x: torch.Tensor, token: torch.Tensor, inv: torch.Tensor, k: int) -> torch.Tensor:
    """``x[token]`` [T·k, H] (``token = order // k``), whose backward sums each token's k rows (``inv``, the inverse
    of ``order``) instead of accumulating into x's gradient with atomics."""
    return _GatherRows.apply(x, token, inv, k)


def combine_rows(
    out: torch.Tensor,
    token: torch.Tensor,
    inv: torch.Tensor,
    k: int,
    dtype: torch.dtype,
    *,
    output_unused: bool = False,
):
    """``y[t] = Σ_i out[inv[t·k + i]]`` [T, H] in ``dtype`` (HF's ``index_add_`` of the routed rows into zeros, in fp32,
    rounded once); the backward gathers ``dy[token]``. ``output_unused``: the caller reads nothing of y but its graph
    (a recompute, as :func:`~strop.kernels.ops.moe_gemm.moe_lora_gemm`'s): no sum, uninitialised memory of y's shape."""
    return _CombineRows.apply(out, token, inv, k, dtype, not output_unused)
