"""RMSNorm: the derived backward against autograd, then the Triton op against HF's LlamaRMSNorm, and in
GEMMA mode against HF's Gemma2RMSNorm / Gemma3RMSNorm (weight stored as an offset from 1, fp32 product).

CPU tier: Triton interpreter (TRITON_INTERPRET=1), small odd shapes. GPU tier: 16,384 × 4,096 bf16.
"""

from __future__ import annotations

import pytest
import torch
from transformers.models.gemma2.modeling_gemma2 import Gemma2RMSNorm
from transformers.models.gemma3.modeling_gemma3 import Gemma3RMSNorm
from transformers.models.llama.modeling_llama import LlamaRMSNorm

from strop.kernels.ops.rmsnorm import (
    RMSNormMode,
    rms_norm,
    rms_norm_bwd,
    rms_norm_bwd_reference,
    rms_norm_fwd,
    rms_norm_reference,
)
from tests.kernels._tolerances import assert_bf16_within_torch_bound, assert_close_fp32, cpu_tier, needs_cuda

# Odd hidden sizes (not powers of two), one row, several batch dims, enough rows (37) that the dW
# reduction runs several rows per program with a partial last program, and H spanning 8 warps.
SHAPES = [(1, 67), (3, 5, 96), (37, 200), (2, 3, 2500)]


