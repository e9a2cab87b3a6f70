"""NF4 dequantization, bit-exact with bitsandbytes, into a caller's (or a shared, reused) buffer.

Format (bitsandbytes ``quantize_4bit(..., quant_type="nf4")``), for a weight of ``n`` elements flattened
row-major, blocks of ``bs`` consecutive elements (``bs`` ∈ {32, …, 4096}; blocks run across rows: the
flat index decides, not the row):

    packed[j]  uint8, element 2j in the high nibble, element 2j+1 in the low nibble  (⌈n/2⌉ bytes)
    absmax[b]  fp32, one per block                                                    (⌈n/bs⌉ values)
    w[i]       = cast_{qdtype}( code[nibble(i)] · absmax[i // bs] )                   fp32 product

``code`` is the 16-entry NF4 table (quantiles of N(0, 1) scaled to [−1, 1]); ``qdtype`` is
``quant_state.dtype``, the dtype the weight had when it was quantized. With double quantization
(``compress_statistics=True``, ``quant_state.nested``) absmax itself is stored blockwise in 8 bits:

    absmax[b]  = code2[absmax_u8[b]] · absmax2[b // bs2]  (fp32, rounded)  then  + offset  (fp32, rounded)

with ``code2``/``absmax2``/``bs2`` = ``state2.code``/``state2.absmax``/``state2.blocksize`` (256 in
bitsandbytes) and ``offset`` a 0-d fp32 tensor. The multiply and the add are two roundings in
bitsandbytes (two kernels), so the Triton kernel is launched with fp-contraction off: an FMA would round
once and differ in the last bit.

Shapes and dtypes: ``packed`` is the ``Params4bit`` data (any storage dtype, read as bytes), output
``quant_state.shape`` in fp32/bf16/fp16. An output dtype other than ``qdtype`` is produced as
``cast_{dtype}(cast_{qdtype}(·))``, i.e. exactly ``dequantize_4bit(...).to(dtype)``.

Not differentiable (the base weight is frozen), so there is no autograd Function here: LoRA's
functions call :func:`dequantize_shared` in their forward and again in their backward, so one layer's
16-bit weight at a time is resident instead of all of them.

Reference semantics: bitsandbytes' CUDA kernel and its pure-torch backend (flat blocks). bitsandbytes
0.50.2's *native CPU* kernel blocks per row instead, which only agrees when the row length is a multiple
of ``bs`` (it does not invert its own quantizer otherwise); the tests pin both facts.
"""

from __future__ import annotations

import math
import operator
import os
import threading
import weakref
from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch.multiprocessing.reductions import StorageWeakRef
from triton import knobs

from .nf4_format import NF4_CODE
from .utils import BoundLaunch, cdiv, interpreter_rows

__all__ = [
    "NF4_CODE",
    "dequantize_shared",
    "dequantize_shared_stacked",
    "dequantize_weight",
    "is_nf4",
    "nf4_dequantize",
    "nf4_dequantize_reference",
    "shared_buffer_holding",
]

_BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
_FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_TL_DTYPES = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
# untuned: 4,096 packed bytes (8,192 outputs, 16 KiB of bf16) per program over 8 warps is 16 bytes in
# and 64 bytes out per lane (one 16-byte vector load, four stores), ~7,200 programs for an 8B MLP weight;
# chosen over smaller tiles also because the Triton interpreter (CPU tier) pays per program, not per
# element. Revisit with a sweep on the H200.
_BYTES_PER_PROGRAM = 4096
_NUM_WARPS = 8


def _numel(shape: tuple[int, ...] | torch.Size) -> int:
    return math.prod(int(s) for s in shape)


def is_nf4(t: object) -> bool:
    """True for a bitsandbytes NF4 ``Params4bit`` (or any tensor carrying an NF4 ``quant_state``)."""
    qs = getattr(t, "quant_state", None)
    return isinstance(t, torch.Tensor) and qs is not None and getattr(qs, "quant_type", None) == "nf4"


