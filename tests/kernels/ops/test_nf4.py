"""NF4 dequantization: bit-exact with bitsandbytes on odd shapes, with and without double quantization.

bitsandbytes' reference semantics are its CUDA kernel's, which its pure-torch backend
(``backends/default/ops._dequantize_4bit_compute``) reproduces: blocks run over the flattened weight.
Its native CPU kernel (what ``dequantize_4bit`` dispatches to here) blocks per row, so it agrees only
when the row length is a multiple of the blocksize; the public API is compared on such shapes, the
pure-torch backend on every shape.
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.deps import locked

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

bnb = locked("bitsandbytes")
bnb_functional = locked("bitsandbytes.functional")

from strop.kernels.ops.nf4 import (  # noqa: E402
    dequantize_shared,
    dequantize_shared_stacked,
    dequantize_weight,
    nf4_dequantize,
    nf4_dequantize_reference,
)

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _quantize(shape, dtype, blocksize, nested, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(shape, generator=gen).to(dtype).to(device)
    packed, state = bnb_functional.quantize_4bit(
        w, blocksize=blocksize, quant_type="nf4", compress_statistics=nested
    )
    return w, packed, state


def _bnb_flat_dequantize(packed, state, dtype):
    """bitsandbytes' own pure-torch NF4 dequantization (its CUDA kernel's semantics), then ``.to(dtype)``."""
    from bitsandbytes.backends.default.ops import _dequantize_4bit_compute

    absmax = state.absmax
    if state.nested:
        absmax = bnb_functional.dequantize_blockwise(state.absmax, state.state2) + state.offset
    code = bnb_functional.get_4bit_type("nf4", device=packed.device)
    # __wrapped__: the uncompiled function (bitsandbytes wraps it in torch.compile).
    compute = getattr(_dequantize_4bit_compute, "__wrapped__", _dequantize_4bit_compute)
    out = compute(packed.reshape(-1), absmax, code, state.blocksize, state.shape, state.dtype)
    return out.to(dtype)


# Odd shapes: rows that are multiples of nothing, totals that are not multiples of the blocksize, odd
# totals (the last byte holds one value), a single element row.
ODD_SHAPES = [(67, 96), (96, 67), (200, 67), (1, 7), (5, 3), (3, 1)]


@pytest.mark.parametrize("shape", ODD_SHAPES)
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "double_quant"])
@pytest.mark.parametrize("quant_dtype", FLOATS, ids=str)
def test_kernel_is_bit_exact_with_bitsandbytes_on_odd_shapes(shape, nested, quant_dtype):
    for blocksize in (64, 256):
        _, packed, state = _quantize(shape, quant_dtype, blocksize, nested)
        for out_dtype in FLOATS:
            expected = _bnb_flat_dequantize(packed, state, out_dtype)
            got = nf4_dequantize(packed, state, dtype=out_dtype)
            assert got.shape == expected.shape == torch.Size(shape)
            assert got.dtype == out_dtype
            # Bit-exact: same fp32 product, same round-to-nearest-even casts, same double-quant roundings.
            assert torch.equal(got, expected), (blocksize, out_dtype)


@pytest.mark.parametrize("shape", [(67, 128), (200, 64), (3, 256)])
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "double_quant"])
def test_kernel_equals_public_dequantize_4bit_where_rows_are_whole_blocks(shape, nested):
    _, packed, state = _quantize(shape, torch.bfloat16, 64, nested)
    expected = bnb_functional.dequantize_4bit(packed, state)
    assert torch.equal(nf4_dequantize(packed, state), expected)
    assert torch.equal(nf4_dequantize_reference(packed, state), expected)


def test_dequantization_is_close_to_the_weight_it_quantized():
    # Guards against a kernel and a reference that agree on something wrong: rounding to the nearest
    # code costs at most half the table's largest gap (1 − 0.696 = 0.304) times the block's absmax, and
    # the 8-bit double quantization of absmax adds well under 1 % of it.
    w, packed, state = _quantize((67, 96), torch.float32, 64, nested=True)
    got = nf4_dequantize(packed, state)
    flat = w.reshape(-1)
    absmax = torch.nn.functional.pad(flat, (0, (-flat.numel()) % 64)).view(-1, 64).abs().amax(1)
    code = bnb_functional.get_4bit_type("nf4", device="cpu")
    half_gap = (code[1:] - code[:-1]).max() / 2
    bound = (half_gap + 0.01) * absmax.repeat_interleave(64)[: flat.numel()]
    err = (got.reshape(-1) - flat).abs()
    assert bool((err <= bound).all()), (err / bound).max()


def test_out_buffer_is_filled_in_place_and_returned_as_a_view():
    _, packed, state = _quantize((67, 96), torch.bfloat16, 64, nested=True)
    buf = torch.full((67 * 96 + 100,), float("nan"), dtype=torch.bfloat16)
    got = nf4_dequantize(packed, state, out=buf[: 67 * 96])
    assert got.data_ptr() == buf.data_ptr() and got.shape == (67, 96)
    assert torch.equal(got, _bnb_flat_dequantize(packed, state, torch.bfloat16))
    assert torch.isnan(buf[67 * 96 :]).all()  # nothing written past the weight


def test_dequantize_shared_reuses_one_buffer_per_device_and_dtype():
    _, p1, s1 = _quantize((64, 64), torch.float32, 64, nested=True, seed=1)
    _, p2, s2 = _quantize((32, 64), torch.float32, 64, nested=True, seed=2)
    param1 = bnb.nn.Params4bit(p1, requires_grad=False, quant_state=s1, quant_type="nf4", bnb_quantized=True)
    param2 = bnb.nn.Params4bit(p2, requires_grad=False, quant_state=s2, quant_type="nf4", bnb_quantized=True)
    a = dequantize_shared(param1, torch.float32)
    expected_a = nf4_dequantize_reference(p1, s1)
    assert torch.equal(a, expected_a)
    b = dequantize_shared(param2, torch.float32)
    assert b.data_ptr() == a.data_ptr()  # the smaller weight lands in the same scratch storage
    assert torch.equal(b, nf4_dequantize_reference(p2, s2))


def test_params4bit_is_dequantized_without_its_python_torch_function(monkeypatch):
    """Params4bit's __torch_function__ (Python, on every tensor method or property read) is never entered by the NF4
    entry points, which read the packed weight as the plain tensor it is for every op they call; the values are the
    reference's bit for bit."""
    _, p1, s1 = _quantize((64, 64), torch.bfloat16, 64, nested=True, seed=1)
    _, p2, s2 = _quantize((32, 64), torch.bfloat16, 64, nested=True, seed=2)
    params = [
        bnb.nn.Params4bit(p, requires_grad=False, quant_state=s, quant_type="nf4", bnb_quantized=True)
        for p, s in ((p1, s1), (p2, s2))
    ]
    assert params[0].numel() == p1.numel()  # the override runs on a plain read outside these functions
    entered, real = [0], bnb.nn.Params4bit.__torch_function__.__func__

    def counting(cls, *args, **kwargs):
        entered[0] += 1
        return real(cls, *args, **kwargs)

    monkeypatch.setattr(bnb.nn.Params4bit, "__torch_function__", classmethod(counting))
    assert params[0].numel() == p1.numel() and entered == [1]  # counted where it runs
    entered[0] = 0
    one = dequantize_shared(params[1], torch.bfloat16).clone()
    direct = nf4_dequantize(params[0], s1, dtype=torch.bfloat16)
    both = dequantize_shared_stacked(tuple(params), torch.bfloat16)
    assert entered == [0]
    assert torch.equal(one, nf4_dequantize_reference(p2, s2, torch.bfloat16))
    assert torch.equal(direct, nf4_dequantize_reference(p1, s1, torch.bfloat16))
    assert torch.equal(both, torch.cat([direct, one]))


