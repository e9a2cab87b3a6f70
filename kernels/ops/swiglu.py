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

Saved for backward: gate and up only. The product h is never saved; the backward recomputes act(g).

Backward, with dh the gradient of h:

    dup   = dh · cast(a)
    dgate = dh · u · act'(g)
    silu'(g)      = σ(g) (1 + g (1 − σ(g)))
    gelu'(g)      = ½ (1 + erf(g/√2)) + g φ(g),            φ(g) = exp(−g²/2)/√(2π)
    gelu_tanh'(g) = ½ (1 + t) + ½ g (1 − t²) k₀ (1 + 3 k₁ g²),   t = tanh(k₀ (g + k₁ g³))

``swiglu_bwd``/``geglu_bwd`` can write dgate/dup into gate/up's storage (``inplace=True``) and also
recompute h into a caller's buffer (``h_out``, which may be dh itself): the fused LoRA MLP needs h for
the down projection's LoRA gradients and has no other use for dh, gate or up afterwards.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .utils import as_rows, cast_to, check_float_tensor, check_same_device, is_writable_in_place, tanh

__all__ = [
    "GeGLUFunction",
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
# untuned: 2,048 columns over 4 warps is 16 per lane (two 16-byte bf16 vector loads per tensor), and
# Llama-3's intermediate 14,336 is exactly 7 blocks, so no lane idles on padding; sweep on the H200.
_BLOCK_SIZE, _NUM_WARPS = 2048, 4


def _block(n_cols: int) -> int:
    return min(_BLOCK_SIZE, triton.next_power_of_2(n_cols))


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
def _swiglu_fwd_kernel(
    g_ptr, u_ptr, h_ptr, g_row_stride, u_row_stride, h_row_stride, n_cols,
    ACTIVATION: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    g = tl.load(g_ptr + row * g_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    a, _ = _activation(g, ACTIVATION)
    # Round the activation to the input dtype before the product, as HF's two separate ops do.
    a = cast_to(a, h_ptr.dtype.element_ty).to(tl.float32)
    tl.store(h_ptr + row * h_row_stride + cols, cast_to(a * u, h_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(
    dh_ptr, g_ptr, u_ptr, dg_ptr, du_ptr, h_ptr,
    dh_row_stride, g_row_stride, u_row_stride, dg_row_stride, du_row_stride, h_row_stride, n_cols,
    ACTIVATION: tl.constexpr, STORE_H: tl.constexpr, BLOCK_SIZE: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1).to(tl.int64) * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)
    mask = cols < n_cols
    dh = tl.load(dh_ptr + row * dh_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(g_ptr + row * g_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(u_ptr + row * u_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    a, da = _activation(g, ACTIVATION)
    a = cast_to(a, g_ptr.dtype.element_ty).to(tl.float32)
    # dg/du/h may alias g/u/dh: every element is loaded before any is stored, by this program only.
    tl.store(dg_ptr + row * dg_row_stride + cols, cast_to(dh * u * da, dg_ptr.dtype.element_ty), mask=mask)
    tl.store(du_ptr + row * du_row_stride + cols, cast_to(dh * a, du_ptr.dtype.element_ty), mask=mask)
    if STORE_H:
        tl.store(h_ptr + row * h_row_stride + cols, cast_to(a * u, h_ptr.dtype.element_ty), mask=mask)


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


def _glu_fwd(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None, activation: int) -> torch.Tensor:
    _check_pair(gate, up)
    h = _out(out, gate, "out")
    if gate.numel() == 0:
        return h
    g2, u2, h2 = _rows(gate, "gate"), _rows(up, "up"), _rows(h, "out", writable=True)
    n_rows, n_cols = g2.shape
    block = _block(n_cols)
    _swiglu_fwd_kernel[(n_rows, triton.cdiv(n_cols, block))](
        g2, u2, h2, g2.stride(0), u2.stride(0), h2.stride(0), n_cols,
        ACTIVATION=activation, BLOCK_SIZE=block, num_warps=_NUM_WARPS,
    )  # fmt: skip
    return h


def _glu_bwd(
    dh: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    activation: int,
    inplace: bool,
    h_out: torch.Tensor | None,
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
    block = _block(n_cols)
    _swiglu_bwd_kernel[(n_rows, triton.cdiv(n_cols, block))](
        dh2, g2, u2, dg2, du2, h2,
        dh2.stride(0), g2.stride(0), u2.stride(0), dg2.stride(0), du2.stride(0), h2.stride(0), n_cols,
        ACTIVATION=activation, STORE_H=h_out is not None, BLOCK_SIZE=block, num_warps=_NUM_WARPS,
    )  # fmt: skip
    return dgate, dup


def _approximate(approximate: str) -> int:
    if approximate not in _APPROXIMATE:
        raise ValueError(f"approximate must be 'none' or 'tanh', got {approximate!r}")
    return _APPROXIMATE[approximate]


def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``silu(gate) * up`` into ``out`` (a fresh contiguous tensor when None; may be gate or up itself)."""
    return _glu_fwd(gate, up, out, _SILU)


def swiglu_bwd(
    dh: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    *,
    inplace: bool = False,
    h_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``silu(gate) * up``, recomputing the activation.

    Args:
        dh: Gradient of the output.
        gate: The forward gate.
        up: The forward up.
        inplace: Write dgate into gate and dup into up (their contents are lost).
        h_out: If given, also write the recomputed forward output here (may be ``dh``).

    Returns:
        ``(dgate, dup)``.
    """
    return _glu_bwd(dh, gate, up, _SILU, inplace, h_out)


def geglu_fwd(
    gate: torch.Tensor, up: torch.Tensor, out: torch.Tensor | None = None, *, approximate: str = "none"
) -> torch.Tensor:
    """``gelu(gate, approximate) * up`` into ``out``; see :func:`swiglu_fwd`."""
    return _glu_fwd(gate, up, out, _approximate(approximate))


def geglu_bwd(
    dh: torch.Tensor,
    gate: torch.Tensor,
    up: torch.Tensor,
    *,
    approximate: str = "none",
    inplace: bool = False,
    h_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of ``gelu(gate, approximate) * up``; see :func:`swiglu_bwd`."""
    return _glu_bwd(dh, gate, up, _approximate(approximate), inplace, h_out)


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