_CODE: dict[torch.device, torch.Tensor] = {}


def _code(device: torch.device) -> torch.Tensor:
    # Cached per device: building it from a Python list is a host-to-device copy that would stall the host.
    code = _CODE.get(device)
    if code is None:
        code = _CODE[device] = torch.tensor(NF4_CODE, dtype=torch.float32, device=device)
    return code


def _offset(offset, device: torch.device) -> torch.Tensor:
    """The double-quant offset (a quant state's ``offset``) as a 1-element fp32 tensor on ``device`` (bitsandbytes
    keeps a 0-d tensor)."""
    return torch.as_tensor(offset, dtype=torch.float32, device=device).reshape(1)


def _absmax_fp32(quant_state) -> torch.Tensor:
    """The per-block fp32 absmax, undoing double quantization as bitsandbytes does (two roundings)."""
    if not quant_state.nested:
        return quant_state.absmax.float()
    s2 = quant_state.state2
    q = quant_state.absmax.reshape(-1).long()
    blocks2 = torch.arange(q.numel(), device=q.device) // s2.blocksize
    absmax = s2.code.float()[q] * s2.absmax.float()[blocks2]
    return absmax + _offset(quant_state.offset, absmax.device)


def nf4_dequantize_reference(
    packed: torch.Tensor, quant_state, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """The format of the module docstring in plain torch: what the kernel must reproduce bit for bit."""
    shape = tuple(quant_state.shape)
    n = _numel(shape)
    data = packed.reshape(-1).view(torch.uint8)
    nibbles = torch.stack((data >> 4, data & 0x0F), dim=-1).reshape(-1)[:n].long()
    blocks = torch.arange(n, device=data.device) // quant_state.blocksize
    w = _code(data.device)[nibbles] * _absmax_fp32(quant_state)[blocks]
    return w.to(quant_state.dtype).to(dtype or quant_state.dtype).reshape(shape)


@triton.jit
def _nf4_dequant_kernel(
    packed_ptr,
    absmax_ptr,
    absmax2_ptr,
    code2_ptr,
    offset_ptr,
    code_ptr,
    out_ptr,
    n_bytes,
    n_out,
    HALF_BS: tl.constexpr,
    ROWS: tl.constexpr,
    NESTED: tl.constexpr,
    BS2: tl.constexpr,
    QDTYPE: tl.constexpr,
    OUT_DTYPE: tl.constexpr,
):
    # One program dequantizes ROWS whole quantization blocks, laid out as a [ROWS, HALF_BS] tile of
    # bytes, so each block's absmax is loaded once as a row vector instead of once per element.
    pid = tl.program_id(0).to(tl.int64)
    blk = pid * ROWS + tl.arange(0, ROWS)
    byte = blk[:, None] * HALF_BS + tl.arange(0, HALF_BS)[None, :]
    row_mask = blk * HALF_BS < n_bytes
    if NESTED:
        q2 = tl.load(absmax_ptr + blk, mask=row_mask, other=0).to(tl.int32)
        scale = tl.load(code2_ptr + q2, mask=row_mask, other=0.0).to(tl.float32)
        scale2 = tl.load(absmax2_ptr + blk // BS2, mask=row_mask, other=0.0).to(tl.float32)
        # Two roundings, as bitsandbytes: the launch disables fp contraction so this is no FMA.
        absmax = scale * scale2
        absmax = absmax + tl.load(offset_ptr).to(tl.float32)
    else:
        absmax = tl.load(absmax_ptr + blk, mask=row_mask, other=0.0).to(tl.float32)
    b = tl.load(packed_ptr + byte, mask=byte < n_bytes, other=0).to(tl.int32)
    # Gathers from a 16-entry fp32 table (L1-resident): exact, and cheaper than a select tree.
    hi = tl.load(code_ptr + (b >> 4)) * absmax[:, None]
    lo = tl.load(code_ptr + (b & 0x0F)) * absmax[:, None]
    v = tl.interleave(hi, lo)
    # Rounded to the quantized dtype, then to the output dtype: dequantize_4bit(...).to(dtype), ties to
    # even. bf16 is rounded with integer ops, not a cast: the Triton interpreter's fp32→bf16 cast
    # truncates and the CPU tier must be bit-exact too. The values are finite (code · absmax), so the
    # carry into the exponent is the right rounding and no NaN case exists. (Inline, not a jit helper:
    # the interpreter re-patches the language on every helper call, which costs milliseconds.)
    if QDTYPE == tl.bfloat16:  # noqa: SIM300
        u = v.to(tl.uint32, bitcast=True)
        v = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    elif QDTYPE == tl.float16:  # noqa: SIM300
        v = v.to(tl.float16).to(tl.float32)
    if OUT_DTYPE == tl.bfloat16:  # noqa: SIM300
        u = v.to(tl.uint32, bitcast=True)
        v = ((u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000).to(tl.float32, bitcast=True)
    elif OUT_DTYPE == tl.float16:  # noqa: SIM300
        v = v.to(tl.float16).to(tl.float32)
    out = blk[:, None] * (2 * HALF_BS) + tl.arange(0, 2 * HALF_BS)[None, :]
    # The values are exact in the output dtype by now, so this cast only changes the representation.
    tl.store(out_ptr + out, v.to(OUT_DTYPE), mask=out < n_out)


def _use_kernel(device: torch.device) -> bool:
    # On a CPU-only host the kernel runs only in the Triton interpreter (the CPU test tier); elsewhere on
    # the CPU the torch reference is used, which is bit-exact too (just slower).
    return device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1"


def _check(packed: torch.Tensor, quant_state, out: torch.Tensor | None, dtype: torch.dtype) -> int:
    if not isinstance(packed, torch.Tensor):
        raise TypeError(f"packed must be a torch.Tensor, got {type(packed).__name__}")
    if quant_state is None:
        raise ValueError("quant_state is required (the Params4bit's .quant_state)")
    if quant_state.quant_type != "nf4":
        raise ValueError(f"only NF4 is supported, got quant_type={quant_state.quant_type!r}")
    if quant_state.blocksize not in _BLOCKSIZES:
        raise ValueError(f"blocksize must be one of {_BLOCKSIZES}, got {quant_state.blocksize}")
    if quant_state.dtype not in _FLOAT_DTYPES or dtype not in _FLOAT_DTYPES:
        raise TypeError(f"dtypes must be float32/bfloat16/float16, got {quant_state.dtype} and {dtype}")
    n = _numel(quant_state.shape)
    if packed.numel() * packed.element_size() < (n + 1) // 2:
        raise ValueError(
            f"packed holds {packed.numel() * packed.element_size()} bytes, {n} values need {(n + 1) // 2}"
        )
    if not packed.is_contiguous():
        raise ValueError("packed must be contiguous")
    n_blocks = -(-n // quant_state.blocksize)
    if quant_state.absmax.numel() < n_blocks:
        raise ValueError(f"absmax has {quant_state.absmax.numel()} entries, {n_blocks} blocks need one each")
    if quant_state.absmax.device != packed.device:
        raise ValueError(f"absmax is on {quant_state.absmax.device}, packed on {packed.device}")
    if quant_state.nested:
        s2 = quant_state.state2
        if quant_state.absmax.dtype != torch.uint8:
            raise TypeError(f"double-quantized absmax must be uint8, got {quant_state.absmax.dtype}")
        if s2.code.numel() != 256 or s2.absmax.numel() * s2.blocksize < n_blocks:
            raise ValueError("state2 must hold a 256-entry code and one absmax per state2 block")
    if out is not None:
        if out.dtype != dtype:
            raise TypeError(f"out has dtype {out.dtype}, expected {dtype}")
        if out.numel() != n or not out.is_contiguous():
            raise ValueError(f"out must be contiguous with {n} elements, got shape {tuple(out.shape)}")
        if out.device != packed.device:
            raise ValueError(f"out is on {out.device}, packed on {packed.device}")
    return n


def nf4_dequantize(
    packed: torch.Tensor, quant_state, out: torch.Tensor | None = None, dtype: torch.dtype | None = None
) -> torch.Tensor:
    """Dequantize an NF4 tensor exactly as ``bitsandbytes.functional.dequantize_4bit(...).to(dtype)``.

    Args:
        packed: The packed 4-bit data (``Params4bit`` itself or its ``.data``), contiguous.
        quant_state: Its bitsandbytes ``QuantState`` (with or without double quantization).
        out: Optional destination, contiguous with ``prod(quant_state.shape)`` elements of ``dtype``;
            reused buffers avoid an allocation per call.
        dtype: Output dtype; defaults to ``quant_state.dtype``.

    Returns:
        The weight with shape ``quant_state.shape`` (a view of ``out`` when given).

    Raises:
        TypeError: On a wrong tensor type or dtype.
        ValueError: On an unsupported quant type or blocksize, or sizes/devices that do not match.
    """
    with torch._C.DisableTorchFunctionSubclass():  # see _nf4_dequantize
        return _nf4_dequantize(packed, quant_state, out, dtype)


# bitsandbytes' Params4bit overrides __torch_function__ (to keep its quant state through chunk and split), so each
# tensor method or property read on one runs that Python override: several times the host time of the same read on
# a plain tensor, some twenty of them a dequantization. For any other op the override returns what torch returns,
# so the NF4 entry points (nf4_dequantize, dequantize_shared, dequantize_shared_stacked), which never call chunk or
# split, run with subclass dispatch off: the same tensors, less host time.
def _nf4_dequantize(
    packed: torch.Tensor, quant_state, out: torch.Tensor | None, dtype: torch.dtype | None
) -> torch.Tensor:
    dtype = dtype or quant_state.dtype
    bind = out is not None and packed.is_cuda and BIND_LAUNCHES  # a caller's buffer: its next call may replay
    if bind:
        bound = _bound_launch(packed, quant_state, out, dtype)
        if bound is not None:
            launch, shape, device = bound
            launch(out, device)
            return out.view(shape)
    src = _sources(quant_state)  # one read of every attribute the launch's arguments come from
    n = _check(packed, quant_state, out, dtype)
    shape = tuple(src.shape)
    if out is None:
        out = torch.empty(shape, dtype=dtype, device=packed.device)
    out = out.view(shape)
    if n == 0:
        return out
    if not _use_kernel(packed.device):
        return out.copy_(nf4_dequantize_reference(packed, quant_state, dtype))
    half_bs = src.blocksize // 2
    rows = max(1, _BYTES_PER_PROGRAM // half_bs, interpreter_rows(cdiv(n, src.blocksize), 2 * half_bs))
    n_bytes = (n + 1) // 2
    grid = (cdiv(cdiv(n, src.blocksize), rows),)
    absmax = src.absmax.reshape(-1)
    if src.nested:
        absmax2, code2, bs2 = src.absmax2.reshape(-1), src.code2, src.blocksize2
        offset = _offset(src.offset, packed.device)
    else:
        absmax2 = code2 = offset = absmax  # unread placeholders
        bs2 = 1
    # every parameter of the kernel in order (out is the 7th), as a bound launch replays them
    args = [
        packed.reshape(-1).view(torch.uint8),
        absmax,
        absmax2,
        code2,
        offset,
        _code(packed.device),
        out,
        n_bytes,
        n,
        half_bs,
        rows,
        bool(src.nested),
        bs2,
        _TL_DTYPES[src.dtype],
        _TL_DTYPES[dtype],
    ]
    compiled = _nf4_dequant_kernel[grid](*args, num_warps=_NUM_WARPS, enable_fp_fusion=False)
    if bind and compiled is not None:
        _bind(packed, quant_state, src, out, dtype, BoundLaunch(compiled, grid, args, _OUT_ARG), shape)
    return out


# Bound launches (utils.BoundLaunch) of each weight's dequantization: id(quant state) -> (a weak reference to it,
# {launch key: (the sources it was bound from, their addresses, the launch, the weight's shape and size)}). A launch
# key is what Triton's specialization of this kernel, and its choice of compiled kernel, reads that can differ
# between calls for one quant state: the packed data's address and size, the output dtype, whether the output's
# address is 16-byte aligned, the current device, Triton's debug and instrumentation settings. The sources are every
# attribute of the quant state the launch's arguments came from, checked at each replay as the same objects at the
# same addresses: one reassigned (bitsandbytes' QuantState.to makes new tensors) or given other storage binds anew,
# and the rebinding drops what no longer holds. The output is checked as _check does. A binding holds views of the
# weight's packed data and statistics until its quant state is freed or rebound: a model moved off the GPU would keep
# those GPU copies while its quant states live (strop never moves an NF4 model off its GPU).
# (Keyed by id with a weak reference, not a WeakKeyDictionary: a QuantState defines __eq__ and so is unhashable.)
_BOUND: dict[int, tuple[weakref.ref, dict]] = {}
_BIND_LOCK = threading.Lock()
_OUT_ARG = 6
# False: every dequantization launches through Triton's own binding (to compare the two).
BIND_LAUNCHES = True


class _Sources(NamedTuple):
    absmax: torch.Tensor
    shape: tuple
    blocksize: int
    dtype: torch.dtype
    quant_type: str
    nested: bool
    offset: object  # the double quantization's (None without)
    state2: object
    absmax2: torch.Tensor | None
    code2: torch.Tensor | None
    blocksize2: int | None


def _sources(quant_state) -> _Sources:
    s2 = quant_state.state2 if quant_state.nested else None
    return _Sources(
        quant_state.absmax,
        quant_state.shape,
        quant_state.blocksize,
        quant_state.dtype,
        quant_state.quant_type,
        quant_state.nested,
        None if s2 is None else quant_state.offset,
        s2,
        None if s2 is None else s2.absmax,
        None if s2 is None else s2.code,
        None if s2 is None else s2.blocksize,
    )


def _same(a: _Sources, b: _Sources) -> bool:
    return all(map(operator.is_, a, b))


def _addresses(src: _Sources) -> tuple:
    """Where the source tensors are, and the offset's version counter: an offset the launch copied to the device
    (``_offset``, for one that is not an fp32 tensor there) is its value at binding, so a change in place binds
    anew."""
    offset = src.offset
    return (
        *(t.data_ptr() if t is not None else None for t in (src.absmax, src.absmax2, src.code2)),
        (offset.data_ptr(), offset._version) if isinstance(offset, torch.Tensor) else offset,
    )


def _launch_key(packed: torch.Tensor, out: torch.Tensor, dtype: torch.dtype) -> tuple:
    return (
        packed.data_ptr(),
        packed.numel(),
        dtype,
        out.data_ptr() % 16 == 0,
        torch.cuda.current_device(),
        knobs.runtime.debug,
        knobs.compilation.instrumentation_mode,
    )


def _bound_launch(packed: torch.Tensor, quant_state, out: torch.Tensor, dtype: torch.dtype):
    """``(launch, shape, device)`` where this weight's dequantization into ``out`` was bound and still holds (the
    device: the current one, the key's), else None."""
    entry = _BOUND.get(id(quant_state))
    if entry is None or entry[0]() is not quant_state:
        return None
    key = _launch_key(packed, out, dtype)
    hit = entry[1].get(key)
    if hit is None:
        return None
    sources, addresses, launch, shape, n = hit
    src = _sources(quant_state)
    if not _same(sources, src) or _addresses(src) != addresses:
        return None  # the full path binds anew, in place of this one
    if (
        out.dtype != dtype
        or out.numel() != n
        or not out.is_contiguous()
        or out.get_device() != packed.get_device()
    ):
        return None  # the full path raises its error
    return launch, shape, key[4]


def _bind(
    packed: torch.Tensor, quant_state, src: _Sources, out: torch.Tensor, dtype: torch.dtype, launch, shape
):
    key = id(quant_state)
    with _BIND_LOCK:  # jobs on other threads bind too; lookups (_bound_launch) only read
        entry = _BOUND.get(key)
        if entry is None or entry[0]() is not quant_state:

            def forget(ref, key=key):
                if _BOUND.get(key, (None,))[0] is ref:
                    _BOUND.pop(key, None)

            entry = _BOUND[key] = (weakref.ref(quant_state, forget), {})
        launches = entry[1]
        lkey = _launch_key(packed, out, dtype)
        if any(k[0] != lkey[0] or not _same(v[0], src) for k, v in list(launches.items())):
            launches.clear()  # the weight's data moved, or its quant state changed: bound anew from here
        launches[lkey] = (src, _addresses(src), launch, shape, _numel(shape))


# One flat scratch tensor per (device, dtype), grown to the largest weight seen. LoRA functions dequantize
# each frozen NF4 weight into it just before its matmul, in forward and again in backward, so at most one
# layer weight at 16 bits is ever resident. Stream order makes the reuse safe on one CUDA stream. A second slot
# (``slot=1``) is written by one kind of weight alone (an MoE layer's down stack: ``moe_gemm``), so that what the
# first holds survives it.
_SHARED: dict[tuple[torch.device, torch.dtype, int], torch.Tensor] = {}
# What the front of each buffer holds, where :func:`shared_buffer_holding` wrote it: (weak references to its
# sources' storages, (element count, extra, each source's view and version counter)). Every other writer takes the
# buffer through :func:`_shared_buffer`, which forgets it.
_HELD: dict[tuple[torch.device, torch.dtype, int], tuple[tuple[StorageWeakRef, ...], tuple]] = {}


def _shared_buffer(device: torch.device, dtype: torch.dtype, n: int, slot: int = 0) -> torch.Tensor:
    key = (device, dtype, slot)
    _HELD.pop(key, None)  # the caller is about to write into it
    buf = _SHARED.get(key)
    if buf is None or buf.numel() < n:
        _SHARED.pop(key, None)  # free the smaller buffer before allocating the larger one
        buf = _SHARED[key] = torch.empty(n, dtype=dtype, device=device)
    return buf


def dequantize_shared(param: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Dequantize an NF4 ``Params4bit`` into the shared per-device scratch buffer.

    The result aliases that buffer: it is valid only until the next call for the same device and dtype.
    Use it for one matmul; never return it, keep it, or save it for backward.

    Args:
        param: An NF4 ``Params4bit`` (see :func:`is_nf4`).
        dtype: The dtype to dequantize into (normally the compute dtype).

    Returns:
        A ``quant_state.shape`` view into the scratch buffer.
    """
    if not is_nf4(param):
        raise TypeError(f"expected an NF4 Params4bit, got {type(param).__name__}")
    qs = param.quant_state
    n = _numel(qs.shape)
    with torch._C.DisableTorchFunctionSubclass():  # see _nf4_dequantize
        return _nf4_dequantize(param, qs, _shared_buffer(param.device, dtype, n)[:n], dtype)


def shared_buffer_holding(
    device: torch.device,
    dtype: torch.dtype,
    n: int,
    sources: tuple[torch.Tensor, ...],
    extra: tuple,
    fill: Callable[[torch.Tensor], object],
    *,
    reuse: bool = True,
    slot: int = 0,
) -> torch.Tensor:
    """The shared scratch buffer's first ``n`` elements holding a value computed from ``sources`` (and ``extra``,
    plain values compared with ==): ``fill`` writes it, unless ``reuse`` and the last writer was a call with the same
    sources and extra and nothing has taken the buffer since (every other writer goes through ``_shared_buffer``,
    which forgets what it held): where nothing runs between, a forward's last stack is its backward's first (an
    uncheckpointed MoE layer's down stack, a checkpointed one's gate/up stack merged by the recompute), read as it is.

    A source is the same when it views the same live storage (a weak reference to it: a freed storage never
    matches) at the same place, shape and strides, with the same version counter value (no in-place change since).
    Not the same tensor object: autograd hands a backward its saved tensors as other objects (a checkpoint's
    recompute saves its own views of the parameters), which view the parameters' storages and share their version
    counters.

    Aliases the buffer as :func:`dequantize_shared` does (valid until the next NF4 dequantization on this device;
    ``slot=1``: until the next write to that slot).
    """
    key = (device, dtype, slot)
    state = (n, extra, tuple((t.data_ptr(), tuple(t.shape), t.stride(), t._version) for t in sources))
    held = _HELD.get(key)
    if (
        reuse
        and held is not None
        and held[1] == state
        and all(
            not r.expired() and r == StorageWeakRef(t.untyped_storage())
            for r, t in zip(held[0], sources, strict=True)
        )
    ):
        return _SHARED[key][:n]
    buf = _shared_buffer(device, dtype, n, slot)[:n]
    fill(buf)
    _HELD[key] = (tuple(StorageWeakRef(t.untyped_storage()) for t in sources), state)
    return buf


def dequantize_shared_stacked(params: tuple[torch.Tensor, ...], dtype: torch.dtype) -> torch.Tensor:
    """Dequantize NF4 weights of one input width, one under the other, into the shared scratch buffer.

    ``[Σ out_i, in]``: one GEMM against it computes every projection of an input at once (a fused MLP's gate and
    up), and one GEMM with it computes the sum of their input gradients. Aliases the buffer as
    :func:`dequantize_shared` does.
    """
    for p in params:
        if not is_nf4(p):
            raise TypeError(f"expected NF4 Params4bit weights, got {type(p).__name__}")
    shapes = [tuple(p.quant_state.shape) for p in params]
    if len({s[1:] for s in shapes}) != 1:
        raise ValueError(f"stacked weights need one input width, got shapes {shapes}")
    sizes = [_numel(s) for s in shapes]
    with torch._C.DisableTorchFunctionSubclass():  # see _nf4_dequantize
        buf = _shared_buffer(params[0].device, dtype, sum(sizes))
        start = 0
        for p, n in zip(params, sizes, strict=True):
            _nf4_dequantize(p, p.quant_state, buf[start : start + n], dtype)
            start += n
    return buf[:start].view(sum(s[0] for s in shapes), *shapes[0][1:])


def dequantize_weight(
    module_or_param: torch.nn.Module | torch.Tensor,
    out: torch.Tensor | None = None,
    dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The dense weight of a bitsandbytes ``Linear4bit``/``Params4bit``, or a plain weight as is.

    Args:
        module_or_param: A ``Linear4bit`` (or any module with a ``.weight``), a ``Params4bit``, or a tensor.
        out: Optional destination for NF4 (see :func:`nf4_dequantize`).
        dtype: Output dtype; NF4 defaults to ``quant_state.dtype``. A dense weight is cast only if given.

    Returns:
        A fresh dense tensor (or ``out``) for NF4; the dense weight itself (cast if ``dtype`` asks) otherwise.

    Raises:
        TypeError: If the argument has no weight, or carries a non-NF4 quant state (e.g. FP4).
    """
    t = module_or_param.weight if isinstance(module_or_param, torch.nn.Module) else module_or_param
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"expected a tensor or a module with a .weight, got {type(module_or_param).__name__}")
    qs = getattr(t, "quant_state", None)
    if qs is not None:
        if qs.quant_type != "nf4":
            raise TypeError(f"only NF4 weights can be dequantized here, got quant_type={qs.quant_type!r}")
        return nf4_dequantize(t, qs, out=out, dtype=dtype)
    return t if dtype is None or t.dtype == dtype else t.to(dtype)
