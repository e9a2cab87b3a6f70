"""GGUF files for llama.cpp: merged models (F32/F16/BF16/Q8_0) and LoRA adapters.

The pieces, one module each: the type table (``gguf_types``), the tokenizer metadata
(``gguf_tokenizer``), what llama.cpp expects of an architecture (``gguf_arch``: metadata, tensor names,
the q/k permutation) and the streaming writer (``gguf_writer``). This module puts them together:
the tensor plan is fixed first, then tensors are merged, permuted, converted and written one at a
time. K-quants are made from an exact GGUF by llama.cpp's quantizer (``quantize``).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import gguf
import numpy as np
import torch

from strop.common.export_types import DEFAULT_GGUF_LORA_TYPE
from strop.common.gguf_metadata import GgufVocab
from strop.export_svc.core import moe
from strop.export_svc.core.adapter_source import Adapter
from strop.export_svc.core.base_source import BaseModel
from strop.export_svc.core.errors import TargetRefused, UnknownFormat
from strop.export_svc.core.gguf_arch import (
    add_model_metadata,
    check_gguf_model,
    gguf_tensor_name,
    llama3_rope_factors,
    norm_offset,
    permute_qk,
    qk_heads,
    rope_of,
    tensor_name_map,
)
from strop.export_svc.core.gguf_types import GGUF_TYPES, LORA_TYPES, QT, tensor_type
from strop.export_svc.core.gguf_writer import GgufStreamWriter, encode
from strop.export_svc.core.merge import iter_merged


def write_gguf_model(
    path: Path,
    base: BaseModel,
    adapter: Adapter | None,
    vocab: GgufVocab,
    *,
    gguf_type: str,
    name: str,
    before_tensor: Callable[[str], None] | None = None,
    after_tensor: Callable[[str, int, int, int], None] | None = None,
) -> int:
    """Merge (if ``adapter``) and write one GGUF model file of ``gguf_type``; returns its size in bytes.

    Raises:
        UnknownFormat: ``gguf_type`` is not one gguf-py writes directly (F32, F16, BF16, Q8_0).
        TargetRefused: a setting llama.cpp's arch would not reproduce (``gguf_arch.gguf_refusals``).
    """
    t = GGUF_TYPES.get(gguf_type)
    if t is None or t.qtype is None:
        direct = [n for n, x in GGUF_TYPES.items() if x.direct]
        raise UnknownFormat(f"GGUF type {gguf_type!r} is not written directly; choose from {sorted(direct)}")
    model_type = t.qtype
    arch = base.arch
    check_gguf_model(base.config, arch)
    name_map = tensor_name_map(base)
    w = GgufStreamWriter(path, arch.gguf_arch)
    try:
        add_model_metadata(w.kv, base.config, arch, name)
        w.kv.add_file_type(t.file_type)
        if model_type not in (QT.F32, QT.F16, QT.BF16):
            w.kv.add_quantization_version(gguf.GGML_QUANT_VERSION)
        vocab.add_to(w.kv)
        _, rope_type, _ = rope_of(base.config)
        extra: list[tuple[str, np.ndarray]] = []
        if rope_type == "llama3":
            extra.append(
                (
                    gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.ROPE_FREQS] + ".weight",
                    llama3_rope_factors(base.config),
                )
            )
        for gname, arr in extra:
            w.plan(gname, arr.shape, QT.F32)
        names = [n for n in base.tensors if "rotary_emb.inv_freq" not in n]
        if base.config.get("tie_word_embeddings") and not (adapter and "lm_head.weight" in adapter.modules):
            names = [n for n in names if n != "lm_head.weight"]  # llama.cpp reads token_embd as the output
        # an MoE layer's experts go out stacked, [E, out, in], when the last of them has been merged
        stacks = moe.expert_stacks(base.config, names)
        gnames = {n: gguf_tensor_name(name_map, stacks[n][0] if n in stacks else n) for n in names}
        last = {gnames[n]: n for n in names}
        for n in names:
            shape = base.tensors[n].shape
            if n in stacks:
                if last[gnames[n]] != n:
                    continue
                shape = (stacks[n][2], *shape)
            w.plan(gnames[n], shape, tensor_type(gnames[n], shape, model_type))
        qtypes = {pt.name: pt.qtype for pt in w.planned}
        w.begin()
        for gname, arr in extra:
            w.write(gname, arr)
        pending: dict[str, dict[int, torch.Tensor]] = {}
        for i, (n, x) in enumerate(iter_merged(base, adapter, names=names, before_tensor=before_tensor)):
            heads = qk_heads(base, n)
            if heads is not None:
                x = permute_qk(x, heads)
            offset = norm_offset(arch, n)
            if offset:
                x = x.to(torch.float32) + offset  # 1-D norms are written F32: the shift is exact
            if n in stacks:
                group = pending.setdefault(gnames[n], {})
                group[stacks[n][1]] = x
                if last[gnames[n]] != n:
                    continue
                x = torch.stack([group[e].to(torch.float32) for e in range(stacks[n][2])])
                del pending[gnames[n]]
            w.write(gnames[n], encode(x, qtypes[gnames[n]]))
            if after_tensor is not None:
                after_tensor(n, i, w.bytes_written, w.bytes_total)
        w.finish()
    except BaseException:
        w.abort()
        raise
    return path.stat().st_size


def lora_alpha_for_gguf(adapter: Adapter) -> tuple[float, bool]:
    """(alpha to store, fold scale into B?). llama.cpp scales each pair by ``alpha / rank``.

    When every module shares one ``scale·rank`` (always, unless rank/alpha patterns differ), storing
    ``alpha = scale·rank`` reproduces PEFT's scale exactly, rsLoRA included. Otherwise alpha is stored
    as 0 (llama.cpp then applies no scale) and each module's scale is folded into its B.
    """
    products = {round(m.scale * m.r, 9) for m in adapter.modules.values()}
    if len(products) == 1:
        return float(products.pop()), False
    return 0.0, True


def gguf_lora_refusals(adapter: Adapter) -> list[str]:
    """What in this adapter a GGUF LoRA cannot carry (empty: it can)."""
    why = []
    if adapter.use_dora:
        why.append("DoRA")
    if any(m.kind == "embedding" for m in adapter.modules.values()):
        why.append("LoRA on embeddings")
    if adapter.replacements:
        why.append(f"whole-module weights ({sorted(adapter.replacements)[:2]})")
    if adapter.expert_pairs or any(m.a_rows is not None for m in adapter.modules.values()):
        why.append(
            "LoRA on fused experts (llama.cpp's LoRA adapters carry 2-D pairs only; a merged GGUF can)"
        )
    return why


def check_gguf_lora(adapter: Adapter) -> None:
    """Raise TargetRefused naming what in ``adapter`` a GGUF LoRA cannot carry.

    Raises:
        TargetRefused: DoRA, embedding LoRA, or whole-module replacements (llama.cpp's LoRA cannot
            express them; a merged GGUF can).
    """
    why = gguf_lora_refusals(adapter)
    if why:
        raise TargetRefused(
            f"adapter {adapter.label!r} uses {', '.join(why)}, which a GGUF LoRA cannot carry; export a merged GGUF"
        )


def write_gguf_lora(
    path: Path,
    base: BaseModel,
    adapter: Adapter,
    *,
    lora_type: str = DEFAULT_GGUF_LORA_TYPE,
    name: str,
    before_tensor: Callable[[str], None] | None = None,
    after_tensor: Callable[[str, int, int, int], None] | None = None,
) -> int:
    """Write a GGUF LoRA adapter llama.cpp applies to the GGUF of ``base``; returns its size.

    Raises:
        TargetRefused: see :func:`check_gguf_lora`.
        UnknownFormat: ``lora_type`` not F32/F16/BF16.
    """
    if lora_type not in LORA_TYPES:
        raise UnknownFormat(f"GGUF LoRA tensor type {lora_type!r} is not one of {sorted(LORA_TYPES)}")
    check_gguf_lora(adapter)
    qtype = LORA_TYPES[lora_type]
    name_map = tensor_name_map(base)
    alpha, fold = lora_alpha_for_gguf(adapter)
    w = GgufStreamWriter(path, base.arch.gguf_arch)
    try:
        w.kv.add_type(gguf.GGUFType.ADAPTER)
        w.kv.add_string(gguf.Keys.Adapter.TYPE, "lora")
        w.kv.add_float32(gguf.Keys.Adapter.LORA_ALPHA, alpha)
        w.kv.add_name(name)
        mods = list(adapter.modules.values())
        for m in mods:
            g = gguf_tensor_name(name_map, m.base_key)
            w.plan(g + ".lora_a", adapter.file.entries[m.a_key].shape, qtype)
            w.plan(g + ".lora_b", adapter.file.entries[m.b_key].shape, qtype)
        w.begin()
        for i, m in enumerate(mods):
            if before_tensor is not None:
                before_tensor(m.base_key)
            g = gguf_tensor_name(name_map, m.base_key)
            a = adapter.read(m.a_key).to(torch.float32)
            b = adapter.read(m.b_key).to(torch.float32)
            if fold:
                b = b * m.scale
            heads = qk_heads(base, m.base_key)
            if heads is not None:
                b = permute_qk(b, heads)  # rows of B are the output rows llama.cpp permutes
            w.write(g + ".lora_a", encode(a, qtype))
            w.write(g + ".lora_b", encode(b, qtype))
            if after_tensor is not None:
                after_tensor(m.base_key, i, w.bytes_written, w.bytes_total)
        w.finish()
    except BaseException:
        w.abort()
        raise
    return path.stat().st_size
