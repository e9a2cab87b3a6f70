"""LoRA linear / QKV / MLP autograd functions against plain-torch references, dense and NF4 bases.

Method: the backward formulas of ``kernels/lora_mlp.py``'s docstring are written out in torch and checked
against autograd on the reference forward; then every Function's forward and gradients are checked
against autograd on the reference, on odd shapes (in/out 67, 96, 200; r 1 and 8; a single row; 3-D
inputs), in fp32 and bf16.

Tolerances. Every value is compared with the reference computed in fp64 on the same inputs (the NF4
base dequantized, bf16 inputs exactly upcast), by relative error in Frobenius norm. fp32: at most
1e-5, or twice the error of the same reference run in fp32 where that is larger — a dot product that
nearly cancels (one row, r = 1) loses digits in any fp32 summation order, ours or torch's. bf16: at
most twice the error of torch's own bf16 path (HF + PEFT under bf16 autocast: every linear, product
and sum in bf16), that error floored at 2⁻⁹ (half bf16's unit roundoff, about one typical rounding).
The bf16 cases use 15 rows and r = 8: a gradient set by a few rounded scalars (one row, r = 1) carries
the error of one or two random roundings on either side, whose ratio says nothing about either path,
so single rows and r = 1 are checked in fp32.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from tests.deps import locked

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

from strop.kernels.lora.linear import (
    LoRAProj,
    as_proj,
    factors_of,
    lora_linear,
    lora_linear_reference,
    lora_qkv,
    no_autocast,
)
from strop.kernels.lora.mlp import lora_mlp, lora_mlp_reference
from strop.kernels.ops.nf4 import dequantize_weight

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP32_FLOOR = 0.5e-5  # bound = 2 × max(torch's fp32 error, this) ≥ 1e-5
BF16_FLOOR = 2.0**-9


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


def _rel(a: torch.Tensor, ref: torch.Tensor) -> float:
    a, ref = a.detach().double(), ref.detach().double()
    return float((a - ref).norm() / ref.norm().clamp_min(1e-30))


def _nf4(w: torch.Tensor) -> torch.Tensor:
    bnb = locked("bitsandbytes")
    return bnb.nn.Params4bit(w.cpu(), requires_grad=False, quant_type="nf4", compress_statistics=True).to(
        w.device
    )


def _proj(out_f, in_f, r, *, dtype, nf4=False, bias=False, seed=0, device=DEVICE):
    """A frozen base (dense in ``dtype`` or NF4 quantized from ``dtype``) with fp32 adapters (as strop)."""
    g = torch.Generator().manual_seed(seed)
    w = (torch.randn(out_f, in_f, generator=g) / in_f**0.5).to(dtype).to(device)
    base = _nf4(w) if nf4 else w
    a = b = None
    if r:
        a = (torch.randn(r, in_f, generator=g) / in_f**0.5).to(device).requires_grad_()
        b = (torch.randn(out_f, r, generator=g) / r**0.5).to(device).requires_grad_()  # non-zero B
    bias_t = torch.randn(out_f, generator=g).to(dtype).to(device) if bias else None
    return (base, a, b, 0.5 + r / 16, bias_t)


def _dense(p):
    """The same projection with the NF4 base dequantized (what the kernels must compute against)."""
    base, a, b, s, bias = p
    return (dequantize_weight(base), a, b, s, bias)


def _copy(p, dtype):
    """A detached copy in ``dtype`` (dense base), adapters requiring grad."""
    base, a, b, s, bias = _dense(p)
    f = lambda t: None if t is None else t.detach().to(dtype).requires_grad_(t.requires_grad)  # noqa: E731
    return (f(base), f(a), f(b), s, f(bias))


def _factors(*projs):
    return [t for p in projs for t in (p[1], p[2]) if t is not None]


def _grads(outs, inputs, douts):
    return list(torch.autograd.grad(outs, inputs, douts))


def _bf16_torch_linear(x, p):
    """torch's own bf16 path for one projection: HF + PEFT under bf16 autocast."""
    base, a, b, s, bias = p
    y = F.linear(x, base.to(torch.bfloat16), None if bias is None else bias.to(torch.bfloat16))
    if a is None:
        return y
    return y + F.linear(F.linear(x, a.to(torch.bfloat16)), b.to(torch.bfloat16)) * s


