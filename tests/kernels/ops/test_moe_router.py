"""The fused router (``kernels/ops/moe_router.py``) against HF's router computation, forward and backward.

CPU tier under the interpreter; GPU tier (``pytest -m gpu``) at Qwen3-30B-A3B's router shape. The truth is HF's computation (``moe_router_reference``, torch autograd) in fp64 on
the same logits. Choices: with distinct logits the experts and their order are the reference's exactly. Values: the
kernel works in fp32; a probability is an exp, an E-term sum and a division, a weight a k-term sum and a division
more, so each is within (E + k + 4) fp32 roundings u = 2⁻²⁴ of the truth, relative; the backward adds the k-term
sums of dv and the softmax's correction, so a logit's gradient is within (E + 2k + 8)·u of the sum of the
magnitudes it is formed from (``_grad_scale``); the bounds below double those counts. A bf16 output adds its one
rounding (2⁻⁸ relative).
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels._tolerances import cpu_tier, needs_cuda

U32 = 2.0**-24


def _truth(logits: torch.Tensor, k: int, normalize: bool, dw: torch.Tensor):
    """HF's router in fp64: (weights, indices, the logits' gradient for the weights' gradient dw)."""
    from strop.kernels.ops.moe_router import moe_router_reference

    l64 = logits.double().requires_grad_()
    w, idx = moe_router_reference(l64, k, normalize, torch.float64)
    w.backward(dw.double())
    return w.detach(), idx, l64.grad


def _grad_scale(logits: torch.Tensor, idx: torch.Tensor, normalize: bool, dw: torch.Tensor) -> torch.Tensor:
    """Per logit, the magnitudes its gradient p_e·(dp_e − Σ_j dv_j v_j) is summed from, with |dv_j| bounded by
    (|dw_j| + Σ_m |dw_m| w_m) / S when normalised: what fp32 rounding errors scale with."""
    p = torch.softmax(logits.double(), -1)
    v = p.gather(-1, idx)
    dw = dw.double().abs()
    if normalize:
        s = v.sum(-1, keepdim=True)
        dv = (dw + (dw * v / s).sum(-1, keepdim=True)) / s
    else:
        dv = dw
    dp = torch.zeros_like(p).scatter(-1, idx, dv)
    return p * (dp + (dv * v).sum(-1, keepdim=True))


def _check(logits, k, normalize, out_dtype, seed=0):
    from strop.kernels.ops.moe_router import moe_router

    t, e = logits.shape
    gen = torch.Generator().manual_seed(seed)
    dw = torch.randn(t, k, generator=gen).to(device=logits.device, dtype=out_dtype)
    w_true, idx_true, dl_true = _truth(logits, k, normalize, dw)

    lg = logits.clone().requires_grad_()
    w, idx = moe_router(lg, k, normalize=normalize, out_dtype=out_dtype)
    assert w.dtype == out_dtype and idx.dtype == torch.int64 and w.shape == idx.shape == (t, k)
    assert torch.equal(idx, idx_true), "distinct logits: the reference's experts in its order"
    # exp(l − m) in fp32 carries |l − m|·u from rounding l − m, plus a few roundings of exp itself (numpy's SIMD expf
    # under the interpreter, libm's or the GPU's otherwise): max|l − m| + 4 more roundings in every p
    spread = float((logits.float() - logits.float().max(-1, keepdim=True).values).abs().max()) + 4
    fwd = 2 * (e + k + 4 + spread) * U32 + (2.0**-8 if out_dtype != torch.float32 else 0.0)
    assert ((w.double() - w_true).abs() <= fwd * w_true.abs()).all(), (
        f"weights off by {(w.double() - w_true).abs().max():.3g} (bound {fwd:.3g} relative)"
    )
    w.backward(dw)
    bwd = 2 * (e + 2 * k + 8 + spread) * U32
    bound = bwd * _grad_scale(logits, idx_true, normalize, dw)
    if logits.dtype != torch.float32:  # the gradient rounded once to the logits' dtype
        bound = bound + 2.0**-8 * dl_true.abs()
    err = (lg.grad.double() - dl_true).abs()
    assert (err <= bound).all(), (
        f"logit gradient off by {err.max():.3g}, bound there {bound[err > bound].min():.3g}"
    )
    return w, idx, lg.grad


