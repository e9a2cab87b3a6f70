"""Fused NF4 LoRA linear for few rows (decoding): ``y = x·W_nf4ᵀ + s·(x·Aᵀ)·Bᵀ (+ b)`` without a 16-bit W.

Why. At decode time a projection sees a few dozen rows. bitsandbytes (and ``lora_linear``) dequantize the whole
weight to 16 bits and run a GEMM over it: 0.5 byte of codes read, 2 bytes written, 2 bytes read again per weight,
every step. Here each program streams its rows' packed codes (0.5 byte a weight plus 1 byte per 64 of absmax),
dequantizes them in registers and multiplies at once, so the weight costs ~0.52 byte a weight of traffic.

Math (format: ``kernels/ops/nf4.py``). ``W`` is ``[N, K]`` row-major, quantized in blocks of ``bs`` consecutive
elements; with ``K % bs == 0`` block ``n·K/bs + k//bs`` covers row ``n``, columns ``k0 .. k0+bs``, and its bytes are
``blk·bs/2 + t`` (element ``k0+2t`` in the high nibble, ``k0+2t+1`` in the low). The weight value is exactly
bitsandbytes' dequantized one, ``cast_qdtype(code[nibble]·absmax[blk])`` (double-quantized absmax undone with the
same two roundings, launched with fp-contraction off), cast to ``x``'s dtype as bitsandbytes' ``MatMul4Bit`` does.
The even and odd columns are two dots, ``x[:, 0::2]·W_hiᵀ + x[:, 1::2]·W_loᵀ``, so no nibble interleave is needed.
The LoRA term takes ``xa = x·Aᵀ`` (fp32, computed by the caller: PEFT's fp32 adapter) and adds ``s·xa·Bᵀ`` in fp32
into the same accumulator; the output is rounded once, where PEFT rounds the base and the LoRA term separately.

Shapes: ``x`` ``[M, K]`` (M ≤ 128, 16-bit or fp32), ``xa`` ``[M, r]`` fp32, ``B`` ``[N, r]`` fp32, output
``[M, N]`` in ``x``'s dtype. Not differentiable: sampling runs without gradients.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["MAX_DECODE_ROWS", "NF4DecodeWeight", "nf4_lora_decode", "nf4_lora_decode_reference"]

MAX_DECODE_ROWS = 128  # above this the dequantize-then-GEMM path is compute-bound and better
# Tile over output features. Each program re-reads all of x ([M, K], from L2) for its BLOCK_N rows of W, so x traffic
# is (N / BLOCK_N)·M·K·2 bytes against N·K/2 of codes: at M = 64 a tile of 32 would read 8x more x than codes, 128
# reads 2x, but leaves 32 programs for a 4096-wide projection on 132 SMs. Not yet measured: on CUDA the autotuner picks
# per (M, N, K) among these on first use (the sampler's first eager step, never inside a graph capture); the
# interpreter (CPU tests), which pays per program, runs the widest.
_CONFIGS = ((64, 4, 3), (128, 4, 3), (128, 8, 4))  # (BLOCK_N, num_warps, num_stages)
_DEFAULT = _CONFIGS[1]
_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


class NF4DecodeWeight:
    """A bitsandbytes NF4 weight's tensors as the kernel reads them, gathered once (no host copies per call)."""

    def __init__(self, weight: torch.Tensor):
        from .nf4 import NF4_CODE

        qs = weight.quant_state
        self.bs = int(qs.blocksize)
        if qs.quant_type != "nf4" or len(qs.shape) != 2 or int(qs.shape[1]) % self.bs or self.bs % 32:
            raise ValueError(
                f"{qs.quant_type} weight {tuple(qs.shape)}, blocksize {self.bs}: not whole NF4 blocks"
            )
        self.n, self.k = int(qs.shape[0]), int(qs.shape[1])
        device = weight.device
        self.packed = weight.data.reshape(-1).view(torch.uint8)
        self.nested = bool(qs.nested)
        self.absmax = qs.absmax.reshape(-1)
        if self.nested:
            self.absmax2 = qs.state2.absmax.reshape(-1).float()
            self.code2 = qs.state2.code.float()
            self.bs2 = int(qs.state2.blocksize)
            self.offset = torch.as_tensor(qs.offset, dtype=torch.float32, device=device).reshape(1)
        else:
            self.absmax = self.absmax.float()
            self.absmax2 = self.code2 = self.offset = self.absmax
            self.bs2 = 1
        self.code = torch.tensor(NF4_CODE, dtype=torch.float32, device=device)
        self.qdtype = qs.dtype