def _bf16_torch_mlp(x, gate, up, down, activation="swiglu"):
    e, g = _bf16_torch_linear(x, gate), _bf16_torch_linear(x, up)
    approximate = "tanh" if activation == "geglu_tanh" else "none"
    act = F.silu(e) if activation == "swiglu" else F.gelu(e, approximate=approximate)
    return _bf16_torch_linear(act * g, down)


def _as_list(t):
    return list(t) if isinstance(t, (tuple, list)) else [t]


def _compare(outs, x, projs, douts, reference, bf16_path=None, *, x_dtype=None):
    """Check our outputs and the grads of x and every adapter factor against the fp64 reference.

    ``reference(x, *projs)`` is the plain-torch forward; ``bf16_path(x, *projs)`` torch's own bf16 path
    (used when the outputs are bf16). ``x_dtype`` is the dtype the reference sees x in (bf16 under
    autocast, where our functions round x to bf16 first).
    """
    outs, douts = _as_list(outs), _as_list(douts)
    ours = [*outs, *_grads(outs, [x, *_factors(*projs)], douts)]

    def run(dtype):
        pc = [_copy(p, dtype) for p in projs]
        xc = x.detach().to(x_dtype or x.dtype).to(dtype).requires_grad_()
        o = _as_list(reference(xc, *pc))
        return [*o, *_grads(o, [xc, *_factors(*pc)], [d.to(dtype) for d in douts])]

    ref = run(torch.float64)
    if outs[0].dtype == torch.float32:
        torch_path, floor = run(torch.float32), FP32_FLOOR
    else:
        xb = x.detach().to(outs[0].dtype).requires_grad_()
        o = _as_list(bf16_path(xb, *(_dense(p) for p in projs)))
        torch_path, floor = [*o, *_grads(o, [xb, *_factors(*projs)], douts)], BF16_FLOOR
    assert len(ours) == len(ref) == len(torch_path)
    for i, (o, r, t) in enumerate(zip(ours, ref, torch_path, strict=True)):
        bound = 2 * max(_rel(t, r), floor)
        err = _rel(o, r)
        assert err <= bound, f"value {i}: error {err:.3g} > bound {bound:.3g}"


X_SHAPES = {"single_row": (1,), "3d": (3, 5)}


def _linear_reference(x, p):
    return lora_linear_reference(x, *p)


def _cases(**axes):
    """The product of the axes, without bf16 cases on one row or r = 1 (see the module docstring)."""
    keys, rows = list(axes), [()]
    for k in keys:
        rows = [(*c, v) for c in rows for v in axes[k]]

    def keep(row):
        case = dict(zip(keys, row, strict=True))
        return case["dtype"] != torch.bfloat16 or (case["x_shape"] != "single_row" and case.get("r", 8) != 1)

    return pytest.mark.parametrize(",".join(keys), [row for row in rows if keep(row)])


# ---- the derived backward, in torch, against autograd ----------------------------------------------


def _mlp_bwd_derived(dout, x, gate, up, down):
    """The backward formulas of kernels/lora_mlp.py's docstring, written out in torch (SwiGLU)."""
    (wg, ag, bg, sg, _), (wu, au, bu, su, _), (wd, ad, bd, sd, _) = gate, up, down
    e = x @ wg.t() + sg * (x @ ag.t()) @ bg.t()
    g = x @ wu.t() + su * (x @ au.t()) @ bu.t()
    sig = torch.sigmoid(e)
    h = e * sig * g
    g_d = sd * dout @ bd
    dh = dout @ wd + g_d @ ad
    d_bd, d_ad = sd * dout.t() @ (h @ ad.t()), g_d.t() @ h
    de, dg = dh * g * sig * (1 + e * (1 - sig)), dh * e * sig
    g_g, g_u = sg * de @ bg, su * dg @ bu
    dx = de @ wg + dg @ wu + g_g @ ag + g_u @ au
    return [dx, g_g.t() @ x, sg * de.t() @ (x @ ag.t()), g_u.t() @ x, su * dg.t() @ (x @ au.t()), d_ad, d_bd]


