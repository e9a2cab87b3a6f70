"""The grouped LoRA GEMM over experts (``kernels/ops/moe_gemm.py``) against its definition, expert by expert.

CPU tier, fp32, odd shapes: three experts holding 5, 0 and 37 routed rows (an empty expert between two uneven ones),
K 40 and N 24, rank 4. Forward and the
hand-written backward (dx, dA, dB) are compared with the reference's output and its autograd gradients to fp32
rounding (DESIGN: ≈1e-5 relative to the tensor's scale; every value here is one dot of ≤ 40 + 24 products).
"""

from __future__ import annotations

import pytest
import torch

from tests.kernels._tolerances import assert_close_fp32, cpu_tier

pytestmark = cpu_tier


def _inputs(counts=(5, 0, 37), k=40, n=24, r=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    e = len(counts)
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int64)
    x = torch.randn(int(offsets[-1]), k, generator=gen)
    w = torch.randn(e, n, k, generator=gen) / k**0.5
    a = torch.randn(e, r, k, generator=gen) / k**0.5
    b = torch.randn(e, n, r, generator=gen) / r**0.5
    return x, offsets, w, a, b


@pytest.mark.parametrize("split", [False, True], ids=["one-node", "split"])
def test_the_grouped_forward_and_backward_equal_the_per_expert_definition(split):
    from strop.kernels.ops.moe_gemm import moe_lora_gemm, moe_lora_gemm_reference

    x, offsets, w, a, b = _inputs()
    scale = 2.0
    xs, as_, bs = (t.clone().requires_grad_() for t in (x, a, b))
    y = moe_lora_gemm(xs, offsets, w, as_, bs, scale, split=split)
    xr, ar, br = (t.clone().requires_grad_() for t in (x, a, b))
    ref = moe_lora_gemm_reference(xr, offsets, w, ar, br, scale)
    assert_close_fp32(y, ref, "y")
    dy = torch.randn(y.shape, generator=torch.Generator().manual_seed(1))
    y.backward(dy)
    ref.backward(dy)
    assert_close_fp32(xs.grad, xr.grad, "dx")
    assert_close_fp32(as_.grad, ar.grad, "dA")
    assert_close_fp32(bs.grad, br.grad, "dB")
    assert not as_.grad[1].any() and not bs.grad[1].any(), "an expert with no rows gets zero gradients"


def test_transposed_expert_weights_are_read_through_their_strides():
    """An [E, K, N] stack viewed as [E, N, K] (gpt-oss stores experts transposed) gives the same result."""
    from strop.kernels.ops.moe_gemm import moe_lora_gemm, moe_lora_gemm_reference

    x, offsets, w, a, b = _inputs(counts=(9, 14), k=24, n=40, r=8, seed=3)
    wt = w.transpose(1, 2).contiguous().transpose(1, 2)  # same values, non-unit last stride
    assert wt.stride(2) != 1
    assert_close_fp32(
        moe_lora_gemm(x, offsets, wt, a, b, 0.5), moe_lora_gemm_reference(x, offsets, w, a, b, 0.5), "y"
    )


