"""``y += alpha · a @ b`` for a small inner dimension K (the LoRA rank): a memory-bound Triton kernel.

LoRA adds its low-rank term to a large output, y [M, N] += s · u [M, r] · Bᵀ [r, N], with r = 8–64. cuBLAS
runs that as a GEMM with beta = 1 and compute-bound tiles, well short of copy bandwidth for its one read and one
write of y (bench/RESULTS.md, "small-K update (LoRA's y += s·u·Bᵀ) vs cuBLAS addmm_"). The work is one
read-modify-write of y;
this kernel does exactly that, one [BLOCK_M, BLOCK_N] tile of y per program with the whole K in one
``tl.dot`` (K ≤ 128 after padding to a power of two ≥ 16, masked).

Numerics are addmm's: the product accumulates in fp32, alpha scales the fp32 accumulator, y is read in
fp32, and the sum is rounded once to y's dtype. fp32 inputs use IEEE fp32 dot products (no TF32), so the
CPU tier's fp32 parity tests stay exact to fp32 rounding.

Shapes and layout: y [M, N] with unit column stride (any row stride), a [M, K] and b [K, N] with any
strides (b is typically ``B.t()``), all on one device in one floating dtype. Anything else falls back to
``torch.Tensor.addmm_``, as does a host without CUDA and without ``TRITON_INTERPRET=1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .utils import INTERPRETER, cast_to, cdiv, next_power_of_2

__all__ = ["MAX_SMALL_K", "addmm_small_k_", "block_k", "small_k_tile"]

MAX_SMALL_K = 128
# Tile of y per program and warps: the best of bench/small_k.py's sweep for the gate/up and q/o updates
# (bench/RESULTS.md, "small-K update (LoRA's y += s·u·Bᵀ) vs cuBLAS addmm_").
BLOCK_M, BLOCK_N, NUM_WARPS = 64, 128, 8


@triton.jit
def small_k_tile(
    a_ptr,
    b_ptr,
    rm,
    rn,
    m_mask,
    n_mask,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    """``a[rm, :K] @ b[:K, rn]`` for one [BLOCK_M, BLOCK_N] tile, K ≤ BLOCK_K in one ``tl.dot``, fp32 result."""
    rk = tl.arange(0, BLOCK_K)
    k_mask = rk < K
    a = tl.load(
        a_ptr + rm[:, None] * stride_am + rk[None, :] * stride_ak,
        mask=m_mask[:, None] & k_mask[None, :],
        other=0.0,
    )
    b = tl.load(
        b_ptr + rk[:, None] * stride_bk + rn[None, :] * stride_bn,
        mask=k_mask[:, None] & n_mask[None, :],
        other=0.0,
    )
    if IEEE or INTERPRETER:
        # fp32, or the interpreter (whose bf16 dot is wrong in triton 3.6): bf16 products are exact in
        # fp32, so an IEEE fp32 dot of the upcast tiles is the compiled bf16 dot's math
        acc = tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    else:
        acc = tl.dot(a, b)
    return acc


@triton.jit
def _addmm_small_k_kernel(
    y_ptr,
    a_ptr,
    b_ptr,
    M,
    N,
    K,
    stride_ym,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    alpha,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1).to(tl.int64)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask = rm < M
    n_mask = rn < N
    acc = small_k_tile(
        a_ptr, b_ptr, rm, rn, m_mask, n_mask, K, stride_am, stride_ak, stride_bk, stride_bn, BLOCK_K, IEEE
    )
    mask = m_mask[:, None] & n_mask[None, :]
    y_ptrs = y_ptr + rm[:, None] * stride_ym + rn[None, :]
    y = tl.load(y_ptrs, mask=mask, other=0.0).to(tl.float32)
    tl.store(y_ptrs, cast_to(y + alpha * acc, y_ptr.dtype.element_ty), mask=mask)


def block_k(k: int) -> int:
    """The ``tl.dot`` width for an inner dimension k ≤ MAX_SMALL_K: a power of two ≥ 16, masked past k."""
    return max(16, next_power_of_2(k))


def _triton_ok(y: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
    if not (y.device.type == "cuda" or INTERPRETER):
        return False
    return (
        y.dim() == 2
        and a.dim() == 2
        and b.dim() == 2
        and a.shape[1] <= MAX_SMALL_K
        and y.stride(1) == 1
        and y.dtype in (torch.float32, torch.bfloat16, torch.float16)
        and a.dtype == b.dtype == y.dtype
        and a.device == b.device == y.device
        and a.shape[0] == y.shape[0]
        and b.shape == (a.shape[1], y.shape[1])
    )


def addmm_small_k_(y: torch.Tensor, a: torch.Tensor, b: torch.Tensor, alpha: float = 1.0) -> torch.Tensor:
    """``y.addmm_(a, b, alpha=alpha)`` as one read-modify-write of y when K = a.shape[1] ≤ MAX_SMALL_K.

    Args:
        y: ``[M, N]``, updated in place.
        a: ``[M, K]``.
        b: ``[K, N]`` (a transposed view is fine).
        alpha: Scale of the product.

    Returns:
        y.
    """
    if not _triton_ok(y, a, b):
        return y.addmm_(a, b, alpha=alpha)
    (m, n), k = y.shape, a.shape[1]
    if m * n * k == 0:
        return y
    grid = (cdiv(m, BLOCK_M), cdiv(n, BLOCK_N))
    # fmt: skip below: tensors and sizes, strides, alpha and constexprs one row each
    _addmm_small_k_kernel[grid](
        y, a, b, m, n, k,
        y.stride(0), a.stride(0), a.stride(1), b.stride(0), b.stride(1),
        float(alpha),
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=block_k(k), IEEE=y.dtype == torch.float32,
        num_warps=NUM_WARPS,
    )  # fmt: skip
    return y
