"""Grouped decode attention split over the keys: a few query rows per kv head against a long cache.

Why. When a request's samples decode against its shared prompt (``trainer_svc/core/decode_step.py``), each kv head
sees ``samples × (heads / kv_heads)`` query rows (32 at 8 samples of an 8B model) over the whole cache (8K slots and
more). A flash kernel gives one program to each (batch, head, 64-query tile): 8 programs for an 8B model's kv heads,
each walking every key alone, so most of the GPU idles and the call is far slower than reading K and V once.
Here the keys are split into chunks with a program each (``splits`` per kv head, about two programs an SM in all),
every program keeps its chunk's online-softmax state (row max, row sum, unnormalised output, fp32), and a second
kernel merges the chunks' states per row.

Math. For query row ``m`` of kv head ``h`` (its sample ``m // group``) and key ``n``:
``s[m, n] = scale · q[m]·k[n] + mask[sample, n]`` (fp32, the additive mask as SDPA adds it), and the output is
``Σ_n softmax(s[m])[n] · v[n]``. Chunk ``c`` keeps ``m_c = max_n s``, ``l_c = Σ_n exp(s − m_c)`` and
``o_c = Σ_n exp(s − m_c)·v[n]`` (16-bit inputs: the weights enter the product as two 16-bit parts, high and
remainder, where flash kernels round them to one; fp32 inputs: IEEE fp32 dots); the merge is ``Σ_c exp(m_c − M)·o_c / Σ_c exp(m_c − M)·l_c`` with ``M = max_c m_c``.
A chunk whose keys a row may not see (an ``-inf`` mask, or keys past the cache) keeps ``m_c = −inf`` and weighs 0 in
the merge; a finite large negative mask value (the sampler's) is a key like any other, as in SDPA.

Shapes: ``q`` ``[R, Hkv, M, D]``, ``k`` ``[R, Hkv, L, D]``, ``v`` ``[R, Hkv, L, Dv]`` (any strides with the last
dimension contiguous: the cache is read in place), ``mask`` ``[R, S, L]`` additive (or None) with ``M = S·group``;
output ``[R, Hkv, M, Dv]`` in q's dtype. Not differentiable: sampling runs without gradients.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .utils import INTERPRETER, cast_to, cdiv, interpreter_rows, next_power_of_2, num_sms

__all__ = ["decode_attention", "decode_attention_can_run", "decode_attention_reference"]

_BLOCK_N = 64  # keys a loop iteration
_MIN_CHUNK = (
    256  # keys a program at least: below it the merge's traffic is no longer small against the chunk's
)
_MAX_SPLITS = 64  # the merge holds a row's state of every chunk at once: [64, Dv] fp32
_MAX_BLOCK_M = 64  # query rows a program: [64, 128] fp32 of accumulator in registers
_TL = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}


@triton.jit
def _dot(a, b, IEEE: tl.constexpr):
    if IEEE or INTERPRETER:
        # fp32 inputs, or the interpreter (whose 16-bit dot is wrong in triton 3.6): 16-bit products are exact in
        # fp32, so an IEEE fp32 dot of the upcast tiles is the compiled 16-bit dot's math
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b)


@triton.jit
def _split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    mask_ptr,
    part_ptr,
    stat_ptr,
    HKV,
    M,
    L,
    D,
    DV,
    GROUP,
    SPLITS,
    scale,
    sq_r,
    sq_h,
    sq_m,
    sk_r,
    sk_h,
    sk_l,
    sv_r,
    sv_h,
    sv_l,
    sm_r,
    sm_s,
    sm_l,
    HAS_MASK: tl.constexpr,
    IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr,
    CHUNK_BLOCKS: tl.constexpr,
):
    rh = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    mb = tl.program_id(2)
    r = rh // HKV
    h = rh % HKV
    rm = mb * BLOCK_M + tl.arange(0, BLOCK_M)
    rd = tl.arange(0, BLOCK_D)
    rdv = tl.arange(0, BLOCK_DV)
    m_ok = rm < M
    q = tl.load(
        q_ptr + r * sq_r + h * sq_h + rm[:, None] * sq_m + rd[None, :],
        mask=m_ok[:, None] & (rd[None, :] < D),
        other=0.0,
    )
    sample = rm // GROUP
    start = sp * CHUNK_BLOCKS * BLOCK_N
    stop = tl.minimum(start + CHUNK_BLOCKS * BLOCK_N, L)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    # a constexpr bound (triton 3.6's interpreter cannot loop to a runtime one); the last chunk's blocks past L
    # are masked whole, after its first (which holds a key)
    for i in range(CHUNK_BLOCKS):
        rn = start + i * BLOCK_N + tl.arange(0, BLOCK_N)
        n_ok = rn < stop
        k = tl.load(
            k_ptr + r * sk_r + h * sk_h + rn[:, None] * sk_l + rd[None, :],
            mask=n_ok[:, None] & (rd[None, :] < D),
            other=0.0,
        )
        s = _dot(q, tl.trans(k), IEEE) * scale
        if HAS_MASK:
            s += tl.load(
                mask_ptr + r * sm_r + sample[:, None] * sm_s + rn[None, :] * sm_l,
                mask=m_ok[:, None] & n_ok[None, :],
                other=0.0,
            ).to(tl.float32)
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: weights 0, not NaN
        alpha = tl.exp(m_i - m_use)
        p = tl.exp(s - m_use[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(
            v_ptr + r * sv_r + h * sv_h + rn[:, None] * sv_l + rdv[None, :],
            mask=n_ok[:, None] & (rdv[None, :] < DV),
            other=0.0,
        )
        if IEEE:
            pv = _dot(p, v, IEEE)
        else:  # the weights as two 16-bit parts (~16 significant bits): near fp32's product at a second small dot
            p_hi = p.to(v_ptr.dtype.element_ty)
            pv = _dot(p_hi, v, IEEE) + _dot((p - p_hi.to(tl.float32)).to(v_ptr.dtype.element_ty), v, IEEE)
        acc = acc * alpha[:, None] + pv
        m_i = m_new
    at = rh * SPLITS + sp  # [R·Hkv, SPLITS, M, ·], contiguous
    tl.store(
        part_ptr + at * M * DV + rm[:, None] * DV + rdv[None, :],
        acc,
        mask=m_ok[:, None] & (rdv[None, :] < DV),
    )
    tl.store(stat_ptr + at * 2 * M + rm, m_i, mask=m_ok)
    tl.store(stat_ptr + at * 2 * M + M + rm, l_i, mask=m_ok)


@triton.jit
def _merge_kernel(
    part_ptr,
    stat_ptr,
    out_ptr,
    M,
    DV,
    SPLITS,
    BLOCK_S: tl.constexpr,
    ROWS: tl.constexpr,
    BLOCK_DV: tl.constexpr,
):
    rh = tl.program_id(0).to(tl.int64)
    rm = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
    rs = tl.arange(0, BLOCK_S)
    rdv = tl.arange(0, BLOCK_DV)
    ok = (rs[:, None] < SPLITS) & (rm[None, :] < M)  # [BLOCK_S, ROWS]: the rows' state in every chunk
    at = (rh * SPLITS + rs[:, None]) * 2 * M + rm[None, :]
    m_c = tl.load(stat_ptr + at, mask=ok, other=float("-inf"))
    l_c = tl.load(stat_ptr + at + M, mask=ok, other=0.0)
    o_c = tl.load(
        part_ptr + ((rh * SPLITS + rs[:, None, None]) * M + rm[None, :, None]) * DV + rdv[None, None, :],
        mask=ok[:, :, None] & (rdv[None, None, :] < DV),
        other=0.0,
    )
    top = tl.max(m_c, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # padding rows: no chunk
    w = tl.exp(m_c - top[None, :])  # a chunk past SPLITS weighs 0
    denom = tl.where(rm < M, tl.sum(l_c * w, 0), 1.0)  # padding rows: 1, not 0/0
    out = tl.sum(o_c * w[:, :, None], 0) / denom[:, None]
    tl.store(
        out_ptr + (rh * M + rm[:, None]) * DV + rdv[None, :],
        cast_to(out, out_ptr.dtype.element_ty),
        mask=(rm[:, None] < M) & (rdv[None, :] < DV),
    )


def decode_attention_can_run(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether :func:`decode_attention` takes these tensors: CUDA (or the interpreter), one float dtype, last
    dimensions contiguous and at most 256 wide."""
    import os

    return (
        (q.is_cuda or os.environ.get("TRITON_INTERPRET") == "1")
        and q.dtype in _TL
        and k.dtype == q.dtype
        and v.dtype == q.dtype
        and q.stride(-1) == 1
        and k.stride(-1) == 1
        and v.stride(-1) == 1
        and q.shape[-1] <= 256
        and v.shape[-1] <= 256
    )


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: torch.Tensor | None,
    group: int,
    scale: float,
    splits: int | None = None,
) -> torch.Tensor:
    """Attention of ``q`` ``[R, Hkv, M, D]`` over ``k``/``v`` ``[R, Hkv, L, ·]`` with the additive ``mask``
    ``[R, S, L]`` (row ``m`` reads mask row ``m // group``), split over the keys (module docstring).

    Args:
        splits: Key chunks a kv head, at most 64 (None: about two programs an SM, each of at least 256 keys);
            rounded so that a chunk is a power of two of 64-key blocks.
    """
    r, hkv, m, d = q.shape
    length, dv = k.shape[2], v.shape[-1]
    if k.shape[:2] != (r, hkv) or v.shape[:3] != k.shape[:3] or k.shape[3] != d:
        raise ValueError(
            f"q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}: not one cache's shapes"
        )
    if mask is not None and (mask.shape[0] != r or mask.shape[2] != length or mask.shape[1] * group != m):
        raise ValueError(f"mask {tuple(mask.shape)} for q {tuple(q.shape)}, {length} keys, group {group}")
    if not decode_attention_can_run(q, k, v):
        raise ValueError(f"decode_attention cannot run on {q.device} {q.dtype} with these strides")
    if splits is None:
        splits = max(1, min(_MAX_SPLITS, cdiv(length, _MIN_CHUNK), cdiv(2 * num_sms(q.device), r * hkv)))
    # chunks of a power of two of key blocks: few compiled variants as the cache length changes between calls
    chunk_blocks = next_power_of_2(cdiv(cdiv(length, splits), _BLOCK_N))
    splits = cdiv(length, chunk_blocks * _BLOCK_N)  # every chunk holds at least one key
    block_m = min(_MAX_BLOCK_M, max(16, next_power_of_2(m)))
    block_d, block_dv = max(16, next_power_of_2(d)), max(16, next_power_of_2(dv))
    part = torch.empty(r * hkv, splits, m, dv, device=q.device, dtype=torch.float32)
    stat = torch.empty(r * hkv, splits, 2, m, device=q.device, dtype=torch.float32)
    out = torch.empty(r, hkv, m, dv, device=q.device, dtype=q.dtype)
    sm = mask.stride() if mask is not None else (0, 0, 0)
    m_blocks = cdiv(m, block_m)
    _split_kernel[(r * hkv, splits, m_blocks)](
        q,
        k,
        v,
        mask if mask is not None else q,
        part,
        stat,
        hkv,
        m,
        length,
        d,
        dv,
        group,
        splits,
        float(scale),
        q.stride(0),
        q.stride(1),
        q.stride(2),
        k.stride(0),
        k.stride(1),
        k.stride(2),
        v.stride(0),
        v.stride(1),
        v.stride(2),
        sm[0],
        sm[1],
        sm[2],
        HAS_MASK=mask is not None,
        IEEE=q.dtype == torch.float32,
        BLOCK_M=block_m,
        BLOCK_N=_BLOCK_N,
        BLOCK_D=block_d,
        BLOCK_DV=block_dv,
        CHUNK_BLOCKS=chunk_blocks,
        num_warps=4,
        num_stages=2,
    )
    block_s = max(2, next_power_of_2(splits))
    # two rows a program compiled (no tile dimension of 1), more under the interpreter (its cost is per program)
    rows = max(2, interpreter_rows(m, block_s * block_dv))
    _merge_kernel[(r * hkv, cdiv(m, rows))](
        part, stat, out, m, dv, splits, BLOCK_S=block_s, ROWS=rows, BLOCK_DV=block_dv, num_warps=8
    )
    return out


def decode_attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, group: int, scale: float
) -> torch.Tensor:
    """The same attention in fp32 by plain torch ops (tests' truth)."""
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores + mask.float().repeat_interleave(group, dim=1)[:, None]
    return torch.matmul(torch.softmax(scores, dim=-1), v.float())
