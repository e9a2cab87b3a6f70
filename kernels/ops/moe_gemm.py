"""Grouped LoRA GEMM over experts: every expert's projection of its own tokens, with its LoRA term, in one launch.

A mixture-of-experts layer routes each token to k experts. With the routed copies of the tokens sorted by expert
(rows ``offsets[e] : offsets[e+1]`` of ``x`` belong to expert e), each expert's projection is::

    y[m] = x[m] · W_eᵀ + s · (x[m] · A_eᵀ) · B_eᵀ          W [E, N, K] frozen, A [E, r, K], B [E, N, r]

(PEFT's ``ParamWrapper`` on a fused experts parameter, expert e's factors: ``trainer_svc/core/moe.py``). HF's
expert loop runs this as one small GEMM pair per expert after adding ``s · B_e A_e`` to the whole stack (an
[E, N, K] temporary per layer and call). Here one launch covers all experts: the grid walks row tiles that never
straddle two experts (the host lists each tile's expert and first row), and each program accumulates
``x · W_eᵀ`` and the rank-r ``x · A_eᵀ`` over K in the same loop, then adds ``s · (x A_eᵀ) B_eᵀ``.

Backward (W frozen: no weight gradient), with u = x · A_eᵀ [M, r] saved from the forward (r values a row)::

    dx[m] = dy[m] · W_e + s · (dy[m] · B_e) · A_e          the forward kernel with W, B, A transposed by strides
    dA_e  = s · Σ_{m ∈ e} (dy[m] · B_e)ᵀ ⊗ x[m]            [r, K]   one program per (row tile, K tile)
    dB_e  = s · Σ_{m ∈ e} dy[m]ᵀ ⊗ u[m]                    [N, r]   one program per (row tile, N tile)

The first is the same kernel as the forward (``out[m, j] = Σ_i in[m, i] P[e, j, i] + s Σ_ρ (Σ_i in[m, i] Q[e, ρ, i])
R[e, j, ρ]`` with P, Q, R given by strides); it also writes v = dy · B_e, which the dA reduction reads. The two
weight gradients are one segmented-reduction kernel (``out[e, j, ρ] = s Σ_{m ∈ e} U[m, j] V[m, ρ]``).

NF4 experts (:class:`Nf4Experts`, a frozen base quantized as bitsandbytes' NF4: blocks of 64 along each expert's
flattened [N, K], the absmax double-quantized): the kernel gathers the packed codes and absmax of the W tile it is
about to multiply and dequantizes it in registers (``nf4.nf4_gather``, the format of ``nf4.py``), in the forward
and in dx's ``W_e`` alike. The tile index is a flat index into the logical [E, N, K] stack, so the transposed read
is the same stride swap as for a 16-bit W; no [E, N, K] 16-bit temporary exists. The values are bit-identical to
:func:`~strop.kernels.ops.nf4.nf4_dequantize`'s (fp contraction off in those launches), so the NF4 path computes
exactly the 16-bit path over the dequantized stack.

Numerics: loads upcast to fp32, fp32 accumulation, one rounding on store; fp32 inputs (and the interpreter) use
IEEE fp32 dots, so the CPU tier compares with :func:`moe_lora_gemm_reference` to fp32 rounding. Saved for backward:
x (the caller's gathered rows, not copied), u [M, r] and the tile tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import torch
import triton
import triton.language as tl

from .nf4 import nf4_code, nf4_dequantize, nf4_gather
from .utils import INTERPRETER, cdiv, next_power_of_2

__all__ = ["MoeLoraGemmFunction", "Nf4Experts", "expert_tiles", "moe_lora_gemm", "moe_lora_gemm_reference"]

_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
NF4_BLOCKSIZE = (
    64  # strop's NF4 block (the dense layers' on-load setting: export_svc/core/nf4_on_load.Nf4OnLoad)
)


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
            w.detach().contiguous().view(w.shape[0], -1), blocksize=NF4_BLOCKSIZE,
            compress_statistics=double_quant, quant_type="nf4", quant_storage=torch.uint8,
        )  # fmt: skip
        nested = bool(qs.nested)
        return cls(
            packed=packed.reshape(-1), absmax=qs.absmax.reshape(-1),
            absmax2=qs.state2.absmax.reshape(-1).float() if nested else None,
            code2=qs.state2.code.float() if nested else None,
            offset=torch.as_tensor(qs.offset, dtype=torch.float32, device=w.device).reshape(1) if nested else None,
            shape=tuple(w.shape), dtype=w.dtype, blocksize2=qs.state2.blocksize if nested else 256,
        )  # fmt: skip

    def quant_state(self) -> SimpleNamespace:
        """The stack's quantization as the attributes of a bitsandbytes ``QuantState`` (what nf4.py reads)."""
        state2 = SimpleNamespace(absmax=self.absmax2, code=self.code2, blocksize=self.blocksize2)
        return SimpleNamespace(
            quant_type="nf4", blocksize=self.blocksize, dtype=self.dtype, shape=self.shape, absmax=self.absmax,
            nested=self.nested, state2=state2, offset=self.offset,
        )  # fmt: skip

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The dense ``[E, N, K]`` stack (``nf4_dequantize``: what the kernel multiplies, bit for bit)."""
        return nf4_dequantize(self.packed, self.quant_state(), dtype=dtype)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The storage's tensors by role (for buffers, memory counts and digests)."""
        named = {"packed": self.packed, "absmax": self.absmax}
        if self.nested:
            named |= {"absmax2": self.absmax2, "code2": self.code2, "offset": self.offset}
        return named