def test_derived_mlp_backward_matches_autograd():
    shapes = ((200, 67), (200, 67), (67, 200))
    gate, up, down = (
        _copy(_proj(o, i, 8, dtype=torch.float32, seed=k), torch.float64) for k, (o, i) in enumerate(shapes)
    )
    x = torch.randn(7, 67, device=DEVICE, dtype=torch.float64, requires_grad=True)
    out = lora_mlp_reference(x, gate, up, down)
    dout = torch.randn_like(out)
    auto = _grads(out, [x, *_factors(gate, up, down)], dout)
    derived = _mlp_bwd_derived(dout, x, gate, up, down)
    for i, (d, a) in enumerate(zip(derived, auto, strict=True)):
        assert _rel(d, a) <= 1e-12, i  # fp64, same math: only summation order differs


# ---- lora_linear ------------------------------------------------------------------------------------


@_cases(
    shape=[(67, 96), (96, 200), (200, 67)],
    r=[1, 8],
    x_shape=list(X_SHAPES),
    nf4=[False, True],
    dtype=[torch.float32, torch.bfloat16],
)
def test_lora_linear_forward_and_grads_match_reference(shape, r, x_shape, nf4, dtype):
    in_f, out_f = shape
    p = _proj(out_f, in_f, r, dtype=dtype, nf4=nf4, bias=(r == 8))
    x = torch.randn(*X_SHAPES[x_shape], in_f).to(dtype).to(DEVICE).requires_grad_()
    y = lora_linear(x, *p)
    assert y.shape == (*X_SHAPES[x_shape], out_f) and y.dtype == dtype
    d_a, d_b = _grads(y, [p[1], p[2]], torch.ones_like(y))
    assert d_a.dtype == d_b.dtype == torch.float32  # adapter grads in the adapters' dtype
    y = lora_linear(x, *p)
    _compare(y, x, [p], torch.randn_like(y), _linear_reference, _bf16_torch_linear)


def test_lora_linear_without_adapter_is_the_base_alone():
    p = _proj(96, 67, 0, dtype=torch.float32, bias=True)
    x = torch.randn(4, 67, device=DEVICE, requires_grad=True)
    y = lora_linear(x, p[0], bias=p[4])
    _compare(y, x, [p], torch.randn_like(y), _linear_reference)


def test_adapter_grads_are_computed_when_x_needs_no_grad():
    p = _proj(96, 67, 8, dtype=torch.float32)
    x = torch.randn(5, 67, device=DEVICE)  # e.g. the first layer without input grads
    y = lora_linear(x, *p)
    dy = torch.randn_like(y)
    ours = _grads(y, [p[1], p[2]], dy)
    p64, x64 = _copy(p, torch.float64), x.double()
    ref = _grads(lora_linear_reference(x64, *p64), [p64[1], p64[2]], dy.double())
    for o, r in zip(ours, ref, strict=True):
        assert _rel(o, r) <= 1e-5


def test_autocast_computes_in_the_autocast_dtype_like_peft():
    p = _proj(96, 67, 8, dtype=torch.float32)  # fp32 model and adapters, bf16 autocast
    x = torch.randn(3, 5, 67, device=DEVICE, requires_grad=True)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        y = lora_linear(x, *p)
    assert y.dtype == torch.bfloat16
    (dx,) = _grads(y, [x], torch.ones_like(y))
    assert dx.dtype == torch.float32  # back through the cast to x's dtype
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        y = lora_linear(x, *p)
    _compare(y, x, [p], torch.randn_like(y), _linear_reference, _bf16_torch_linear, x_dtype=torch.bfloat16)


def test_no_autocast_turns_autocast_off_inside_and_back_on_after():
    """The LoRA functions' region without autocast: off inside (an fp32 matmul stays fp32), autocast's own state
    (on, its dtype) back after, also when the region raises; nothing switched where autocast was off."""
    a = torch.randn(4, 4, device=DEVICE)
    with torch.autocast(DEVICE, dtype=torch.bfloat16):
        assert (a @ a).dtype == torch.bfloat16
        with no_autocast(DEVICE):
            assert not torch.is_autocast_enabled(DEVICE) and (a @ a).dtype == torch.float32
        assert torch.is_autocast_enabled(DEVICE) and torch.get_autocast_dtype(DEVICE) == torch.bfloat16
        assert (a @ a).dtype == torch.bfloat16
        with pytest.raises(KeyError), no_autocast(DEVICE):
            raise KeyError("inside")
        assert torch.is_autocast_enabled(DEVICE) and (a @ a).dtype == torch.bfloat16
    with no_autocast(DEVICE):
        assert not torch.is_autocast_enabled(DEVICE)
    assert not torch.is_autocast_enabled(DEVICE)


