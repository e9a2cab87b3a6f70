"""Grouped LoRA GEMM over experts: every expert's projection of its own tokens, with its LoRA term, on torch's grouped GEMM.

A mixture-of-experts layer routes each token to k experts. With the routed copies of the tokens sorted by expert
(rows ``offsets[e] : offsets[e+1]`` of ``x`` belong to expert e), each expert's projection is::

    y[m] = x[m] · W_eᵀ + s · (x[m] · A_eᵀ) · B_eᵀ          W [E, N, K] frozen, A [E, r, K], B [E, N, r]

(PEFT's ``ParamWrapper`` on a fused experts parameter, expert e's factors: ``trainer_svc/core/moe.py``), i.e.
``y[m] = x[m] · (W_e + s · B_e A_e)ᵀ``. HF's expert path under PEFT builds that merged stack too, as an [E, N, K]
temporary per layer and call saved for backward. Here one Triton kernel (``_merge_kernel``) writes it into nf4.py's
shared per-device scratch buffer, reading W (16-bit, or NF4 codes dequantized in the kernel) and adding the rank-r
product tile by tile; then every product is one call of torch's grouped GEMM (``torch.nn.functional.grouped_mm``,
else ``torch._grouped_mm``: what transformers' ``grouped_mm`` experts run) on the same row offsets: ``x · W'_eᵀ``.
One pass over x and one [M, N] output, where separate LoRA terms cost a second read of x, an [M, N] term and a
read-modify-write of y.

Backward (W frozen: no weight gradient)::

    dx    = dy · (W_e + s · B_e A_e)                   one grouped GEMM over the merged stack
    v     = dy · B_e,  u = x · A_eᵀ                     [M, r] each (u computed here, once, not in every forward
                                                       of a checkpointed layer)
    dA_e  = s · Σ_{m ∈ e} v[m]ᵀ ⊗ x[m]                  [E, r, K]  one grouped GEMM reducing over each expert's rows
    dB_e  = s · Σ_{m ∈ e} dy[m]ᵀ ⊗ u[m]                 [E, N, r]  likewise

The backward merges the stack again unless the buffer still holds it (``nf4.shared_buffer_holding``: the same stack
and factors, unmodified, and nothing else took the buffer): an uncheckpointed MoE layer's down stack, the last one
its forward merges, is the first its backward needs; a checkpointed layer's gate/up stack, the last one its recompute
merges, is the next its backward needs (4 merges a checkpointed layer and step: forward gate/up and down, recompute
gate/up, backward down). No merged stack is saved; the split form's product (the down projection) merges into the
buffer's second slot, every other weight into the first (every NF4 weight of the model reuses that buffer, in stream
order), so a 16-bit session's experts also use those two. The second slot keeps that count under strop's offloaded
checkpoint too, which recomputes a layer before its backward (the gate/up merge first, then the backward's down
merge): with one slot the down merge would take the gate/up stack the backward needs next, a fifth merge a layer.

``split=True`` runs the same products as two autograd nodes, one that saves x and computes nothing (its backward
gives dA from du = s · dy · B_e) and the product (saving no tensor; it computes u = x · A_eᵀ too, and holds the
stack, the factors and u, [M, r], on the node), so that a checkpointed layer ending in this projection (an MoE
layer's down projection) is recomputed only up to its input: torch's non-reentrant checkpoint stops its recompute
at the layer's last saved tensor, before the merge, the product and u.

NF4 experts (:class:`Nf4Experts`, a frozen base quantized as bitsandbytes' NF4: blocks of 64 along each expert's
flattened [N, K], the absmax double-quantized) are dequantized by the merge kernel exactly as
:func:`~strop.kernels.ops.nf4.nf4_dequantize` does (rounded to the stack's dtype), so the NF4 path is the 16-bit
path over the dequantized stack, bit for bit, by construction.

Numerics: everything in the compute dtype (the autocast dtype when autocast is on, else x's), as PEFT's LoRA under
autocast: fp32 LoRA factors round to it; the merged weight is W plus the factors' product in fp32, rounded once to
it (PEFT's merged stack is rounded to it too); each GEMM accumulates in fp32 and rounds once. The weight gradients are
rounded to the compute dtype, then cast to the factors'. Where torch's grouped GEMM cannot take the operands (no such
op; a stride that is not a multiple of 16 bytes, as rank 4 in bf16), the same products run expert by expert with
``torch.mm``; off the GPU and the interpreter the merge is torch's. Saved for backward: x (the caller's gathered rows,
not copied) and the offsets.
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from types import SimpleNamespace

import torch
import triton
import triton.language as tl

from .nf4 import _TL_DTYPES, _code, _offset, _use_kernel, nf4_dequantize, shared_buffer_holding
from .small_k import MAX_SMALL_K, block_k, small_k_tile
from .utils import cast_to, compute_dtype

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


@triton.jit
def _block_scale(
    absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, blk, mask, NESTED: tl.constexpr, BS2: tl.constexpr
):
    """The fp32 absmax of NF4 blocks ``blk`` (any shape), double quantization undone as bitsandbytes does."""
    if NESTED:
        q2 = tl.load(absmax_ptr + blk, mask=mask, other=0).to(tl.int32)
        s1 = tl.load(code2_ptr + q2, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(absmax2_ptr + blk // BS2, mask=mask, other=0.0).to(tl.float32)
        absmax = s1 * s2  # two roundings, as bitsandbytes (the launch disables fp contraction)
        return absmax + tl.load(offset_ptr).to(tl.float32)
    return tl.load(absmax_ptr + blk, mask=mask, other=0.0).to(tl.float32)


# fmt: skip on the signature: one row per role (the stack and its NF4 state, the factors, sizes, strides, constexprs)
@triton.jit
def _merge_kernel(
    w_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, pairs_ptr,
    b_ptr, a_ptr, out_ptr, scale,
    N, K, R,
    b_se, b_sn, b_sr, a_se, a_sr, a_sk, w_se, w_sn, w_sk,
    NF4: tl.constexpr, HALF_BS: tl.constexpr, NESTED: tl.constexpr, BS2: tl.constexpr, ROW_BLOCKS: tl.constexpr,
    QDTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, PAIRS: tl.constexpr,
    K_TILES: tl.constexpr,
):  # fmt: skip
    """K_TILES consecutive [BLOCK_N, BLOCK_K] tiles of expert e's ``W_e + s · B_e A_e`` (:func:`_merge_tile` each)."""
    for t in tl.range(K_TILES):
        _merge_tile(
            w_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, pairs_ptr,
            b_ptr, a_ptr, out_ptr, scale,
            N, K, R,
            b_se, b_sn, b_sr, a_se, a_sr, a_sk, w_se, w_sn, w_sk,
            tl.program_id(1) * K_TILES + t,
            NF4, HALF_BS, NESTED, BS2, ROW_BLOCKS, QDTYPE, OUT_DTYPE, IEEE, BLOCK_N, BLOCK_K, BLOCK_R, PAIRS,
        )  # fmt: skip


