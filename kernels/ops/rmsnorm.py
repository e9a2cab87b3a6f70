"""RMSNorm with Llama/Qwen or Gemma semantics: forward and hand-written backward, dX and dW.

Forward, per row x ∈ R^H (all leading dims are rows):

    r = rsqrt(mean(x_f32²) + eps)              fp32, one per row
    n = x_f32 · r                               fp32
    y = w · cast_{x.dtype}(n)                   LLAMA: in the promoted dtype of (x, w)
    y = cast_{x.dtype}(n · (1 + w_f32))         GEMMA: fp32 product, cast last, in x's dtype

LLAMA is exactly HF ``LlamaRMSNorm`` (and Mistral's, Qwen's): the normalised row is cast back to the input
dtype *before* the weight multiply, and the product takes torch's promoted dtype (bf16·bf16 → bf16,
bf16·fp32 → fp32). GEMMA is exactly HF ``Gemma2RMSNorm``/``Gemma3RMSNorm``: the weight is stored as an
offset from 1 (HF initialises it to zeros), the whole row is scaled in fp32 and rounded once, to x's dtype
(HF's comment there cites transformers PR 29402 for this order).

Shapes and dtypes: x [..., H] (fp32/bf16/fp16, any leading dims, rows may be strided), w [H]. y has x's
shape and dtype ``torch.promote_types(x.dtype, w.dtype)`` (LLAMA) or x's dtype (GEMMA). All arithmetic
inside the kernels is fp32.

Saved for backward: x, w and r (one fp32 per row). Not y, not n.

Backward (the casts are the identity for autograd, as they are in HF's graph). With s = w (LLAMA) or
s = 1 + w (GEMMA) and g = dy · s:

    dW = Σ_rows dy · cast_{x.dtype}(n)      LLAMA    the exact derivatives of HF's forwards
    dW = Σ_rows dy · n                      GEMMA    (d(1 + w)/dw = 1; n is never rounded there)
    dx = r · (g − n · mean(g · n))                   since ∂r/∂x_j = −r³ x_j / H

dx is written to a fresh buffer, or into dy when ``inplace_backward=True`` (safe only when nothing else
reads dy afterwards: true for Llama's pre-norms, whose dy comes from the q/k/v or gate/up projections'
backward; false for Gemma's post-norms, whose output feeds a residual add that hands the same gradient
tensor to both branches). dW is reduced as fp32 partial sums, one row of partials per program, summed
by torch afterwards, and returned whenever ``weight.requires_grad`` — never silently dropped.
"""

from __future__ import annotations

import enum

import torch
import triton
import triton.language as tl

from .utils import (
    as_rows,
    calculate_settings,
    cast_to,
    cdiv,
    check_float_tensor,
    check_same_device,
    is_writable_in_place,
    next_power_of_2,
    num_sms,
    rows_a_program,
)

__all__ = [
    "RMSNormFunction",
    "RMSNormMode",
    "rms_norm",
    "rms_norm_bwd",
    "rms_norm_bwd_reference",
    "rms_norm_fwd",
    "rms_norm_reference",
]


class RMSNormMode(enum.StrEnum):
    """Which HF RMSNorm the op reproduces (module docstring)."""

    LLAMA = "llama"  # w · cast(x̂): Llama, Mistral, Qwen2, Qwen3
    GEMMA = "gemma"  # cast(x̂ · (1 + w)) in fp32: Gemma 2, Gemma 3


def rms_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, mode: RMSNormMode = RMSNormMode.LLAMA
) -> torch.Tensor:
    """HF ``LlamaRMSNorm.forward`` (LLAMA) or ``Gemma2RMSNorm.forward`` (GEMMA) in plain torch (fp32
    statistics; pass fp32 tensors for an fp32 reference)."""
    input_dtype = x.dtype
    h = x.to(torch.float32)
    variance = h.pow(2).mean(-1, keepdim=True)
    h = h * torch.rsqrt(variance + eps)
    if RMSNormMode(mode) is RMSNormMode.GEMMA:
        return (h * (1.0 + weight.float())).to(input_dtype)
    return weight * h.to(input_dtype)


