"""The routing plan's counting sort (``kernels/ops/moe_routing.py``) against the torch code it replaces (a stable
radix sort, searchsorted, an inverse scatter, gathers): integers, so equal element for element; the weights are a
gather and one cast, and their gradient a gather and one cast (torch's: a scatter into zeros), so equal too.

CPU tier under the interpreter: several blocks of 64 copies with a partial last one, experts without copies, a
non-power-of-two expert count, k = 1 and k = E, bf16 and fp32 weights cast to bf16 (Qwen3-MoE's and Mixtral's).
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels._tolerances import cpu_tier, needs_cuda


def _choices(t: int, e: int, k: int, seed: int, skew: bool = False) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    scores = torch.rand(t, e, generator=gen)
    if skew:  # most copies on a few experts, some experts never chosen
        scores[:, : e // 2] *= 0.05
    return scores.topk(k, dim=-1).indices


def _check(idx: torch.Tensor, e: int, w_dtype: torch.dtype, seed: int = 0):
    from strop.kernels.ops.moe_routing import route_plan, route_plan_reference

    gen = torch.Generator().manual_seed(seed)
    w = torch.rand(idx.shape, generator=gen).to(device=idx.device, dtype=w_dtype)
    dws = torch.randn(idx.numel(), generator=gen).to(device=idx.device, dtype=torch.bfloat16)
    w_ours, w_ref = w.clone().requires_grad_(), w.clone().requires_grad_()
    got = route_plan(idx, w_ours, e, torch.bfloat16)
    want = route_plan_reference(idx, w_ref, e, torch.bfloat16)
    got[3].backward(dws)
    want[3].backward(dws)
    parts = ("offsets", "token", "inv", "weights", "the weights' gradient")
    for name, g, r in zip(parts, (*got, w_ours.grad), (*want, w_ref.grad), strict=True):
        assert g.dtype == r.dtype and g.shape == r.shape, (name, g.dtype, r.dtype, g.shape, r.shape)
        assert torch.equal(g, r), (
            f"{name} differs from the stable sort's at {(g != r).nonzero()[:5].tolist()}"
        )


@cpu_tier
@pytest.mark.parametrize(
    ("t", "e", "k", "skew"),
    [(301, 16, 4, True), (97, 60, 8, False), (200, 8, 1, False), (33, 6, 6, False), (1, 128, 8, False)],
    ids=["blocks-and-empty-experts", "odd-experts", "top-1", "all-experts", "one-token"],
)
@pytest.mark.parametrize("w_dtype", [torch.bfloat16, torch.float32], ids=["bf16-weights", "fp32-weights"])
def test_the_counting_sort_is_the_stable_sorts_plan(t, e, k, skew, w_dtype):
    _check(_choices(t, e, k, seed=t, skew=skew), e, w_dtype)


@cpu_tier
def test_the_scan_carries_its_sum_across_chunks_of_blocks(monkeypatch):
    """Past ``_SCAN_CHUNK`` blocks (2,048 of 64 copies) the per-expert scan runs in steps, carrying each expert's
    count on: here steps of 2 blocks over 47."""
    from strop.kernels.ops import moe_routing

    monkeypatch.setattr(moe_routing, "_SCAN_CHUNK", 2)
    _check(_choices(375, 16, 8, seed=4, skew=True), 16, torch.bfloat16)


@cpu_tier
def test_no_tokens_and_mismatched_shapes():
    from strop.kernels.ops.moe_routing import route_plan

    offsets, token, inv, ws = route_plan(
        torch.zeros(0, 2, dtype=torch.long), torch.zeros(0, 2), 4, torch.float32
    )
    assert offsets.tolist() == [0] * 5 and token.numel() == inv.numel() == ws.numel() == 0
    with pytest.raises(ValueError, match="alike"):
        route_plan(torch.zeros(3, 2, dtype=torch.long), torch.zeros(3, 3), 4, torch.float32)


@pytest.mark.gpu
@needs_cuda
def test_the_counting_sort_on_cuda_at_the_qwen3_30b_a3b_shape():
    """8 × 2048 tokens, 128 experts, top 8 (the benchmark's routing), skewed so some experts get no copy."""
    _check(_choices(8 * 2048, 128, 8, seed=1, skew=True).cuda(), 128, torch.bfloat16)