@triton.jit
def _merge_tile(
    w_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, pairs_ptr,
    b_ptr, a_ptr, out_ptr, scale,
    N, K, R,
    b_se, b_sn, b_sr, a_se, a_sr, a_sk, w_se, w_sn, w_sk,
    kt,
    NF4: tl.constexpr, HALF_BS: tl.constexpr, NESTED: tl.constexpr, BS2: tl.constexpr, ROW_BLOCKS: tl.constexpr,
    QDTYPE: tl.constexpr, OUT_DTYPE: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_R: tl.constexpr, PAIRS: tl.constexpr,
):  # fmt: skip
    """Column tile ``kt`` of the program's [BLOCK_N, ·] rows of expert e's ``W_e + s · B_e A_e``: W read (NF4:
    dequantized as nf4.py's kernel does, bit for bit, and rounded to the stack's dtype), the rank-R product added
    in fp32, rounded once."""
    e = tl.program_id(2).to(tl.int64)
    rn = tl.program_id(0).to(tl.int64) * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = kt.to(tl.int64) * BLOCK_K + tl.arange(0, BLOCK_K)
    n_mask = rn < N
    mask = n_mask[:, None] & (rk < K)[None, :]
    row = e * N * K + rn * K  # each row's first element in the flat stack
    if NF4:  # K even: a row starts on a byte; the tile's BLOCK_K // 2 bytes a row, two codes each
        rb = kt.to(tl.int64) * (BLOCK_K // 2) + tl.arange(0, BLOCK_K // 2)
        bmask = n_mask[:, None] & (rb < K // 2)[None, :]
        byte = row[:, None] // 2 + rb[None, :]
        if ROW_BLOCKS and (BLOCK_K % (2 * HALF_BS) == 0):
            # K and the tile both whole blocks: a tile row spans BLOCK_K // blocksize blocks, each block's scale
            # read once a row (not once a byte) and selected by column
            absmax = tl.zeros([BLOCK_N, BLOCK_K // 2], dtype=tl.float32)
            first = row // (2 * HALF_BS) + kt.to(tl.int64) * (BLOCK_K // (2 * HALF_BS))
            col_blk = (tl.arange(0, BLOCK_K // 2) // HALF_BS)[None, :]
            for j in tl.static_range(BLOCK_K // (2 * HALF_BS)):
                rmask = n_mask & (kt * BLOCK_K + j * 2 * HALF_BS < K)
                scale_j = _block_scale(
                    absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, first + j, rmask, NESTED, BS2
                )
                absmax = tl.where(col_blk == j, scale_j[:, None], absmax)
        else:
            absmax = _block_scale(
                absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, byte // HALF_BS, bmask, NESTED, BS2
            )
        b = tl.load(w_ptr + byte, mask=bmask, other=0).to(tl.int32)
        if PAIRS:
            # both codes of a byte from one 256-entry table of (code[high nibble], code[low nibble]): one 8-byte
            # read a byte, the pair already in output order; a warp's reads spread over the table's 2 KiB
            pair = tl.load(pairs_ptr + (2 * b)[:, :, None] + tl.arange(0, 2)[None, None, :])
            v = tl.reshape(pair * absmax[:, :, None], [BLOCK_N, BLOCK_K])
        else:
            # each nibble's code from the 16-entry code book: two 4-byte reads a byte, a warp's all within the
            # book's 64 bytes (one cache line), interleaved into output order; the same products as the pairs'
            v = tl.interleave(tl.load(code_ptr + (b >> 4)) * absmax, tl.load(code_ptr + (b & 0x0F)) * absmax)
        # rounded to the stack's dtype as nf4.py's kernel does, to nearest even (cast_to: the hardware's rounding
        # compiled, integer rounding in the interpreter, whose cast truncates)
        v = cast_to(v, QDTYPE).to(tl.float32)
    else:
        v = tl.load(w_ptr + e * w_se + rn[:, None] * w_sn + rk[None, :] * w_sk, mask=mask, other=0.0).to(
            tl.float32
        )
    # B_e [rows, R] @ A_e [R, cols], one tl.dot (small_k's tile: fp32, exact products of the 16-bit factors)
    ba = small_k_tile(b_ptr + e * b_se, a_ptr + e * a_se, rn, rk, n_mask, rk < K, R, b_sn, b_sr, a_sr, a_sk, BLOCK_R, IEEE)  # fmt: skip
    tl.store(out_ptr + row[:, None] + rk[None, :], cast_to(v + scale * ba, OUT_DTYPE), mask=mask)


# The merge's tiles, (BLOCK_N, BLOCK_K, num_warps, PAIRS, K_TILES): the first is what the interpreter (CPU tests, which pay
# per program) always runs; on CUDA the autotuner times them all on first use for each projection's shape, rank and
# dtypes (a trainer's first step: a compile and ~0.1 s of timing a tile) and keeps the fastest. The NF4 tile's
# code gathers hold a 64-bit address a byte or nibble, so registers bound the programs an SM runs (ptxas -v on the
# sm_90 compile says how many); the smaller tiles trade elements a thread for programs in flight. PAIRS picks how a
# byte's two codes are read: one 8-byte gather from the 2 KiB pair table (fewer instructions; a warp's 32 reads
# touch up to 16 of its 128-byte lines, each a pass of the L1) or two 4-byte gathers from the 64-byte code book
# (one line: one pass each); the same values either way. Every tile gives each warpgroup 64 rows, so the rank-r
# product is one Hopper wgmma k-step whatever the tile (fewer rows a warpgroup would make it mma's); W's part is
# exact. A 16-bit stack and NF4 codes of one shape share the kept tile (_MERGE_TILE's key), so the two paths merge
# to the same bits. K_TILES > 1 loops a program over that many tiles along K (a runtime loop, which Triton may
# pipeline): the row setup, expert offsets and mask work once per program, not once a tile, and the next tile's loads
# can be in flight while one is stored (a single-tile merge moves about half of what a copy does: bench/RESULTS.md,
# issue 38); the same per-element operations, so the same bits. Three single tiles a lookup and one
# looped, eight configs in all, each a compile at the first step (64 × 32 runs the most instructions an element,
# 128 × 128 the fewest warps an SM: left out).
_MERGE_TILES = tuple(
    (n, k, warps, pairs, k_tiles)
    for pairs in (False, True)
    for n, k, warps, k_tiles in ((64, 128, 4, 1), (64, 64, 4, 1), (128, 64, 8, 1), (64, 64, 4, 4))
)
_TUNED_MERGE: list = []


_CODE_PAIRS: dict[torch.device, torch.Tensor] = {}


def _code_pairs(device: torch.device) -> torch.Tensor:
    """[256, 2] fp32: for each byte, the NF4 code of its high nibble then of its low one (the stack's order)."""
    pairs = _CODE_PAIRS.get(device)
    if pairs is None:
        byte = torch.arange(256, device=device)
        code = _code(device)
        pairs = _CODE_PAIRS[device] = torch.stack((code[byte >> 4], code[byte & 0x0F]), dim=1).contiguous()
    return pairs


# The tile the autotuner kept, by what it keys on: later merges of that shape launch the kernel with it directly,
# without the autotuner's per-call bookkeeping (host time on every merge, several a layer and step).
_MERGE_TILE: dict[tuple, dict] = {}


def merge_tile_kwargs(tile: tuple) -> dict:
    """A ``_MERGE_TILES`` entry as the kernel's launch keywords."""
    n, k, warps, pairs, k_tiles = tile
    return {"BLOCK_N": n, "BLOCK_K": k, "PAIRS": pairs, "K_TILES": k_tiles, "num_warps": warps}


def _merge_kernel_for(key: tuple, device: torch.device):
    """(kernel, tile kwargs, tuner): the first tile off CUDA (the interpreter); on CUDA the tile the autotuner
    kept for ``key``, else the autotuner itself (the caller records its pick)."""
    if device.type != "cuda":
        return _merge_kernel, merge_tile_kwargs(_MERGE_TILES[0]), None
    if key in _MERGE_TILE:
        return _merge_kernel, _MERGE_TILE[key], None
    if not _TUNED_MERGE:
        configs = [
            triton.Config({"BLOCK_N": n, "BLOCK_K": k, "PAIRS": p, "K_TILES": kt}, num_warps=w)
            for n, k, w, p, kt in _MERGE_TILES
        ]
        _TUNED_MERGE.append(
            triton.autotune(configs, key=["N", "K", "R", "NF4", "NESTED", "ROW_BLOCKS"])(_merge_kernel)
        )
    return _TUNED_MERGE[0], {}, _TUNED_MERGE[0]


def _merge_into(out: torch.Tensor, w, a_: torch.Tensor, b_: torch.Tensor, scale: float) -> None:
    """``out`` [E·N·K] ← ``W_e + s · B_e A_e`` for every expert, in out's dtype: W (16-bit, or NF4 dequantized and
    rounded to its dtype) plus the product of the compute-dtype factors in fp32, rounded once."""
    e, n, k = w.shape
    nf4 = isinstance(w, Nf4Experts)
    if not _use_kernel(out.device) or (nf4 and k % 2) or a_.shape[1] > MAX_SMALL_K:
        dense = w.dequantize() if nf4 else w
        merged = dense.float().baddbmm(b_.float(), a_.float(), alpha=scale)
        out.view(e, n, k).copy_(merged)
        return
    if nf4:
        qs = w.quant_state()
        nested = w.nested
        src, absmax = w.packed, w.absmax
        absmax2, code2, offset = (
            (w.absmax2, w.code2, _offset(qs.offset, w.device)) if nested else (absmax,) * 3
        )
        code, pairs, half_bs, qdtype = _code(w.device), _code_pairs(w.device), w.blocksize // 2, w.dtype
        bs2 = w.blocksize2 if nested else 1
    else:
        src = w  # read through its strides
        absmax = absmax2 = code2 = offset = code = pairs = src  # unread placeholders
        half_bs, bs2, nested, qdtype = 1, 1, False, w.dtype
    r = a_.shape[1]
    w_strides = (0, 0, 0) if nf4 else w.stride()
    row_blocks = nf4 and k % (2 * half_bs) == 0
    key = (out.device, n, k, r, out.dtype, a_.dtype)  # not the stack's kind: NF4 and 16-bit share a tile
    kernel, tile, tuner = _merge_kernel_for(key, out.device)

    def grid(meta):
        return triton.cdiv(n, meta["BLOCK_N"]), triton.cdiv(k, meta["BLOCK_K"] * meta["K_TILES"]), e

    # fmt: skip below: one row per role, as the kernel's signature
    kernel[grid](
        src, absmax, absmax2, code2, offset, code, pairs,
        b_, a_, out, float(scale),
        n, k, r,
        b_.stride(0), b_.stride(1), b_.stride(2), a_.stride(0), a_.stride(1), a_.stride(2), *w_strides,
        NF4=nf4, HALF_BS=half_bs, NESTED=nested, BS2=bs2, ROW_BLOCKS=row_blocks,
        QDTYPE=_TL_DTYPES[qdtype], OUT_DTYPE=_TL_DTYPES[out.dtype], IEEE=out.dtype == torch.float32,
        BLOCK_R=block_k(r), enable_fp_fusion=False, **tile,
    )  # fmt: skip
    if tuner is not None:
        _MERGE_TILE[key] = tuner.best_config.all_kwargs()


def _merged(w, a, b, a_, b_, scale: float, dtype, *, reuse: bool = False, slot: int = 0) -> torch.Tensor:
    """``W_e + s · B_e A_e`` [E, N, K] in the compute dtype in nf4.py's shared scratch buffer (valid until the next
    NF4 dequantization on this device: used for one GEMM, never kept); with ``reuse`` (backwards only), read there as
    it is where the buffer still holds it for the same stack and factors, unmodified (``shared_buffer_holding``: the
    same storages, views and versions, whatever tensor objects autograd hands the backward).
    A forward always merges: between steps the factors change in place, and a change the version counters do not
    see (through ``.data``) would otherwise leave a stale stack; within a forward and its backward autograd forbids
    changing them."""
    e, n, k = w.shape
    src = w.packed if isinstance(w, Nf4Experts) else w
    buf = shared_buffer_holding(
        src.device,
        dtype,
        e * n * k,
        (src, a, b),
        (float(scale),),
        lambda out: _merge_into(out, w, a_, b_, scale),
        reuse=reuse,
        slot=slot,
    )
    return buf.view(e, n, k)


def _factors(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """A and B in the compute dtype and contiguous (PEFT's B is a permuted view whose strides torch's grouped GEMM
    cannot take; the copy is E·N·r values): one cast-and-copy each, none where a factor already is both."""
    return _contiguous_in(a, dtype), _contiguous_in(b, dtype)


def _contiguous_in(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    # ``to`` with a memory format casts into a contiguous tensor in one copy; it returns t itself when the dtype
    # is already t's, whatever its strides
    return t.contiguous() if t.dtype == dtype else t.to(dtype, memory_format=torch.contiguous_format)


class MoeLoraGemmFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, offsets, w, a, b, scale):
        with torch.autocast(x.device.type, enabled=False):  # the caller chose the dtype: no per-op casts
            return MoeLoraGemmFunction._forward(ctx, x, offsets, w, a, b, scale)

    @staticmethod
    def _forward(ctx, x, offsets, w, a, b, scale):
        dt = x.dtype
        a_, b_ = _factors(a, b, dt)
        y = grouped_mm(x, _merged(w, a, b, a_, b_, scale, dt).transpose(1, 2), _ends(offsets))
        # NF4 experts are frozen buffers, kept by reference (no activation is saved for them)
        ctx.nf4 = w if isinstance(w, Nf4Experts) else None
        ctx.save_for_backward(x, offsets, a if ctx.nf4 else w, a, b)
        ctx.scale = scale
        return y

    @staticmethod
    def backward(ctx, dy):
        x, offsets, w, a, b = ctx.saved_tensors
        w, s, dt, ends = ctx.nf4 or w, ctx.scale, x.dtype, _ends(offsets)
        dy = dy.to(dt).contiguous()
        a_, b_ = _factors(a, b, dt)
        dx = da = db = None
        if ctx.needs_input_grad[0]:  # dy · (W_e + s B_e A_e)
            dx = grouped_mm(dy, _merged(w, a, b, a_, b_, s, dt, reuse=True), ends)
        has_rows = _has_rows(offsets)
        if ctx.needs_input_grad[3]:  # dA_e = s Σ v[m]ᵀ x[m], v = dy · B_e
            v = grouped_mm(dy, b_, ends)
            da = _factor_grad(grouped_mm(v.t(), x, ends), has_rows, a.dtype, s)
        if ctx.needs_input_grad[4]:  # dB_e = s Σ dy[m]ᵀ u[m], u = x · A_eᵀ
            u = grouped_mm(x, a_.transpose(1, 2), ends)
            db = _factor_grad(grouped_mm(dy.t(), u, ends), has_rows, b.dtype, s)
        return dx, None, None, da, db, None


def _ends(offsets: torch.Tensor) -> torch.Tensor:
    """Each expert's row end, int32 (torch's grouped GEMM's ``offs``): a view of int32 offsets."""
    return offsets[1:].to(torch.int32)


def _has_rows(offsets: torch.Tensor) -> torch.Tensor:
    """[E, 1, 1]: experts with rows (an expert without gets exactly 0, the per-expert loop's zeros; what torch's
    kernel leaves there is not read). One comparison of the offsets with themselves shifted."""
    return (offsets[1:] > offsets[:-1])[:, None, None]


_ZERO: dict[tuple, torch.Tensor] = {}


def _factor_grad(g: torch.Tensor, has_rows: torch.Tensor, dtype: torch.dtype, s: float) -> torch.Tensor:
    """A factor's gradient [E, …] from its grouped GEMM's ``g`` (compute dtype): in the factor's ``dtype``, exactly
    0 for an expert without rows, times ``s`` in that dtype. The mask and the cast are one ``where`` against a
    zero of ``dtype`` (dimensioned, so it promotes g), and a scale of 1 multiplies nothing: the values of
    ``g.where(has_rows, 0).to(dtype).mul_(s)``, in one or two launches, not three."""
    zero = _ZERO.get((g.device, dtype))
    if zero is None:
        zero = _ZERO[(g.device, dtype)] = torch.zeros(1, 1, 1, dtype=dtype, device=g.device)
    out = torch.where(has_rows, g, zero)
    if out.dtype != dtype:
        out = out.to(dtype)
    return out if s == 1.0 else out.mul_(s)


class _LoraInputFunction(torch.autograd.Function):
    """The split form's first node: it saves x and computes nothing: its output is a stand-in of u's shape [M, r]
    (one zero, expanded: no memory, no GEMM) through which the product node, which computes u itself, hands back
    du = s · dy · B_e. Its backward gives dA_e = Σ du[m]ᵀ x[m] only: x's share of the LoRA path is in the product
    node's ``dy · W'_e``. A checkpoint's recompute stops when this node saves x, so it recomputes no u either."""

    @staticmethod
    def forward(ctx, x, offsets, a):
        ctx.save_for_backward(x, offsets)
        ctx.a_dtype = a.dtype
        return x.new_zeros(()).expand(x.shape[0], a.shape[1])

    @staticmethod
    def backward(ctx, du):
        x, offsets = ctx.saved_tensors
        da = None
        if ctx.needs_input_grad[2]:
            g = grouped_mm(du.to(x.dtype).t(), x, _ends(offsets))
            da = _factor_grad(g, _has_rows(offsets), ctx.a_dtype, 1.0)
        return None, None, da


class _MergedProductFunction(torch.autograd.Function):
    """The split form's product node: ``y = x · W'_eᵀ`` over the merged stack and, for dB, ``u = x · A_eᵀ`` [M, r],
    saving no tensor through ``save_for_backward`` (so torch's non-reentrant checkpoint, whose recompute stops at a
    layer's last saved tensor, skips this node's merge and GEMMs where it ends a layer): the stack, the factors and
    u are held on ctx. Its backward: dx = dy · W'_e, du = s · dy · B_e (to the first node's stand-in, for dA),
    dB_e = s · Σ dy[m]ᵀ u[m]."""

    @staticmethod
    def forward(ctx, x, stand_in, offsets, w, a, b, scale, product=True):
        with torch.autocast(x.device.type, enabled=False):
            dt = x.dtype
            ends = _ends(offsets)
            a_, b_ = _factors(a, b, dt)
            u = grouped_mm(x, a_.transpose(1, 2), ends) if ctx.needs_input_grad[5] else None
            if product:
                y = grouped_mm(x, _merged(w, a, b, a_, b_, scale, dt, slot=1).transpose(1, 2), ends)
            else:  # a recompute that reads nothing of y but its graph (moe_lora_gemm's output_unused)
                y = x.new_empty(x.shape[0], w.shape[1])
        ctx.w, ctx.a, ctx.b, ctx.u, ctx.offsets, ctx.scale, ctx.dt = w, a, b, u, offsets, scale, dt
        return y

    @staticmethod
    def backward(ctx, dy):
        w, a, b, u, offsets, s, dt = ctx.w, ctx.a, ctx.b, ctx.u, ctx.offsets, ctx.scale, ctx.dt
        ends = _ends(offsets)
        dy = dy.to(dt).contiguous()
        a_, b_ = _factors(a, b, dt)
        dx = du = db = None
        if ctx.needs_input_grad[0]:
            dx = grouped_mm(dy, _merged(w, a, b, a_, b_, s, dt, reuse=True, slot=1), ends)
        if ctx.needs_input_grad[1]:
            du = grouped_mm(dy, b_, ends)
            du = du if s == 1.0 else du.mul_(s)
        if ctx.needs_input_grad[5]:
            db = _factor_grad(grouped_mm(dy.t(), u, ends), _has_rows(offsets), b.dtype, s)
        return dx, du, None, None, None, db, None, None


def moe_lora_gemm(
    x, offsets, w, a, b, scale: float, *, split: bool = False, output_unused: bool = False
) -> torch.Tensor:
    """``y[m] = x[m] W_eᵀ + s (x[m] A_eᵀ) B_eᵀ`` for rows sorted by expert (``offsets`` [E + 1]), grouped GEMMs.

    Args:
        x: [M, K] routed rows, grouped by expert.
        offsets: [E + 1] row offsets (int32/int64), ``offsets[0] = 0``, ``offsets[E] = M``.
        w: [E, N, K] frozen expert weights (any strides), or an :class:`Nf4Experts` stack (either merged with
            the factors into the shared scratch buffer per call, NF4 dequantized there).
        a: [E, r, K] LoRA A per expert; b: [E, N, r] LoRA B per expert.
        scale: the LoRA scale s.
        split: two autograd nodes, one saving x (for dA) and the product (saving nothing; it computes
            ``u = x·A_eᵀ`` and holds it, [M, r], on its node): for a checkpointed layer's last projection, whose
            recompute then stops at the first node, before the product, its merge and u (an MoE layer's down
            projection). The same products; dA from du = s·dy·B_e rounded to the compute dtype.
        output_unused: with ``split``, the caller reads nothing of y but its graph (the recompute of a layer under
            strop's reentrant checkpoint, ``kernels/models/offload.py``, which runs the whole layer where torch's
            non-reentrant one stops early): the product node computes u and skips the merge and the product,
            returning uninitialised memory of y's shape. Its backward is unchanged (it merges the stack itself).

    Returns:
        y [M, N] in the compute dtype (autocast's when on, else x's); gradients flow to x, a and b (w is frozen).
    """
    _check(x, offsets, w, a, b)
    x = x.to(compute_dtype(x))
    if not split:
        return MoeLoraGemmFunction.apply(x, offsets, w, a, b, scale)
    need_da = torch.is_grad_enabled() and a.requires_grad
    stand_in = _LoraInputFunction.apply(x, offsets, a) if need_da else None
    return _MergedProductFunction.apply(x, stand_in, offsets, w, a, b, scale, not output_unused)
