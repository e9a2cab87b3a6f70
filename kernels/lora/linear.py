"""LoRA linear and fused LoRA Q/K/V over a frozen base weight (dense or NF4), with hand-written backward.

One projection, in PEFT's layout (A = ``lora_A.weight``, B = ``lora_B.weight``, s = ``scaling``):

    y = x Wᵀ + b + s · (x Aᵀ) Bᵀ           x [N, in], W [out, in], b [out], A [r, in], B [out, r]

Leading dims of x are flattened to N. W and b are frozen: W is a dense fp32/bf16/fp16 tensor or a
bitsandbytes NF4 ``Params4bit``, dequantized just in time into a shared per-device buffer
(:func:`strop.kernels.ops.nf4.dequantize_shared`) in the forward and again in the backward, never kept.
A projection without an adapter (A = B = None) is the base alone.

Forward:  y = addmm(b, x, Wᵀ);  u = x Aᵀ  [N, r];  y += s · u Bᵀ  (one addmm, alpha = s)

Saved for backward: x and u (N·r values, small). Never y, never the dequantized W.

Backward, derived from the forward (checked against autograd in tests/kernels/lora/test_lora.py):

    g  = s · dy B        [N, r]
    dA = gᵀ x            [r, in]     LoRA grads contract the [N, r] factors first, so no [N, in] or
    dB = s · dyᵀ u       [out, r]    [N, out] temporary is ever formed for them
    dx = dy W + g A      [N, in]     (skipped when x needs no grad)

Fused QKV: three projections of one x. x is saved once; the three u come from one GEMM against the
stacked [A_q; A_k; A_v], and the backward forms dx = dq W_q + dk W_k + dv W_v + [g_q g_k g_v][A_q; A_k; A_v]
(one GEMM for all LoRA terms) and dA for the three from one GEMM [g_q g_k g_v]ᵀ x.

dx in x's storage (``inplace_dx=True``): dx is written over x once every use of x (the dA GEMM) is
done. The caller must guarantee nothing reads x afterwards; strop's patch uses it only on the output of
a decoder layer's RMSNorm, which HF drops right after the projections and which no other autograd node
saves (HF's and strop's RMSNorm save their input, not their output). The writes bump x's version
counter, so a second backward or any other saved use of x raises instead of reading garbage.

Dtype contract. The compute dtype c is the autocast dtype when autocast is on for x's device, else
x.dtype. x is cast to c outside the autograd Function (so dx comes back in x's dtype through the cast);
W (dequantized: rounded to ``quant_state.dtype`` first, as bitsandbytes does), b, A and B are cast to c
(A and B once per Function call and, under strop's checkpoint, once per layer and step: :func:`factors_of`);
every GEMM runs in c (fp32 accumulation on GPUs), y is in c. This is what HF + PEFT compute
under bf16 autocast with fp32 adapters (F.linear casts weight and input to bf16), except that the LoRA
term is added inside one addmm (one rounding instead of PEFT's three), which is closer to the fp32
result. dA/dB are formed in c and returned in the adapters' own dtype (fp32 in strop), as autocast's cast
backward returns them. Without autocast, an fp32 x runs everything in fp32 (the CPU test tier).

Stacked NF4 bases. Projections of one x whose bases are NF4 without bias (the fused MLP's gate and up) can be
dequantized one under the other (:func:`stacked_weight`): one GEMM then gives every y_i as a column block of one
output, and the backward's Σ_i dy_i W_i is one GEMM with K = Σ out_i instead of a GEMM and a beta = 1 GEMM per
further projection. Only for callers that keep the y_i private (``forward_projections(stack=True)``); the fused
QKV returns q, k, v as separate tensors, which the caller rotates in place.

The GEMMs are cuBLAS's, the NF4 dequant is ``kernels/ops/nf4.py``, and the rank-r updates of large outputs
(y += s·u Bᵀ, dx += g A) are ``kernels/ops/small_k.py``'s memory-bound kernel (cuBLAS's beta=1 GEMM with K = r
runs compute-bound tiles well short of copy bandwidth; bench/RESULTS.md, "small-K update (LoRA's y += s·u·Bᵀ) vs
cuBLAS addmm_").
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

import torch
import torch.nn.functional as F

from ..ops.fp8 import Fp8Weight, fp8_weight, quantize_rows
from ..ops.nf4 import dequantize_shared, dequantize_shared_stacked, dequantize_weight, is_nf4
from ..ops.small_k import addmm_small_k_
from ..ops.swiglu import LowRank
from ..ops.utils import MAX_FUSED_SIZE, compute_dtype
from .stash import stash, take_stashed

__all__ = [
    "Factors",
    "LoRALinearFunction",
    "LoRAProj",
    "LoRAQKVFunction",
    "attach_fp8",
    "compute_dtype",
    "detach_fp8",
    "factors_of",
    "fp8_of",
    "fp8_reason",
    "lora_linear",
    "lora_linear_reference",
    "lora_qkv",
]


class LoRAProj(NamedTuple):
    """One projection: frozen base (dense [out, in] or NF4 Params4bit) plus optional LoRA factors.

    Attributes:
        base: Frozen weight ``[out, in]``, dense or NF4.
        lora_A: ``[r, in]`` or None (no adapter).
        lora_B: ``[out, r]`` or None.
        scaling: The adapter's ``s`` (``lora_alpha / r``, or ``/ sqrt(r)`` with rsLoRA).
        bias: Frozen ``[out]`` bias of the base layer, or None.
    """

    base: torch.Tensor
    lora_A: torch.Tensor | None = None
    lora_B: torch.Tensor | None = None
    scaling: float = 1.0
    bias: torch.Tensor | None = None


def lora_linear_reference(
    x: torch.Tensor,
    base: torch.Tensor,
    lora_A: torch.Tensor | None = None,
    lora_B: torch.Tensor | None = None,
    scaling: float = 1.0,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """``x Wᵀ + b + s (x Aᵀ) Bᵀ`` in plain torch, fp32 math (fp64 for fp64 x); NF4 bases dequantized first."""
    dt = torch.promote_types(x.dtype, torch.float32)
    xf = x.to(dt)
    y = xf @ dequantize_weight(base).to(dt).t()
    if bias is not None:
        y = y + bias.to(dt)
    if lora_A is not None:
        y = y + scaling * ((xf @ lora_A.to(dt).t()) @ lora_B.to(dt).t())
    return y


def out_features(base: torch.Tensor) -> int:
    """Rows of a dense or NF4 base weight."""
    return int(base.quant_state.shape[0]) if is_nf4(base) else int(base.shape[0])


def in_features(base: torch.Tensor) -> int:
    """Columns of a dense or NF4 base weight."""
    return int(base.quant_state.shape[1]) if is_nf4(base) else int(base.shape[-1])


def check_proj(p: LoRAProj, name: str, width: int, device: torch.device) -> None:
    """Validate one projection against its input width and device (raises TypeError/ValueError)."""
    if type(p.base) in (torch.Tensor, torch.nn.Parameter):
        return _check_proj(p, name, width, device)
    # a subclass, such as an NF4 base's Params4bit, whose Python __torch_function__ would run on each property read
    # here (``kernels/ops/nf4.py``, ``_nf4_dequantize``): read as the plain tensor it is
    with torch._C.DisableTorchFunctionSubclass():
        return _check_proj(p, name, width, device)


def _check_proj(p: LoRAProj, name: str, width: int, device: torch.device) -> None:
    if not isinstance(p.base, torch.Tensor):
        raise TypeError(f"{name}.base must be a tensor or NF4 Params4bit, got {type(p.base).__name__}")
    if not is_nf4(p.base):
        if getattr(p.base, "quant_state", None) is not None:
            raise TypeError(
                f"{name}.base: only NF4 quantized weights are supported, got {p.base.quant_state.quant_type!r}"
            )
        if p.base.dim() != 2 or not p.base.is_floating_point():
            raise ValueError(
                f"{name}.base must be a 2-D float weight [out, in], got {p.base.dtype} {tuple(p.base.shape)}"
            )
    if p.base.requires_grad or (p.bias is not None and p.bias.requires_grad):
        raise ValueError(
            f"{name}: the base weight and bias must be frozen (their gradients are not computed)"
        )
    out_f, in_f = out_features(p.base), in_features(p.base)
    if in_f != width:
        raise ValueError(f"{name}.base has in_features {in_f}, the input has {width}")
    if p.bias is not None and tuple(p.bias.shape) != (out_f,):
        raise ValueError(f"{name}.bias must be [{out_f}], got {tuple(p.bias.shape)}")
    if (p.lora_A is None) != (p.lora_B is None):
        raise ValueError(f"{name}: lora_A and lora_B must both be given or both be None")
    if p.lora_A is not None:
        r = p.lora_A.shape[0]
        if p.lora_A.dim() != 2 or p.lora_A.shape[1] != in_f:
            raise ValueError(f"{name}.lora_A must be [r, {in_f}], got {tuple(p.lora_A.shape)}")
        if tuple(p.lora_B.shape) != (out_f, r):
            raise ValueError(f"{name}.lora_B must be [{out_f}, {r}], got {tuple(p.lora_B.shape)}")
    for t_name, t in (("base", p.base), ("bias", p.bias), ("lora_A", p.lora_A), ("lora_B", p.lora_B)):
        if t is not None and t.device != device:
            raise ValueError(f"{name}.{t_name} is on {t.device}, the input on {device}")


def weight(base: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The base weight in ``dtype`` for one GEMM: NF4 into the shared scratch buffer, dense cast if needed."""
    if is_nf4(base):
        return dequantize_shared(base, dtype)
    return base if base.dtype == dtype else base.to(dtype)


