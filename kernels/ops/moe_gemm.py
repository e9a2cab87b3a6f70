"""Grouped LoRA GEMM over experts: every expert's projection of its own tokens, with its LoRA term, on torch's grouped GEMM.

A mixture-of-experts layer routes each token to k experts. With the routed copies of the tokens sorted by expert
(rows ``offsets[e] : offsets[e+1]`` of ``x`` belong to expert e), each expert's projection is::

    y[m] = x[m] · W_eᵀ + s · (x[m] · A_eᵀ) · B_eᵀ          W [E, N, K] frozen, A [E, r, K], B [E, N, r]

(PEFT's ``ParamWrapper`` on a fused experts parameter, expert e's factors: ``trainer_svc/core/moe.py``). HF's
expert path under PEFT adds ``s · B_e A_e`` to the whole stack first (an [E, N, K] temporary per layer and call,
saved for backward). Here every product is one call of torch's grouped GEMM (``torch.nn.functional.grouped_mm``,
else ``torch._grouped_mm``: what transformers' ``grouped_mm`` experts run), on the same row offsets: the base
``x · W_eᵀ``, then the rank-r ``u = x · A_eᵀ`` and ``s · u · B_eᵀ``; no merged stack exists.

Backward (W frozen: no weight gradient), with u [M, r] saved from the forward::

    v     = dy · B_e                                   [M, r]
    dx    = dy · W_e + s · v · A_e                     two grouped GEMMs over the [E, ·, ·] stacks
    dA_e  = s · Σ_{m ∈ e} v[m]ᵀ ⊗ x[m]                  [E, r, K]  one grouped GEMM reducing over each expert's rows
    dB_e  = s · Σ_{m ∈ e} dy[m]ᵀ ⊗ u[m]                 [E, N, r]  likewise

NF4 experts (:class:`Nf4Experts`, a frozen base quantized as bitsandbytes' NF4: blocks of 64 along each expert's
flattened [N, K], the absmax double-quantized) are dequantized by :func:`~strop.kernels.ops.nf4.nf4_dequantize`
(one launch) into nf4.py's shared per-device scratch buffer just before the base GEMM, in the forward and again in
the backward's ``dy · W_e`` unless the buffer still holds that stack (the down stack, the last one a layer's forward
or recompute dequantizes, is the first its backward needs); no 16-bit stack is saved, and one is resident at a time
(every NF4 weight of the model reuses that buffer, in stream order). The NF4 path is therefore the 16-bit path over the dequantized stack, bit for
bit, by construction.

Numerics: everything in the compute dtype (the autocast dtype when autocast is on, else x's), as PEFT's LoRA under
autocast: fp32 LoRA factors round to it, each GEMM accumulates in fp32 and rounds once, the LoRA term is added to the
base product after both round. The weight gradients are rounded to the compute dtype, then cast to the factors'.
Where torch's grouped GEMM cannot take the operands (no such op; a stride that is not a multiple of 16 bytes, as
rank 4 in bf16), the same products run expert by expert with ``torch.mm``. Saved for backward: x (the caller's
gathered rows, not copied), u [M, r] and the offsets.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from types import SimpleNamespace

import torch

from .nf4 import dequantize_shared_reused, nf4_dequantize

__all__ = ["MoeLoraGemmFunction", "Nf4Experts", "grouped_mm", "moe_lora_gemm", "moe_lora_gemm_reference"]

NF4_BLOCKSIZE = (
    64  # strop's NF4 block (the dense layers' on-load setting: export_svc/core/nf4_on_load.Nf4OnLoad)
)

_GROUPED_MM = getattr(torch.nn.functional, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)
_REFUSED: list[RuntimeError] = []  # the first refusal of torch's grouped GEMM in this process (warned once)


@dataclass(frozen=True)
class Nf4Experts:
    """A frozen fused expert stack ``[E, N, K]`` in NF4: bitsandbytes' codes and absmax, quantized per expert.

    ``packed`` [E·N·K/2] uint8 (two codes a byte, high nibble first); ``absmax`` one per block of
    ``blocksize`` elements of the flattened stack (blocks never straddle experts: N·K is a multiple of the
    block), uint8 codes of ``absmax2``/``code2``/``offset`` when double-quantized (``nested``), else fp32;
    ``dtype`` the dtype the weights had when quantized (what dequantization rounds to first).
    """

    packed: torch.Tensor
    absmax: torch.Tensor
    absmax2: torch.Tensor | None
    code2: torch.Tensor | None
    offset: torch.Tensor | None
    shape: tuple[int, int, int]
    dtype: torch.dtype
    blocksize: int = NF4_BLOCKSIZE
    blocksize2: int = 256

    @property
    def nested(self) -> bool:
        return self.absmax2 is not None

    @property
    def device(self) -> torch.device:
        return self.packed.device

    @classmethod
    def quantize(cls, w: torch.Tensor, *, double_quant: bool = True) -> Nf4Experts:
        """bitsandbytes' ``quantize_4bit`` (NF4, blocks of 64) of each expert's ``[N, K]``, on ``w``'s device.

        Raises:
            ValueError: not a 3-D stack, or N·K not a multiple of the block (blocks would straddle experts).
        """
        from bitsandbytes.functional import quantize_4bit

        if w.dim() != 3 or (w.shape[1] * w.shape[2]) % NF4_BLOCKSIZE:
            raise ValueError(
                f"NF4 experts need an [E, N, K] stack with N·K a multiple of {NF4_BLOCKSIZE}, got {list(w.shape)}"
            )
        # one row an expert: bitsandbytes' CPU kernel blocks per row, its CUDA kernel over the flat index; with
        # rows a multiple of the block both are the flat blocks this file (and nf4.py) read
        packed, qs = quantize_4bit(
            w.detach().contiguous().view(w.shape[0], -1),
            blocksize=NF4_BLOCKSIZE,
            compress_statistics=double_quant,
            quant_type="nf4",
            quant_storage=torch.uint8,
        )
        nested = bool(qs.nested)
        return cls(
            packed=packed.reshape(-1),
            absmax=qs.absmax.reshape(-1),
            absmax2=qs.state2.absmax.reshape(-1).float() if nested else None,
            code2=qs.state2.code.float() if nested else None,
            offset=torch.as_tensor(qs.offset, dtype=torch.float32, device=w.device).reshape(1)
            if nested
            else None,
            shape=tuple(w.shape),
            dtype=w.dtype,
            blocksize2=qs.state2.blocksize if nested else 256,
        )

    def quant_state(self) -> SimpleNamespace:
        """The stack's quantization as the attributes of a bitsandbytes ``QuantState`` (what nf4.py reads)."""
        state2 = SimpleNamespace(absmax=self.absmax2, code=self.code2, blocksize=self.blocksize2)
        return SimpleNamespace(
            quant_type="nf4",
            blocksize=self.blocksize,
            dtype=self.dtype,
            shape=self.shape,
            absmax=self.absmax,
            nested=self.nested,
            state2=state2,
            offset=self.offset,
        )

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dense ``[E, N, K]`` stack (``nf4_dequantize``: what the kernel multiplies, bit for bit)."""
        return nf4_dequantize(self.packed, self.quant_state(), dtype=dtype)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The storage's tensors by role (for buffers, memory counts and digests)."""
        named = {"packed": self.packed, "absmax": self.absmax}
        if self.nested:
            named |= {"absmax2": self.absmax2, "code2": self.code2, "offset": self.offset}
        return named