# Untuned: the CPU tier's shapes; a GPU sweep (bench) is still to be run.
BLOCK_M, BLOCK_N, BLOCK_K = 32, 32, 32


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


def expert_tiles(offsets: torch.Tensor, block_m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert, first row) of every BLOCK_M row tile, tiles never straddling two experts (empty experts: none)."""
    counts = (offsets[1:] - offsets[:-1]).tolist()
    experts, starts = [], []
    for e, n in enumerate(counts):
        for t in range(cdiv(int(n), block_m)):
            experts.append(e)
            starts.append(int(offsets[e]) + t * block_m)
    dev = offsets.device
    return torch.tensor(experts, dtype=torch.int32, device=dev), torch.tensor(
        starts, dtype=torch.int64, device=dev
    )


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE or INTERPRETER:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b.to(a.dtype))  # 16-bit rows: fp32 LoRA factors round to them, as under PEFT's autocast


@triton.jit
def _grouped_fwd_kernel(
    in_ptr, p_ptr, q_ptr, r_ptr, out_ptr, u_ptr, tile_expert, tile_start, offsets, scale,
    J, RANK,
    s_in_m, s_in_i, s_pe, s_pj, s_pi, s_qe, s_qr, s_qi, s_re, s_rj, s_rr, s_out_m, s_out_j, s_u_m, s_u_r,
    absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr,
    WRITE_U: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_R: tl.constexpr,
    K_IN: tl.constexpr, N_I: tl.constexpr,
    P_NF4: tl.constexpr, NESTED: tl.constexpr, BS: tl.constexpr, BS2: tl.constexpr, QDTYPE: tl.constexpr,
):  # fmt: skip
    """out[m, j] = Σ_i in[m, i] P[e, j, i] + s · Σ_ρ u[m, ρ] R[e, j, ρ], u[m, ρ] = Σ_i in[m, i] Q[e, ρ, i].

    ``P_NF4``: ``p_ptr`` holds NF4 codes and ``s_p*`` are the logical stack's strides (a flat element index)."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.load(tile_expert + t).to(tl.int64)
    m0 = tl.load(tile_start + t)
    m_end = tl.load(offsets + e + 1)
    rm = m0 + tl.arange(0, BLOCK_M)
    rj = tl.program_id(1).to(tl.int64) * BLOCK_J + tl.arange(0, BLOCK_J)
    rr = tl.arange(0, BLOCK_R)
    m_mask, j_mask, r_mask = rm < m_end, rj < J, rr < RANK
    acc = tl.zeros((BLOCK_M, BLOCK_J), dtype=tl.float32)
    u = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for it in range(N_I):  # constexpr bound: triton 3.6's interpreter cannot loop to a runtime one
        ri = it * BLOCK_I + tl.arange(0, BLOCK_I)
        i_mask = ri < K_IN
        xin = tl.load(
            in_ptr + rm[:, None] * s_in_m + ri[None, :] * s_in_i,
            mask=m_mask[:, None] & i_mask[None, :],
            other=0.0,
        )
        p_mask = i_mask[:, None] & j_mask[None, :]
        p_idx = e * s_pe + rj[None, :] * s_pj + ri[:, None] * s_pi
        if P_NF4:
            p = nf4_gather(
                p_ptr,
                p_idx,
                p_mask,
                absmax_ptr,
                absmax2_ptr,
                code2_ptr,
                offset_ptr,
                code_ptr,
                BS,
                BS2,
                NESTED,
                QDTYPE,
            )
            p = tl.where(p_mask, p, 0.0)
        else:
            p = tl.load(p_ptr + p_idx, mask=p_mask, other=0.0)
        q = tl.load(
            q_ptr + e * s_qe + rr[None, :] * s_qr + ri[:, None] * s_qi,
            mask=i_mask[:, None] & r_mask[None, :],
            other=0.0,
        )
        acc += _dot(xin, p, IEEE)
        u += _dot(xin, q, IEEE)
    rmat = tl.load(
        r_ptr + e * s_re + rj[None, :] * s_rj + rr[:, None] * s_rr,
        mask=r_mask[:, None] & j_mask[None, :],
        other=0.0,
    )
    acc += scale * _dot(u, rmat.to(tl.float32), True)
    tl.store(
        out_ptr + rm[:, None] * s_out_m + rj[None, :] * s_out_j,
        acc.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & j_mask[None, :],
    )
    if WRITE_U and tl.program_id(1) == 0:
        tl.store(u_ptr + rm[:, None] * s_u_m + rr[None, :] * s_u_r, u, mask=m_mask[:, None] & r_mask[None, :])