def test_dequantize_weight_accepts_linear4bit_params4bit_and_plain_tensors():
    torch.manual_seed(0)
    lin = bnb.nn.Linear4bit(64, 48, bias=False, quant_type="nf4", compress_statistics=True).to("cpu")
    expected = nf4_dequantize_reference(lin.weight, lin.weight.quant_state)
    assert torch.equal(dequantize_weight(lin), expected)
    assert torch.equal(dequantize_weight(lin.weight, dtype=torch.bfloat16), expected.to(torch.bfloat16))
    dense = torch.randn(4, 5)
    assert dequantize_weight(dense) is dense  # returned as is
    assert dequantize_weight(torch.nn.Linear(5, 4)).shape == (4, 5)


def test_invalid_inputs_raise_real_exceptions():
    _, packed, state = _quantize((8, 64), torch.float32, 64, nested=False)
    with pytest.raises(TypeError, match="out has dtype"):
        nf4_dequantize(packed, state, out=torch.empty(8 * 64, dtype=torch.float16))
    with pytest.raises(ValueError, match="contiguous with 512"):
        nf4_dequantize(packed, state, out=torch.empty(100))
    fp4_packed, fp4_state = bnb_functional.quantize_4bit(torch.randn(8, 64), quant_type="fp4")
    with pytest.raises(ValueError, match="only NF4"):
        nf4_dequantize(fp4_packed, fp4_state)
    with pytest.raises(TypeError, match="only NF4"):
        dequantize_weight(bnb.nn.Params4bit(fp4_packed, quant_state=fp4_state, bnb_quantized=True))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "double_quant"])