def test_the_adapters_factors_are_their_casts_stacked_and_the_bs_one_cast_where_they_share_a_rank():
    """factors_of casts stacks (the A of every adapter; the B where they share a rank) once: the values are each
    factor's own cast, bit for bit, with a B in another dtype and a projection without an adapter among them."""
    gen = torch.Generator().manual_seed(5)

    def mat(rows, cols, dtype=torch.float32):
        return torch.randn(rows, cols, generator=gen).to(dtype).to(DEVICE)

    w = torch.zeros(1, 1, device=DEVICE)
    projs = [
        LoRAProj(w, mat(4, 24), mat(24, 4), 1.0),
        LoRAProj(w),  # no adapter
        LoRAProj(w, mat(4, 24, torch.bfloat16), mat(6, 4, torch.float16), 1.0),
        LoRAProj(w, mat(4, 24), mat(6, 4), 1.0),
    ]
    f = factors_of(projs, torch.bfloat16)
    own = torch.cat([p.lora_A.to(torch.bfloat16) for p in projs if p.lora_A is not None])
    assert f.a.dtype == torch.bfloat16 and torch.equal(f.a, own)
    assert f.b[1] is None
    for p, b in zip(projs, f.b, strict=True):
        if p.lora_B is not None:
            assert b.dtype == torch.bfloat16 and torch.equal(b, p.lora_B.to(torch.bfloat16))
    assert f.b[0].untyped_storage().data_ptr() == f.b[3].untyped_storage().data_ptr(), "one cast for the Bs"
    ranks = [LoRAProj(w, mat(4, 24), mat(24, 4), 1.0), LoRAProj(w, mat(8, 24), mat(6, 8), 1.0)]
    g = factors_of(ranks, torch.bfloat16)  # different ranks: each B cast alone
    assert all(torch.equal(b, p.lora_B.to(torch.bfloat16)) for p, b in zip(ranks, g.b, strict=True))
    kept = factors_of(ranks, torch.float32)  # no cast needed: the Bs themselves, as before
    assert all(b is p.lora_B for p, b in zip(ranks, kept.b, strict=True))


def test_a_projection_tuple_becomes_a_lora_proj_with_a_float_scaling():
    w, a, b = torch.randn(6, 5), torch.randn(2, 5), torch.randn(6, 2)
    p = as_proj((w, a, b, 2, None))
    assert type(p.scaling) is float and p.scaling == 2.0 and p.base is w and p.lora_A is a and p.lora_B is b
    assert as_proj((w,)) == (w, None, None, 1.0, None), "the base alone: LoRAProj's defaults"


def test_frozen_base_is_required_and_shapes_are_checked():
    p = _proj(96, 67, 8, dtype=torch.float32)
    with pytest.raises(ValueError, match="frozen"):
        lora_linear(torch.randn(2, 67, device=DEVICE), p[0].clone().requires_grad_(), p[1], p[2])
    with pytest.raises(ValueError, match="in_features"):
        lora_linear(torch.randn(2, 66, device=DEVICE), *p)
    with pytest.raises(ValueError, match="both"):
        lora_linear(torch.randn(2, 67, device=DEVICE), p[0], p[1], None)


# ---- lora_qkv ---------------------------------------------------------------------------------------


def _qkv_reference(x, q, k, v):
    return tuple(lora_linear_reference(x, *p) for p in (q, k, v))


def _qkv_bf16(x, q, k, v):
    return tuple(_bf16_torch_linear(x, p) for p in (q, k, v))


