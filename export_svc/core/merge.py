"""Merging LoRA adapters into base weights, exactly.

The math, for a linear module with base weight ``W [out, in]`` (16-bit, or NF4 dequantized to fp32),
LoRA ``A [r, in]``, ``B [out, r]`` and scale ``s = alpha / r`` (rsLoRA: ``alpha / sqrt(r)``)::

    W' = cast(W32 + s · (B32 @ A32))                     # LoRA
    W' = cast(m / ‖W32 + s·B32@A32‖_row · (W32 + s·B32@A32))   # DoRA (m: magnitude, one per row)

Everything is computed in fp32, checked finite, and cast once to the target dtype; a 4-bit base is
never re-quantized. Embedding LoRA (``lora_embedding_A [r, vocab]``, ``lora_embedding_B [hidden, r]``)
adds ``s · (B @ A)ᵀ`` to the ``[vocab, hidden]`` table.

``merge_weight`` is the pure function (one weight and its LoRA pair in, the merged weight out);
``iter_merged`` applies it over a model the way every writer uses it: one base tensor at a time, in
on-disk order, so peak memory stays near one tensor (plus its fp32 copies) instead of the whole model.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Iterator

import torch

from strop.export_svc.core.adapter_source import Adapter
from strop.export_svc.core.base_source import BaseModel
from strop.export_svc.core.errors import CorruptInput


def merge_weight(
    w: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    scale: float,
    *,
    kind: str = "linear",
    magnitude: torch.Tensor | None = None,
    inplace: bool = False,
) -> torch.Tensor:
    """``W + scale · B @ A`` in fp32 (``(B @ A)ᵀ`` for embeddings; DoRA rescaling if ``magnitude``).

    Args:
        w: base weight ``[out, in]`` (embeddings: ``[vocab, hidden]``), any float dtype.
        a: LoRA A ``[r, in]`` (embeddings: ``[r, vocab]``).
        b: LoRA B ``[out, r]`` (embeddings: ``[hidden, r]``).
        scale: the LoRA scale (``lora_scale``).
        kind: ``"linear"`` or ``"embedding"``.
        magnitude: DoRA magnitude vector ``[out]``, or None for plain LoRA.
        inplace: ``w`` is an fp32 tensor the caller no longer needs: accumulate into it (saves one
            weight-sized buffer; the result is bitwise the same).

    Returns:
        The merged weight in fp32 (not yet cast).
    """
    delta = b.to(torch.float32) @ a.to(torch.float32)
    if kind == "embedding":
        delta = delta.T
    delta.mul_(scale)  # s·(B@A), rounded once, then added: the same bits as `w + scale * delta`
    if inplace and w.dtype == torch.float32:
        merged = w.add_(delta)
    else:
        merged = w.to(torch.float32) + delta
    del delta
    if magnitude is not None:
        norm = torch.linalg.norm(merged, dim=1)
        merged.mul_((magnitude.to(torch.float32) / norm).unsqueeze(1))
    return merged


_EXPONENT_BITS = {
    torch.float32: (torch.int32, 0x7F800000),
    torch.bfloat16: (torch.int16, 0x7F80),
    torch.float16: (torch.int16, 0x7C00),
}


def count_non_finite(t: torch.Tensor) -> int:
    """How many elements are NaN or ±inf: those whose exponent bits are all ones.

    Integer bit tests on 4M-element chunks: exact, fast for 16-bit types (where ``isfinite`` is
    slow on the CPU), and never a weight-sized temporary.
    """
    if t.dtype not in _EXPONENT_BITS:
        return int((~torch.isfinite(t)).sum()) if t.is_floating_point() else 0
    int_type, mask = _EXPONENT_BITS[t.dtype]
    chunks = t.reshape(-1).view(int_type).split(1 << 22)
    if not any(bool(((c & mask) == mask).any()) for c in chunks):
        return 0
    return sum(int(((c & mask) == mask).sum()) for c in chunks)


def check_finite(name: str, t: torch.Tensor) -> torch.Tensor:
    """Raise CorruptInput naming ``name`` if ``t`` holds NaN or infinity."""
    bad = count_non_finite(t)
    if bad:
        raise CorruptInput(f"merged tensor {name!r} has {bad} non-finite values (base or adapter is corrupt)")
    return t


def _release_free_memory() -> None:
    """Give freed heap pages back to the OS (glibc keeps them otherwise, inflating the resident set)."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


try:
    _LIBC = ctypes.CDLL("libc.so.6")
    _LIBC.malloc_trim  # noqa: B018  (glibc only)
except (OSError, AttributeError):
    _LIBC = None


def iter_merged(
    base: BaseModel,
    adapter: Adapter | None,
    *,
    names: list[str] | None = None,
    before_tensor: Callable[[str], None] | None = None,
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, tensor)`` for every base tensor, merged where the adapter targets it.

    The base's weights are what ``base`` reads: stored 4-bit codes dequantized, a ``quantized_on_load``
    view's NF4 codes re-created and dequantized (the model as trained), else the 16-bit weights.
    Merged and dequantized tensors are fp32; a tensor the adapter does not touch comes as stored
    (16-bit), since upcasting it is exact and would only double its memory. The caller casts once, to
    the dtype of its format. Tensors come in on-disk order, one at a time, and the heap is trimmed
    after each, so the resident set stays near one tensor's working memory. ``before_tensor(name)``
    runs before each read (progress and cancellation hooks).
    """
    for name in names if names is not None else list(base.tensors):
        if before_tensor is not None:
            before_tensor(name)
        if adapter is not None and name in adapter.modules:
            m = adapter.modules[name]
            w = merge_weight(
                base.read_fp32(name),
                adapter.read_a(m),
                adapter.read_b(m),
                m.scale,
                kind=m.kind,
                magnitude=adapter.read(m.magnitude_key) if m.magnitude_key else None,
                inplace=True,
            )
        elif adapter is not None and name in adapter.replacements:
            w = adapter.read(adapter.replacements[name])
        elif base.is_dequantized(name):
            w = base.read_fp32(name)
        else:
            w = base.read_raw(name)
        yield name, check_finite(name, w)
        del w
        _release_free_memory()