def stacked_weight(
    projs: Sequence[LoRAProj], dtype: torch.dtype, backward: bool = False
) -> torch.Tensor | None:
    """The projections' bases one under the other, ``[Σ out_i, in]`` in the shared scratch buffer, when they are
    NF4 without bias (the dequant writes them there anyway) and run no FP8 GEMMs in this direction (``backward``:
    the dx GEMM); None otherwise (dense bases would need a copy)."""

    def exact(p: LoRAProj) -> bool:
        f8 = fp8_of(p.base, dtype)
        return f8 is None or (not backward and f8.w is None)

    if len(projs) < 2 or not all(p.bias is None and is_nf4(p.base) and exact(p) for p in projs):
        return None
    return dequantize_shared_stacked(tuple(p.base for p in projs), dtype)


# The attribute of a frozen base weight that holds its FP8 copies (``kernels/ops/fp8.py``); set by attach_fp8.
FP8_ATTR = "strop_fp8"


# e4m3 tensor-core GEMMs need both matrix dims of each operand in multiples of 16 (the base's in and out features;
# the token count is free)
FP8_ALIGN = 16


def fp8_reason(base: torch.Tensor) -> str | None:
    """Why ``base`` cannot have FP8 GEMMs (its GEMMs then stay exact), or None."""
    if base.requires_grad:
        return "a trainable base weight"
    dims = (out_features(base), in_features(base))
    if any(d % FP8_ALIGN for d in dims):
        return f"[out, in] = {list(dims)}: not multiples of {FP8_ALIGN}"
    if max(dims) > MAX_FUSED_SIZE:
        return f"[out, in] = {list(dims)}: a row longer than the quantizer's {MAX_FUSED_SIZE}"
    return None


