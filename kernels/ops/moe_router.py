"""A mixture-of-experts router's choices from its logits: softmax, top-k and the renormalisation in one kernel, and
its hand-written backward in another.

HF's Qwen3-MoE and Mixtral routers (``Qwen3MoeTopKRouter``, ``MixtralTopKRouter``), after their linear layer's
logits ``l [T, E]``, compute for each token::

    p = softmax(fp32(l))                       [E]   fp32
    v, idx = topk(p, k)                        [k]   descending
    w = v / Σ_j v_j                            [k]   when normalised (Mixtral always; Qwen3 by ``norm_topk_prob``)
    w → the output dtype                             (Qwen3: the logits' dtype; Mixtral keeps fp32)

Six to ten kernels a layer on HF's path (a fp32 softmax over [T, E], torch's top-k, a sum, a division, a cast),
and more in the backward (a [T, E] scatter of zeros, the softmax's and the division's backward). Here one program
holds a block of rows in registers and does all of it; the backward recomputes p from the logits (which it saves,
in their own dtype, instead of the fp32 probabilities) and gives the logits' gradient in one pass.

Backward, per token (fp32; dw the weights' gradient, S = Σ_j v_j)::

    dv_j = (dw_j − Σ_m dw_m w_m) / S           normalised (the quotient rule through the shared S); else dv_j = dw_j
    dp_e = dv_j where e = idx_j, else 0        (top-k's backward)
    dl_e = p_e · (dp_e − Σ_j dv_j v_j)         (softmax's backward: Σ_e dp_e p_e = Σ_j dv_j v_j)

The choice. p is an increasing function of the logit within a row (exp, then one division by the row's sum), so
the top k of p are the top k logits: the kernel selects on the logits, k rounds of a row maximum. Equal
logits go to the lowest expert index (torch's top-k leaves the order of ties to its implementation: its CPU and CUDA
kernels differ); with distinct logits the chosen experts, and their order, are torch's. Where p rounds two distinct
logits to one value (both underflow to 0), torch may take either; this takes the larger logit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .nf4 import _use_kernel
from .utils import cast_to, cdiv, next_power_of_2, rows_a_program

__all__ = ["MoeRouterFunction", "moe_router", "moe_router_reference"]

# a program's tile: rows × the expert count's power of two, utils.ROW_TILE elements (E = 128: 16 rows, as
# RMSNorm's); untuned (sm_90 compile at E = 128, k = 8: 168 registers forward, 191 backward, no spills)
_NUM_WARPS = 4


@triton.jit
def _probs(l_ptr, rt, T, E, stride, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr):
    """(the logits as fp32, −inf past E; p = softmax; the column indices; the valid-column mask)"""
    cols = tl.arange(0, BLOCK_E)
    valid = (rt < T)[:, None] & (cols < E)[None, :]
    x = tl.load(l_ptr + rt[:, None] * stride + cols[None, :], mask=valid, other=float("-inf")).to(tl.float32)
    m = tl.max(x, axis=1)
    m = tl.where(m == float("-inf"), 0.0, m)  # a padding row (rt ≥ T): all −inf, kept finite
    e = tl.where(valid, tl.exp(x - m[:, None]), 0.0)
    s = tl.sum(e, axis=1)
    s = tl.where(s == 0.0, 1.0, s)
    return x, e / s[:, None], cols, valid


@triton.jit
def _router_fwd_kernel(
    l_ptr, w_ptr, idx_ptr, T, E, stride,
    K: tl.constexpr, NORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rt = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    x, p, cols, avail = _probs(l_ptr, rt, T, E, stride, BLOCK_T, BLOCK_E)
    kcols = tl.arange(0, BLOCK_K)
    v = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    idx = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.int32)
    for i in tl.static_range(K):
        best = tl.max(tl.where(avail, x, float("-inf")), axis=1)
        j = tl.min(tl.where(avail & (x == best[:, None]), cols[None, :], BLOCK_E), axis=1)
        j = tl.minimum(j, E - 1)  # a NaN row matches nothing: keep the index in range (its weights are NaN)
        hit = cols[None, :] == j[:, None]
        vi = tl.sum(tl.where(hit, p, 0.0), axis=1)
        avail = avail & ~hit
        v = tl.where(kcols[None, :] == i, vi[:, None], v)
        idx = tl.where(kcols[None, :] == i, j[:, None], idx)
    if NORMALIZE:
        s = tl.sum(v, axis=1)
        v = v / tl.where(s == 0.0, 1.0, s)[:, None]  # 0 only in a padding row
    out = rt[:, None] * K + kcols[None, :]
    mask = (rt < T)[:, None] & (kcols < K)[None, :]
    tl.store(w_ptr + out, cast_to(v, w_ptr.dtype.element_ty), mask=mask)
    tl.store(idx_ptr + out, idx.to(tl.int64), mask=mask)


@triton.jit
def _router_bwd_kernel(
    l_ptr, idx_ptr, dw_ptr, dl_ptr, T, E, stride, dl_stride,
    K: tl.constexpr, NORMALIZE: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    rt = tl.program_id(0).to(tl.int64) * BLOCK_T + tl.arange(0, BLOCK_T)
    _, p, cols, valid = _probs(l_ptr, rt, T, E, stride, BLOCK_T, BLOCK_E)
    kcols = tl.arange(0, BLOCK_K)
    kmask = (rt < T)[:, None] & (kcols < K)[None, :]
    at = rt[:, None] * K + kcols[None, :]
    idx = tl.load(idx_ptr + at, mask=kmask, other=0).to(tl.int32)  # < E
    dw = tl.load(dw_ptr + at, mask=kmask, other=0.0).to(tl.float32)
    v = tl.zeros((BLOCK_T, BLOCK_K), dtype=tl.float32)
    for i in tl.static_range(K):  # v_i = p at the i-th choice
        j = tl.sum(tl.where(kcols[None, :] == i, idx, 0), axis=1)
        vi = tl.sum(tl.where(cols[None, :] == j[:, None], p, 0.0), axis=1)
        v = tl.where(kcols[None, :] == i, vi[:, None], v)
    if NORMALIZE:
        s = tl.sum(v, axis=1)
        s = tl.where(s == 0.0, 1.0, s)
        dv = (dw - tl.sum(dw * (v / s[:, None]), axis=1)[:, None]) / s[:, None]
    else:
        dv = dw
    g = tl.sum(dv * v, axis=1)
    dp = tl.zeros((BLOCK_T, BLOCK_E), dtype=tl.float32)
    for i in tl.static_range(K):  # top-k's backward: dv_i to its expert's column
        j = tl.sum(tl.where(kcols[None, :] == i, idx, 0), axis=1)
        dvi = tl.sum(tl.where(kcols[None, :] == i, dv, 0.0), axis=1)
        dp = tl.where(cols[None, :] == j[:, None], dvi[:, None], dp)
    dl = p * (dp - g[:, None])
    tl.store(
        dl_ptr + rt[:, None] * dl_stride + cols[None, :], cast_to(dl, dl_ptr.dtype.element_ty), mask=valid
    )


def moe_router_reference(
    logits: torch.Tensor, k: int, normalize: bool, out_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF's router after its linear layer, in torch: (weights [T, k] in ``out_dtype``, expert indices [T, k])."""
    probs = torch.softmax(logits.float(), dim=-1)
    top, idx = torch.topk(probs, k, dim=-1)
    if normalize:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(out_dtype), idx