def rms_norm_bwd_reference(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    mode: RMSNormMode = RMSNormMode.LLAMA,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The derived backward of the module docstring in fp32 torch: returns (dx, dW) in fp32."""
    gemma = RMSNormMode(mode) is RMSNormMode.GEMMA
    xf, wf, dyf = x.float(), weight.float(), dy.float()
    r = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    n = xf * r
    g = dyf * (1.0 + wf if gemma else wf)
    dx = r * (g - n * (g * n).mean(-1, keepdim=True))
    dw = (dyf * (n if gemma else n.to(x.dtype).float())).reshape(-1, x.shape[-1]).sum(0)
    return dx, dw


# Rows a program of the row kernels (the forward, the backward without dW): ``rows_a_program`` (kernels/ops/utils.py).


@triton.jit
def _rms_norm_fwd_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    rstd_ptr,
    x_row_stride,
    y_row_stride,
    n_rows,
    n_cols,
    eps,
    BLOCK_SIZE: tl.constexpr,
    ROWS: tl.constexpr,
    GEMMA: tl.constexpr,
):
    # ROWS rows a program (``rows_a_program``)
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    cols = tl.arange(0, BLOCK_SIZE)[None, :]
    mask = (row < n_rows) & (cols < n_cols)
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    rstd = tl.math.rsqrt(tl.sum(x * x, axis=1, keep_dims=True) / n_cols + eps)
    if GEMMA:  # fp32 all the way, one rounding at the store
        y = x * rstd * (1.0 + w)
    else:  # HF casts the normalised row to the input dtype before the weight multiply; round the same way.
        y = cast_to(x * rstd, x_ptr.dtype.element_ty).to(tl.float32) * w
    tl.store(y_ptr + row * y_row_stride + cols, cast_to(y, y_ptr.dtype.element_ty), mask=mask)
    tl.store(rstd_ptr + row, rstd, mask=row < n_rows)


# Launch shape of the backward with dW (see rms_norm_bwd), the best of bench/rmsnorm_dw_sweep.py (bench/RESULTS.md,
# "RMSNorm backward with dW: pipelined row tiles"): 1 program per SM, 2-row tiles, loads pipelined 3 deep. The
# pipeline's shared memory (stages × rows × 2 tensors × H × itemsize) is capped at DW_SMEM_BYTES: wider rows
# or fp32 inputs get fewer rows per step, then fewer stages.
DW_PROGRAMS_PER_SM = 1
DW_ROWS_PER_STEP = 2
DW_NUM_STAGES = 3
DW_NUM_WARPS: int | None = None  # None: calculate_settings' choice for the row length
DW_SMEM_BYTES = 100 * 1024


def _dw_pipeline(block: int, itemsize: int, n_rows: int) -> tuple[int, int]:
    """(rows per step, stages) within DW_SMEM_BYTES of pipelined loads."""
    rows = min(DW_ROWS_PER_STEP, next_power_of_2(n_rows))
    stages = DW_NUM_STAGES
    while rows > 1 and stages * rows * 2 * block * itemsize > DW_SMEM_BYTES:
        rows //= 2
    while stages > 1 and stages * rows * 2 * block * itemsize > DW_SMEM_BYTES:
        stages -= 1
    return rows, stages


@triton.jit
def _rms_norm_bwd_kernel(
    dy_ptr,
    x_ptr,
    w_ptr,
    rstd_ptr,
    dx_ptr,
    dy_row_stride,
    x_row_stride,
    dx_row_stride,
    n_rows,
    n_cols,
    BLOCK_SIZE: tl.constexpr,
    ROWS: tl.constexpr,
    GEMMA: tl.constexpr,
):
    """Frozen weight: ROWS rows a program (``rows_a_program``), dx only."""
    row = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)[:, None]
    cols = tl.arange(0, BLOCK_SIZE)[None, :]
    mask = (row < n_rows) & (cols < n_cols)
    w = tl.load(w_ptr + cols, mask=cols < n_cols, other=0.0).to(tl.float32)
    if GEMMA:
        w = 1.0 + w
    x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(dy_ptr + row * dy_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
    rstd = tl.load(rstd_ptr + row, mask=row < n_rows, other=0.0)
    n = x * rstd
    g = dy * w
    dx = rstd * (g - n * (tl.sum(g * n, axis=1, keep_dims=True) / n_cols))
    # dx may alias dy (in-place backward): this row of dy is already in registers.
    tl.store(dx_ptr + row * dx_row_stride + cols, cast_to(dx, dx_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd_dw_kernel(
    dy_ptr,
    x_ptr,
    w_ptr,
    rstd_ptr,
    dx_ptr,
    dw_partial_ptr,
    dy_row_stride,
    x_row_stride,
    dx_row_stride,
    n_rows,
    n_cols,
    BLOCK_SIZE: tl.constexpr,
    ROWS_PER_PROGRAM: tl.constexpr,
    ROWS_PER_STEP: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    GEMMA: tl.constexpr,
):
    """Trainable weight: each program walks ROWS_PER_PROGRAM rows, ROWS_PER_STEP at a time as one
    [rows, cols] tile, loads software-pipelined NUM_STAGES deep, and writes one row of fp32 dW partials."""
    pid = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_SIZE)
    col_mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=col_mask, other=0.0).to(tl.float32)[None, :]
    if GEMMA:
        w = 1.0 + w
    dw_acc = tl.zeros([BLOCK_SIZE], dtype=tl.float32)
    # A constexpr trip count: triton 3.6's interpreter cannot loop to a runtime bound under numpy ≥ 2.4.
    for i in tl.range(0, ROWS_PER_PROGRAM, ROWS_PER_STEP, num_stages=NUM_STAGES):
        rows = pid * ROWS_PER_PROGRAM + i + tl.arange(0, ROWS_PER_STEP)
        row_mask = rows < n_rows
        # The last program's tail rows past n_rows load zeros, store nothing and add nothing to dW.
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(x_ptr + rows[:, None] * x_row_stride + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(dy_ptr + rows[:, None] * dy_row_stride + cols[None, :], mask=mask, other=0.0).to(
            tl.float32
        )
        rstd = tl.load(rstd_ptr + rows, mask=row_mask, other=0.0)[:, None]
        n = x * rstd
        g = dy * w
        dx = rstd * (g - n * (tl.sum(g * n, axis=1) / n_cols)[:, None])
        tl.store(
            dx_ptr + rows[:, None] * dx_row_stride + cols[None, :],
            cast_to(dx, dx_ptr.dtype.element_ty),
            mask=mask,
        )
        if GEMMA:  # the forward scaled the fp32 row: no rounding of n in its derivative either
            dw_acc += tl.sum(dy * n, axis=0)
        else:
            dw_acc += tl.sum(dy * cast_to(n, x_ptr.dtype.element_ty).to(tl.float32), axis=0)
    tl.store(dw_partial_ptr + pid * n_cols + cols, dw_acc, mask=col_mask)


@triton.jit
def _sum_partials_kernel(
    partial_ptr,
    dw_ptr,
    n_partials,
    n_cols,
    BLOCK_COLS: tl.constexpr,
    BLOCK_ROWS: tl.constexpr,
    STEPS: tl.constexpr,
):
    """dW = Σ over the programs' fp32 partials, cast to the weight's dtype: one launch for both."""
    cols = tl.program_id(0) * BLOCK_COLS + tl.arange(0, BLOCK_COLS)
    col_mask = cols < n_cols
    acc = tl.zeros([BLOCK_COLS], dtype=tl.float32)
    for i in range(STEPS):  # constexpr trip count (the interpreter's limit, as above); masked past the end
        rows = i * BLOCK_ROWS + tl.arange(0, BLOCK_ROWS)
        mask = (rows < n_partials)[:, None] & col_mask[None, :]
        acc += tl.sum(
            tl.load(partial_ptr + rows[:, None] * n_cols + cols[None, :], mask=mask, other=0.0), axis=0
        )
    tl.store(dw_ptr + cols, cast_to(acc, dw_ptr.dtype.element_ty), mask=col_mask)


def _rows_or_copy(t: torch.Tensor) -> torch.Tensor:
    rows = as_rows(t)
    return rows if rows is not None else t.contiguous().view(-1, t.shape[-1])


def _check(x: torch.Tensor, weight: torch.Tensor, eps: float) -> None:
    check_float_tensor(x, "x", min_ndim=1)
    check_float_tensor(weight, "weight", ndim=1)
    check_same_device(x=x, weight=weight)
    if weight.shape[0] != x.shape[-1]:
        raise ValueError(f"weight has {weight.shape[0]} elements but x's last dim is {x.shape[-1]}")
    if not eps >= 0.0:
        raise ValueError(f"eps must be a non-negative float, got {eps}")


def _out_dtype(x: torch.Tensor, weight: torch.Tensor, mode: RMSNormMode) -> torch.dtype:
    return x.dtype if mode is RMSNormMode.GEMMA else torch.promote_types(x.dtype, weight.dtype)


def rms_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6, mode: RMSNormMode = RMSNormMode.LLAMA
) -> tuple[torch.Tensor, torch.Tensor]:
    """Launch the forward kernel.

    Args:
        x: Input ``[..., H]``.
        weight: Scale ``[H]`` (GEMMA: the offset from 1).
        eps: Added to the mean square before the rsqrt.
        mode: LLAMA or GEMMA semantics (module docstring).

    Returns:
        ``(y, rstd)``: y ``[..., H]`` in the promoted dtype of (x, weight) (GEMMA: x's dtype); rstd
        ``[rows]`` fp32.
    """
    mode = RMSNormMode(mode)
    _check(x, weight, eps)
    n_cols = x.shape[-1]
    x2 = _rows_or_copy(x) if x.numel() else x.reshape(-1, n_cols)
    y = torch.empty(x.shape, dtype=_out_dtype(x, weight, mode), device=x.device)
    rstd = torch.empty(x2.shape[0], dtype=torch.float32, device=x.device)
    if x.numel() == 0:
        return y, rstd
    block, num_warps = calculate_settings(n_cols)
    n_rows = x2.shape[0]
    rows = rows_a_program(n_rows, block)
    _rms_norm_fwd_kernel[(cdiv(n_rows, rows),)](
        x2,
        weight,
        y,
        rstd,
        x2.stride(0),
        n_cols,
        n_rows,
        n_cols,
        eps,
        BLOCK_SIZE=block,
        ROWS=rows,
        GEMMA=mode is RMSNormMode.GEMMA,
        num_warps=num_warps,
    )
    return y, rstd


def rms_norm_bwd(
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    rstd: torch.Tensor,
    *,
    compute_dw: bool = True,
    inplace: bool = False,
    mode: RMSNormMode = RMSNormMode.LLAMA,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the backward kernel.

    Args:
        dy: Gradient of y, same shape as x.
        x: The forward input.
        weight: The forward weight.
        rstd: The per-row fp32 rstd returned by :func:`rms_norm_fwd`.
        compute_dw: Also reduce dW (returned in weight's dtype).
        inplace: Write dx into dy's storage (needs dy in x's dtype and writable row by row).
        mode: The forward's mode.

    Returns:
        ``(dx, dW or None)``.
    """
    gemma = RMSNormMode(mode) is RMSNormMode.GEMMA
    _check(x, weight, 0.0)
    if dy.shape != x.shape:
        raise ValueError(f"dy has shape {tuple(dy.shape)} but x has {tuple(x.shape)}")
    check_float_tensor(dy, "dy")
    n_cols = x.shape[-1]
    if rstd.dtype != torch.float32 or rstd.numel() != x.numel() // max(n_cols, 1):
        raise ValueError("rstd must be the fp32 per-row tensor returned by rms_norm_fwd")
    x2 = _rows_or_copy(x) if x.numel() else x.reshape(-1, n_cols)
    dy2 = _rows_or_copy(dy) if dy.numel() else dy.reshape(-1, n_cols)
    if inplace:
        if dy.dtype != x.dtype or as_rows(dy) is None or not is_writable_in_place(dy):
            raise ValueError(
                "in-place backward needs dy in x's dtype, viewable as rows and not self-overlapping"
            )
        dx, dx2 = dy, dy2
    else:
        dx = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        dx2 = dx.view(-1, n_cols)
    n_rows = x2.shape[0]
    if n_rows == 0 or n_cols == 0:
        dw = torch.zeros_like(weight) if compute_dw else None
        return dx, dw
    block, num_warps = calculate_settings(n_cols)
    if not compute_dw:
        rows = rows_a_program(n_rows, block)
        _rms_norm_bwd_kernel[(cdiv(n_rows, rows),)](
            dy2,
            x2,
            weight,
            rstd,
            dx2,
            dy2.stride(0),
            x2.stride(0),
            dx2.stride(0),
            n_rows,
            n_cols,
            BLOCK_SIZE=block,
            ROWS=rows,
            GEMMA=gemma,
            num_warps=num_warps,
        )
        return dx, None
    # A few programs per SM, each reducing its rows' dW in registers; the fp32 partials (programs × H × 4 B,
    # 4.3 MB at H=4096 on 132 SMs) stay small next to the 400 MB of row I/O. Rows per program is a power of
    # two (≥ the rows per step) so varying token counts compile few variants.
    rows_per_step, stages = _dw_pipeline(block, max(x2.element_size(), dy2.element_size()), n_rows)
    rows_per_program = max(
        rows_per_step, next_power_of_2(cdiv(n_rows, DW_PROGRAMS_PER_SM * num_sms(x.device)))
    )
    n_programs = cdiv(n_rows, rows_per_program)
    partial = torch.empty(n_programs, n_cols, dtype=torch.float32, device=x.device)
    _rms_norm_bwd_dw_kernel[(n_programs,)](
        dy2,
        x2,
        weight,
        rstd,
        dx2,
        partial,
        dy2.stride(0),
        x2.stride(0),
        dx2.stride(0),
        n_rows,
        n_cols,
        BLOCK_SIZE=block,
        ROWS_PER_PROGRAM=rows_per_program,
        ROWS_PER_STEP=rows_per_step,
        NUM_STAGES=stages,
        GEMMA=gemma,
        num_warps=DW_NUM_WARPS or num_warps,
    )
    dw = torch.empty_like(weight)
    steps = next_power_of_2(cdiv(n_programs, 32))
    _sum_partials_kernel[(cdiv(n_cols, 64),)](
        partial, dw, n_programs, n_cols, BLOCK_COLS=64, BLOCK_ROWS=32, STEPS=steps
    )
    return dx, dw


class RMSNormFunction(torch.autograd.Function):
    """Autograd wrapper: saves (x, weight, rstd); backward returns dx and, when trainable, dW."""

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        x: torch.Tensor,
        weight: torch.Tensor,
        eps: float = 1e-6,
        inplace_backward: bool = False,
        mode: RMSNormMode = RMSNormMode.LLAMA,
    ) -> torch.Tensor:
        y, rstd = rms_norm_fwd(x, weight, eps, mode)
        ctx.save_for_backward(x, weight, rstd)
        ctx.inplace_backward = inplace_backward
        ctx.mode = mode
        return y

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, dy: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        # In place only where dy's storage can take dx directly; otherwise a fresh buffer, never an error.
        inplace = (
            ctx.inplace_backward
            and dy.dtype == x.dtype
            and as_rows(dy) is not None
            and is_writable_in_place(dy)
        )
        dx, dw = rms_norm_bwd(
            dy, x, weight, rstd, compute_dw=ctx.needs_input_grad[1], inplace=inplace, mode=ctx.mode
        )
        return (dx if ctx.needs_input_grad[0] else None), dw, None, None, None


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float = 1e-6,
    *,
    inplace_backward: bool = False,
    mode: RMSNormMode = RMSNormMode.LLAMA,
) -> torch.Tensor:
    """RMSNorm exactly as HF ``LlamaRMSNorm`` (or, with GEMMA, ``Gemma2RMSNorm``) computes it, with a
    Triton forward and backward.

    Args:
        x: Input ``[..., H]`` (fp32/bf16/fp16).
        weight: Scale ``[H]`` (GEMMA: the offset from 1); dW is computed when it requires grad.
        eps: Added to the mean square.
        inplace_backward: Write dx into the incoming gradient (see the module docstring for when it is
            safe). Off by default.
        mode: :class:`RMSNormMode` (LLAMA by default).

    Returns:
        ``[..., H]`` in ``torch.promote_types(x.dtype, weight.dtype)`` (GEMMA: in x's dtype).
    """
    return RMSNormFunction.apply(x, weight, eps, inplace_backward, RMSNormMode(mode))