def attach_fp8(base: torch.Tensor, forward: bool = True) -> Fp8Weight:
    """Give a frozen base weight (dense or NF4) its e4m3 copies: from then on its projections' base GEMMs run in
    FP8 under bf16 compute (``kernels/ops/fp8.py``), the forward's too unless ``forward=False`` (then only the
    backward's dx). Opt-in (``patch_model(fp8_base=True or "dx")``); undone by :func:`detach_fp8`.

    Raises:
        ValueError: For a base :func:`fp8_reason` refuses.
    """
    reason = fp8_reason(base)
    if reason is not None:
        raise ValueError(f"no FP8 copies for this base weight: {reason}")
    dense = dequantize_weight(base, dtype=torch.bfloat16) if is_nf4(base) else base
    copies = fp8_weight(dense, forward=forward)
    base.__dict__[FP8_ATTR] = copies
    return copies


def detach_fp8(base: torch.Tensor) -> None:
    """Drop a base weight's FP8 copies: its GEMMs are exact again."""
    base.__dict__.pop(FP8_ATTR, None)


def fp8_of(base: torch.Tensor, dtype: torch.dtype) -> Fp8Weight | None:
    """The base's FP8 copies when its GEMMs run in FP8 at this compute dtype (bf16 only: the scaled GEMM's output
    dtype), else None."""
    return base.__dict__.get(FP8_ATTR) if dtype is torch.bfloat16 else None


