"""Gated MLP activations SwiGLU and GeGLU: h = act(gate) · up, with a recomputing backward.

Forward, elementwise over gate g and up u (HF ``LlamaMLP``: ``act_fn(gate_proj(x)) * up_proj(x)``):

    a = act(g_f32)                         act = silu, gelu (erf) or gelu (tanh approximation)
    h = cast(cast(a) · u)                  the activation is rounded to the input dtype before the
                                           product, as torch's bf16 ``F.silu``/``F.gelu`` output is

    silu(g)      = g σ(g)
    gelu(g)      = ½ g (1 + erf(g/√2))
    gelu_tanh(g) = ½ g (1 + tanh(k₀ (g + k₁ g³))),  k₀ = √(2/π), k₁ = 0.044715

Shapes and dtypes: gate and up have one shape [..., I] and one dtype (fp32/bf16/fp16); rows may be
strided (a column half of a fused gate/up buffer is used where it lies). h is contiguous, same dtype.

Saved for backward: gate and up only (base outputs, without their terms). The product h is never saved; the backward recomputes act(g).

Backward, with dh the gradient of h:

    dup   = dh · cast(a)
    dgate = dh · u · act'(g)
    silu'(g)      = σ(g) (1 + g (1 − σ(g)))
    gelu'(g)      = ½ (1 + erf(g/√2)) + g φ(g),            φ(g) = exp(−g²/2)/√(2π)
    gelu_tanh'(g) = ½ (1 + t) + ½ g (1 − t²) k₀ (1 + 3 k₁ g²),   t = tanh(k₀ (g + k₁ g³))

``swiglu_bwd``/``geglu_bwd`` can write dgate/dup into gate/up's storage (``inplace=True``) and also
recompute h into a caller's buffer (``h_out``, which may be dh itself): the fused LoRA MLP needs h for
the down projection's LoRA gradients and has no other use for dh, gate or up afterwards.

Row scale (``row_scale`` [M], MoE's routing weights): ``h = cast(cast(a) · u · w_m)``, one rounding; the
backward takes dh of that scaled output and also gives ``dw_m = Σ_n dh · cast(a) · u`` (fp32, added atomically
into the caller's zeros) before using ``dh · w_m`` above. A routed expert's output ``w · (h Dᵀ)`` is ``(w · h) Dᵀ``:
the weight applied on the [M, I] activation instead of the [M, H] product saves the weighting's own passes.

Low-rank terms (``LowRank``: ``scale · a @ b``, K ≤ 128). The fused LoRA MLP passes gate and up as the base
projections' outputs and their adapters' terms ``s · (x Aᵀ) Bᵀ`` beside them; the backward also takes dh's term
``g_d A_d`` from the down adapter. Each kernel adds a term in fp32 to the tile it has just read (one ``tl.dot``
of [32, K] by [K, 128] a tile), so gate' = gate + term is never written or rounded, and the forward and backward above
apply to gate', up' and dh'. What that saves: one read-modify-write of each [N, I] operand per pass, which
``small_k.addmm_small_k_`` spends otherwise (four a layer in the forward and recompute, one in the backward); what
it costs: the dots, which take more than their arithmetic (a tile's fixed cost, ``bench/swiglu_tiles.py``). Net, a
layer's two forwards and one backward are faster with the terms inside (bench/RESULTS.md, "LoRA terms inside the
SwiGLU kernels").
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .small_k import MAX_SMALL_K, block_k, small_k_tile
from .utils import (
    as_rows,
    cast_to,
    cdiv,
    check_float_tensor,
    check_same_device,
    interpreter_rows,
    is_writable_in_place,
    tanh,
)

__all__ = [
    "GeGLUFunction",
    "LowRank",
    "SwiGLUFunction",
    "geglu",
    "geglu_bwd",
    "geglu_fwd",
    "swiglu",
    "swiglu_bwd",
    "swiglu_bwd_reference",
    "swiglu_fwd",
    "swiglu_reference",
]

_SILU, _GELU, _GELU_TANH = 0, 1, 2
_APPROXIMATE = {"none": _GELU, "tanh": _GELU_TANH}
_SQRT_2_OVER_PI = 0.7978845608028654
_INV_SQRT_2 = 0.7071067811865476
_INV_SQRT_2PI = 0.3989422804014327
_GELU_K1 = 0.044715
# One [32, 128] tile of the [rows, I] operands per program over 4 warps, the best of bench/swiglu_tiles.py's sweep
# (bench/RESULTS.md, "LoRA terms inside the SwiGLU kernels"): without terms as fast as the earlier one-row kernel,
# with terms faster than the row kernel plus small_k's separate updates.
_BLOCK_M, _BLOCK_N, _NUM_WARPS = 32, 128, 4


def swiglu_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """HF's ``ACT2FN["silu"](gate) * up`` (pass fp32 tensors for an fp32 reference)."""
    return torch.nn.functional.silu(gate) * up