def moe_lora_gemm_reference(x, offsets, w, a, b, scale: float) -> torch.Tensor:
    """``y[m] = x[m] W_eᵀ + s (x[m] A_eᵀ) B_eᵀ`` expert by expert, in fp32 (the definition, for tests; NF4
    experts dequantized first)."""
    if isinstance(w, Nf4Experts):
        w = w.dequantize(torch.float32)
    out = torch.empty(x.shape[0], w.shape[1], dtype=torch.float32, device=x.device)
    for e in range(w.shape[0]):
        lo, hi = int(offsets[e]), int(offsets[e + 1])
        xe = x[lo:hi].float()
        out[lo:hi] = xe @ w[e].float().T + scale * (xe @ a[e].float().T) @ b[e].float().T
    return out


def _check(x, offsets, w, a, b) -> None:
    if x.dim() != 2 or len(w.shape) != 3 or a.dim() != 3 or b.dim() != 3:
        raise ValueError(
            f"x [M, K], w [E, N, K], a [E, r, K], b [E, N, r]; got {x.shape}, {w.shape}, {a.shape}, {b.shape}"
        )
    e, n, k = w.shape
    if x.shape[1] != k or a.shape[0] != e or a.shape[2] != k or b.shape != (e, n, a.shape[1]):
        raise ValueError(
            f"shapes do not agree: x {list(x.shape)}, w {list(w.shape)}, a {list(a.shape)}, b {list(b.shape)}"
        )
    if offsets.shape != (e + 1,) or offsets.dtype not in (torch.int32, torch.int64):
        raise ValueError(
            f"offsets must be an integer tensor of {e + 1} row offsets, got {offsets.dtype} {list(offsets.shape)}"
        )
    if len({t.device for t in (x, offsets, w, a, b)}) != 1:
        raise ValueError("x, offsets, w, a and b must be on one device")