@triton.jit
def _grouped_outer_kernel(
    u_ptr, v_ptr, out_ptr, tile_expert, tile_start, offsets, scale, J, RANK,
    s_u_m, s_u_j, s_v_m, s_v_r, s_oe, s_oj, s_or,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_J: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    """out[e, j, ρ] += s · Σ_{m in this row tile of e} U[m, j] V[m, ρ]: each tile adds its share to its expert's
    fp32 gradient (an atomic add: a tile's rows are a runtime count, and the interpreter loops only to constexpr
    bounds; on the GPU the order of the adds, and so the last bits, may vary run to run)."""
    t = tl.program_id(0).to(tl.int64)
    e = tl.load(tile_expert + t).to(tl.int64)
    m0 = tl.load(tile_start + t)
    m_end = tl.load(offsets + e + 1)
    rm = m0 + tl.arange(0, BLOCK_M)
    rj = tl.program_id(1).to(tl.int64) * BLOCK_J + tl.arange(0, BLOCK_J)
    rr = tl.arange(0, BLOCK_R)
    m_mask, j_mask, r_mask = rm < m_end, rj < J, rr < RANK
    uu = tl.load(
        u_ptr + rm[None, :] * s_u_m + rj[:, None] * s_u_j, mask=j_mask[:, None] & m_mask[None, :], other=0.0
    )
    vv = tl.load(
        v_ptr + rm[:, None] * s_v_m + rr[None, :] * s_v_r, mask=m_mask[:, None] & r_mask[None, :], other=0.0
    )
    acc = scale * _dot(uu, vv, IEEE)
    tl.atomic_add(
        out_ptr + e * s_oe + rj[:, None] * s_oj + rr[None, :] * s_or,
        acc,
        mask=j_mask[:, None] & r_mask[None, :],
    )


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


def _nf4_args(p) -> tuple[tuple, dict]:
    """The kernel's NF4 pointer arguments and constexprs for ``p`` (placeholders for a 16-bit stack)."""
    if not isinstance(p, Nf4Experts):
        return (p,) * 5, dict(P_NF4=False, NESTED=False, BS=1, BS2=1, QDTYPE=tl.float32)
    nested = p.nested
    ptrs = (p.absmax, p.absmax2, p.code2, p.offset) if nested else (p.absmax,) * 4
    consts = dict(P_NF4=True, NESTED=nested, BS=p.blocksize, BS2=p.blocksize2, QDTYPE=_TL[p.dtype])
    return (*ptrs, nf4_code(p.device)), consts


def _grouped(inp, p, q, r, offsets, tiles, scale, n_out, strides_p, strides_q, strides_r, want_u):
    """The forward kernel on ``inp`` [M, I]: out [M, n_out] and (``want_u``) the rank-r product [M, r] in fp32."""
    m, i = inp.shape
    rank = q.shape[1] if strides_q is None else strides_q[3]
    out = torch.empty(m, n_out, dtype=inp.dtype, device=inp.device)
    u = torch.empty(m, rank, dtype=torch.float32, device=inp.device) if want_u else out
    tile_expert, tile_start = tiles
    if m and len(tile_expert):
        grid = (len(tile_expert), cdiv(n_out, BLOCK_N))
        nf4_ptrs, nf4_consts = _nf4_args(p)
        _grouped_fwd_kernel[grid](
            inp, p.packed if nf4_consts["P_NF4"] else p, q, r, out, u, tile_expert, tile_start, offsets,
            float(scale), n_out, rank,
            inp.stride(0), inp.stride(1), *strides_p, *strides_q[:3], *strides_r, out.stride(0), out.stride(1),
            u.stride(0), u.stride(1) if want_u else 0, *nf4_ptrs,
            WRITE_U=want_u, IEEE=inp.dtype == torch.float32, BLOCK_M=BLOCK_M, BLOCK_J=BLOCK_N, BLOCK_I=BLOCK_K,
            BLOCK_R=max(16, next_power_of_2(rank)), K_IN=i, N_I=cdiv(i, BLOCK_K), **nf4_consts,
            # NF4: the absmax's multiply and add round twice, as bitsandbytes does (no FMA)
            enable_fp_fusion=not nf4_consts["P_NF4"],
        )  # fmt: skip
    return out, (u if want_u else None)


def _strides(w) -> tuple[int, int, int]:
    """W's element strides: a 16-bit tensor's own; an NF4 stack's logical (contiguous [E, N, K]) ones."""
    if isinstance(w, Nf4Experts):
        _, n, k = w.shape
        return n * k, k, 1
    return w.stride(0), w.stride(1), w.stride(2)


class MoeLoraGemmFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, offsets, w, a, b, scale):
        _check(x, offsets, w, a, b)
        tiles = expert_tiles(offsets, BLOCK_M)
        rank = a.shape[1]
        y, u = _grouped(
            x, w, a, b, offsets, tiles, scale, w.shape[1], _strides(w),
            (a.stride(0), a.stride(1), a.stride(2), rank), (b.stride(0), b.stride(1), b.stride(2)), True,
        )  # fmt: skip
        # NF4 experts are frozen buffers, kept by reference (no activation is saved for them)
        ctx.nf4 = w if isinstance(w, Nf4Experts) else None
        ctx.save_for_backward(x, offsets, a if ctx.nf4 else w, a, b, u, *tiles)
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx, dy):
        x, offsets, w, a, b, u, tile_expert, tile_start = ctx.saved_tensors
        w = ctx.nf4 or w
        s, rank, k = ctx.scale, a.shape[1], x.shape[1]
        ws = _strides(w)
        dy = dy.contiguous()
        # dx = dy W_e + s (dy B_e) A_e: P[e, j=k, i=n] = W[e, n, k], Q[e, ρ, i=n] = B[e, n, ρ], R[e, j=k, ρ] = A[e, ρ, k]
        dx, v = _grouped(
            dy, w, b, a, offsets, (tile_expert, tile_start), s, k,
            (ws[0], ws[2], ws[1]), (b.stride(0), b.stride(2), b.stride(1), rank),
            (a.stride(0), a.stride(2), a.stride(1)), True,
        )  # fmt: skip
        da = db = None
        n = w.shape[1]
        block_r = max(16, next_power_of_2(rank))
        ieee = x.dtype == torch.float32
        if ctx.needs_input_grad[
            3
        ]:  # dA_e[ρ, k] = s Σ v[m, ρ] x[m, k]: out[e, j=k, ρ] written into dA's strides
            da = torch.zeros(a.shape, dtype=torch.float32, device=a.device)
            _grouped_outer_kernel[(len(tile_expert), cdiv(k, BLOCK_N))](
                x, v, da, tile_expert, tile_start, offsets, float(s), k, rank, x.stride(0), x.stride(1), v.stride(0), v.stride(1),
                da.stride(0), da.stride(2), da.stride(1),
                IEEE=ieee, BLOCK_M=BLOCK_M, BLOCK_J=BLOCK_N, BLOCK_R=block_r,
            )  # fmt: skip
            da = da.to(a.dtype)
        if ctx.needs_input_grad[4]:  # dB_e[n, ρ] = s Σ dy[m, n] u[m, ρ]
            db = torch.zeros(b.shape, dtype=torch.float32, device=b.device)
            _grouped_outer_kernel[(len(tile_expert), cdiv(n, BLOCK_N))](
                dy, u, db, tile_expert, tile_start, offsets, float(s), n, rank, dy.stride(0), dy.stride(1), u.stride(0), u.stride(1),
                db.stride(0), db.stride(1), db.stride(2),
                IEEE=ieee, BLOCK_M=BLOCK_M, BLOCK_J=BLOCK_N, BLOCK_R=block_r,
            )  # fmt: skip
            db = db.to(b.dtype)
        return dx if ctx.needs_input_grad[0] else None, None, None, da, db, None


def moe_lora_gemm(x, offsets, w, a, b, scale: float) -> torch.Tensor:
    """``y[m] = x[m] W_eᵀ + s (x[m] A_eᵀ) B_eᵀ`` for rows sorted by expert (``offsets`` [E + 1]), one launch.

    Args:
        x: [M, K] routed rows, grouped by expert.
        offsets: [E + 1] row offsets (int32/int64), ``offsets[0] = 0``, ``offsets[E] = M``.
        w: [E, N, K] frozen expert weights (any strides), or an :class:`Nf4Experts` stack dequantized in the kernel.
        a: [E, r, K] LoRA A per expert; b: [E, N, r] LoRA B per expert.
        scale: the LoRA scale s.

    Returns:
        y [M, N] in x's dtype; gradients flow to x, a and b (w is frozen).
    """
    return MoeLoraGemmFunction.apply(x, offsets, w, a, b, scale)
