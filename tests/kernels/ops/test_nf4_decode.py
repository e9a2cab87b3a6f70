"""``nf4_lora_decode`` (kernels/ops/nf4_decode.py) against bitsandbytes' dequantized weight and its torch reference.

Bound: fp32 throughout (the interpreter's dots are fp32), K = 256 products per output of values |x·w| ≲ 3, so the
summation-order difference is at most K·2^-24·Σ|x·w| ≈ 256 · 6e-8 · 256·3 ≈ 1.2e-2 in the worst case and ~1e-5
typically; 1e-3 absolute is far below the outputs' spread (|y| up to ~70).
"""

from __future__ import annotations

import pytest
import torch

from strop.kernels.ops.nf4_decode import NF4DecodeWeight, nf4_lora_decode, nf4_lora_decode_reference


def _weight(n: int, k: int, nested: bool, blocksize: int = 64):
    import bitsandbytes.functional as F

    w = torch.randn(n, k)
    packed, qs = F.quantize_4bit(w, blocksize=blocksize, compress_statistics=nested, quant_type="nf4")
    p = torch.nn.Parameter(packed, requires_grad=False)
    p.quant_state = qs
    return p, F.dequantize_4bit(packed, qs)


@pytest.mark.parametrize("nested", [True, False])
@pytest.mark.parametrize("rows", [1, 5, 33])
def test_nf4_lora_decode_equals_dequantize_then_matmul(nested, rows):
    """y = x·Wᵀ + s·(x·Aᵀ)·Bᵀ + b with W bitsandbytes' own dequantization; N = 80 is not a multiple of the
    kernel's 32-feature tile, so the edge is masked."""
    torch.manual_seed(0)
    p, dense = _weight(80, 256, nested)
    w = NF4DecodeWeight(p)
    x, a, b, bias = torch.randn(rows, 256), torch.randn(4, 256), torch.randn(80, 4), torch.randn(80)
    xa = x @ a.T
    y = nf4_lora_decode(x, w, xa, b, 0.5, bias)
    expected = x @ dense.T + 0.5 * (xa @ b.T) + bias
    assert torch.allclose(y, expected, atol=1e-3, rtol=0)
    assert torch.allclose(nf4_lora_decode_reference(x, w, xa, b, 0.5, bias), expected, atol=1e-3, rtol=0)
    assert torch.allclose(nf4_lora_decode(x[None], w), (x @ dense.T)[None], atol=1e-3, rtol=0)  # no LoRA, 3-D


def test_nf4_lora_decode_refuses_what_it_cannot_compute():
    p, _ = _weight(32, 96, True, blocksize=64)  # 96 is not whole 64-blocks per row
    with pytest.raises(ValueError, match="not whole NF4 blocks"):
        NF4DecodeWeight(p)
    w = NF4DecodeWeight(_weight(32, 128, True)[0])
    with pytest.raises(ValueError, match="rows"):
        nf4_lora_decode(torch.randn(129, 128), w)
