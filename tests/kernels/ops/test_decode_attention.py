"""``decode_attention`` (kernels/ops/decode_attention.py) against the fp32 product of plain torch ops and SDPA.

Bounds. fp32 inputs: the kernel's dots are IEEE fp32 and the chunks' merge rescales by exp of differences, so it
differs from one softmax over all keys by summation order only: a few ulps of the outputs, inside DESIGN's fp32
tolerance (1e-5 relative to the output's scale). bf16 inputs: the error against the fp32 truth on the same bf16
values may be at most 2x that of torch's own bf16 SDPA with the mask repeated per query head (DESIGN's bf16 rule).
"""

from __future__ import annotations

import pytest
import torch

from strop.kernels.ops.decode_attention import decode_attention, decode_attention_reference
from tests.kernels._tolerances import assert_bf16_within_torch_bound, assert_close_fp32, cpu_tier, needs_cuda


def _case(requests, kv_heads, samples, group, length, dim, dtype, spare=37):
    """q [R, Hkv, S·g, D]; K/V views of longer buffers (strided, as the sampler's cache slots beyond the call's);
    a mask in the sampler's form: sample i sees the prompt (its first half, pads at the front of request 1 hidden)
    and its own block of the rest."""
    g = torch.Generator().manual_seed(length + samples)
    q = torch.randn(requests, kv_heads, samples * group, dim, generator=g).to(dtype)
    k = torch.randn(requests, kv_heads, length + spare, dim, generator=g).to(dtype)[:, :, :length]
    v = torch.randn(requests, kv_heads, length + spare, dim, generator=g).to(dtype)[:, :, :length]
    prompt, block = length // 2, (length - length // 2) // samples
    slot = torch.arange(length)
    owner = torch.where(slot < prompt, -1, (slot - prompt) // max(block, 1))
    seen = (owner[None, :] == -1) | (owner[None, :] == torch.arange(samples)[:, None])  # [S, L]
    seen = seen[None].repeat(requests, 1, 1)
    if requests > 1:
        seen[1, :, :5] = False  # request 1's left pads
    low = torch.finfo(dtype).min
    mask = torch.where(seen, torch.zeros((), dtype=dtype), torch.full((), low, dtype=dtype))
    return q, k, v, mask


@cpu_tier
@pytest.mark.parametrize(
    ("requests", "kv_heads", "samples", "group", "length", "splits"),
    [
        (1, 2, 8, 4, 700, None),  # the sampler's shape, scaled down: chunks of 4 blocks, the last one partial
        (2, 1, 3, 2, 333, 3),  # two requests, L not a multiple of the 64-key block
        (1, 1, 20, 4, 200, 1),  # 80 query rows: two row blocks; one chunk
        (1, 2, 1, 1, 1000, 64),  # one row per kv head; many chunks (each of one block)
    ],
)
def test_fp32_equals_one_softmax_over_all_keys(requests, kv_heads, samples, group, length, splits):
    q, k, v, mask = _case(requests, kv_heads, samples, group, length, 64, torch.float32)
    scale = 64**-0.5
    got = decode_attention(q, k, v, mask, group, scale, splits=splits)
    truth = decode_attention_reference(q, k, v, mask, group, scale)
    assert_close_fp32(got, truth, "split decode attention")
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask.repeat_interleave(group, dim=1)[:, None], scale=scale
    )
    assert_close_fp32(got, sdpa, "split decode attention against SDPA")


@cpu_tier
def test_keys_masked_with_minus_infinity_weigh_nothing_and_no_mask_reads_every_key():
    """A chunk whose keys a row may not see at all (-inf, as SDPA takes masks) adds nothing, rather than NaN."""
    q, k, v, mask = _case(1, 2, 4, 2, 600, 32, torch.float32)
    mask = mask.masked_fill(mask < 0, float("-inf"))
    got = decode_attention(q, k, v, mask, 2, 0.2, splits=6)
    assert torch.isfinite(got).all()
    assert_close_fp32(got, decode_attention_reference(q, k, v, mask, 2, 0.2), "-inf mask")
    got = decode_attention(q, k, v, None, 2, 0.2, splits=4)
    assert_close_fp32(got, decode_attention_reference(q, k, v, None, 2, 0.2), "no mask")


@cpu_tier
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_16bit_is_within_twice_torch_sdpas_error(dtype):
    q, k, v, mask = _case(2, 2, 8, 4, 900, 128, dtype)
    scale = 128**-0.5
    got = decode_attention(q, k, v, mask, 4, scale)
    assert got.dtype == dtype
    truth = decode_attention_reference(q, k, v, mask, 4, scale)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask.repeat_interleave(4, dim=1)[:, None], scale=scale
    )
    assert_bf16_within_torch_bound(got, sdpa, truth, f"split decode attention, {dtype}")


def test_shapes_that_are_not_one_cache_are_refused():
    q = torch.randn(1, 2, 8, 64)
    k = torch.randn(1, 2, 100, 64)
    with pytest.raises(ValueError, match="not one cache"):
        decode_attention(q, k, torch.randn(1, 2, 99, 64), None, 4, 1.0)
    with pytest.raises(ValueError, match="mask"):
        decode_attention(q, k, k, torch.zeros(1, 3, 100), 4, 1.0)


@pytest.mark.gpu
@needs_cuda
def test_gpu_8b_decode_shape_within_twice_torch_sdpas_error_and_captured_in_a_graph():
    """GPU tier, the GRPO decode shape of an 8B model: 8 samples x 4 query heads on each of 8 kv heads over an 8.2K
    prompt plus 8 blocks of 64 slots, bf16; the kernel (about two programs an SM) against the fp32 truth within 2x
    SDPA's bf16 error, and the same values when replayed from a CUDA graph (as the sampler runs it)."""
    q, k, v, mask = (t.cuda() for t in _case(1, 8, 8, 4, 8192 + 8 * 64, 128, torch.bfloat16))
    scale = 128**-0.5
    got = decode_attention(q, k, v, mask, 4, scale)
    truth = decode_attention_reference(q, k, v, mask, 4, scale)
    sdpa = torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=mask.repeat_interleave(4, dim=1)[:, None], scale=scale
    )
    assert_bf16_within_torch_bound(got, sdpa, truth, "split decode attention at the 8B GRPO shape")
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph.capture_begin()
        out = decode_attention(q, k, v, mask, 4, scale)
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, got)
