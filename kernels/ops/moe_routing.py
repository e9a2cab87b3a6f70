"""A mixture-of-experts layer's routing plan: the T·k routed copies put in expert order by a counting sort, in three
Triton launches and no host synchronisation.

Given the router's choices ``idx [T, k]`` (expert ids in [0, E)) and weights ``w [T, k]``, with ``flat = idx.view(-1)``
(copy j = t·k + i is token t's i-th choice) and ``order`` the *stable* sort of ``flat`` (copies of one expert in
increasing j)::

    offsets[e] = #{j : flat[j] < e}                 [E + 1]   each expert's first sorted row; offsets[E] = T·k
    inv[j]     = offsets[flat[j]] + #{j' < j : flat[j'] = flat[j]}     the sorted row of copy j (order's inverse)
    token[p]   = order[p] // k                      [T·k]     the token of sorted row p
    ws[p]      = w.view(-1)[order[p]]               [T·k]     its weight, in the compute dtype

which :func:`route_plan_reference` builds with torch's stable radix sort, a searchsorted, an inverse scatter and two
gathers (about a dozen launches: what ``lora_moe_experts`` ran before this op). Here, over blocks of ``BLOCK``
consecutive copies:

1. ``_counts_kernel``: each block's count of copies per expert ``c[b, e]`` (a one-hot column sum).
2. ``_scan_kernel``: per expert, the copies of earlier blocks ``before[b, e] = Σ_{b' < b} c[b', e]`` and the total.
3. ``_place_kernel``: ``offsets`` as the exclusive sum of the totals (every program recomputes the E values), each
   copy's rank among its block's earlier copies of its expert (a [BLOCK, BLOCK] compare, summed),
   ``inv[j] = offsets[e] + before[b, e] + rank``, and the scatter of ``token`` and ``ws`` to ``inv[j]``.

Integers only, so the plan is torch's stable sort's exactly: ``route_plan_reference`` is that torch code, and the
test holds the two equal element for element.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .nf4 import _use_kernel
from .utils import cast_to, cdiv, next_power_of_2

__all__ = ["route_plan", "route_plan_reference"]

# copies a block (the place kernel's [BLOCK, BLOCK] and [BLOCK, E] compares): sm_90 compile at E = 128, k = 8,
# 131,072 copies (ptxas, no GPU): 64 copies and 4 warps 96 registers and 13.6 M warp-instructions for the place
# kernel over all blocks; 64 / 8 warps 16.3 M; 128 / 8 warps 14.0 M at 213 registers; 256 / 8 warps 17.8 M at 249
_BLOCK, _NUM_WARPS = 64, 4
_SCAN_CHUNK = 2048  # blocks one scan step holds (8 × 2048 tokens × top 8 is 2,048 blocks of 64: one step)


@triton.jit
def _counts_kernel(idx_ptr, counts_ptr, N, E, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    j = b * BLOCK + tl.arange(0, BLOCK)
    e = tl.load(idx_ptr + j, mask=j < N, other=-1).to(tl.int32)  # past N: no expert
    cols = tl.arange(0, BLOCK_E)
    c = tl.sum((e[:, None] == cols[None, :]).to(tl.int32), axis=0)
    tl.store(counts_ptr + b * E + cols, c, mask=cols < E)


@triton.jit
def _scan_kernel(counts_ptr, before_ptr, total_ptr, NB, E, BLOCK_NB: tl.constexpr, CHUNKS: tl.constexpr):
    e = tl.program_id(0).to(tl.int64)
    total = tl.sum(tl.zeros((BLOCK_NB,), dtype=tl.int32), axis=0)
    # blocks in chunks, each chunk's exclusive sum carried on (a constexpr trip count: the interpreter's limit)
    for i in range(CHUNKS):
        b = i * BLOCK_NB + tl.arange(0, BLOCK_NB)
        c = tl.load(counts_ptr + b * E + e, mask=b < NB, other=0)
        tl.store(before_ptr + b * E + e, total + tl.cumsum(c, axis=0) - c, mask=b < NB)
        total += tl.sum(c, axis=0)
    tl.store(total_ptr + e, total)


@triton.jit
def _place_kernel(
    idx_ptr, w_ptr, before_ptr, total_ptr, offsets_ptr, inv_ptr, token_ptr, ws_ptr, N, E,
    K: tl.constexpr, BLOCK: tl.constexpr, BLOCK_E: tl.constexpr,
):  # fmt: skip
    b = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    tot = tl.load(total_ptr + cols, mask=cols < E, other=0)
    start = tl.cumsum(tot, axis=0) - tot  # offsets[e]
    if b == 0:
        tl.store(offsets_ptr + cols, start, mask=cols < E)
        tl.store(offsets_ptr + E, tl.sum(tot, axis=0))
    r = tl.arange(0, BLOCK)
    j = b * BLOCK + r
    valid = j < N
    e = tl.load(idx_ptr + j, mask=valid, other=-1).to(tl.int32)
    # copy j's rank among its block's copies of its expert: the earlier copies i < j with e_i = e_j
    same = (e[:, None] == e[None, :]) & (r[:, None] < r[None, :])
    rank = tl.sum(same.to(tl.int32), axis=0)
    first = tl.sum(tl.where(e[:, None] == cols[None, :], start[None, :], 0), axis=1)  # offsets[e_j]
    before = tl.load(before_ptr + b * E + e, mask=valid, other=0)
    p = (first + before + rank).to(tl.int64)
    tl.store(inv_ptr + j, p, mask=valid)
    tl.store(token_ptr + p, j // K, mask=valid)
    w = tl.load(w_ptr + j, mask=valid, other=0.0)
    tl.store(ws_ptr + p, cast_to(w.to(tl.float32), ws_ptr.dtype.element_ty), mask=valid)


def route_plan_reference(
    top_k_index: torch.Tensor, top_k_weights: torch.Tensor, experts: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The plan by torch's stable sort (what ``lora_moe_experts`` built before :func:`route_plan`): (offsets [E + 1] int32, token [T·k] and
    inv [T·k] int64, weights in expert order [T·k] in ``dtype``)."""
    k = top_k_index.shape[-1]
    flat = top_k_index.reshape(-1)
    if experts <= torch.iinfo(torch.int16).max:  # 16-bit keys: fewer radix passes, the same stable order
        flat = flat.to(torch.int16)
    order = torch.argsort(flat, stable=True)
    bounds = torch.arange(experts + 1, dtype=flat.dtype, device=flat.device)
    # int32: the grouped GEMMs' row ends are views of it
    offsets = torch.searchsorted(flat[order], bounds, out_int32=True)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    return offsets, order // k, inv, top_k_weights.reshape(-1)[order].to(dtype)