@cpu_tier
@pytest.mark.parametrize(
    ("t", "e", "k"),
    [(37, 128, 8), (5, 60, 4), (19, 8, 2), (3, 16, 1), (2, 6, 6)],
    ids=["qwen3-30b-a3b-experts", "odd-experts", "mixtral-8x2", "top-1", "all-experts"],
)
@pytest.mark.parametrize("normalize", [True, False], ids=["normalized", "raw"])
def test_router_equals_hf_router_in_fp32_forward_and_backward(t, e, k, normalize):
    gen = torch.Generator().manual_seed(t * e + k)
    logits = 3 * torch.randn(t, e, generator=gen)
    _check(logits, k, normalize, torch.float32)


def _distinct_bf16(t: int, e: int, seed: int) -> torch.Tensor:
    # each row a permutation of e distinct bf16 values i/16 − 4 (exact in bf16 for i < 256): no ties
    gen = torch.Generator().manual_seed(seed)
    rows = torch.rand(t, e, generator=gen).argsort(dim=1)
    return (rows.float() / 16 - 4).to(torch.bfloat16)


@cpu_tier
@pytest.mark.parametrize("weights_dtype", [torch.bfloat16, torch.float32], ids=["qwen3-bf16", "mixtral-fp32"])
def test_router_on_bf16_logits_gives_hf_choices_and_weights_within_one_rounding(weights_dtype):
    """Qwen3-MoE's weights are cast to the logits' dtype, Mixtral's stay fp32: both, from bf16 logits."""
    logits = _distinct_bf16(21, 128, seed=1)
    _check(logits, 8, True, weights_dtype)


@pytest.mark.gpu
@needs_cuda
def test_router_on_cuda_at_the_qwen3_30b_a3b_shape_equals_hf_router():
    """8 × 2048 tokens, 128 experts, top 8 renormalised, bf16 logits and weights (the benchmark's router), compiled:
    the CPU tests' checks (on the GPU, tl.exp's error, |l − m|·u for the |l − m| ≤ 16 here, is within the bound)."""
    _check(_distinct_bf16(8 * 2048, 128, seed=2).cuda(), 8, True, torch.bfloat16)
    _check(_distinct_bf16(8 * 2048, 128, seed=3).float().cuda(), 8, False, torch.float32)


@cpu_tier
def test_equal_logits_go_to_the_lowest_expert_index():
    from strop.kernels.ops.moe_router import moe_router

    logits = torch.zeros(3, 10)
    logits[1, 7] = 1.0  # one clear winner, then ties among the rest
    w, idx = moe_router(logits, 3, normalize=False, out_dtype=torch.float32)
    assert idx.tolist() == [[0, 1, 2], [7, 0, 1], [0, 1, 2]]
    p_tie = 1 / (9 + torch.e)
    torch.testing.assert_close(w[0], torch.full((3,), 0.1), rtol=4 * U32, atol=0)
    torch.testing.assert_close(w[1, 1:], torch.full((2,), p_tie), rtol=20 * U32, atol=0)


@cpu_tier
def test_no_tokens_and_bad_arguments():
    from strop.kernels.ops.moe_router import moe_router

    w, idx = moe_router(torch.zeros(0, 8, requires_grad=True), 2, normalize=True)
    assert w.shape == idx.shape == (0, 2)
    with pytest.raises(ValueError, match=r"k=9 must be within 1\.\.8"):
        moe_router(torch.zeros(4, 8), 9, normalize=True)
    with pytest.raises(ValueError, match=r"must be \[tokens, experts\]"):
        moe_router(torch.zeros(2, 4, 8), 2, normalize=True)