def test_mismatched_shapes_are_refused_naming_them():
    from strop.kernels.ops.moe_gemm import moe_lora_gemm

    x, offsets, w, a, b = _inputs()
    with pytest.raises(ValueError, match="shapes do not agree"):
        moe_lora_gemm(x[:, :-1], offsets, w, a, b, 1.0)
    with pytest.raises(ValueError, match="offsets must be"):
        moe_lora_gemm(x, offsets[:-1], w, a, b, 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_torch_grouped_gemm_and_the_per_expert_loop_agree(dtype):
    """``grouped_mm`` runs torch's op on operands it takes and an expert-by-expert ``torch.mm`` otherwise (here a
    start off the 16-byte alignment). Both layouts (rows × stack; the reduction over each expert's rows) are within
    one rounding of the dtype plus fp32 accumulation (K·2⁻²⁴ of Σ|terms|) of the exact fp32 products of the same
    inputs, whichever runs; an expert with no rows reduces to exactly 0."""
    from strop.kernels.ops.moe_gemm import _aligned, grouped_mm

    x, offsets, w, _, _ = _inputs(k=64, n=24)
    x, w = x.to(dtype), w.to(dtype)
    ends = offsets[1:].to(torch.int32)
    dy = torch.randn(x.shape[0], 24, generator=torch.Generator().manual_seed(2)).to(dtype)
    shifted = torch.empty(x.numel() + 1, dtype=dtype)[1:].view_as(x).copy_(x)  # same values, unaligned start
    assert _aligned(x) and not _aligned(shifted)
    rows = [slice(int(offsets[e]), int(offsets[e + 1])) for e in range(3)]
    xf, wf, dyf = x.double(), w.double(), dy.double()
    exact_rows = torch.cat([xf[r] @ wf[e].T for e, r in enumerate(rows)])
    mag_rows = torch.cat([xf[r].abs() @ wf[e].abs().T for e, r in enumerate(rows)])
    exact_red = torch.stack([dyf[r].T @ xf[r] for r in rows])
    mag_red = torch.stack([dyf[r].abs().T @ xf[r].abs() for r in rows])
    u = 2**-24 if dtype == torch.float32 else 2**-8
    for xin in (x, shifted):
        for got, exact, mag, k in (
            (grouped_mm(xin, w.transpose(1, 2), ends), exact_rows, mag_rows, 64),
            (grouped_mm(dy.t(), xin, ends), exact_red, mag_red, 37),
        ):
            bound = u * exact.abs() + k * 2**-24 * mag
            assert ((got.double() - exact).abs() <= bound).all(), (dtype, _aligned(xin))
    assert not grouped_mm(dy.t(), x, ends)[1].any(), "the empty expert's reduction is 0"


def test_every_product_runs_on_torch_grouped_gemm_with_pefts_factor_layout(monkeypatch):
    """With PEFT's factors as ``peft_expert_factors`` views them (B a permuted view of ``lora_B.weight``) and
    operands whose strides are multiples of 16 bytes, the 2 forward products (x·(W + sBA)ᵀ over the merged stack, u)
    and 4 backward ones (dx, v, dA, dB) are all torch's grouped GEMM (none falls back to the expert-by-expert loop),
    and the result is the definition's."""
    from strop.kernels.lora.moe import peft_expert_factors
    from strop.kernels.ops import moe_gemm

    if moe_gemm._GROUPED_MM is None:
        pytest.skip("this torch has no grouped GEMM")
    calls = []

    def counted(a, b, offs):
        calls.append((tuple(a.shape), tuple(b.shape)))
        return grouped(a, b, offs=offs)

    grouped = moe_gemm._GROUPED_MM
    monkeypatch.setattr(moe_gemm, "_GROUPED_MM", counted)
    x, offsets, w, _, _ = _inputs(k=64, n=32, r=4)
    gen = torch.Generator().manual_seed(4)
    lora_a = (torch.randn(3 * 8, 64, generator=gen) / 8).requires_grad_()  # [E·r, in], r = 8
    lora_b = (torch.randn(32, 3 * 8, generator=gen) / 3).requires_grad_()  # [out, E·r]
    a, b = peft_expert_factors(lora_a, lora_b, 3)
    assert not b.is_contiguous()
    xs = x.clone().requires_grad_()
    y = moe_gemm.moe_lora_gemm(xs, offsets, w, a, b, 2.0)
    y.backward(torch.ones_like(y))
    assert len(calls) == 6, calls
    assert_close_fp32(y, moe_gemm.moe_lora_gemm_reference(x, offsets, w, a.detach(), b.detach(), 2.0), "y")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32-factor", "bf16-factor"])
@pytest.mark.parametrize("s", [1.0, 0.37], ids=["scale-1", "scale-0.37"])
def test_a_factor_gradient_is_masked_cast_and_scaled_as_the_three_step_chain(dtype, s):
    """``_factor_grad`` (one ``where`` that also casts, a scale of 1 multiplying nothing) gives the bits of
    ``g.where(has_rows, 0).to(dtype).mul_(s)``, and exactly 0 where an expert has no rows even if the grouped
    GEMM left NaN or inf there (torch's kernel leaves an empty group's output unwritten)."""
    from strop.kernels.ops.moe_gemm import _factor_grad, _has_rows

    gen = torch.Generator().manual_seed(7)
    offsets = torch.tensor([0, 3, 3, 7, 7], dtype=torch.int32)  # experts 1 and 3 have no rows
    has_rows = _has_rows(offsets)
    assert has_rows.flatten().tolist() == [True, False, True, False]
    g = torch.randn(4, 2, 5, generator=gen).to(torch.bfloat16)
    g[1] = float("nan")
    g[3] = float("inf")
    want = g.where(has_rows, 0).to(dtype).mul_(s)
    got = _factor_grad(g.clone(), has_rows, dtype, s)
    assert got.dtype == dtype and torch.equal(got, want)
    assert not got[1].any() and not got[3].any()
