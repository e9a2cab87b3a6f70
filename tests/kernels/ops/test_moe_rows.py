"""The routed rows' gather and its adjoint sum (``kernels/ops/moe_rows.py``) against torch's indexing and
``index_add_``, which HF's experts and the earlier path used.

CPU tier under the interpreter: T = 13 tokens (a partial tile of 8), k = 3 choices, H = 300 (a partial 256-column
tile). fp32: forward and both backwards equal torch's to fp32 rounding (a sum of 3 terms). bf16: the sum of a token's
k rows is rounded once, so it is within half a bf16 ulp of the exact sum (2⁻⁸ relative to it), and within DESIGN's bf16
rule of torch's bf16 ``index_add_`` (one rounding an add).
"""

from __future__ import annotations

import torch

from tests.kernels._tolerances import assert_bf16_within_torch_bound, assert_close_fp32, cpu_tier

pytestmark = cpu_tier

T, K, H = 13, 3, 300


def _routing(seed=0):
    gen = torch.Generator().manual_seed(seed)
    choice = torch.stack([torch.randperm(7, generator=gen)[:K] for _ in range(T)])  # distinct experts a token
    order = torch.argsort(choice.reshape(-1), stable=True)
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel())
    return order // K, inv, gen


def test_gather_and_sum_match_torch_indexing_and_index_add_with_their_gradients_in_fp32():
    from strop.kernels.ops.moe_rows import combine_rows, gather_rows

    token, inv, gen = _routing()
    x = torch.randn(T, H, generator=gen)
    out = torch.randn(T * K, H, generator=gen)
    dxs, dy = torch.randn(T * K, H, generator=gen), torch.randn(T, H, generator=gen)

    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    ours, ref = gather_rows(xa, token, inv, K), xb[token]
    assert torch.equal(ours, ref)
    ours.backward(dxs)
    ref.backward(dxs)
    assert_close_fp32(xa.grad, xb.grad, "the gather's backward: each token's k rows summed")

    oa, ob = out.clone().requires_grad_(), out.clone().requires_grad_()
    y = combine_rows(oa, token, inv, K, torch.float32)
    y_ref = torch.zeros(T, H).index_add_(0, token, ob)
    assert_close_fp32(y, y_ref, "the sum of each token's k rows")
    y.backward(dy)
    y_ref.backward(dy)
    assert torch.equal(oa.grad, ob.grad), "the sum's backward: dy gathered"


def test_bf16_sum_is_rounded_once_and_within_the_bf16_rule_of_index_add():
    from strop.kernels.ops.moe_rows import combine_rows

    token, inv, gen = _routing(1)
    out = torch.randn(T * K, H, generator=gen).bfloat16()
    exact = torch.zeros(T, H, dtype=torch.float64).index_add_(0, token, out.double())
    ours = combine_rows(out, token, inv, K, torch.bfloat16)
    assert ((ours.double() - exact).abs() <= 2**-8 * exact.abs()).all(), "one rounding of the exact sum"
    torch_bf16 = torch.zeros(T, H, dtype=torch.bfloat16).index_add_(0, token, out)
    assert_bf16_within_torch_bound(ours, torch_bf16, exact.float(), "sum of the routed rows")