def _aligned(t: torch.Tensor) -> bool:
    """torch's grouped GEMM's layout rule: 16-byte aligned start, one unit stride among the last two, the others
    multiples of 16 bytes."""
    size = t.element_size()
    if t.data_ptr() % 16 or 1 not in t.stride()[-2:]:
        return False
    return all((st * size) % 16 == 0 for st, n in zip(t.stride(), t.shape, strict=True) if st != 1 and n > 1)


def grouped_mm(a: torch.Tensor, b: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """torch's grouped GEMM on row groups ending at ``ends`` [E] (int32, cumulative), in a's dtype.

    ``a`` [M, K] with ``b`` [E, K, N]: ``out[m] = a[m] · b[e]`` for the rows m of group e ([M, N]).
    ``a`` [K, M] with ``b`` [M, N]: ``out[e] = a[:, rows of e] · b[rows of e]`` ([E, K, N]; an empty group gives 0).
    """
    if _GROUPED_MM is not None and a.numel() and _aligned(a) and _aligned(b):
        try:
            return _GROUPED_MM(a, b, offs=ends)
        except RuntimeError as err:  # a layout or dtype this torch's kernel refuses: said once, then the loop
            if not _REFUSED:
                _REFUSED.append(err)
                warnings.warn(
                    f"torch's grouped GEMM refused {list(a.shape)} × {list(b.shape)} {a.dtype}: {err}; "
                    "the expert GEMMs run expert by expert",
                    RuntimeWarning,
                    stacklevel=2,
                )
    starts = [0, *ends.tolist()]
    if b.dim() == 3:  # per expert over its rows
        out = torch.zeros(a.shape[0], b.shape[2], dtype=a.dtype, device=a.device)
        for e in range(b.shape[0]):
            if starts[e + 1] > starts[e]:
                torch.mm(a[starts[e] : starts[e + 1]], b[e], out=out[starts[e] : starts[e + 1]])
        return out
    out = torch.zeros(len(starts) - 1, a.shape[0], b.shape[1], dtype=a.dtype, device=a.device)
    for e in range(out.shape[0]):
        if starts[e + 1] > starts[e]:
            torch.mm(a[:, starts[e] : starts[e + 1]], b[starts[e] : starts[e + 1]], out=out[e])
    return out


def _dense(w, dtype: torch.dtype) -> torch.Tensor:
    """W [E, N, K] in the compute dtype: an NF4 stack dequantized into the shared scratch buffer (valid until the
    next NF4 dequantization on this device: used for one GEMM, never kept), or read there as it is where the
    buffer still holds it (``dequantize_shared_reused``: the down stack from the forward or recompute that just
    ran, in its backward)."""
    if isinstance(w, Nf4Experts):
        return dequantize_shared_reused(w.packed, w.quant_state(), dtype)
    return w.to(dtype)


def _factors(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A and B in the compute dtype and contiguous (PEFT's B is a permuted view whose strides torch's grouped GEMM
    cannot take; the copy is E·N·r values)."""
    return a.to(dtype).contiguous(), b.to(dtype).contiguous()


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    dev = x.device.type
    return torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else x.dtype


class MoeLoraGemmFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, offsets, w, a, b, scale):
        with torch.autocast(x.device.type, enabled=False):  # the caller chose the dtype: no per-op casts
            return MoeLoraGemmFunction._forward(ctx, x, offsets, w, a, b, scale)

    @staticmethod
    def _forward(ctx, x, offsets, w, a, b, scale):
        dt = x.dtype
        ends = offsets[1:].to(torch.int32)
        a_, b_ = _factors(a, b, dt)
        y = grouped_mm(x, _dense(w, dt).transpose(1, 2), ends)
        u = grouped_mm(x, a_.transpose(1, 2), ends)
        y.add_(grouped_mm(u, b_.transpose(1, 2), ends), alpha=scale)
        # NF4 experts are frozen buffers, kept by reference (no activation is saved for them)
        ctx.nf4 = w if isinstance(w, Nf4Experts) else None
        ctx.save_for_backward(x, ends, a if ctx.nf4 else w, a, b, u)
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx, dy):
        x, ends, w, a, b, u = ctx.saved_tensors
        w, s, dt = ctx.nf4 or w, ctx.scale, x.dtype
        dy = dy.to(dt).contiguous()
        a_, b_ = _factors(a, b, dt)
        v = grouped_mm(dy, b_, ends)  # dy · B_e   [M, r]
        dx = da = db = None
        if ctx.needs_input_grad[0]:
            dx = grouped_mm(dy, _dense(w, dt), ends)
            dx.add_(grouped_mm(v, a_, ends), alpha=s)
        # an expert without rows gets exactly 0 (the per-expert loop's zeros; what torch's kernel leaves there is not read)
        has_rows = (torch.diff(ends, prepend=ends.new_zeros(1)) > 0)[:, None, None]
        if ctx.needs_input_grad[3]:  # dA_e = s Σ v[m]ᵀ x[m]
            da = grouped_mm(v.t(), x, ends).where(has_rows, 0).to(a.dtype).mul_(s)
        if ctx.needs_input_grad[4]:  # dB_e = s Σ dy[m]ᵀ u[m]
            db = grouped_mm(dy.t(), u, ends).where(has_rows, 0).to(b.dtype).mul_(s)
        return dx, None, None, da, db, None


def moe_lora_gemm(x, offsets, w, a, b, scale: float) -> torch.Tensor:
    """``y[m] = x[m] W_eᵀ + s (x[m] A_eᵀ) B_eᵀ`` for rows sorted by expert (``offsets`` [E + 1]), grouped GEMMs.

    Args:
        x: [M, K] routed rows, grouped by expert.
        offsets: [E + 1] row offsets (int32/int64), ``offsets[0] = 0``, ``offsets[E] = M``.
        w: [E, N, K] frozen expert weights (any strides), or an :class:`Nf4Experts` stack (dequantized per call).
        a: [E, r, K] LoRA A per expert; b: [E, N, r] LoRA B per expert.
        scale: the LoRA scale s.

    Returns:
        y [M, N] in the compute dtype (autocast's when on, else x's); gradients flow to x, a and b (w is frozen).
    """
    _check(x, offsets, w, a, b)
    return MoeLoraGemmFunction.apply(x.to(_compute_dtype(x)), offsets, w, a, b, scale)