def _inputs(shape, dtype, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    w = (1 + 0.1 * torch.randn(shape[-1], generator=gen)).to(device=device, dtype=dtype)
    dy = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    return x, w, dy


def assert_bf16_fwd_bwd_within_torch_bound(x, w, dy, mode=RMSNormMode.LLAMA) -> torch.Tensor:
    """y, dx and dW of bf16 inputs: ours within 2× torch's bf16 error against fp32; returns our y."""
    truth_x, truth_w = x.float().requires_grad_(), w.float().requires_grad_()
    y_truth = rms_norm_reference(truth_x, truth_w, mode=mode)
    dx_truth, dw_truth = torch.autograd.grad(y_truth, (truth_x, truth_w), dy.float())
    tx, tw = x.clone().requires_grad_(), w.clone().requires_grad_()
    y_torch = rms_norm_reference(tx, tw, mode=mode)
    dx_torch, dw_torch = torch.autograd.grad(y_torch, (tx, tw), dy)
    ox, ow = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = rms_norm(ox, ow, mode=mode)
    dx, dw = torch.autograd.grad(y, (ox, ow), dy)
    assert_bf16_within_torch_bound(y, y_torch, y_truth.detach(), "forward")
    assert_bf16_within_torch_bound(dx, dx_torch, dx_truth, "dx")
    assert_bf16_within_torch_bound(dw, dw_torch, dw_truth, "dW")
    return y


@cpu_tier
@pytest.mark.parametrize("mode", list(RMSNormMode))
def test_derived_backward_matches_autograd_of_reference(mode):
    x, w, dy = _inputs((3, 5, 67), torch.float32)
    x.requires_grad_(), w.requires_grad_()
    dx_auto, dw_auto = torch.autograd.grad(rms_norm_reference(x, w, 1e-6, mode), (x, w), dy)
    dx, dw = rms_norm_bwd_reference(dy, x.detach(), w.detach(), 1e-6, mode)
    assert_close_fp32(dx, dx_auto, "derived dx")
    assert_close_fp32(dw, dw_auto, "derived dW")


def _check_against_hf(hf, x, w, dy, eps: float, mode: RMSNormMode, what: str):
    """strop's forward, dx and dW against HF's module ``hf`` holding weight ``w``, in fp32; returns HF's output."""
    with torch.no_grad():
        hf.weight.copy_(w)
    x_ref = x.clone().requires_grad_()
    y_ref = hf(x_ref)
    dx_ref, dw_ref = torch.autograd.grad(y_ref, (x_ref, hf.weight), dy)

    x.requires_grad_(), w.requires_grad_()
    y = rms_norm(x, w, eps, mode=mode)
    dx, dw = torch.autograd.grad(y, (x, w), dy)
    assert_close_fp32(y, y_ref, f"{what}forward")
    assert_close_fp32(dx, dx_ref, f"{what}dx")
    assert_close_fp32(dw, dw_ref, f"{what}dW (weight is trainable, so it must be returned)")
    return y_ref


@cpu_tier
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_forward_and_both_gradients_match_hf_llama_rmsnorm_in_fp32(shape):
    x, w, dy = _inputs(shape, torch.float32)
    _check_against_hf(LlamaRMSNorm(shape[-1], eps=1e-5), x, w, dy, 1e-5, RMSNormMode.LLAMA, "")


@cpu_tier
@pytest.mark.parametrize("hf_class", [Gemma2RMSNorm, Gemma3RMSNorm], ids=lambda c: c.__name__)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_gemma_mode_matches_hf_gemma_rmsnorm_forward_and_both_gradients_in_fp32(shape, hf_class):
    x, w, dy = _inputs(shape, torch.float32)
    w = w - 1  # Gemma stores the offset from 1: a weight around 0 (HF initialises it to exactly 0)
    y_ref = _check_against_hf(hf_class(shape[-1], eps=1e-6), x, w, dy, 1e-6, RMSNormMode.GEMMA, "Gemma ")
    # the offset matters: Llama semantics on the same weight are a different function
    assert (rms_norm(x.detach(), w.detach(), 1e-6) - y_ref).abs().max() > 0.5


@cpu_tier
def test_gemma_mode_bf16_within_twice_torch_error_rounds_once_and_keeps_the_input_dtype():
    x, w, dy = _inputs((37, 200), torch.bfloat16)
    w = (w.float() - 1).to(torch.bfloat16)
    y = assert_bf16_fwd_bwd_within_torch_bound(x, w, dy, RMSNormMode.GEMMA)
    assert y.dtype == torch.bfloat16
    # HF Gemma scales the fp32 row and rounds once; so do we: only fp32 ties on a bf16 boundary may differ
    same = (y == rms_norm_reference(x, w, mode=RMSNormMode.GEMMA)).float().mean().item()
    assert same >= 0.99, f"only {same:.1%} of bf16 outputs equal HF Gemma's; expected ≥ 99%"
    # an fp32 weight under a bf16 input still gives x's dtype (HF: output.type_as(x))
    assert rms_norm(x, w.float(), mode=RMSNormMode.GEMMA).dtype == torch.bfloat16


@cpu_tier
def test_gemma_mode_frozen_weight_and_inplace_backward_give_the_derived_dx():
    x, w, dy = _inputs((6, 67), torch.float32)
    w = w - 1
    _, rstd = rms_norm_fwd(x, w, mode=RMSNormMode.GEMMA)
    dx_expected, dw_expected = rms_norm_bwd_reference(dy, x, w, mode=RMSNormMode.GEMMA)
    dx, no_dw = rms_norm_bwd(dy.clone(), x, w, rstd, compute_dw=False, mode=RMSNormMode.GEMMA)
    assert no_dw is None
    assert_close_fp32(dx, dx_expected, "Gemma dx, frozen weight")
    dy2 = dy.clone()
    dx2, dw2 = rms_norm_bwd(dy2, x, w, rstd, compute_dw=True, inplace=True, mode=RMSNormMode.GEMMA)
    assert dx2.data_ptr() == dy2.data_ptr()
    assert_close_fp32(dx2, dx_expected, "Gemma in-place dx")
    assert_close_fp32(dw2, dw_expected, "Gemma dW alongside in-place dx")


@cpu_tier
@pytest.mark.parametrize("shape", [(3, 5, 96), (37, 200)], ids=str)
def test_bf16_error_is_within_twice_torch_bf16_error(shape):
    x, w, dy = _inputs(shape, torch.bfloat16)
    y = assert_bf16_fwd_bwd_within_torch_bound(x, w, dy)
    assert y.dtype == torch.bfloat16, "bf16 x and bf16 weight give a bf16 output, as in HF"


@cpu_tier
def test_bf16_forward_rounds_like_hf_cast_then_weight_multiply():
    x, w, _ = _inputs((64, 200), torch.bfloat16)
    y, _ = rms_norm_fwd(x, w)
    same = (y == rms_norm_reference(x, w)).float().mean().item()
    # HF casts the normalised row to bf16 and then multiplies by the weight (two roundings); doing the
    # same leaves only elements whose fp32 value sits on a rounding boundary to differ.
    assert same >= 0.99, f"only {same:.1%} of bf16 outputs equal HF's; expected ≥ 99%"


@cpu_tier
def test_fp32_weight_with_bf16_input_promotes_output_to_fp32_like_hf():
    x, w, _ = _inputs((4, 67), torch.bfloat16)
    w32 = w.float()
    y = rms_norm(x, w32)
    y_ref = rms_norm_reference(x, w32)
    assert y.dtype == torch.float32, "HF multiplies an fp32 weight by the bf16-cast row, promoting to fp32"
    truth = rms_norm_reference(x.float(), w32)
    assert_bf16_within_torch_bound(y, y_ref, truth, "forward with fp32 weight")


@cpu_tier
def test_frozen_weight_gets_no_gradient_and_dx_is_unchanged():
    x, w, dy = _inputs((5, 96), torch.float32)
    x.requires_grad_()
    y = rms_norm(x, w)
    (dx,) = torch.autograd.grad(y, (x,), dy)
    dx_ref, _ = rms_norm_bwd_reference(dy, x.detach(), w)
    assert w.grad is None, "a frozen weight must not receive a gradient"
    assert_close_fp32(dx, dx_ref, "dx with a frozen weight")


@cpu_tier
def test_inplace_backward_writes_dx_into_dy_storage():
    x, w, dy = _inputs((6, 67), torch.float32)
    _, rstd = rms_norm_fwd(x, w)
    dx_expected, dw_expected = rms_norm_bwd_reference(dy, x, w)
    dx, dw = rms_norm_bwd(dy, x, w, rstd, compute_dw=True, inplace=True)
    assert dx.data_ptr() == dy.data_ptr(), "inplace=True must reuse dy's memory for dx"
    assert_close_fp32(dx, dx_expected, "in-place dx")
    assert_close_fp32(dw, dw_expected, "dW alongside in-place dx")


@cpu_tier
def test_inplace_backward_through_autograd_gives_the_same_gradients():
    x, w, dy = _inputs((2, 3, 67), torch.float32)
    x.requires_grad_(), w.requires_grad_()
    grads_inplace = torch.autograd.grad(rms_norm(x, w, inplace_backward=True), (x, w), dy.clone())
    grads_fresh = torch.autograd.grad(rms_norm(x, w), (x, w), dy.clone())
    assert_close_fp32(grads_inplace[0], grads_fresh[0], "dx (in-place vs fresh buffer)")
    assert_close_fp32(grads_inplace[1], grads_fresh[1], "dW (in-place vs fresh buffer)")


@cpu_tier
def test_strided_rows_are_normalised_where_they_lie():
    wide, w, _ = _inputs((7, 150), torch.float32)
    x = wide[:, :67]  # row stride 150: a column slice, as from a fused projection
    y = rms_norm(x, w[:67])
    assert_close_fp32(y, rms_norm_reference(x, w[:67]), "forward on strided rows")


@cpu_tier
def test_expanded_gradient_is_not_written_in_place():
    x, w, _ = _inputs((4, 67), torch.float32)
    x.requires_grad_()
    y = rms_norm(x, w, inplace_backward=True)
    (dx,) = torch.autograd.grad(y.sum(), (x,))  # the incoming gradient is an expanded (stride-0) tensor
    dx_ref, _ = rms_norm_bwd_reference(torch.ones(4, 67), x.detach(), w)
    assert_close_fp32(dx, dx_ref, "dx from an expanded incoming gradient")


@cpu_tier
def test_bad_inputs_raise_named_errors():
    x, w, _ = _inputs((3, 67), torch.float32)
    with pytest.raises(ValueError, match="weight has 66 elements"):
        rms_norm(x, w[:66])
    with pytest.raises(TypeError, match="x must be float32"):
        rms_norm(x.to(torch.int32), w)
    with pytest.raises(ValueError, match="weight must be 1-D"):
        rms_norm(x, w[None])


@pytest.mark.gpu
@needs_cuda
def test_gpu_bf16_llama_shape_fwd_and_bwd_within_twice_torch_error():
    x, w, dy = _inputs((16384, 4096), torch.bfloat16, device="cuda")
    assert_bf16_fwd_bwd_within_torch_bound(x, w, dy)


@pytest.mark.gpu
@needs_cuda
def test_gpu_bf16_gemma_shape_fwd_and_bwd_within_twice_torch_error():
    x, w, dy = _inputs((16384, 1152), torch.bfloat16, device="cuda")  # Gemma 3 1B's hidden size
    assert_bf16_fwd_bwd_within_torch_bound(x, (w.float() - 1).to(torch.bfloat16), dy, RMSNormMode.GEMMA)


@pytest.mark.gpu
@needs_cuda
def test_gpu_bf16_head_dim_rows_fwd_and_frozen_bwd_within_twice_torch_error():
    """Qwen3's q/k norms: rows of head_dim 128 (a block of rows a program), a row count that leaves the last
    program part full; the frozen weight's dx-only backward too."""
    x, w, dy = _inputs((3, 1001, 5, 128), torch.bfloat16, device="cuda")
    assert_bf16_fwd_bwd_within_torch_bound(x, w, dy)
    truth_x = x.float().requires_grad_()
    (dx_truth,) = torch.autograd.grad(rms_norm_reference(truth_x, w.float()), (truth_x,), dy.float())
    tx, ox = x.clone().requires_grad_(), x.clone().requires_grad_()
    (dx_torch,) = torch.autograd.grad(rms_norm_reference(tx, w), (tx,), dy)
    (dx,) = torch.autograd.grad(rms_norm(ox, w), (ox,), dy)
    assert_bf16_within_torch_bound(dx, dx_torch, dx_truth, "dx with a frozen weight")
