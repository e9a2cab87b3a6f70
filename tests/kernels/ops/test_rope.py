"""RoPE on Q and K: the derived backward against autograd, then the in-place Triton op against HF.

CPU tier: Triton interpreter (TRITON_INTERPRET=1), small odd shapes, cos/sin from HF's own rotary module.
GPU tier: Llama-3-8B attention shape (32 q heads, 8 kv heads, head dim 128) over 16,384 tokens, bf16.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from strop.kernels.ops.rope import rope_qk, rope_qk_bwd, rope_qk_bwd_reference, rope_qk_reference
from tests.kernels._tolerances import assert_bf16_within_torch_bound, assert_close_fp32, cpu_tier, needs_cuda


def hf_cos_sin(position_ids: torch.Tensor, head_dim: int, dtype: torch.dtype, device="cpu"):
    """cos/sin exactly as HF's LlamaRotaryEmbedding returns them for these positions."""
    config = LlamaConfig(
        hidden_size=4 * head_dim, num_attention_heads=4, head_dim=head_dim, max_position_embeddings=4096
    )
    rotary = LlamaRotaryEmbedding(config).to(device)
    probe = torch.empty(1, dtype=dtype, device=device)
    return rotary(probe, position_ids.to(device))


def projected_qk(b, t, hq, hk, d, dtype, device="cpu", seed=0):
    """Leaf [B, T, H, D] projections and the transposed [B, H, T, D] views HF's attention rotates."""
    gen = torch.Generator().manual_seed(seed)
    q_src = torch.randn(b, t, hq, d, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    k_src = torch.randn(b, t, hk, d, generator=gen).to(device=device, dtype=dtype).requires_grad_()
    dq = torch.randn(b, hq, t, d, generator=gen).to(device=device, dtype=dtype)
    dk = torch.randn(b, hk, t, d, generator=gen).to(device=device, dtype=dtype)
    return q_src, k_src, dq, dk


# Packed rows: positions restart inside each row, differently per row.
PACKED_POSITIONS = torch.tensor([[0, 1, 2, 3, 0, 1, 2, 0, 1], [0, 1, 2, 3, 4, 5, 0, 1, 2]])


def assert_bf16_fwd_bwd_within_torch_bound(q_src, k_src, dq, dk, cos, sin) -> None:
    """Rotated q/k and dq/dk of bf16 leaves: ours within 2× HF's bf16 error against the fp32 reference."""
    truth_q, truth_k = q_src.detach().float().requires_grad_(), k_src.detach().float().requires_grad_()
    qt, kt = rope_qk_reference(truth_q.transpose(1, 2), truth_k.transpose(1, 2), cos.float(), sin.float())
    dq_truth, dk_truth = torch.autograd.grad((qt, kt), (truth_q, truth_k), (dq.float(), dk.float()))
    q_torch, k_torch = apply_rotary_pos_emb(q_src.transpose(1, 2), k_src.transpose(1, 2), cos, sin)
    dq_torch, dk_torch = torch.autograd.grad((q_torch, k_torch), (q_src, k_src), (dq, dk))
    q_out, k_out = rope_qk((q_src * 1).transpose(1, 2), (k_src * 1).transpose(1, 2), cos, sin)
    dq_ours, dk_ours = torch.autograd.grad((q_out, k_out), (q_src, k_src), (dq.clone(), dk.clone()))
    assert_bf16_within_torch_bound(q_out, q_torch, qt.detach(), "rotated q")
    assert_bf16_within_torch_bound(k_out, k_torch, kt.detach(), "rotated k")
    assert_bf16_within_torch_bound(dq_ours, dq_torch, dq_truth, "dq")
    assert_bf16_within_torch_bound(dk_ours, dk_torch, dk_truth, "dk")


@cpu_tier
def test_derived_backward_matches_autograd_of_reference_for_general_cos_sin():
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(2, 3, 5, 10, generator=gen, requires_grad=True)
    k = torch.randn(2, 1, 5, 10, generator=gen, requires_grad=True)
    cos, sin = torch.randn(2, 5, 10, generator=gen), torch.randn(2, 5, 10, generator=gen)  # halves differ
    dq, dk = torch.randn(2, 3, 5, 10, generator=gen), torch.randn(2, 1, 5, 10, generator=gen)
    auto = torch.autograd.grad(rope_qk_reference(q, k, cos, sin), (q, k), (dq, dk))
    derived = rope_qk_bwd_reference(dq, dk, cos, sin)
    assert_close_fp32(derived[0], auto[0], "derived dq")
    assert_close_fp32(derived[1], auto[1], "derived dk")


@cpu_tier
def test_kernels_apply_the_exact_map_and_its_transpose_for_arbitrary_cos_sin_halves():
    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(2, 3, 5, 10, generator=gen), torch.randn(2, 1, 5, 10, generator=gen)
    cos, sin = torch.randn(2, 5, 10, generator=gen), torch.randn(2, 5, 10, generator=gen)  # halves differ
    expected_q, expected_k = rope_qk_reference(q, k, cos, sin)
    expected_dq, expected_dk = rope_qk_bwd_reference(q, k, cos, sin)
    q_out, k_out = rope_qk(q.clone(), k.clone(), cos, sin)
    dq, dk = q.clone(), k.clone()
    rope_qk_bwd(dq, dk, cos, sin)
    assert_close_fp32(q_out, expected_q, "forward q with unequal halves")
    assert_close_fp32(k_out, expected_k, "forward k with unequal halves")
    assert_close_fp32(dq, expected_dq, "backward uses Mᵀ (s₂ in the first half, s₁ in the second)")
    assert_close_fp32(dk, expected_dk, "backward dk with unequal halves")


@cpu_tier
@pytest.mark.parametrize(("hq", "hk", "d"), [(4, 2, 18), (20, 5, 8)], ids=["gqa2-d18", "20heads-two-tiles"])
def test_transposed_views_match_hf_apply_rotary_pos_emb_with_packed_positions_fp32(hq, hk, d):
    q_src, k_src, dq, dk = projected_qk(2, 9, hq, hk, d, torch.float32)
    cos, sin = hf_cos_sin(PACKED_POSITIONS, d, torch.float32)
    q_hf, k_hf = apply_rotary_pos_emb(q_src.transpose(1, 2), k_src.transpose(1, 2), cos, sin)
    dq_hf, dk_hf = torch.autograd.grad((q_hf, k_hf), (q_src, k_src), (dq, dk))

    q, k = (q_src * 1).transpose(1, 2), (k_src * 1).transpose(1, 2)  # non-leaf, non-contiguous views
    q_out, k_out = rope_qk(q, k, cos, sin)
    dq_ours, dk_ours = torch.autograd.grad((q_out, k_out), (q_src, k_src), (dq.clone(), dk.clone()))
    assert q_out.data_ptr() == q.data_ptr() and k_out.data_ptr() == k.data_ptr(), "rotation must be in place"
    assert_close_fp32(q_out, q_hf, "rotated q")
    assert_close_fp32(k_out, k_hf, "rotated k")
    assert_close_fp32(dq_ours, dq_hf, "dq")
    assert_close_fp32(dk_ours, dk_hf, "dk")


@cpu_tier
def test_bf16_error_is_within_twice_torch_bf16_error():
    q_src, k_src, dq, dk = projected_qk(2, 9, 4, 2, 18, torch.bfloat16)
    cos, sin = hf_cos_sin(PACKED_POSITIONS, 18, torch.bfloat16)
    assert_bf16_fwd_bwd_within_torch_bound(q_src, k_src, dq, dk, cos, sin)


@cpu_tier
def test_cos_sin_with_batch_one_broadcast_over_the_batch():
    q_src, k_src, _, _ = projected_qk(3, 6, 2, 1, 8, torch.float32)
    cos, sin = hf_cos_sin(torch.arange(6)[None], 8, torch.float32)  # HF's default position_ids: [1, T]
    q_hf, k_hf = apply_rotary_pos_emb(q_src.transpose(1, 2), k_src.transpose(1, 2), cos, sin)
    q_out, k_out = rope_qk(
        q_src.detach().transpose(1, 2).clone(), k_src.detach().transpose(1, 2).clone(), cos, sin
    )
    assert_close_fp32(q_out, q_hf, "q with a broadcast cos/sin batch")
    assert_close_fp32(k_out, k_hf, "k with a broadcast cos/sin batch")


@cpu_tier
def test_backward_launcher_rotates_gradients_in_place_by_minus_theta():
    _, _, dq, dk = projected_qk(2, 9, 4, 2, 18, torch.float32)
    cos, sin = hf_cos_sin(PACKED_POSITIONS, 18, torch.float32)
    expected = rope_qk_bwd_reference(dq, dk, cos, sin)
    # With HF's cos/sin (equal halves) the transpose is the rotation by −θ: the forward with −sin.
    minus_theta = rope_qk_reference(dq, dk, cos, -sin)
    rope_qk_bwd(dq, dk, cos, sin)
    assert_close_fp32(expected[0], minus_theta[0], "Mᵀ equals the rotation by −θ for HF cos/sin")
    assert_close_fp32(dq, expected[0], "dq rotated in place")
    assert_close_fp32(dk, expected[1], "dk rotated in place")


@cpu_tier
def test_expanded_incoming_gradient_is_copied_not_written():
    q_src, k_src, _, _ = projected_qk(1, 5, 2, 1, 8, torch.float32)
    cos, sin = hf_cos_sin(torch.arange(5)[None], 8, torch.float32)
    q_out, k_out = rope_qk((q_src * 1).transpose(1, 2), (k_src * 1).transpose(1, 2), cos, sin)
    dq, dk = torch.autograd.grad(q_out.sum() + k_out.sum(), (q_src, k_src))  # stride-0 incoming grads
    q_hf, k_hf = apply_rotary_pos_emb(q_src.transpose(1, 2), k_src.transpose(1, 2), cos, sin)
    dq_hf, dk_hf = torch.autograd.grad(q_hf.sum() + k_hf.sum(), (q_src, k_src))
    assert_close_fp32(dq, dq_hf, "dq from an expanded gradient")
    assert_close_fp32(dk, dk_hf, "dk from an expanded gradient")


@cpu_tier
def test_rotating_a_tensor_saved_by_another_op_fails_loudly_instead_of_corrupting_its_gradient():
    x = torch.randn(1, 2, 3, 8, requires_grad=True)
    q, k = x.exp(), x.exp()  # exp saves its output for backward
    cos, sin = hf_cos_sin(torch.arange(3)[None], 8, torch.float32)
    q_out, k_out = rope_qk(q, k, cos, sin)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        (q_out.sum() + k_out.sum()).backward()


@cpu_tier
def test_bad_inputs_raise_named_errors():
    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 1, 3, 8)
    cos, sin = hf_cos_sin(torch.arange(3)[None], 8, torch.float32)
    with pytest.raises(ValueError, match="head dim must be even"):
        rope_qk(torch.randn(1, 2, 3, 7), torch.randn(1, 1, 3, 7), cos[..., :7], sin[..., :7])
    with pytest.raises(ValueError, match="cos/sin must be"):
        rope_qk(q, k, cos[:, :2], sin[:, :2])
    with pytest.raises(ValueError, match="must agree on batch"):
        rope_qk(q, torch.randn(1, 1, 4, 8), cos, sin)
    with pytest.raises(ValueError, match="does not differentiate cos/sin"):
        rope_qk(q, k, cos.requires_grad_(), sin)


@pytest.mark.gpu
@needs_cuda
def test_gpu_bf16_llama3_attention_shape_fwd_and_bwd_within_twice_torch_error():
    b, t, hq, hk, d = 8, 2048, 32, 8, 128
    q_src, k_src, dq, dk = projected_qk(b, t, hq, hk, d, torch.bfloat16, device="cuda")
    positions = torch.arange(t).repeat(b, 1)
    positions[:, t // 2 :] -= t // 2  # two packed sequences per row
    cos, sin = hf_cos_sin(positions, d, torch.bfloat16, device="cuda")
    assert_bf16_fwd_bwd_within_torch_bound(q_src, k_src, dq, dk, cos, sin)
