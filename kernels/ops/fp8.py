"""FP8 (e4m3) GEMMs for frozen base weights: rowwise quantization and the scaled matmuls. Opt-in, never the default.

A LoRA step's GEMM work is almost all against the frozen base: y = x Wᵀ in the forward (and its recompute) and
dx = dy W in the backward; W has no gradient. Hopper runs e4m3 GEMMs at twice the bf16 rate, so
``patch_model(..., fp8_base=True)`` gives each patched projection's base two e4m3 copies and runs both GEMMs on them:

    forward    y  ≈ (s_x ⊙ Q(x)) (s_w ⊙ Q(W))ᵀ           Q(x) [N, in] per token, Q(W) [out, in] per output row
    backward   dx ≈ (s_dy ⊙ Q(dy)) (s_wt ⊙ Q(Wᵀ))ᵀ        Q(dy) [N, out] per token, Q(Wᵀ) [in, out] per input column

Q(r) = RNE_e4m3(r · 448 / amax(r)) row by row, s = amax / 448 (amax floored at ``EPS``): every row uses the
whole e4m3 range, so a token's or a channel's scale never limits another's precision. ``torch._scaled_mm`` applies
s_a (a column, one per row of the left operand) and s_b (a row, one per column of the result) to the fp32
accumulator and rounds the product once to bf16. Two copies, because each GEMM's scale must run along its
output, never along its inner dimension: the forward scales W by output row, the backward by input column.
1 byte a weight each: 2 × 6.5 GiB for an 8B model's decoder projections (the LM head stays bf16).

``fp8_base="dx"`` keeps the forward (and its recompute) exact and runs only the backward's dx in e4m3, from one
copy (Q(Wᵀ), 6.5 GiB): the forward's rounding is what costs learning on a deep model (``bench/fp8_learning_check.py``: a deep model
keeps most of the exact loss drop with dx alone, less with both; bench/RESULTS.md, "What FP8 costs in learning"), and
dx is half of a step's base GEMMs where no layer is recomputed.

What stays exact: the LoRA factors and their products (u = x Aᵀ, dA, dB, g A) read x and dy in bf16; the
norms, attention, activations and loss are unchanged. Only the base's contributions to y and dx carry the
e4m3 rounding. Bound (tests/kernels/ops/test_fp8.py derives it): each factor of a product is rounded with
relative error ≤ 2⁻⁴ (3 mantissa bits; a subnormal adds ≤ 2⁻¹⁰ · s absolute), so
|Q-GEMM − exact| ≤ (2·2⁻⁴ + 2⁻⁸) Σ_k |a_k||b_k| + subnormal terms, plus the bf16 rounding of the result.

The quantizer is one Triton program per row (rows ≤ ``MAX_FUSED_SIZE``): one read of the row in bf16/fp32,
one write of its e4m3 codes and one fp32 scale (under the interpreter, a block of rows a program: ``interpreter_rows``). Under ``TRITON_INTERPRET=1`` the fp32 → e4m3 cast is done by
explicit rounding first (Triton 3.6's interpreter truncates where the compiled cast rounds to nearest even, and
carries into the next binade wrongly: 125.2 came back as 64, not 128), so the CPU tier checks the kernel bit
for bit against :func:`quantize_rows_reference`. Without CUDA or the interpreter the reference runs.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from .utils import INTERPRETER, calculate_settings, check_float_tensor, interpreter_rows

__all__ = [
    "EPS",
    "FP8",
    "FP8_MAX",
    "FP8_MIN_CAPABILITY",
    "Fp8Weight",
    "fp8_device_reason",
    "fp8_weight",
    "mm_fp8",
    "quantize_rows",
    "quantize_rows_reference",
]

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value
FP8_MIN_CAPABILITY = (8, 9)  # e4m3 tensor-core GEMMs: Ada, Hopper and later
EPS = 1e-12  # amax floor: an all-zero row gets codes 0 and a scale of EPS / 448, not a division by zero
_SUBNORMAL = tl.constexpr(2.0**-6)  # smallest normal e4m3 magnitude; below it the code step is 2⁻⁹
# an fp32 constant whose ulp is 2⁻⁹: (v + c) − c rounds a subnormal-range v to a multiple of 2⁻⁹, ties to even
_SUB_ROUND = tl.constexpr(1.5 * 2.0**14)


def quantize_rows_reference(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(Q(x), s)``: x [M, K] as e4m3 codes with one fp32 scale per row (``s`` [M, 1]), x ≈ s ⊙ Q(x)."""
    xf = x.float()
    amax = xf.abs().amax(dim=1, keepdim=True).clamp_min(EPS)
    top = torch.full_like(
        amax, FP8_MAX
    )  # tensor / tensor: IEEE division (a scalar / tensor multiplies by 1/amax)
    return (xf * (top / amax)).to(FP8), amax / top


@triton.jit
def _round_e4m3(v):
    """``v`` (fp32, |v| ≤ 448) rounded to the nearest e4m3 value (ties to even), still fp32: the interpreter's cast
    is then exact. Normals keep 3 mantissa bits (add half an ulp less one, plus the kept lsb, then truncate);
    subnormals are multiples of 2⁻⁹."""
    bits = v.to(tl.uint32, bitcast=True)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & 0xFFF00000).to(tl.float32, bitcast=True)
    sub = ((tl.abs(v) + _SUB_ROUND) - _SUB_ROUND).to(tl.uint32, bitcast=True) | (
        bits & 0x80000000
    )  # keeps −0
    return tl.where(tl.abs(v) < _SUBNORMAL, sub.to(tl.float32, bitcast=True), normal)


