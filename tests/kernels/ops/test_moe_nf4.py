"""NF4 experts in the grouped LoRA GEMM (``kernels/ops/moe_gemm.py``): the stack's storage, and the GEMM that
dequantizes it (``nf4_dequantize``, into the shared scratch buffer) before torch's grouped GEMM, against the 16-bit
path run on the dequantized stack.

CPU tier under the interpreter, odd shapes as ``test_moe_gemm.py`` (experts holding 5, 0 and 37 rows, N 24, rank
4; K 64 so each expert's N·K is whole NF4 blocks). The NF4 path runs the 16-bit path's GEMMs on the values
``nf4_dequantize`` gives, so on the same inputs both give equal tensors: the exact comparison is the bound (a wrong
nibble, block or absmax moves a weight by ≥ one NF4 step, ~0.08 of its block's absmax). Against the fp32
per-expert definition the bound is the 16-bit test's, fp32 rounding.

GPU tier (``pytest -m gpu``): bf16 rows on a Qwen3-30B-A3B expert shape, the NF4 path equal to the 16-bit path over
the dequantized stack (y, dx, dA, dB), and DESIGN's bf16 rule against the fp32 definition.
"""

from __future__ import annotations

import pytest
import torch

from tests.deps import locked
from tests.kernels._tolerances import assert_bf16_within_torch_bound, assert_close_fp32, cpu_tier

bnb_functional = locked("bitsandbytes.functional")


def _inputs(counts=(5, 0, 37), k=64, n=24, r=4, seed=0, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    e = len(counts)
    offsets = torch.tensor([0, *torch.tensor(counts).cumsum(0).tolist()], dtype=torch.int64)
    x = torch.randn(int(offsets[-1]), k, generator=gen)
    w = torch.randn(e, n, k, generator=gen) / k**0.5
    a = torch.randn(e, r, k, generator=gen) / k**0.5
    b = torch.randn(e, n, r, generator=gen) / r**0.5
    return (t.to(device) for t in (x, offsets, w, a, b))


def _run(x, offsets, w, a, b, scale, dy):
    from strop.kernels.ops.moe_gemm import moe_lora_gemm

    xs, as_, bs = (t.clone().requires_grad_() for t in (x, a, b))
    y = moe_lora_gemm(xs, offsets, w, as_, bs, scale)
    y.backward(dy)
    return y.detach(), xs.grad, as_.grad, bs.grad


@cpu_tier
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["from-fp32", "from-bf16"])
def test_nf4_experts_hold_bitsandbytes_codes_per_expert(dtype):
    """Each expert's 4-bit codes are the ones bitsandbytes gives that expert's [N, K] alone (its blocks never
    straddle experts), and the stack dequantizes as bitsandbytes' own dequantize_4bit."""
    from strop.kernels.ops.moe_gemm import Nf4Experts

    _, _, w, _, _ = _inputs()
    w = w.to(dtype)
    q = Nf4Experts.quantize(w)
    assert q.nested and q.packed.dtype == torch.uint8 and q.absmax.dtype == torch.uint8
    per = w.shape[1] * w.shape[2] // 2
    for e in range(w.shape[0]):
        packed_e, _ = bnb_functional.quantize_4bit(w[e].reshape(1, -1), blocksize=64, quant_type="nf4")
        assert torch.equal(q.packed[e * per : (e + 1) * per], packed_e.reshape(-1)), f"expert {e}'s codes"
    packed, qs = bnb_functional.quantize_4bit(
        w.reshape(w.shape[0], -1), blocksize=64, compress_statistics=True, quant_type="nf4"
    )
    expected = bnb_functional.dequantize_4bit(packed, qs).reshape(w.shape)
    assert torch.equal(q.dequantize(), expected), "the stack is bitsandbytes' NF4 of the whole stack"
    assert q.dequantize().dtype == dtype