def swiglu_bwd_reference(
    dh: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, activation: str = "silu"
) -> tuple[torch.Tensor, torch.Tensor]:
    """The derived backward of the module docstring in fp32 torch; activation is silu, gelu or gelu_tanh."""
    g, u, dh = gate.float(), up.float(), dh.float()
    if activation == "silu":
        s = torch.sigmoid(g)
        a, da = g * s, s * (1 + g * (1 - s))
    elif activation == "gelu":
        cdf = 0.5 * (1 + torch.erf(g * _INV_SQRT_2))
        a, da = g * cdf, cdf + g * _INV_SQRT_2PI * torch.exp(-0.5 * g * g)
    else:
        t = torch.tanh(_SQRT_2_OVER_PI * (g + _GELU_K1 * g**3))
        a = 0.5 * g * (1 + t)
        da = 0.5 * (1 + t) + 0.5 * g * (1 - t * t) * _SQRT_2_OVER_PI * (1 + 3 * _GELU_K1 * g * g)
    return dh * u * da, dh * a.to(gate.dtype).float()


@triton.jit
def _activation(g, ACTIVATION: tl.constexpr):
    """act(g) and act'(g) in fp32."""
    if ACTIVATION == 0:
        s = tl.sigmoid(g)
        a = g * s
        da = s * (1.0 + g * (1.0 - s))
    elif ACTIVATION == 1:
        cdf = 0.5 * (1.0 + tl.math.erf(g * 0.7071067811865476))
        a = g * cdf
        da = cdf + g * 0.3989422804014327 * tl.exp(-0.5 * g * g)
    else:
        t = tanh(0.7978845608028654 * (g + 0.044715 * g * g * g))
        a = 0.5 * g * (1.0 + t)
        da = 0.5 * (1.0 + t) + 0.5 * g * (1.0 - t * t) * 0.7978845608028654 * (1.0 + 3.0 * 0.044715 * g * g)
    return a, da


@triton.jit
def _low_rank(
    t,
    a_ptr,
    b_ptr,
    scale,
    rm,
    rn,
    m_mask,
    n_mask,
    K,
    stride_am,
    stride_ak,
    stride_bk,
    stride_bn,
    BLOCK_K: tl.constexpr,
    IEEE: tl.constexpr,
):
    """t + scale · a @ b on one fp32 tile (the fp32 accumulator scaled, nothing rounded)."""
    return t + scale * small_k_tile(
        a_ptr, b_ptr, rm, rn, m_mask, n_mask, K, stride_am, stride_ak, stride_bk, stride_bn, BLOCK_K, IEEE
    )