def test_kernel_is_bit_exact_with_bitsandbytes_cuda_at_8b_shapes(nested):
    for shape in ((14336, 4096), (4096, 14336), (1024, 4096)):
        _, packed, state = _quantize(shape, torch.bfloat16, 64, nested, device="cuda")
        expected = bnb_functional.dequantize_4bit(packed, state)
        assert torch.equal(nf4_dequantize(packed, state), expected)
        assert torch.equal(nf4_dequantize(packed, state, dtype=torch.float32), expected.float())


def _dequant_checked(packed, state, out, replays: list, expect_replays: int) -> None:
    before = len(replays)
    got = nf4_dequantize(packed, state, out=out)
    assert len(replays) == before + expect_replays
    assert torch.equal(got, _bnb_flat_dequantize(packed, state, torch.bfloat16))


def _bound_entries(state) -> dict:
    from strop.kernels.ops import nf4

    entry = nf4._BOUND.get(id(state))
    return {} if entry is None or entry[0]() is not state else entry[1]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "double_quant"])
def test_bound_launches_stay_bit_exact_and_follow_the_weight(nested, monkeypatch):
    """A weight's later dequantizations into a buffer replay the first launch's compiled kernel (``BoundLaunch``):
    the same bits as bitsandbytes on every call, at an unaligned output (its own launch), on a side stream (whose
    queued wait a launch on another stream would overtake), after the packed data changed in place (the launch
    reads it), after the quant state's absmax was replaced (bound anew); a wrong output dtype still raises; the
    binding goes with the quant state."""
    import gc

    from strop.kernels.ops import nf4, utils

    assert nf4.BIND_LAUNCHES
    replays = []
    real_call = utils.BoundLaunch.__call__
    monkeypatch.setattr(
        utils.BoundLaunch, "__call__", lambda self, t, device: (replays.append(1), real_call(self, t, device))
    )
    for shape, bs in (((67, 96), 64), ((1024, 4096), 64), ((5, 3), 256)):
        _, packed, state = _quantize(shape, torch.bfloat16, bs, nested, device="cuda")
        n = shape[0] * shape[1]
        buf = torch.empty(n + 8, dtype=torch.bfloat16, device="cuda")

        _dequant_checked(packed, state, buf[:n], replays, 0)
        _dequant_checked(packed, state, buf[:n], replays, 1)
        _dequant_checked(packed, state, buf[:n], replays, 1)
        assert len(_bound_entries(state)) == 1
        _dequant_checked(
            packed, state, buf[1 : n + 1], replays, 0
        )  # 2 bytes off: not 16-byte aligned, a launch of its own
        _dequant_checked(packed, state, buf[1 : n + 1], replays, 1)
        assert len(_bound_entries(state)) == 2
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)  # ~tens of ms of queued work ahead of the zeroing and the launch
            got = nf4_dequantize(packed, state, out=buf[:n].zero_()).clone()
        side.synchronize()
        assert torch.equal(got, _bnb_flat_dequantize(packed, state, torch.bfloat16))
        with pytest.raises(TypeError, match="dtype"):
            nf4_dequantize(
                packed, state, out=torch.empty(n, dtype=torch.float16, device="cuda"), dtype=torch.bfloat16
            )
        _, other, _ = _quantize(shape, torch.bfloat16, bs, nested, device="cuda", seed=1)
        packed.copy_(other)
        _dequant_checked(packed, state, buf[:n], replays, 1)
        if nested:
            state.state2.absmax = state.state2.absmax * 2
        else:
            state.absmax = state.absmax * 2
        _dequant_checked(packed, state, buf[:n], replays, 0)
        _dequant_checked(packed, state, buf[:n], replays, 1)
        key = id(state)
        del state
        gc.collect()
        assert key not in nf4._BOUND