@_cases(r=[1, 8], x_shape=list(X_SHAPES), nf4=[False, True], dtype=[torch.float32, torch.bfloat16])
def test_lora_qkv_forward_and_grads_match_reference(r, x_shape, nf4, dtype):
    # Qwen2-style biases on all three, and k without an adapter (target_modules without k_proj).
    q = _proj(96, 67, r, dtype=dtype, nf4=nf4, bias=True, seed=1)
    k = _proj(32, 67, 0, dtype=dtype, nf4=nf4, bias=True, seed=2)
    v = _proj(32, 67, r, dtype=dtype, nf4=nf4, bias=True, seed=3)
    x = torch.randn(*X_SHAPES[x_shape], 67).to(dtype).to(DEVICE).requires_grad_()
    ys = lora_qkv(x, q, k, v)
    assert [tuple(y.shape) for y in ys] == [(*X_SHAPES[x_shape], n) for n in (96, 32, 32)]
    _compare(ys, x, [q, k, v], [torch.randn_like(y) for y in ys], _qkv_reference, _qkv_bf16)


def test_adapter_grads_come_back_in_each_adapters_dtype_from_one_cast_a_stack():
    """bf16 compute with fp32 adapters (strop's): the dA of the adapters of one call and their dB (one rank) are
    cast from the compute dtype as one stack each; every gradient is in its own factor's dtype and the values are
    the per-projection backward's, cast alone (a cast rounds each value by itself)."""
    q, k, v = (_proj(o, 67, 8, dtype=torch.bfloat16, seed=s) for s, o in ((1, 96), (2, 32), (3, 32)))
    x = torch.randn(15, 67).to(torch.bfloat16).to(DEVICE).requires_grad_()
    ys = lora_qkv(x, q, k, v)
    dys = [torch.randn_like(y) for y in ys]
    fused = _grads(ys, _factors(q, k, v), dys)
    assert [g.dtype for g in fused] == [torch.float32] * 6
    for p, y_grad, ga, gb in zip((q, k, v), dys, fused[0::2], fused[1::2], strict=True):
        alone = lora_linear(x, *p)
        da, db = _grads([alone], _factors(p), [y_grad])
        # the same bf16 products (one GEMM's rows or columns against a GEMM of that block alone), rounded once each
        assert _rel(ga, da) <= 2.0**-8 and _rel(gb, db) <= 2.0**-8
    gate, up, down = (
        _proj(o, i, 8, dtype=torch.bfloat16, seed=s) for s, o, i in ((4, 96, 67), (5, 96, 67), (6, 67, 96))
    )
    out = lora_mlp(x, gate, up, down)
    assert [g.dtype for g in _grads([out], _factors(gate, up, down), [torch.randn_like(out)])] == [
        torch.float32
    ] * 6


# ---- lora_mlp ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("hidden", "inter", "r", "activation", "nf4", "dtype", "x_shape"),
    [
        (67, 200, 8, "swiglu", False, torch.float32, "single_row"),
        (67, 200, 1, "swiglu", True, torch.float32, "3d"),
        (96, 67, 8, "geglu", False, torch.float32, "3d"),
        (96, 67, 1, "geglu_tanh", True, torch.float32, "single_row"),
        (67, 200, 8, "swiglu", False, torch.bfloat16, "3d"),
        (67, 200, 8, "swiglu", True, torch.bfloat16, "3d"),
        (96, 67, 8, "geglu_tanh", False, torch.bfloat16, "3d"),
    ],
)
def test_lora_mlp_forward_and_grads_match_reference(hidden, inter, r, activation, nf4, dtype, x_shape):
    gate = _proj(inter, hidden, r, dtype=dtype, nf4=nf4, seed=1)
    up = _proj(inter, hidden, r, dtype=dtype, nf4=nf4, seed=2)
    down = _proj(hidden, inter, r, dtype=dtype, nf4=nf4, seed=3)
    x = torch.randn(*X_SHAPES[x_shape], hidden).to(dtype).to(DEVICE).requires_grad_()
    out = lora_mlp(x, gate, up, down, activation)
    assert out.shape == x.shape and out.dtype == dtype
    _compare(
        out,
        x,
        [gate, up, down],
        torch.randn_like(out),
        lambda x_, g_, u_, d_: lora_mlp_reference(x_, g_, u_, d_, activation),
        lambda x_, g_, u_, d_: _bf16_torch_mlp(x_, g_, u_, d_, activation),
    )