@cpu_tier
@pytest.mark.parity
@pytest.mark.parametrize(
    "dtype,double_quant",
    [(torch.float32, True), (torch.bfloat16, True), (torch.float32, False)],
    ids=["fp32-double-quant", "bf16-double-quant", "fp32-fp32-absmax"],
)
def test_the_nf4_grouped_gemm_equals_the_16_bit_path_on_the_dequantized_stack(dtype, double_quant):
    from strop.kernels.ops.moe_gemm import Nf4Experts, moe_lora_gemm_reference

    x, offsets, w, a, b = _inputs()
    q = Nf4Experts.quantize(w.to(dtype), double_quant=double_quant)
    dense = q.dequantize(torch.float32)
    assert (dense - w).abs().max() > 1e-3, "NF4 moved the weights: the comparison sees the quantized ones"
    dy = torch.randn(x.shape[0], w.shape[1], generator=torch.Generator().manual_seed(1))
    ours = _run(x, offsets, q, a, b, 2.0, dy)
    dense_path = _run(x, offsets, dense, a, b, 2.0, dy)
    for name, got, want in zip(("y", "dx", "dA", "dB"), ours, dense_path, strict=True):
        assert torch.equal(got, want), f"{name}: the NF4 tiles are not the dequantized stack's values"
    xr, ar, br = (t.clone().requires_grad_() for t in (x, a, b))
    ref = moe_lora_gemm_reference(xr, offsets, q, ar, br, 2.0)
    ref.backward(dy)
    for name, got, want in zip(("y", "dx", "dA", "dB"), ours, (ref, xr.grad, ar.grad, br.grad), strict=True):
        assert_close_fp32(got, want.detach(), name)
    assert not ours[2][1].any() and not ours[3][1].any(), "an expert with no rows gets zero gradients"


@cpu_tier
def test_the_backward_reuses_the_stack_its_forward_left_in_the_shared_buffer_and_only_that(monkeypatch):
    """The backward's ``dy · (W_e + s B_e A_e)`` reads the forward's merged stack where the shared buffer still holds
    it, and merges again once anything else has taken the buffer or the codes or factors changed; a forward always
    merges (a change of the factors through .data would not show in their version counters); same gradients."""
    from strop.kernels.ops import moe_gemm, nf4
    from strop.kernels.ops.moe_gemm import Nf4Experts, moe_lora_gemm

    x, offsets, w, a, b = _inputs()
    q = Nf4Experts.quantize(w)
    calls = []
    real = moe_gemm._merge_into
    monkeypatch.setattr(moe_gemm, "_merge_into", lambda out, w, *rest: calls.append(w) or real(out, w, *rest))
    dy = torch.randn(x.shape[0], w.shape[1], generator=torch.Generator().manual_seed(1))
    want = _run(x, offsets, q.dequantize(torch.float32), a, b, 2.0, dy)
    calls.clear()
    assert torch.equal(_run(x, offsets, q, a, b, 2.0, dy)[1], want[1])
    assert len(calls) == 1, "the backward merged the stack its forward had just left in the buffer"

    def forward_then(between):
        """dx, and which stacks the forward and the backward merged."""
        xs = x.clone().requires_grad_()
        calls.clear()
        y = moe_lora_gemm(xs, offsets, q, a, b, 2.0)
        merged_fwd = [c is q for c in calls]
        between()
        calls.clear()
        y.backward(dy)
        return xs.grad, merged_fwd, [c is q for c in calls]

    n = w.numel()
    other, oa, ob = Nf4Experts.quantize(torch.randn(2, 8, 64)), torch.randn(2, 4, 64), torch.randn(2, 8, 4)
    takers = {  # another stack merged, any other writer of the buffer (overwriting it), the codes modified
        "another stack": lambda: moe_gemm._merged(other, oa, ob, oa, ob, 1.0, torch.float32),
        "another writer": lambda: nf4._shared_buffer(x.device, torch.float32, n)[:n].fill_(0),
        "codes changed": lambda: q.packed.add_(0),
    }
    for what, between in takers.items():
        dx, merged_fwd, merged_bwd = forward_then(between)
        assert merged_fwd == [True], f"{what}: a forward merges, whatever the buffer holds"
        assert torch.equal(dx, want[1]), f"{what}: dx"
        assert merged_bwd == [True], f"{what}: the backward must merge the stack again"
    b.add_(0)  # the factors changed (an optimizer step's in-place update; same values here)
    dx, merged_fwd, merged_bwd = forward_then(lambda: None)
    assert torch.equal(dx, want[1]) and merged_fwd == [True] and merged_bwd == [], (
        "changed factors: merged again"
    )