@triton.jit
def _quantize_rows_kernel(
    x_ptr, q_ptr, s_ptr, M, K, stride_x, stride_q, eps, BLOCK: tl.constexpr, ROWS: tl.constexpr
):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    cols = tl.arange(0, BLOCK)[None, :]
    mask = (rows < M) & (cols < K)
    x = tl.load(x_ptr + rows * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1, keep_dims=True), eps)
    # correctly rounded divisions (Triton's fp32 `/` is approximate on the GPU), as the reference's
    v = x * tl.math.div_rn(tl.full(amax.shape, 448.0, tl.float32), amax)
    if INTERPRETER:
        v = _round_e4m3(v)
    tl.store(q_ptr + rows * stride_q + cols, v.to(tl.float8e4nv), mask=mask)
    tl.store(s_ptr + rows, tl.math.div_rn(amax, tl.full(amax.shape, 448.0, tl.float32)), mask=rows < M)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Rowwise e4m3 quantization of a 2-D ``x``: ``(Q(x) [M, K], s [M, 1])``, bitwise :func:`quantize_rows_reference`.
    Any row stride is read in place; a column stride other than 1 costs a contiguous copy first.

    Raises:
        TypeError: If x is not a float tensor.
        ValueError: If x is not 2-D.
    """
    check_float_tensor(x, "x", ndim=2)
    if x.numel() == 0 or not (
        x.is_cuda or INTERPRETER
    ):  # no rows: an empty batch's gradient may have any strides
        return quantize_rows_reference(x)
    if x.stride(1) != 1 and x.shape[1] > 1:
        x = x.contiguous()
    m, k = x.shape
    block, warps = calculate_settings(k)
    rows = interpreter_rows(m, block)
    q = torch.empty(m, k, dtype=FP8, device=x.device)
    s = torch.empty(m, 1, dtype=torch.float32, device=x.device)
    _quantize_rows_kernel[(triton.cdiv(m, rows),)](
        x, q, s, m, k, x.stride(0), q.stride(0), EPS, BLOCK=block, ROWS=rows, num_warps=warps
    )
    return q, s


def mm_fp8(
    a: torch.Tensor,
    scale_a: torch.Tensor,
    b: torch.Tensor,
    scale_b: torch.Tensor,
    out_dtype: torch.dtype,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """``(scale_a ⊙ a) @ (b ⊙ scale_b)`` in ``out_dtype``: a [M, K] e4m3 row-major with scale_a [M, 1], b [K, N]
    e4m3 column-major (the transpose of a row-major [N, K]) with scale_b [1, N]; fp32 accumulation, one rounding."""
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype, out=out)


class Fp8Weight(NamedTuple):
    """A frozen [out, in] weight's e4m3 copies (see the module docstring): both, or the backward's alone.

    Attributes:
        w: Q(W) [out, in], row-major; ``w_scale`` [1, out]: the forward's right operand is ``w.t()``. None for a
            weight whose forward stays exact (``fp8_weight(..., forward=False)``).
        wt: Q(Wᵀ) [in, out], row-major; ``wt_scale`` [1, in]: the backward's right operand is ``wt.t()``.
    """

    w: torch.Tensor | None
    w_scale: torch.Tensor | None
    wt: torch.Tensor
    wt_scale: torch.Tensor

    def forward(self, xq: torch.Tensor, x_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """``x Wᵀ`` [N, out] from ``quantize_rows(x)`` (a copy with ``w``)."""
        return mm_fp8(xq, x_scale, self.w.t(), self.w_scale, dtype)

    def backward(
        self, dyq: torch.Tensor, dy_scale: torch.Tensor, dtype: torch.dtype, out: torch.Tensor | None = None
    ) -> torch.Tensor:
        """``dy W`` [N, in] from ``quantize_rows(dy)``, into ``out`` if given."""
        return mm_fp8(dyq, dy_scale, self.wt.t(), self.wt_scale, dtype, out)

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self if t is not None)


def fp8_device_reason(device: torch.device) -> str | None:
    """Why the scaled GEMMs cannot run on a CUDA ``device`` (no e4m3 tensor cores), or None (other devices: None)."""
    if device.type != "cuda":
        return None
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_MIN_CAPABILITY:
        return f"FP8 GEMMs need compute capability >= 8.9 (FP8 tensor cores); {device} has {capability[0]}.{capability[1]}"
    return None


def fp8_weight(w: torch.Tensor, forward: bool = True) -> Fp8Weight:
    """The e4m3 copies of a dense [out, in] weight (already dequantized if it was NF4): both, or with
    ``forward=False`` the backward's alone (its forward GEMM stays exact)."""
    check_float_tensor(w, "w", ndim=2)
    q = s = None
    if forward:
        q, s = quantize_rows(w)
        s = s.view(1, -1)
    qt, st = quantize_rows(w.t().contiguous())
    return Fp8Weight(q, s, qt, st.view(1, -1))