def nf4_lora_decode_reference(
    x: torch.Tensor,
    w: NF4DecodeWeight,
    xa: torch.Tensor | None,
    lora_b: torch.Tensor | None,
    scale: float,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """The same function in plain torch (fp32 accumulation; the weight through ``nf4_dequantize_reference``)."""
    from types import SimpleNamespace

    from .nf4 import nf4_dequantize_reference

    qs = SimpleNamespace(
        shape=(w.n, w.k),
        blocksize=w.bs,
        dtype=w.qdtype,
        nested=w.nested,
        absmax=w.absmax,
        state2=SimpleNamespace(absmax=w.absmax2, code=w.code2, blocksize=w.bs2),
        offset=w.offset,
    )
    weight = nf4_dequantize_reference(w.packed, qs).to(x.dtype)
    y = x.float() @ weight.float().T
    if xa is not None:
        y = y + scale * (xa.float() @ lora_b.float().T)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


# fmt: skip on the signature: pointers, sizes and strides, then the constexprs, one row per kind
@triton.jit
def _nf4_lora_decode_kernel(
    x_ptr, packed_ptr, absmax_ptr, absmax2_ptr, code2_ptr, offset_ptr, code_ptr, xa_ptr, b_ptr, bias_ptr, out_ptr,
    M, N, R, stride_xm, stride_om, scale,
    BLOCKS_PER_ROW: tl.constexpr, BS: tl.constexpr, BS2: tl.constexpr, NESTED: tl.constexpr,
    HAS_LORA: tl.constexpr, HAS_BIAS: tl.constexpr, QDTYPE: tl.constexpr, XDTYPE: tl.constexpr,
    IEEE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0).to(tl.int64)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < M
    t = tl.arange(0, BS // 2)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    x_rows = x_ptr + offs_m[:, None].to(tl.int64) * stride_xm
    for kb in range(0, BLOCKS_PER_ROW):
        k0 = kb * BS
        xe = tl.load(x_rows + (k0 + 2 * t)[None, :], mask=m_mask[:, None], other=0.0)
        xo = tl.load(x_rows + (k0 + 2 * t + 1)[None, :], mask=m_mask[:, None], other=0.0)
        blk = offs_n * BLOCKS_PER_ROW + kb
        if NESTED:
            q2 = tl.load(absmax_ptr + blk, mask=n_mask, other=0).to(tl.int32)
            a = tl.load(code2_ptr + q2, mask=n_mask, other=0.0) * tl.load(
                absmax2_ptr + blk // BS2, mask=n_mask, other=0.0
            )
            a = a + tl.load(offset_ptr)  # two roundings, as bitsandbytes (launched without fp contraction)
        else:
            a = tl.load(absmax_ptr + blk, mask=n_mask, other=0.0)
        b = tl.load(packed_ptr + blk[:, None] * (BS // 2) + t[None, :], mask=n_mask[:, None], other=0).to(
            tl.int32
        )
        wh = (tl.load(code_ptr + (b >> 4)) * a[:, None]).to(QDTYPE).to(XDTYPE)
        wl = (tl.load(code_ptr + (b & 15)) * a[:, None]).to(QDTYPE).to(XDTYPE)
        if IEEE:
            acc += tl.dot(xe, tl.trans(wh), input_precision="ieee")
            acc += tl.dot(xo, tl.trans(wl), input_precision="ieee")
        else:
            acc += tl.dot(xe, tl.trans(wh))
            acc += tl.dot(xo, tl.trans(wl))
    if HAS_LORA:
        offs_r = tl.arange(0, BLOCK_R)
        r_mask = offs_r < R
        xa = tl.load(
            xa_ptr + offs_m[:, None] * R + offs_r[None, :], mask=m_mask[:, None] & r_mask[None, :], other=0.0
        )
        bb = tl.load(
            b_ptr + offs_n[:, None] * R + offs_r[None, :], mask=n_mask[:, None] & r_mask[None, :], other=0.0
        )
        acc += scale * tl.dot(xa, tl.trans(bb), input_precision="ieee")  # PEFT's LoRA term is fp32
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=n_mask, other=0.0).to(tl.float32)[None, :]
    out = out_ptr + offs_m[:, None].to(tl.int64) * stride_om + offs_n[None, :]
    tl.store(out, acc.to(XDTYPE), mask=m_mask[:, None] & n_mask[None, :])


def nf4_lora_decode(
    x: torch.Tensor,
    w: NF4DecodeWeight,
    xa: torch.Tensor | None = None,
    lora_b: torch.Tensor | None = None,
    scale: float = 1.0,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x·Wᵀ + scale·xa·lora_bᵀ (+ bias)`` over the leading dims of ``x`` (≤ ``MAX_DECODE_ROWS`` rows in all).

    Raises:
        ValueError: more rows than ``MAX_DECODE_ROWS``, a width other than the weight's, or a LoRA term whose
            shapes do not fit.
    """
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    m = x2.shape[0]
    if m > MAX_DECODE_ROWS or x2.shape[1] != w.k:
        raise ValueError(
            f"nf4_lora_decode: x {tuple(x.shape)} for a [{w.n}, {w.k}] weight (≤ {MAX_DECODE_ROWS} rows)"
        )
    if x2.stride(1) != 1:
        x2 = x2.contiguous()
    has_lora = xa is not None
    r = int(lora_b.shape[1]) if has_lora else 0
    if has_lora and (tuple(xa.shape) != (m, r) or lora_b.shape[0] != w.n):
        raise ValueError(
            f"nf4_lora_decode: xa {tuple(xa.shape)} and B {tuple(lora_b.shape)} for {m} rows, N={w.n}"
        )
    out = torch.empty(m, w.n, dtype=x.dtype, device=x.device)
    if m == 0:
        return out.reshape(*lead, w.n)
    xa_c = xa.float().contiguous() if has_lora else out
    b_c = lora_b.float().contiguous() if has_lora else out
    kernel = _tuned_kernel() if x.device.type == "cuda" else None
    tile = (
        {}
        if kernel is not None
        else {"BLOCK_N": _DEFAULT[0], "num_warps": _DEFAULT[1], "num_stages": _DEFAULT[2]}
    )
    kernel = kernel or _nf4_lora_decode_kernel
    grid = lambda meta: (triton.cdiv(w.n, meta["BLOCK_N"]),)  # noqa: E731
    # fmt: skip below: one row per kind (pointers, sizes and strides, constexprs), as the kernel's signature
    kernel[grid](
        x2, w.packed, w.absmax, w.absmax2, w.code2, w.offset, w.code, xa_c, b_c,
        bias if bias is not None else out, out,
        m, w.n, r, x2.stride(0), out.stride(0), float(scale),
        BLOCKS_PER_ROW=w.k // w.bs, BS=w.bs, BS2=w.bs2, NESTED=w.nested, HAS_LORA=has_lora,
        HAS_BIAS=bias is not None, QDTYPE=_TL[w.qdtype], XDTYPE=_TL[x.dtype], IEEE=x.dtype == torch.float32,
        BLOCK_M=max(16, triton.next_power_of_2(m)), BLOCK_R=max(16, triton.next_power_of_2(max(r, 1))),
        enable_fp_fusion=False, **tile,
    )  # fmt: skip
    return out.reshape(*lead, w.n)


_TUNED = []


def _tuned_kernel():
    if not _TUNED:
        configs = [triton.Config({"BLOCK_N": n}, num_warps=w, num_stages=st) for n, w, st in _CONFIGS]
        _TUNED.append(triton.autotune(configs, key=["M", "N", "BLOCKS_PER_ROW"])(_nf4_lora_decode_kernel))
    return _TUNED[0]


def kernel_can_run(device: torch.device) -> bool:
    """CUDA, or the Triton interpreter (CPU tests)."""
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"