@cpu_tier
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("double_quant", [True, False], ids=["double-quant", "fp32-absmax"])
@pytest.mark.parametrize("k", [192, 96], ids=["rows-of-whole-blocks", "blocks-across-rows"])
@pytest.mark.parametrize("pairs", [False, True], ids=["code-book", "code-pairs"])
@pytest.mark.parametrize("k_tiles", [1, 4], ids=["a-tile-a-program", "tiles-looped"])
def test_the_merge_kernel_dequantizes_as_nf4_dequantize_and_adds_the_low_rank_product(
    dtype, double_quant, k, pairs, k_tiles, monkeypatch
):
    """The merged stack's W part is ``nf4_dequantize``'s values bit for bit (zero factors: nothing added), and with
    factors it is W + s·B_e A_e of the compute-dtype factors, in fp32 to its rounding (bf16: rounded once, so within
    half an ulp of the fp32 sum: 2⁻⁸ relative, the sum itself the reference's within the fp32 rounding of its r + 1
    terms, which a cancellation can make larger). N 40 and K 192: a partial tile in both, rows of 1.5 K-tiles, each
    of whole NF4 blocks (their scales read once a row); K 96: blocks of 64 straddle rows (scales read a byte). Both
    ways of reading a byte's codes, and a program's one tile or several looped along K (four tiles of 64: the last
    ones past K, masked; the interpreter runs the first tile: here the one of that lookup and loop)."""
    from strop.kernels.ops import moe_gemm

    tiles = [t for t in moe_gemm._MERGE_TILES if t[3] == pairs and t[4] == k_tiles]
    monkeypatch.setattr(moe_gemm, "_MERGE_TILES", (tiles[0],))
    _check_merge((3, 40, k), 4, dtype, double_quant, "cpu")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_merge_kernel_on_cuda_dequantizes_as_nf4_dequantize_and_adds_the_low_rank_product():
    """The autotuned merge on CUDA, Qwen3-30B-A3B's gate/up and down shapes (8 experts), rank 16, bf16: the
    CPU test's checks (the W part bit for bit, the merged stack within 2⁻⁸, the 16-bit stack's merge equal), for
    the tile the autotuner keeps and then for every tile it may keep, each launched alone (both ways of reading
    the codes; the NF4 checks: the autotuner compiled these, the 16-bit stack's variants it did not)."""
    from strop.kernels.ops import moe_gemm

    for n, k in ((2 * 768, 2048), (2048, 768)):
        _check_merge((8, n, k), 16, torch.bfloat16, True, "cuda")
        key = next(key for key in moe_gemm._MERGE_TILE if key[1:3] == (n, k))
        for entry in moe_gemm._MERGE_TILES:
            tile = moe_gemm.merge_tile_kwargs(entry)
            with pytest.MonkeyPatch.context() as mp:
                mp.setitem(moe_gemm._MERGE_TILE, key, tile)
                _check_merge(
                    (8, n, k), 16, torch.bfloat16, True, "cuda", dense=False, label=f"{(n, k)} {tile}: "
                )


