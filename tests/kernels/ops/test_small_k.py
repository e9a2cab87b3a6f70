"""``addmm_small_k_``: y += alpha · a @ b with K = the LoRA rank, against torch's addmm_.

Odd shapes (M and N not multiples of the tiles, K = 1, 13, 16, 48 and 128), strided a (a column slice of
a stacked factor, as the fused QKV passes it) and a transposed b (``B.t()``), a strided y row, fp32 and
bf16. Reference: the same update in fp64 from the same inputs. fp32 must agree to fp32 rounding; bf16 may
differ from the fp64 truth by at most twice torch's own bf16 addmm_ (DESIGN's bf16 rule), since both round
the fp32 sum once. Shapes the kernel does not take (K > 128, mixed dtypes) must fall back to torch.
"""

from __future__ import annotations

import pytest
import torch

from strop.kernels.ops.small_k import MAX_SMALL_K, addmm_small_k_
from tests.kernels._tolerances import assert_bf16_within_torch_bound, assert_close_fp32

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _case(m: int, n: int, k: int, dtype: torch.dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(m, n + 3, generator=g).to(DEVICE, dtype)[:, :n]  # a row stride wider than the row
    stacked = torch.randn(m, k + 5, generator=g).to(DEVICE, dtype)
    a = stacked[:, 2 : 2 + k]  # a column slice of a stacked factor
    b_rows = torch.randn(n, k, generator=g).to(DEVICE, dtype)  # PEFT's B [out, r]; the product takes B.t()
    return y, a, b_rows


@pytest.mark.parametrize("m, n, k", [(1, 7, 1), (37, 200, 13), (130, 257, 16), (65, 129, 48), (9, 300, 128)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_matches_addmm(m, n, k, dtype):
    y, a, b_rows = _case(m, n, k, dtype)
    alpha = 0.37
    truth = y.double() + alpha * (a.double() @ b_rows.double().t())
    torch_path = y.clone().addmm_(a, b_rows.t(), alpha=alpha)
    ours = y  # the strided view itself: the kernel must honour y's row stride
    assert ours.stride(0) != ours.shape[1]
    addmm_small_k_(ours, a, b_rows.t(), alpha=alpha)
    if dtype == torch.float32:
        assert_close_fp32(ours.double(), truth, f"fp32 {m}x{n}x{k}")
    else:
        assert_bf16_within_torch_bound(ours, torch_path, truth.float(), f"bf16 {m}x{n}x{k}")


def test_updates_in_place_through_a_strided_view():
    y, a, b_rows = _case(5, 40, 8, torch.float32)
    base = y._base
    before = base.clone()
    expected = y.clone().addmm_(a, b_rows.t())
    out = addmm_small_k_(y, a, b_rows.t())
    assert out is y
    assert_close_fp32(base[:, :40], expected, "the view's values")
    assert torch.equal(base[:, 40:], before[:, 40:]), "columns outside the view are untouched"


def test_falls_back_to_torch_outside_its_shapes():
    y, a, b_rows = _case(6, 20, MAX_SMALL_K + 1, torch.float32)
    expected = y.clone().addmm_(a, b_rows.t())
    addmm_small_k_(y, a, b_rows.t())
    torch.testing.assert_close(y, expected)
    y, a, b_rows = _case(6, 20, 8, torch.float32)
    with pytest.raises(RuntimeError):  # torch's own error for mismatched dtypes, not a kernel fault
        addmm_small_k_(y, a.double(), b_rows.t())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("n, k", [(14336, 16), (4096, 48), (1024, 16)])
def test_gpu_8b_shapes_in_bf16(n, k):
    y, a, b_rows = _case(16384, n, k, torch.bfloat16)
    truth = y.double() + 0.5 * (a.double() @ b_rows.double().t())
    torch_path = y.clone().addmm_(a, b_rows.t(), alpha=0.5)
    ours = y
    addmm_small_k_(ours, a, b_rows.t(), alpha=0.5)
    assert_bf16_within_torch_bound(ours, torch_path, truth.float(), f"bf16 16384x{n}x{k}")


def test_host_side_grid_helpers_agree_with_tritons():
    import triton

    from strop.kernels.ops.utils import cdiv, next_power_of_2

    for a in (0, 1, 2, 3, 7, 8, 9, 127, 128, 129, 16384, 16385, 131072 * 4096 + 3):
        assert next_power_of_2(a) == triton.next_power_of_2(a), a
        for b in (1, 2, 3, 16, 64, 128, 4096):
            assert cdiv(a, b) == triton.cdiv(a, b), (a, b)