def test_lora_mlp_with_adapters_on_some_projections_only():
    # target_modules=["gate_proj", "down_proj"]: up is the base alone.
    gate, up, down = (
        _proj(200, 67, 8, dtype=torch.float32, seed=1),
        _proj(200, 67, 0, dtype=torch.float32, seed=2),
        _proj(67, 200, 1, dtype=torch.float32, seed=3),
    )
    x = torch.randn(3, 5, 67, device=DEVICE, requires_grad=True)
    out = lora_mlp(x, gate, up, down)
    _compare(out, x, [gate, up, down], torch.randn_like(out), lora_mlp_reference)


def _intermediate_x(shape, dtype=torch.float32):
    leaf = torch.randn(*shape, device=DEVICE, dtype=dtype, requires_grad=True)
    return leaf, leaf * 1.0  # an intermediate: like the RMSNorm output the patch passes


def _mlp_projs():
    return (
        _proj(200, 67, 8, dtype=torch.float32, seed=1),
        _proj(200, 67, 8, dtype=torch.float32, seed=2),
        _proj(67, 200, 8, dtype=torch.float32, seed=3),
    )


def test_inplace_dx_overwrites_x_and_guards_against_a_second_backward():
    gate, up, down = _mlp_projs()
    leaf, x = _intermediate_x((2, 5, 67))
    out = lora_mlp(x, gate, up, down, inplace_dx=True)
    seen = {}

    def record(grad):
        seen["dx_ptr"] = grad.data_ptr()

    x.register_hook(record)
    out.sum().backward(retain_graph=True)
    assert seen["dx_ptr"] == x.data_ptr()  # dx was written over x's storage
    leaf64 = leaf.detach().double().requires_grad_()
    lora_mlp_reference(leaf64 * 1.0, *(_copy(p, torch.float64) for p in (gate, up, down))).sum().backward()
    assert _rel(leaf.grad, leaf64.grad) <= 1e-5
    # x, e and g now hold gradients: reusing the graph must fail loudly, not compute garbage.
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.sum().backward()


def test_inplace_dx_never_touches_a_leaf_input():
    p = _proj(96, 67, 8, dtype=torch.float32)
    x = torch.randn(4, 67, device=DEVICE, requires_grad=True)
    before = x.detach().clone()
    lora_linear(x, *p, inplace_dx=True).sum().backward()
    assert torch.equal(x.detach(), before)


def test_qkv_inplace_dx_gives_the_same_gradient_as_out_of_place():
    q, k, v = (_proj(o, 67, 8, dtype=torch.float32, seed=s) for s, o in enumerate((96, 32, 32)))
    grads = []
    for inplace in (False, True):
        torch.manual_seed(0)
        leaf, x = _intermediate_x((3, 67))
        ys = lora_qkv(x, q, k, v, inplace_dx=inplace)
        sum(y.square().sum() for y in ys).backward()
        grads.append(leaf.grad)
    assert torch.equal(grads[1], grads[0])  # same GEMMs in the same order, only the destination differs


def test_unknown_activation_is_rejected():
    gate, up, down = _mlp_projs()
    with pytest.raises(ValueError, match="activation"):
        lora_mlp(torch.randn(2, 67, device=DEVICE), gate, up, down, "relu")


# ---- GPU tier: 8B shapes in bf16 --------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("nf4", [False, True], ids=["dense", "nf4"])
def test_lora_mlp_and_qkv_at_8b_shapes_in_bf16(nf4):
    # Llama-3.1-8B: hidden 4096, intermediate 14336, 32/8 heads of 128; r 16; 2,048 tokens.
    h, i, r, n = 4096, 14336, 16, 2048
    gate = _proj(i, h, r, dtype=torch.bfloat16, nf4=nf4, seed=1)
    up = _proj(i, h, r, dtype=torch.bfloat16, nf4=nf4, seed=2)
    down = _proj(h, i, r, dtype=torch.bfloat16, nf4=nf4, seed=3)
    x = torch.randn(n, h, device="cuda").to(torch.bfloat16).requires_grad_()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = lora_mlp(x, gate, up, down)
    _compare(out, x, [gate, up, down], torch.randn_like(out), lora_mlp_reference, _bf16_torch_mlp)

    q, k, v = (
        _proj(o, h, r, dtype=torch.bfloat16, nf4=nf4, seed=s) for s, o in ((4, 4096), (5, 1024), (6, 1024))
    )
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ys = lora_qkv(x, q, k, v)
    _compare(ys, x, [q, k, v], [torch.randn_like(y) for y in ys], _qkv_reference, _qkv_bf16)