# fmt: skip on the signature: one row per role (tensors and sizes, each low-rank term's A/B, scale, K and
# strides, the constexprs), in the launch's order
@triton.jit
def _swiglu_fwd_kernel(
    g_ptr, u_ptr, h_ptr, M, N, g_row_stride, u_row_stride, h_row_stride,
    ga_ptr, gb_ptr, g_scale, g_k, ga_sm, ga_sk, gb_sk, gb_sn,
    ua_ptr, ub_ptr, u_scale, u_k, ua_sm, ua_sk, ub_sk, ub_sn,
    rs_ptr,
    ACTIVATION: tl.constexpr, GATE_TERM: tl.constexpr, UP_TERM: tl.constexpr, ROW_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_KG: tl.constexpr, BLOCK_KU: tl.constexpr,
    IEEE: tl.constexpr,
):  # fmt: skip
    rm = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = rm < M, rn < N
    mask = m_mask[:, None] & n_mask[None, :]
    g = tl.load(g_ptr + rm[:, None] * g_row_stride + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + rm[:, None] * u_row_stride + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    # fmt: skip on the two calls: one row each, so the gate and up terms read side by side
    if GATE_TERM:
        g = _low_rank(g, ga_ptr, gb_ptr, g_scale, rm, rn, m_mask, n_mask, g_k, ga_sm, ga_sk, gb_sk, gb_sn, BLOCK_KG, IEEE)  # fmt: skip
    if UP_TERM:
        u = _low_rank(u, ua_ptr, ub_ptr, u_scale, rm, rn, m_mask, n_mask, u_k, ua_sm, ua_sk, ub_sk, ub_sn, BLOCK_KU, IEEE)  # fmt: skip
    a, _ = _activation(g, ACTIVATION)
    # Round the activation to the input dtype before the product, as HF's two separate ops do.
    a = cast_to(a, h_ptr.dtype.element_ty).to(tl.float32)
    h = a * u
    if ROW_SCALE:  # a routed row's weight, applied before the one rounding of h
        h = h * tl.load(rs_ptr + rm, mask=m_mask, other=0.0).to(tl.float32)[:, None]
    tl.store(h_ptr + rm[:, None] * h_row_stride + rn[None, :], cast_to(h, h_ptr.dtype.element_ty), mask=mask)


# fmt: skip on the signature: one row per role (pointers and sizes, row strides, each low-rank term's A/B,
# scale, K and strides, the constexprs), in the launch's order
@triton.jit
def _swiglu_bwd_kernel(
    dh_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, h_ptr, M, N,
    dh_row_stride, g_row_stride, u_row_stride, dg_row_stride, du_row_stride, h_row_stride,
    ga_ptr, gb_ptr, g_scale, g_k, ga_sm, ga_sk, gb_sk, gb_sn,
    ua_ptr, ub_ptr, u_scale, u_k, ua_sm, ua_sk, ub_sk, ub_sn,
    da_ptr, db_ptr, d_scale, d_k, da_sm, da_sk, db_sk, db_sn,
    rs_ptr, drs_ptr,
    ACTIVATION: tl.constexpr, STORE_H: tl.constexpr,
    GATE_TERM: tl.constexpr, UP_TERM: tl.constexpr, DH_TERM: tl.constexpr, ROW_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_KG: tl.constexpr, BLOCK_KU: tl.constexpr, BLOCK_KD: tl.constexpr, IEEE: tl.constexpr,
):  # fmt: skip
    rm = tl.program_id(0).to(tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = tl.program_id(1).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    m_mask, n_mask = rm < M, rn < N
    mask = m_mask[:, None] & n_mask[None, :]
    dh = tl.load(dh_ptr + rm[:, None] * dh_row_stride + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + rm[:, None] * g_row_stride + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + rm[:, None] * u_row_stride + rn[None, :], mask=mask, other=0.0).to(tl.float32)
    # fmt: skip on the three calls: one row each, so the dh, gate and up terms read side by side
    if DH_TERM:
        dh = _low_rank(dh, da_ptr, db_ptr, d_scale, rm, rn, m_mask, n_mask, d_k, da_sm, da_sk, db_sk, db_sn, BLOCK_KD, IEEE)  # fmt: skip
    if GATE_TERM:
        g = _low_rank(g, ga_ptr, gb_ptr, g_scale, rm, rn, m_mask, n_mask, g_k, ga_sm, ga_sk, gb_sk, gb_sn, BLOCK_KG, IEEE)  # fmt: skip
    if UP_TERM:
        u = _low_rank(u, ua_ptr, ub_ptr, u_scale, rm, rn, m_mask, n_mask, u_k, ua_sm, ua_sk, ub_sk, ub_sn, BLOCK_KU, IEEE)  # fmt: skip
    a, da = _activation(g, ACTIVATION)
    a = cast_to(a, g_ptr.dtype.element_ty).to(tl.float32)
    if ROW_SCALE:  # dh is the scaled output's gradient: the scale's gradient Σ_n dh·a·u, then dh·scale
        rs = tl.load(rs_ptr + rm, mask=m_mask, other=0.0).to(tl.float32)
        tl.atomic_add(drs_ptr + rm, tl.sum(dh * a * u, axis=1), mask=m_mask)
        dh = dh * rs[:, None]
    # dg/du/h may alias g/u/dh: every element of the tile is loaded before any is stored, by this program only.
    tl.store(
        dg_ptr + rm[:, None] * dg_row_stride + rn[None, :],
        cast_to(dh * u * da, dg_ptr.dtype.element_ty),
        mask=mask,
    )
    tl.store(
        du_ptr + rm[:, None] * du_row_stride + rn[None, :],
        cast_to(dh * a, du_ptr.dtype.element_ty),
        mask=mask,
    )
    if STORE_H:
        h = a * u
        if ROW_SCALE:
            h = h * rs[:, None]
        tl.store(
            h_ptr + rm[:, None] * h_row_stride + rn[None, :], cast_to(h, h_ptr.dtype.element_ty), mask=mask
        )


class LowRank(NamedTuple):
    """A rank-K term ``scale · a @ b`` that the kernels add, in fp32, to an ``[M, N]`` operand as they read it.

    ``a`` is ``[M, K]`` and ``b`` ``[K, N]`` (any strides; ``b`` is typically ``lora_B.t()``), K ≤ 128, in the
    operand's dtype and on its device: LoRA's ``s · (x Aᵀ) Bᵀ`` on a gate or up projection's base output, or
    ``g_d A_d`` on the down projection's dh. Adding it inside the activation saves the separate read-modify-write
    of the ``[M, N]`` operand (``small_k.addmm_small_k_``) and its rounding to the operand's dtype.
    """

    a: torch.Tensor
    b: torch.Tensor
    scale: float = 1.0


def _term_args(term: LowRank | None, like: torch.Tensor, rows: int, cols: int, name: str) -> tuple[list, int]:
    """The kernel arguments (pointers, scale, K, strides) of one optional term, and its BLOCK_K."""
    if term is None:
        return [like, like, 0.0, 0, 0, 0, 0, 0], 16
    a, b = term.a, term.b
    if a.dim() != 2 or b.dim() != 2 or a.shape[0] != rows or b.shape != (a.shape[1], cols):
        raise ValueError(
            f"{name} must be a [{rows}, K] @ [K, {cols}] term, got {tuple(a.shape)} @ {tuple(b.shape)}"
        )
    if a.shape[1] > MAX_SMALL_K:
        raise ValueError(f"{name} has K = {a.shape[1]} > {MAX_SMALL_K}")
    if a.dtype != like.dtype or b.dtype != like.dtype:
        raise TypeError(f"{name} must be {like.dtype}, got {a.dtype} and {b.dtype}")
    check_same_device(**{name: a, "operand": like, f"{name}.b": b})
    args = [a, b, float(term.scale), a.shape[1], a.stride(0), a.stride(1), b.stride(0), b.stride(1)]
    return args, block_k(a.shape[1])


def _check_pair(gate: torch.Tensor, up: torch.Tensor) -> None:
    check_float_tensor(gate, "gate", min_ndim=1)
    check_float_tensor(up, "up", min_ndim=1)
    check_same_device(gate=gate, up=up)
    if gate.shape != up.shape:
        raise ValueError(f"gate {tuple(gate.shape)} and up {tuple(up.shape)} must have one shape")
    if gate.dtype != up.dtype:
        raise TypeError(f"gate ({gate.dtype}) and up ({up.dtype}) must have one dtype")


def _rows(t: torch.Tensor, name: str, *, writable: bool = False) -> torch.Tensor:
    rows = as_rows(t)
    if rows is None:
        if writable:
            raise ValueError(f"{name} must be viewable as [rows, cols] with unit column stride to be written")
        rows = t.contiguous().view(-1, t.shape[-1])
    if writable and not is_writable_in_place(rows):
        raise ValueError(f"{name} is self-overlapping (e.g. expanded) and cannot be written")
    return rows


def _out(out: torch.Tensor | None, like: torch.Tensor, name: str) -> torch.Tensor:
    if out is None:
        return torch.empty(like.shape, dtype=like.dtype, device=like.device)
    if out.shape != like.shape or out.dtype != like.dtype or out.device != like.device:
        raise ValueError(
            f"{name} must be {tuple(like.shape)} {like.dtype} on {like.device}, "
            f"got {tuple(out.shape)} {out.dtype} on {out.device}"
        )
    return out


def _row_scale(t: torch.Tensor | None, like: torch.Tensor, name: str, *, accumulator: bool = False):
    """A per-row scale ``[rows]`` (contiguous, on the operand's device; fp32 where the kernel accumulates into it),
    or the operand as an unread placeholder pointer."""
    if t is None:
        return like
    check_same_device(**{name: t, "operand": like})
    if t.shape != (like.shape[0],) or not t.is_contiguous() or not t.is_floating_point():
        raise ValueError(
            f"{name} must be a contiguous float [{like.shape[0]}], got {t.dtype} {tuple(t.shape)}"
        )
    if accumulator and t.dtype != torch.float32:
        raise TypeError(f"{name} accumulates in fp32, got {t.dtype}")
    return t


def _block_m(n_rows: int) -> int:
    """Tile rows: ``_BLOCK_M`` compiled; under the interpreter as many as fill its tile (``interpreter_rows``)."""
    return max(_BLOCK_M, interpreter_rows(n_rows, _BLOCK_N))


def _grid(n_rows: int, n_cols: int) -> tuple[int, int]:
    return cdiv(n_rows, _block_m(n_rows)), cdiv(n_cols, _BLOCK_N)


def _glu_fwd(
    gate: torch.Tensor,
    up: torch.Tensor,
    out: torch.Tensor | None,
    activation: int,
    gate_term: LowRank | None = None,
    up_term: LowRank | None = None,
    row_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    _check_pair(gate, up)
    h = _out(out, gate, "out")
    if gate.numel() == 0:
        return h
    g2, u2, h2 = _rows(gate, "gate"), _rows(up, "up"), _rows(h, "out", writable=True)
    n_rows, n_cols = g2.shape
    rs = _row_scale(row_scale, g2, "row_scale")
    g_args, bkg = _term_args(gate_term, g2, n_rows, n_cols, "gate_term")
    u_args, bku = _term_args(up_term, g2, n_rows, n_cols, "up_term")
    _swiglu_fwd_kernel[_grid(n_rows, n_cols)](
        g2,
        u2,
        h2,
        n_rows,
        n_cols,
        g2.stride(0),
        u2.stride(0),
        h2.stride(0),
        *g_args,
        *u_args,
        rs,
        ACTIVATION=activation,
        GATE_TERM=gate_term is not None,
        UP_TERM=up_term is not None,
        ROW_SCALE=row_scale is not None,
        BLOCK_M=_block_m(n_rows),
        BLOCK_N=_BLOCK_N,
        BLOCK_KG=bkg,
        BLOCK_KU=bku,
        IEEE=gate.dtype == torch.float32,
        num_warps=_NUM_WARPS,
    )
    return h


def _glu_bwd(
    dh: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: int,
    inplace: bool,
    h_out: torch.Tensor | None,
    gate_term: LowRank | None = None,
    up_term: LowRank | None = None,
    dh_term: LowRank | None = None,
    row_scale: torch.Tensor | None = None,
    d_row_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    _check_pair(gate, up)
    check_float_tensor(dh, "dh")
    if dh.shape != gate.shape:
        raise ValueError(f"dh {tuple(dh.shape)} must have gate's shape {tuple(gate.shape)}")
    dgate, dup = (gate, up) if inplace else (torch.empty_like(gate), torch.empty_like(up))
    if h_out is not None:
        _out(h_out, gate, "h_out")
    if gate.numel() == 0:
        return dgate, dup
    dh2, g2, u2 = _rows(dh, "dh"), _rows(gate, "gate", writable=inplace), _rows(up, "up", writable=inplace)
    dg2, du2 = _rows(dgate, "dgate", writable=True), _rows(dup, "dup", writable=True)
    h2 = _rows(h_out, "h_out", writable=True) if h_out is not None else dg2
    n_rows, n_cols = g2.shape
    if dh_term is not None and dh2.dtype != g2.dtype:
        raise TypeError(f"a dh_term needs dh in gate's dtype {g2.dtype}, got {dh2.dtype}")
    g_args, bkg = _term_args(gate_term, g2, n_rows, n_cols, "gate_term")
    u_args, bku = _term_args(up_term, g2, n_rows, n_cols, "up_term")
    d_args, bkd = _term_args(dh_term, g2, n_rows, n_cols, "dh_term")
    if (row_scale is None) != (d_row_scale is None):
        raise ValueError("row_scale and d_row_scale go together")
    rs = _row_scale(row_scale, g2, "row_scale")
    drs = _row_scale(d_row_scale, g2, "d_row_scale", accumulator=True)
    # fmt: skip below: one row per role (tensors and sizes, row strides, the three low-rank terms' arguments,
    # the constexprs), as in the kernel's signature
    _swiglu_bwd_kernel[_grid(n_rows, n_cols)](
        dh2, g2, u2, dg2, du2, h2, n_rows, n_cols,
        dh2.stride(0), g2.stride(0), u2.stride(0), dg2.stride(0), du2.stride(0), h2.stride(0),
        *g_args, *u_args, *d_args, rs, drs,
        ACTIVATION=activation, STORE_H=h_out is not None,
        GATE_TERM=gate_term is not None, UP_TERM=up_term is not None, DH_TERM=dh_term is not None,
        ROW_SCALE=row_scale is not None,
        BLOCK_M=_block_m(n_rows), BLOCK_N=_BLOCK_N, BLOCK_KG=bkg, BLOCK_KU=bku, BLOCK_KD=bkd,
        IEEE=gate.dtype == torch.float32, num_warps=_NUM_WARPS,
    )  # fmt: skip
    return dgate, dup


def _approximate(approximate: str) -> int:
    if approximate not in _APPROXIMATE:
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    return _APPROXIMATE[approximate]


def swiglu_fwd(
    gate: torch.Tensor,
    up: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    gate_term: LowRank | None = None,
    up_term: LowRank | None = None,
    row_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """``silu(gate') * up'`` into ``out`` (a fresh contiguous tensor when None; may be gate or up itself), where
    ``gate' = gate + gate_term`` and ``up' = up + up_term`` in fp32 (each term optional, see :class:`LowRank`);
    with ``row_scale`` [rows] each row also times its scale before the one rounding (a routed copy's weight)."""
    return _glu_fwd(gate, up, out, _SILU, gate_term, up_term, row_scale)


def swiglu_bwd(
    dh: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    *,
    inplace: bool = False,
    h_out: torch.Tensor | None = None,
    gate_term: LowRank | None = None,
    up_term: LowRank | None = None,
    dh_term: LowRank | None = None,
    row_scale: torch.Tensor | None = None,
    d_row_scale: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``silu(gate') * up'`` (times ``row_scale`` where given), recomputing the activation.

    Args:
        dh: Gradient of the output.
        gate: The forward gate.
        up: The forward up.
        inplace: Write dgate into gate and dup into up (their contents are lost).
        h_out: If given, also write the recomputed forward output here (may be ``dh``).
        gate_term: As in :func:`swiglu_fwd`: the gradients are those with respect to ``gate'`` and ``up'``.
        up_term: Likewise.
        dh_term: Added to dh in fp32 as it is read (the down projection's LoRA term of dh).
        row_scale: The forward's ``row_scale``; dh is then the scaled output's gradient.
        d_row_scale: fp32 [rows], with ``row_scale``: the scale's gradient ``Σ_n dh · silu(gate') · up'`` is
            added to it (atomically, one partial sum per tile of columns; pass zeros).

    Returns:
        ``(dgate, dup)``.
    """
    return _glu_bwd(dh, gate, up, _SILU, inplace, h_out, gate_term, up_term, dh_term, row_scale, d_row_scale)


def geglu_fwd(
    gate: torch.Tensor,
    up: torch.Tensor,
    out: torch.Tensor | None = None,
    *,
    approximate: str = "none",
    gate_term: LowRank | None = None,
    up_term: LowRank | None = None,
) -> torch.Tensor:
    """``gelu(gate', approximate) * up'`` into ``out``; see :func:`swiglu_fwd`."""
    return _glu_fwd(gate, up, out, _approximate(approximate), gate_term, up_term)


def geglu_bwd(
    dh: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    *,
    approximate: str = "none",
    inplace: bool = False,
    h_out: torch.Tensor | None = None,
    gate_term: LowRank | None = None,
    up_term: LowRank | None = None,
    dh_term: LowRank | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``gelu(gate', approximate) * up'``; see :func:`swiglu_bwd`."""
    return _glu_bwd(dh, gate, up, _approximate(approximate), inplace, h_out, gate_term, up_term, dh_term)


class SwiGLUFunction(torch.autograd.Function):
    """Autograd wrapper: saves gate and up (never the output) and recomputes silu in backward."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        gate: torch.Tensor,
        up: torch.Tensor,
        inplace_backward: bool = False,
    ) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        ctx.inplace_backward = inplace_backward
        return swiglu_fwd(gate, up)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, dh: torch.Tensor):
        gate, up = ctx.saved_tensors
        dgate, dup = swiglu_bwd(dh, gate, up, inplace=ctx.inplace_backward)
        return dgate, dup, None


class GeGLUFunction(torch.autograd.Function):
    """Autograd wrapper: saves gate and up (never the output) and recomputes gelu in backward."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        gate: torch.Tensor,
        up: torch.Tensor,
        approximate: str = "none",
        inplace_backward: bool = False,
    ) -> torch.Tensor:
        ctx.save_for_backward(gate, up)
        ctx.approximate, ctx.inplace_backward = approximate, inplace_backward
        return geglu_fwd(gate, up, approximate=approximate)

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, dh: torch.Tensor):
        gate, up = ctx.saved_tensors
        dgate, dup = geglu_bwd(dh, gate, up, approximate=ctx.approximate, inplace=ctx.inplace_backward)
        return dgate, dup, None, None


def swiglu(gate: torch.Tensor, up: torch.Tensor, *, inplace_backward: bool = False) -> torch.Tensor:
    """``silu(gate) * up`` as HF's LlamaMLP computes it, with a recomputing Triton backward.

    Args:
        gate: ``[..., I]`` gate projection output.
        up: ``[..., I]`` up projection output, same dtype.
        inplace_backward: Let the backward overwrite gate/up with their gradients. Only safe when
            nothing else reads gate/up after this op's backward (true inside an MLP). Off by default.
    """
    return SwiGLUFunction.apply(gate, up, inplace_backward)


def geglu(
    gate: torch.Tensor, up: torch.Tensor, approximate: str = "none", *, inplace_backward: bool = False
) -> torch.Tensor:
    """``gelu(gate) * up`` (``approximate`` "none" = erf, "tanh" = HF's gelu_pytorch_tanh); see :func:`swiglu`."""
    _approximate(approximate)
    return GeGLUFunction.apply(gate, up, approximate, inplace_backward)