def _check_merge(shape, r, dtype, double_quant, device, *, dense=True, label=""):
    from strop.kernels.ops.moe_gemm import Nf4Experts, _merge_into

    gen = torch.Generator().manual_seed(5)
    e, n, k = shape
    w = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    a = torch.randn(e, r, k, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(e, n, r, generator=gen).to(device=device, dtype=dtype)
    q = Nf4Experts.quantize(w, double_quant=double_quant)
    out = torch.empty(w.numel(), dtype=dtype, device=device)
    _merge_into(out, q, a, torch.zeros_like(b), 0.5)
    assert torch.equal(out.view(w.shape), q.dequantize(dtype)), (
        label + "the merge kernel's dequantized values"
    )
    _merge_into(out, q, a, b, 0.5)
    want = q.dequantize(dtype).float().baddbmm(b.float(), a.float(), alpha=0.5)
    if dtype == torch.float32:
        assert_close_fp32(out.view(w.shape), want, label + "merged stack")
    else:  # rounded once: half an ulp of the fp32 sum, which is the reference sum within r + 1 terms' fp32 rounding
        terms = q.dequantize(dtype).float().abs().baddbmm(b.float().abs(), a.float().abs(), alpha=0.5)
        bound = 2**-8 * want.abs() + 2 * (r + 1) * 2**-24 * terms  # both sums rounded in fp32
        assert ((out.view(w.shape).float() - want).abs() <= bound).all(), label + "merged stack"
    if dense:
        merged16 = torch.empty_like(out)
        _merge_into(merged16, q.dequantize(dtype), a, b, 0.5)
        assert torch.equal(merged16, out), (
            "a 16-bit stack merges to the same values as its NF4 codes dequantized"
        )


@cpu_tier
def test_a_stack_whose_experts_are_not_whole_nf4_blocks_is_refused():
    from strop.kernels.ops.moe_gemm import Nf4Experts

    with pytest.raises(ValueError, match="multiple of 64"):
        Nf4Experts.quantize(torch.randn(2, 5, 9))


def _per_expert(x, offsets, w, a, b, scale):
    """The definition in the inputs' dtype (torch's own bf16 GEMMs when they are bf16)."""
    out = []
    for e in range(w.shape[0]):
        xe = x[int(offsets[e]) : int(offsets[e + 1])]
        out.append(xe @ w[e].T + scale * (xe @ a[e].T) @ b[e].T)
    return torch.cat(out)


def _grads(offsets, w, inputs, dy):
    leaves = [t.clone().requires_grad_() for t in inputs]
    y = _per_expert(leaves[0], offsets, w, leaves[1], leaves[2], 2.0)
    y.backward(dy)
    return (y.detach(), *(t.grad for t in leaves))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_nf4_grouped_gemm_on_cuda_is_within_the_bf16_rule():
    """Qwen3-30B-A3B's expert shapes (H 2048, I 768), 8 experts of uneven load (one empty), bf16 rows,
    bf16-quantized stack: y, dx, dA and dB equal the 16-bit path's over the dequantized stack bit for bit (the same
    grouped GEMMs on the same values), and all four are within DESIGN's bf16 rule of the fp32 definition."""
    from strop.kernels.ops.moe_gemm import Nf4Experts

    counts = (300, 0, 17, 1024, 64, 129, 700, 1)
    for k, n in ((2048, 2 * 768), (768, 2048)):
        x, offsets, w, a, b = _inputs(counts, k=k, n=n, r=16, seed=k, device="cuda")
        q = Nf4Experts.quantize(w.to(torch.bfloat16))
        dense = q.dequantize(torch.bfloat16)
        dy = torch.randn(x.shape[0], n, device="cuda").bfloat16()
        xb, ab, bb = x.bfloat16(), a.bfloat16(), b.bfloat16()
        ours = _run(xb, offsets, q, ab, bb, 2.0, dy)
        dense_path = _run(xb, offsets, dense, ab, bb, 2.0, dy)
        for name, got, want in zip(("y", "dx", "dA", "dB"), ours, dense_path, strict=True):
            assert torch.equal(got, want), (
                f"K={k} {name}: the NF4 tiles are not the dequantized stack's values"
            )
        truth = _grads(offsets, dense.float(), (xb.float(), ab.float(), bb.float()), dy.float())
        torch_bf16 = _grads(offsets, dense, (xb, ab, bb), dy)
        for name, got, tb, tr in zip(("y", "dx", "dA", "dB"), ours, torch_bf16, truth, strict=True):
            assert_bf16_within_torch_bound(got, tb, tr, f"K={k} {name}")