def test_mlp_backward_in_token_chunks_gives_the_unchunked_gradients(monkeypatch):
    """dh is made and consumed a chunk of tokens at a time: the same products, only the GEMMs' sums grouped
    differently (a BLAS may order a row's K-sum by the row count; the down adapter's dA sums its tokens per chunk).
    Bound: two orderings of a K-term fp32 sum differ by at most 2·K·u of its magnitude, K ≤ 200 here."""
    import strop.kernels.lora.mlp as mlp_mod

    gate, up, down = _mlp_projs()  # fp32, hidden 67, intermediate 200, r 8
    x = torch.randn(2, 7, 67, device=DEVICE, requires_grad=True)
    dout = torch.randn(2, 7, 67, device=DEVICE)
    params = [x, *_factors(gate, up, down)]  # x, gate A, B, up A, B, down A, B

    def grads():
        return torch.autograd.grad(lora_mlp(x, gate, up, down), params, dout)

    whole = grads()
    calls = []
    real = mlp_mod._act_bwd
    monkeypatch.setattr(
        mlp_mod, "_act_bwd", lambda dh, *a, **k: calls.append(dh.shape[0]) or real(dh, *a, **k)
    )
    monkeypatch.setattr(mlp_mod, "DH_CHUNK_BYTES", 6 * 200 * 4)  # at most 6 tokens a chunk: 3 equal chunks
    chunked = grads()
    assert calls == [5, 5, 4]
    bound = 2 * 200 * 2.0**-24
    for i, (got, ref) in enumerate(zip(chunked, whole, strict=True)):
        assert _rel(got, ref) < bound, (i, _rel(got, ref))


def test_nf4_gate_and_up_run_as_one_gemm_each_way_with_the_per_projection_results(monkeypatch):
    """NF4 gate and up bases are dequantized one under the other: one GEMM gives e and g, one GEMM with K = 2I
    gives dx. Against the per-projection GEMMs only sums are regrouped (dx's K = 2·200 terms at most)."""
    import strop.kernels.lora.linear as linear_mod

    gate = _proj(200, 67, 8, dtype=torch.float32, nf4=True, seed=1)
    up = _proj(200, 67, 8, dtype=torch.float32, nf4=True, seed=2)
    down = _proj(67, 200, 8, dtype=torch.float32, nf4=True, seed=3)
    x = torch.randn(3, 5, 67, device=DEVICE, requires_grad=True)
    dout = torch.randn(3, 5, 67, device=DEVICE)
    params = [x, *_factors(gate, up, down)]
    stacks = []
    real = linear_mod.stacked_weight

    def counting(projs, dtype, backward=False):
        w = real(projs, dtype, backward)
        stacks.append(w is not None)
        return w

    monkeypatch.setattr(linear_mod, "stacked_weight", counting)
    out = lora_mlp(x, gate, up, down)
    stacked = [out, *torch.autograd.grad(out, params, dout)]
    assert stacks == [True, True]  # forward (e, g) and backward (dx)
    monkeypatch.setattr(linear_mod, "stacked_weight", lambda projs, dtype, backward=False: None)
    out = lora_mlp(x, gate, up, down)
    separate = [out, *torch.autograd.grad(out, params, dout)]
    bound = 2 * 400 * 2.0**-24
    for i, (got, ref) in enumerate(zip(stacked, separate, strict=True)):
        assert _rel(got, ref) < bound, (i, _rel(got, ref))


def test_an_mlp_over_no_tokens_gives_zero_adapter_gradients():
    gate, up, down = _mlp_projs()
    x = torch.randn(0, 67, device=DEVICE, requires_grad=True)
    out = lora_mlp(x, gate, up, down)
    grads = torch.autograd.grad(out.sum(), [x, *_factors(gate, up, down)])
    assert out.shape == (0, 67) and grads[0].shape == (0, 67)
    for g, p in zip(grads[1:], _factors(gate, up, down), strict=True):
        assert g.shape == p.shape and not g.any()