def test_a_binding_holds_while_its_quant_state_is_unchanged(monkeypatch):
    """The bookkeeping of bound launches, on any device (the launch itself runs on CUDA only: the GPU test above):
    a binding is found for the same weight and output; not after any quant-state attribute it came from is
    reassigned or given other storage, or the packed data moved, nor for an output of another dtype or size; a
    rebinding drops what no longer holds; the bindings go with their quant state."""
    import gc

    from strop.kernels.ops import nf4

    monkeypatch.setattr(
        nf4,
        "_launch_key",
        lambda p, o, d: (p.data_ptr(), p.numel(), d, o.data_ptr() % 16 == 0, o.get_device()),
    )
    _, packed, state = _quantize((64, 64), torch.bfloat16, 64, True)
    out = torch.empty(64 * 64, dtype=torch.bfloat16)
    launch = object()

    def bind(p, st):
        nf4._bind(p, st, nf4._sources(st), out, torch.bfloat16, launch, (64, 64))

    bind(packed, state)
    assert nf4._bound_launch(packed, state, out, torch.bfloat16) == (launch, (64, 64), -1)  # -1: the CPU
    assert nf4._bound_launch(packed, state, out.half(), torch.bfloat16) is None
    assert nf4._bound_launch(packed, state, out[: 64 * 32], torch.bfloat16) is None
    state.state2.code = state.state2.code.clone()
    assert nf4._bound_launch(packed, state, out, torch.bfloat16) is None
    bind(packed, state)
    assert nf4._bound_launch(packed, state, out, torch.bfloat16) == (launch, (64, 64), -1)  # -1: the CPU
    state.absmax.data = state.absmax.data.clone()  # the same object, other storage
    assert nf4._bound_launch(packed, state, out, torch.bfloat16) is None
    bind(packed, state)
    state.offset.add_(0)  # changed in place: a launch that copied it would read the old value
    assert nf4._bound_launch(packed, state, out, torch.bfloat16) is None
    bind(packed, state)
    moved = packed.clone()
    assert nf4._bound_launch(moved, state, out, torch.bfloat16) is None
    bind(moved, state)
    assert len(_bound_entries(state)) == 1  # the old data's binding dropped
    key = id(state)
    del state
    gc.collect()
    assert key not in nf4._BOUND
