"""``unrounded_linear``: a 16-bit linear whose fp32 sum is not rounded back to 16 bits, with ``F.linear``'s backward.
Checked against float64 products of the same rounded operands (the fp32 summation bound), against the rounded
``F.linear`` (which it is not, so the checks can fail), and for its gradients against autograd through
``F.linear(...).float()`` given the same upstream gradient (bit for bit: the same products)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from strop.kernels.losses.kl import token_kl
from strop.kernels.ops import unrounded_linear as ul


def _operands(m=6, k=64, n=300, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = (4 * torch.randn(m, k, generator=g)).to(torch.bfloat16)
    w = torch.randn(n, k, generator=g).to(torch.bfloat16)
    return x, w


@pytest.mark.parametrize("copy", [False, True])
@pytest.mark.parametrize("rows", [8192, 7])  # one slice of the weight, or 43
def test_the_sum_is_fp32_and_not_rounded(monkeypatch, rows, copy):  # copy: the CPU's fp32 copy of the weight
    monkeypatch.setattr(ul, "CPU_ROWS", rows)
    x, w = _operands()
    bias = torch.randn(w.shape[0]).to(torch.bfloat16)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = ul.unrounded_linear(x, w, bias, weight32=w.float() if copy else None)
        rounded = F.linear(x, w, bias)
    exact = x.double() @ w.double().t() + bias.double()
    terms = x.double().abs() @ w.double().abs().t() + bias.double().abs()
    assert got.dtype == torch.float32 and got.shape == (6, 300)
    assert bool(((got.double() - exact).abs() <= 64 * 2**-23 * terms).all()), (
        "within fp32 summation of 64 terms"
    )
    half_ulp = 2.0 ** (torch.floor(torch.log2(exact.abs())) - 8)
    assert float((rounded.double() - exact).abs().max()) > float((got.double() - exact).abs().max()) * 100
    # the rounded linear is off by its rounding (a half ulp; two where a backend rounds product and bias apart)
    assert bool(((rounded.double() - exact).abs() <= 2.01 * half_ulp + 64 * 2**-23 * terms).all())


def test_a_cpu_callers_fp32_copy_is_the_weight_multiplied():
    """``weight32`` is what the CPU multiplies (a copy twice the weight gives twice the sums), and the gradient
    still flows to the 16-bit weight itself."""
    x, w = _operands()
    w.requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = ul.unrounded_linear(x, w)
        doubled = ul.unrounded_linear(x, w, weight32=2 * w.detach().float())
    torch.testing.assert_close(doubled, 2 * plain, rtol=1e-6, atol=1e-5)
    (g,) = torch.autograd.grad(doubled.sum(), (w,))
    assert g.dtype == torch.bfloat16


def test_the_gradients_are_those_of_the_rounded_linear_for_the_same_upstream_gradient():
    x, w = _operands()
    x.requires_grad_(True)
    w.requires_grad_(True)
    dz = torch.randn(6, 300, generator=torch.Generator().manual_seed(1))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        got = torch.autograd.grad(ul.unrounded_linear(x, w), (x, w), dz)
        ref = torch.autograd.grad(F.linear(x, w).float(), (x, w), dz)
    for a, b in zip(got, ref, strict=True):
        assert a.dtype == b.dtype == torch.bfloat16
        assert torch.equal(a, b)


def test_fp32_operands_are_f_linear_itself():
    g = torch.Generator().manual_seed(2)
    x, w, b = torch.randn(5, 16, generator=g), torch.randn(9, 16, generator=g), torch.randn(9, generator=g)
    assert torch.equal(ul.unrounded_linear(x, w, b), F.linear(x, w, b))
    assert ul.unrounded_linear(x.double(), w.double()).dtype == torch.float64
    with torch.autocast("cpu", dtype=torch.bfloat16):  # autocast leaves float64 alone, as it does F.linear
        assert torch.equal(ul.unrounded_linear(x.double(), w.double()), F.linear(x.double(), w.double()))
    with pytest.raises(RuntimeError):  # mixed dtypes without autocast: F.linear's error, not a silent cast
        ul.unrounded_linear(x.to(torch.float16), w.to(torch.bfloat16))


def test_the_kl_hinge_protects_a_lead_bf16_would_round_to_a_tie():
    """The teacher leads token 1 over token 0 by 1/32 at a logit of 16 (a tie once rounded to bf16); a student
    tied there exactly is 1/32 short of that lead, which the hinge prices. With rounded logits it priced nothing."""
    w = torch.tensor([[16.0, 0.0], [16.0, 2**-5], [0.0, 1.0]]).to(torch.bfloat16)
    teacher = torch.tensor([[1.0, 1.0]]).to(torch.bfloat16)
    student = torch.tensor([[1.0, 0.0]]).to(torch.bfloat16).requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        hinge_and_kl = token_kl(student, teacher, w, lead_weight=1.0, lead_cap=1.0)
        kl = token_kl(student, teacher, w)
    assert float((hinge_and_kl - kl).detach()) == pytest.approx(2**-5, abs=1e-6)
    (g,) = torch.autograd.grad(hinge_and_kl - kl, (student,))
    assert float(g.abs().sum()) > 0, "the hinge's gradient reaches the student"


@pytest.mark.gpu
def test_gpu_the_one_gemm_sums_in_fp32_and_backs_off_as_the_rounded_linear():
    """CUDA's fp32-output GEMM: within the fp32 summation bound of float64 products, far nearer them than the rounded
    linear; its gradients those of ``F.linear(...).float()`` for the same upstream gradient (the same bf16 GEMMs)."""
    x, w = (t.cuda() for t in _operands(m=512, k=2048, n=32_000))
    x.requires_grad_(True)
    w.requires_grad_(True)
    dz = torch.randn(512, 32_000, device="cuda", generator=torch.Generator(device="cuda").manual_seed(1))
    with torch.autocast("cuda", dtype=torch.bfloat16):
        got = ul.unrounded_linear(x, w)
        rounded = F.linear(x, w).float()
    exact = x.detach().double() @ w.detach().double().t()
    terms = x.detach().double().abs() @ w.detach().double().abs().t()
    assert got.dtype == torch.float32
    assert bool(((got.double() - exact).abs() <= 2048 * 2**-23 * terms).all())
    assert float((rounded.double() - exact).abs().max()) > 10 * float((got.double() - exact).abs().max())
    g_got = torch.autograd.grad(got, (x, w), dz)
    g_ref = torch.autograd.grad(rounded, (x, w), dz)
    for a, b in zip(g_got, g_ref, strict=True):
        assert torch.equal(a, b)