def _one_buffer(ts: Sequence[torch.Tensor]) -> torch.Tensor | None:
    """``[N, Σ w_i]`` when the 2-D ``ts`` are adjacent column blocks of one row-major buffer, in order; else None."""
    width = sum(t.shape[1] for t in ts)
    rows, item = ts[0].shape[0], ts[0].element_size()
    ptr = ts[0].data_ptr()
    for t in ts:
        if t.dim() != 2 or t.shape[0] != rows or t.stride() != (width, 1) or t.data_ptr() != ptr:
            return None
        ptr += t.shape[1] * item
    return ts[0].as_strided((rows, width), (width, 1))


# addmm's input at beta = 0, one 0-d tensor per dtype and device: neither read nor propagated (addmm ignores its input
# then), so one kept tensor serves every call instead of an allocation each (some fourteen a layer and step)
_UNREAD: dict[tuple[torch.dtype, torch.device], torch.Tensor] = {}


def mm_scaled(
    a: torch.Tensor, b: torch.Tensor, scale: float, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``scale · (a @ b)`` rounded once: the scale is applied to the fp32 accumulator (addmm's alpha); into ``out``
    if given."""
    key = (a.dtype, a.device)
    unread = _UNREAD.get(key)
    if unread is None:
        unread = _UNREAD[key] = a.new_zeros(())
    if out is None:
        return torch.addmm(unread, a, b, beta=0, alpha=scale)
    return torch.addmm(unread, a, b, beta=0, alpha=scale, out=out)


def _adapters(projs: Sequence[LoRAProj]) -> tuple[tuple[int, int, int], ...]:
    """(projection index, first column, end column) of each adapter in the stacked [N, Σr] factor."""
    spans, col = [], 0
    for i, p in enumerate(projs):
        if p.lora_A is not None:
            spans.append((i, col, col + p.lora_A.shape[0]))
            col += p.lora_A.shape[0]
    return tuple(spans)


class Factors(NamedTuple):
    """The adapters of one call's projections in the compute dtype (see :func:`factors_of`).

    Attributes:
        a: Every adapter's A stacked, ``[Σr, in]`` (the one GEMM ``u = x aᵀ`` reads them all), or None.
        b: Each projection's B, ``[out_i, r_i]``, or None where it has no adapter.
        spans: (projection index, first column, end column) of each adapter in ``a``'s rows / u's columns.
        bt: Each B transposed, ``[r_i, out_i]`` (a view; the forward's rank-r updates read it): made with the
            factors, so once per layer and step rather than in every pass.
    """

    a: torch.Tensor | None
    b: tuple[torch.Tensor | None, ...]
    spans: tuple[tuple[int, int, int], ...]
    bt: tuple[torch.Tensor | None, ...] = ()


def _stacked_in(ts: Sequence[torch.Tensor], dtype: torch.dtype) -> torch.Tensor:
    """``ts`` (one column count) one under the other, in ``dtype``: stacked, then cast once. The same values as
    stacking their casts (a cast rounds each value alone; ``torch.cat`` promotes mixed inputs to a dtype that holds
    each of them exactly), in two launches instead of one a tensor and the stack."""
    return (ts[0] if len(ts) == 1 else torch.cat(ts)).to(dtype)


def factors_of(projs: Sequence[LoRAProj], dtype: torch.dtype) -> Factors:
    """The projections' adapter factors cast to ``dtype``: once per Function call, whose backward reuses them, and
    once per layer and step under strop's checkpoint, whose recompute takes them from the forward
    (``kernels/lora/stash.py``): each cast or stack is a kernel launch, some twelve a layer and pass. Where several
    B need a cast and share a rank, they are cast as one stack and handed out as its row blocks (views)."""
    spans = _adapters(projs)
    if not spans:
        return Factors(None, (None,) * len(projs), spans)
    tensors = [t for p in projs for t in (p.lora_A, p.lora_B) if t is not None]
    tag = ("lora.factors", dtype, *((id(t), t.shape) for t in tensors))
    factors = take_stashed(tag)
    if factors is None:
        a = _stacked_in([projs[i].lora_A for i, _, _ in spans], dtype)
        bs = [p.lora_B for p in projs if p.lora_B is not None]
        if len(bs) > 1 and len({t.shape[1] for t in bs}) == 1 and any(t.dtype != dtype for t in bs):
            blocks = iter(_stacked_in(bs, dtype).split_with_sizes([t.shape[0] for t in bs]))
            b = tuple(None if p.lora_B is None else next(blocks) for p in projs)
        else:
            b = tuple(None if p.lora_B is None else p.lora_B.to(dtype) for p in projs)
        factors = Factors(a, b, spans, tuple(None if t is None else t.t() for t in b))
        stash(tag, factors)
    return factors


def forward_projections(
    x: torch.Tensor,
    projs: Sequence[LoRAProj],
    dtype: torch.dtype,
    factors: Factors,
    *,
    add_lora: bool = True,
    stack: bool = False,
) -> tuple[list[torch.Tensor], torch.Tensor | None]:
    """Forward of several projections of one 2-D ``x`` (in ``dtype``): returns ([y_i], stacked u or None).

    ``add_lora=False`` leaves each y_i the base's alone and returns u for the caller to add ``s · u_i B_iᵀ``
    where it reads y_i (the fused MLP's activation kernel does, ``lora_terms``). ``stack=True`` lets the y_i be
    adjacent column blocks of one output where the bases stack (:func:`stacked_weight`): one GEMM for all, and
    :func:`backward_projections` then forms dx in one GEMM too. For a caller that keeps the y_i private (a view
    returned from an autograd Function could not be modified in place)."""
    # F.linear(x, w) is x @ wᵀ (the same GEMM) in one call from Python instead of two
    w_all = stacked_weight(projs, dtype) if stack else None
    if w_all is not None:
        y_all, ys, col = F.linear(x, w_all), [], 0
        for p in projs:
            ys.append(y_all[:, col : col + out_features(p.base)])
            col += out_features(p.base)
    else:
        ys, xq = [], None
        for p in projs:
            f8 = fp8_of(p.base, dtype)
            if f8 is not None and f8.w is not None:  # (a dx-only copy: the forward stays exact)
                xq = quantize_rows(x) if xq is None else xq  # one quantization of x for every FP8 base
                y = f8.forward(*xq, dtype)
                ys.append(y if p.bias is None else y.add_(p.bias.to(dtype)))
                continue
            w = weight(p.base, dtype)  # consumed by the next GEMM before the scratch buffer is reused
            ys.append(F.linear(x, w) if p.bias is None else torch.addmm(p.bias.to(dtype), x, w.t()))
    if factors.a is None:
        return ys, None
    u = F.linear(x, factors.a)  # one read of x for every adapter
    if add_lora:
        for i, lo, hi in factors.spans:
            addmm_small_k_(ys[i], u[:, lo:hi], factors.bt[i], alpha=projs[i].scaling)
    return ys, u


def lora_terms(projs: Sequence[LoRAProj], u: torch.Tensor | None, factors: Factors) -> list[LowRank | None]:
    """Each projection's LoRA term ``s · u_i B_iᵀ`` (None without an adapter), from forward_projections' u."""
    terms: list[LowRank | None] = [None] * len(projs)
    for i, lo, hi in factors.spans:
        terms[i] = LowRank(u[:, lo:hi], factors.bt[i], projs[i].scaling)
    return terms


def backward_projections(
    x: torch.Tensor,
    u: torch.Tensor | None,
    dys: Sequence[torch.Tensor],
    projs: Sequence[LoRAProj],
    dtype: torch.dtype,
    factors: Factors,
    need_dx: bool,
    dx_out: torch.Tensor | None = None,
) -> tuple[torch.Tensor | None, list[torch.Tensor | None], list[torch.Tensor | None]]:
    """Backward of :func:`forward_projections`: (dx, [dA_i], [dB_i]); dx written into ``dx_out`` if given.

    ``dx_out`` may alias ``x``: x's last read (the dA GEMM) happens before the first write to dx.
    """
    spans = factors.spans
    d_a: list[torch.Tensor | None] = [None] * len(projs)
    d_b: list[torch.Tensor | None] = [None] * len(projs)
    g = None
    if spans:
        if len(spans) == 1:
            ((i, _, _),) = spans
            g = mm_scaled(dys[i], factors.b[i], projs[i].scaling)
        else:  # g = [s_i dy_i B_i], [N, Σr]: each GEMM writes its column block (the row's stride is its ldc)
            g = dys[spans[0][0]].new_empty(x.shape[0], spans[-1][2])
            for i, lo, hi in spans:
                mm_scaled(dys[i], factors.b[i], projs[i].scaling, out=g[:, lo:hi])
        d_a_stack = torch.mm(g.t(), x)  # [Σr, in]: the only read of x in the backward
        # the gradients in the adapters' dtype: each stack cast once (a cast rounds each value alone), handed out
        # as row blocks
        _cast_blocks(d_a_stack, spans, projs, "lora_A", d_a)
        d_b_stack = _d_b_stack(projs, spans, dtype, x.device)
        outs = (
            [None] * len(spans)
            if d_b_stack is None
            else d_b_stack.split_with_sizes([projs[i].lora_B.shape[0] for i, _, _ in spans])
        )
        for (i, lo, hi), out in zip(spans, outs, strict=True):
            d_b[i] = mm_scaled(dys[i].t(), u[:, lo:hi], projs[i].scaling, out=out)
        if d_b_stack is None:
            for i, _, _ in spans:
                d_b[i] = d_b[i].to(projs[i].lora_B.dtype)
        else:
            _cast_blocks(d_b_stack, spans, projs, "lora_B", d_b)
    if not need_dx:
        return None, d_a, d_b
    dy_all = _one_buffer(dys) if len(dys) > 1 else None
    w_all = None if dy_all is None else stacked_weight(projs, dtype, backward=True)
    if w_all is not None:  # Σ_i dy_i W_i as one GEMM over the stacked bases
        dx = torch.mm(dy_all, w_all, out=dx_out) if dx_out is not None else dy_all @ w_all
    else:
        dx = None
        for dy, p in zip(dys, projs, strict=True):
            f8 = fp8_of(p.base, dtype)
            if f8 is not None:  # the scaled GEMM has no beta: a later projection's product is added
                part = f8.backward(*quantize_rows(dy), dtype, out=dx_out if dx is None else None)
                dx = part if dx is None else dx.add_(part)
                continue
            w = weight(p.base, dtype)
            if dx is None:
                dx = torch.mm(dy, w, out=dx_out) if dx_out is not None else dy @ w
            else:
                dx.addmm_(dy, w)
    if g is not None:
        addmm_small_k_(dx, g, factors.a)
    return dx, d_a, d_b


def node_backward(ctx, x: torch.Tensor, u: torch.Tensor | None, dys: Sequence[torch.Tensor], projs):
    """:func:`backward_projections` for an autograd node whose forward kept ``ctx.frozen`` and ``ctx.factors`` (as
    :func:`forward_projections`' callers do), outside autocast, dx into x where the node allows it; the node's
    factors are released after."""
    frozen = ctx.frozen
    with no_autocast(x.device.type):
        out = backward_projections(
            x,
            u,
            dys,
            projs,
            frozen.dtype,
            ctx.factors,
            ctx.needs_input_grad[0],
            dx_out=x if frozen.inplace_dx else None,
        )
    ctx.factors = None
    return out


def _d_b_stack(
    projs: Sequence[LoRAProj], spans: Sequence[tuple[int, int, int]], dtype: torch.dtype, device: torch.device
) -> torch.Tensor | None:
    """One ``[Σ out_i, r]`` buffer for the dB GEMMs to write as row blocks, when there are several adapters of one
    rank whose B share a dtype other than ``dtype`` (so that one cast serves them all); else None."""
    if len(spans) < 2:
        return None
    bs = [projs[i].lora_B for i, _, _ in spans]
    if len({t.shape[1] for t in bs}) != 1 or len({t.dtype for t in bs}) != 1 or bs[0].dtype == dtype:
        return None
    return torch.empty(sum(t.shape[0] for t in bs), bs[0].shape[1], dtype=dtype, device=device)


def _cast_blocks(
    stack: torch.Tensor,
    spans: Sequence[tuple[int, int, int]],
    projs: Sequence[LoRAProj],
    factor: str,
    grads: list[torch.Tensor | None],
) -> None:
    """Set ``grads[i]`` to projection i's row block of ``stack`` (the blocks one under the other in the spans'
    order, each as many rows as projection i's ``factor``) in that factor's dtype: one cast of the stack where the
    dtypes agree, else one cast a block."""
    ts = [getattr(projs[i], factor) for i, _, _ in spans]
    if len(ts) == 1:  # the stack is the one block
        grads[spans[0][0]] = stack.to(ts[0].dtype)
        return
    dtypes = {t.dtype for t in ts}
    whole = stack.to(dtypes.pop()) if len(dtypes) == 1 else stack
    # split_with_sizes, here and above: a method in C, where Tensor.split is a Python wrapper over it
    blocks = whole.split_with_sizes([t.shape[0] for t in ts])
    for (i, _, _), block, t in zip(spans, blocks, ts, strict=True):
        grads[i] = block.to(t.dtype)


class no_autocast:  # a context manager, named as torch.no_grad
    """Autocast off for ``device_type`` inside: the LoRA functions pick every dtype explicitly (see the dtype
    contract).

    Only autocast's enabled flag is switched, and only where it is on; ``torch.autocast(enabled=False)`` also sets
    and restores its dtype, weight-cast cache and nesting count, none of which a region without autocast reads,
    at several times the host time (a few of these regions a projection and pass)."""

    __slots__ = ("device_type", "was_on")

    def __init__(self, device_type: str) -> None:
        self.device_type, self.was_on = device_type, False

    def __enter__(self) -> None:
        self.was_on = torch.is_autocast_enabled(self.device_type)
        if self.was_on:
            torch.set_autocast_enabled(self.device_type, False)

    def __exit__(self, *exc: object) -> None:
        if self.was_on:
            torch.set_autocast_enabled(self.device_type, True)


class Frozen:
    """Non-tensor carrier of the frozen parts, so autograd neither tracks nor saves them."""

    def __init__(self, projs: Sequence[LoRAProj], dtype: torch.dtype, inplace_dx: bool) -> None:
        self.projs, self.dtype, self.inplace_dx = tuple(projs), dtype, inplace_dx


def with_factors(frozen: Frozen, factors: Sequence[torch.Tensor | None]) -> list[LoRAProj]:
    # built directly: NamedTuple._replace costs twice the host time, and this runs in every forward and backward
    return [
        LoRAProj(p.base, factors[2 * i], factors[2 * i + 1], p.scaling, p.bias)
        for i, p in enumerate(frozen.projs)
    ]


def as_proj(p: Sequence) -> LoRAProj:
    """A ``LoRAProj`` or ``(base, lora_A, lora_B, scaling, bias)`` tuple (A/B/bias may be None) as a ``LoRAProj``
    with a float scaling."""
    p = LoRAProj(*p)
    return p if type(p.scaling) is float else LoRAProj(p.base, p.lora_A, p.lora_B, float(p.scaling), p.bias)


class LoRALinearFunction(torch.autograd.Function):
    """y = x Wᵀ + b + s (x Aᵀ) Bᵀ over 2-D x in the compute dtype; see the module docstring."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, lora_A, lora_B, frozen: Frozen) -> torch.Tensor:
        projs = with_factors(frozen, (lora_A, lora_B))
        factors = factors_of(projs, frozen.dtype)
        (y,), u = forward_projections(x, projs, frozen.dtype, factors)
        ctx.save_for_backward(x, u, lora_A, lora_B)
        ctx.frozen, ctx.factors = frozen, factors
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, u, lora_A, lora_B = ctx.saved_tensors
        frozen = ctx.frozen
        projs = with_factors(frozen, (lora_A, lora_B))
        dx, (d_a,), (d_b,) = node_backward(ctx, x, u, [dy.to(frozen.dtype)], projs)
        return dx, d_a, d_b, None


class LoRAQKVFunction(torch.autograd.Function):
    """Three projections of one 2-D x (q, k, v), x saved once; see the module docstring."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, qa, qb, ka, kb, va, vb, frozen: Frozen):
        projs = with_factors(frozen, (qa, qb, ka, kb, va, vb))
        factors = factors_of(projs, frozen.dtype)
        ys, u = forward_projections(x, projs, frozen.dtype, factors)
        ctx.save_for_backward(x, u, qa, qb, ka, kb, va, vb)
        ctx.frozen, ctx.factors = frozen, factors
        return tuple(ys)

    @staticmethod
    def backward(ctx, dq: torch.Tensor, dk: torch.Tensor, dv: torch.Tensor):
        x, u, *factors = ctx.saved_tensors
        frozen = ctx.frozen
        projs = with_factors(frozen, factors)
        # An output nobody used gets a None gradient: it contributes nothing.
        dys = [
            torch.zeros(x.shape[0], out_features(p.base), dtype=frozen.dtype, device=x.device)
            if d is None
            else d.to(frozen.dtype)
            for d, p in zip((dq, dk, dv), projs, strict=True)
        ]
        dx, d_a, d_b = node_backward(ctx, x, u, dys, projs)
        return dx, d_a[0], d_b[0], d_a[1], d_b[1], d_a[2], d_b[2], None


def as_rows_for(x: torch.Tensor, dtype: torch.dtype, inplace_dx: bool) -> tuple[torch.Tensor, bool]:
    """x cast to ``dtype`` and viewed as [N, in] (differentiably), and whether dx may overwrite it.

    In place is allowed only where the caller asked for it, the rows are contiguous, and the storage is
    either a private cast/copy made here or x's own as an intermediate result that is not a view (a
    leaf is a user's tensor; a view would write through to its base). For x's own storage the caller
    vouches that nothing reads x after the backward (see the module docstring).
    """
    x2 = x.to(dtype).reshape(-1, x.shape[-1])
    private = x2.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    owned = x.grad_fn is not None and not x._is_view()
    return x2, bool(inplace_dx and x2.is_contiguous() and (private or owned))


def lora_linear(
    x: torch.Tensor,
    base: torch.Tensor,
    lora_A: torch.Tensor | None = None,
    lora_B: torch.Tensor | None = None,
    scaling: float = 1.0,
    bias: torch.Tensor | None = None,
    *,
    inplace_dx: bool = False,
) -> torch.Tensor:
    """LoRA linear over a frozen dense or NF4 base: ``x Wᵀ + b + s (x Aᵀ) Bᵀ``.

    Args:
        x: ``[..., in]`` activations.
        base: Frozen ``[out, in]`` weight, dense or an NF4 ``Params4bit``.
        lora_A: ``[r, in]`` adapter factor, or None for the base alone.
        lora_B: ``[out, r]`` adapter factor, or None.
        scaling: The adapter's scale s.
        bias: Frozen ``[out]`` bias, or None.
        inplace_dx: Let the backward write dx into x's storage (see the module docstring for when that
            is safe; off by default).

    Returns:
        ``[..., out]`` in the compute dtype (autocast's, else x's).

    Raises:
        TypeError: On unsupported tensor types (e.g. an FP4 base).
        ValueError: On mismatched shapes or devices, or a trainable base weight/bias.
    """
    proj = LoRAProj(base, lora_A, lora_B, float(scaling), bias)
    check_proj(proj, "base", x.shape[-1], x.device)
    dtype = compute_dtype(x)
    x2, inplace = as_rows_for(x, dtype, inplace_dx)
    with no_autocast(x.device.type):
        y = LoRALinearFunction.apply(x2, lora_A, lora_B, Frozen([proj], dtype, inplace))
    return y.view(*x.shape[:-1], y.shape[-1])


def lora_qkv(
    x: torch.Tensor, q: Sequence, k: Sequence, v: Sequence, *, inplace_dx: bool = False
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Q, K and V LoRA projections of one input, fused so x is saved once and read once per pass.

    Args:
        x: ``[..., in]`` activations.
        q: ``LoRAProj`` or tuple ``(base, lora_A, lora_B, scaling, bias)``; A/B/bias may be None.
        k: Same for k.
        v: Same for v.
        inplace_dx: As in :func:`lora_linear`.

    Returns:
        ``(q, k, v)``, each ``[..., out_i]`` in the compute dtype; separate tensors (not views of one),
        so a caller may rotate q and k in place.

    Raises:
        TypeError, ValueError: As :func:`lora_linear`, naming the offending projection.
    """
    projs = [as_proj(p) for p in (q, k, v)]
    for name, p in zip("qkv", projs, strict=True):
        check_proj(p, name, x.shape[-1], x.device)
    dtype = compute_dtype(x)
    x2, inplace = as_rows_for(x, dtype, inplace_dx)
    factors = [t for p in projs for t in (p.lora_A, p.lora_B)]
    with no_autocast(x.device.type):
        ys = LoRAQKVFunction.apply(x2, *factors, Frozen(projs, dtype, inplace))
    return tuple(y.view(*x.shape[:-1], y.shape[-1]) for y in ys)