def _plan(top_k_index: torch.Tensor, top_k_weights: torch.Tensor, experts: int, dtype: torch.dtype):
    dev = top_k_index.device
    t, k = top_k_index.shape
    n = t * k
    idx = top_k_index.reshape(-1).contiguous()
    w = top_k_weights.reshape(-1).contiguous()
    nb = max(1, cdiv(n, _BLOCK))
    block_e = max(2, next_power_of_2(experts))
    counts = torch.empty(nb, experts, dtype=torch.int32, device=dev)
    before = torch.empty_like(counts)
    total = torch.empty(experts, dtype=torch.int32, device=dev)
    offsets = torch.empty(experts + 1, dtype=torch.int32, device=dev)
    inv = torch.empty(n, dtype=torch.int64, device=dev)
    token = torch.empty(n, dtype=torch.int64, device=dev)
    ws = torch.empty(n, dtype=dtype, device=dev)
    _counts_kernel[(nb,)](idx, counts, n, experts, BLOCK=_BLOCK, BLOCK_E=block_e, num_warps=_NUM_WARPS)
    block_nb = min(_SCAN_CHUNK, next_power_of_2(nb))
    _scan_kernel[(experts,)](
        counts, before, total, nb, experts, BLOCK_NB=block_nb, CHUNKS=cdiv(nb, block_nb), num_warps=_NUM_WARPS
    )
    _place_kernel[(nb,)](
        idx, w, before, total, offsets, inv, token, ws, n, experts,
        K=k, BLOCK=_BLOCK, BLOCK_E=block_e, num_warps=_NUM_WARPS,
    )  # fmt: skip
    return offsets, token, inv, ws


class _RoutePlanFunction(torch.autograd.Function):
    """The plan, differentiable in the weights: the gradient of ``ws[inv[j]] = w[j]`` is ``dw[j] = dws[inv[j]]``
    (a gather; torch's path scatters into zeros), cast back to w's dtype: the same values."""

    @staticmethod
    def forward(ctx, top_k_weights, top_k_index, experts, dtype):
        offsets, token, inv, ws = _plan(top_k_index, top_k_weights, experts, dtype)
        ctx.save_for_backward(inv)
        ctx.shape, ctx.dtype = top_k_weights.shape, top_k_weights.dtype
        ctx.mark_non_differentiable(offsets, token, inv)
        return offsets, token, inv, ws

    @staticmethod
    def backward(ctx, _offsets, _token, _inv, dws):
        (inv,) = ctx.saved_tensors
        return dws.to(ctx.dtype).index_select(0, inv).view(ctx.shape), None, None, None


def route_plan(
    top_k_index: torch.Tensor, top_k_weights: torch.Tensor, experts: int, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The routing plan of ``top_k_index [T, k]`` (ids in [0, experts)) and ``top_k_weights [T, k]``: (offsets
    [E + 1], token [T·k], inv [T·k], the weights in expert order [T·k] in ``dtype``), equal to
    :func:`route_plan_reference`'s, the weights' gradient too (the router's gradient path).

    Raises:
        ValueError: index and weights of different shapes, or not 2-D.
    """
    if top_k_index.dim() != 2 or top_k_index.shape != top_k_weights.shape:
        raise ValueError(
            f"top_k_index and top_k_weights must be [tokens, k] alike, got {tuple(top_k_index.shape)} and "
            f"{tuple(top_k_weights.shape)}"
        )
    if not _use_kernel(top_k_index.device):
        return route_plan_reference(top_k_index, top_k_weights, experts, dtype)
    return _RoutePlanFunction.apply(top_k_weights, top_k_index, experts, dtype)