def _launch(logits: torch.Tensor, k: int):
    t, e = logits.shape
    block_e = next_power_of_2(e)
    block_t = rows_a_program(t, block_e)
    return (cdiv(t, block_t),), dict(BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=max(2, next_power_of_2(k)))


class MoeRouterFunction(torch.autograd.Function):
    """The router's weights and choices from its logits [T, E]; the backward gives the logits' gradient (the
    choices are integers: none). Saves the logits (their own dtype) and the choices."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, k: int, normalize: bool, out_dtype: torch.dtype):
        if logits.stride(-1) != 1:
            logits = logits.contiguous()
        t, e = logits.shape
        w = torch.empty(t, k, dtype=out_dtype, device=logits.device)
        idx = torch.empty(t, k, dtype=torch.int64, device=logits.device)
        if t:
            grid, blocks = _launch(logits, k)
            _router_fwd_kernel[grid](
                logits, w, idx, t, e, logits.stride(0),
                K=k, NORMALIZE=normalize, num_warps=_NUM_WARPS, **blocks,
            )  # fmt: skip
        ctx.save_for_backward(logits, idx)
        ctx.k, ctx.normalize = k, normalize
        ctx.mark_non_differentiable(idx)
        return w, idx

    @staticmethod
    def backward(ctx, dw: torch.Tensor, _didx):
        logits, idx = ctx.saved_tensors
        t, e = logits.shape
        dl = torch.empty_like(logits)
        if t:
            dw = dw.contiguous()
            grid, blocks = _launch(logits, ctx.k)
            _router_bwd_kernel[grid](
                logits, idx, dw, dl, t, e, logits.stride(0), dl.stride(0),
                K=ctx.k, NORMALIZE=ctx.normalize, num_warps=_NUM_WARPS, **blocks,
            )  # fmt: skip
        return dl, None, None, None


def moe_router(
    logits: torch.Tensor, k: int, *, normalize: bool, out_dtype: torch.dtype | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """A router's top-k weights and experts from its logits, as HF's Qwen3-MoE / Mixtral router computes them.

    Args:
        logits: [T, E] the router's linear output (any float dtype).
        k: experts a token, 1 ≤ k ≤ E.
        normalize: divide the k weights by their sum (Mixtral: always; Qwen3-MoE: ``config.norm_topk_prob``).
        out_dtype: the weights' dtype (Qwen3-MoE: the logits'; Mixtral: float32). Default: the logits'.

    Returns:
        (weights [T, k] in ``out_dtype``, differentiable to the logits; expert indices [T, k] int64, each token's
        in descending order of weight).

    Raises:
        ValueError: logits not 2-D, or k outside 1..E.
    """
    if logits.dim() != 2:
        raise ValueError(f"logits must be [tokens, experts], got shape {tuple(logits.shape)}")
    if not 1 <= k <= logits.shape[1]:
        raise ValueError(f"k={k} must be within 1..{logits.shape[1]} (the expert count)")
    out_dtype = logits.dtype if out_dtype is None else out_dtype
    if not _use_kernel(logits.device):  # off the GPU and the interpreter: HF's computation in torch
        return moe_router_reference(logits, k, normalize, out_dtype)
    return MoeRouterFunction.apply(logits, k, normalize, out_dtype)
