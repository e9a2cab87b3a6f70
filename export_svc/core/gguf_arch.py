"""What llama.cpp expects of an architecture: its metadata keys, tensor names and q/k row order.

- architecture metadata (``<arch>.block_count``, ``context_length``, ``embedding_length``,
  ``feed_forward_length``, ``attention.head_count[_kv]``, ``attention.layer_norm_rms_epsilon``,
  ``attention.key_length/value_length``, ``rope.freq_base``, ``rope.dimension_count``, rope scaling)
  from ``config.json``; ``general.architecture`` is the registry's ``gguf_arch`` (``strop.common.archs``:
  ``llama`` for Llama and Mistral, ``qwen2``, ``qwen3``);
- tensor names from gguf-py's ``TensorNameMap`` (``blk.N.attn_q.weight`` …);
- q/k weights and biases (and LoRA B rows) of an arch with ``permute_qk`` reordered from HF's
  rotate-half rows to llama.cpp's interleaved pairs.
"""

from __future__ import annotations

import math
from typing import Any

import gguf
import numpy as np
import torch

from strop.common.archs import Arch, head_dim
from strop.export_svc.core.errors import UnsupportedModel
from strop.export_svc.core.sources import BaseModel

# gguf-py's architecture enum by llama.cpp's name for it (general.architecture)
_MODEL_ARCH_BY_NAME = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}


def rope_of(config: dict[str, Any]) -> tuple[float, str, dict[str, Any]]:
    """(theta, rope_type, parameters) from transformers 5's ``rope_parameters`` or 4's ``rope_scaling``."""
    rp = config.get("rope_parameters")
    if isinstance(rp, dict) and rp:
        return (
            float(rp.get("rope_theta", config.get("rope_theta", 10000.0))),
            str(rp.get("rope_type", "default")),
            rp,
        )
    rs = config.get("rope_scaling") or {}
    return float(config.get("rope_theta", 10000.0)), str(rs.get("rope_type", rs.get("type", "default"))), rs


def llama3_rope_factors(config: dict[str, Any]) -> np.ndarray:
    """Llama 3.1-style frequency scaling as llama.cpp's ``rope_freqs`` tensor (one factor per pair)."""
    theta, _, p = rope_of(config)
    dim = head_dim(config)
    factor = float(p.get("factor", 8.0))
    low, high = float(p.get("low_freq_factor", 1.0)), float(p.get("high_freq_factor", 4.0))
    old_ctx = float(p.get("original_max_position_embeddings", 8192))
    out = []
    for k in range(0, dim, 2):
        freq = 1.0 / theta ** (k / dim)
        wavelen = 2 * math.pi / freq
        if wavelen < old_ctx / high:
            out.append(1.0)
        elif wavelen > old_ctx / low:
            out.append(factor)
        else:
            smooth = (old_ctx / wavelen - low) / (high - low)
            out.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(out, dtype=np.float32)


def add_model_metadata(w: gguf.GGUFWriter, config: dict[str, Any], arch: Arch, name: str) -> None:
    """General and architecture keys (everything but the tokenizer and file type)."""
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(name)
    w.add_block_count(int(config["num_hidden_layers"]))
    w.add_context_length(int(config.get("max_position_embeddings", 2048)))
    w.add_embedding_length(int(config["hidden_size"]))
    w.add_feed_forward_length(int(config["intermediate_size"]))
    w.add_head_count(int(config["num_attention_heads"]))
    w.add_head_count_kv(int(config.get("num_key_value_heads") or config["num_attention_heads"]))
    w.add_layer_norm_rms_eps(float(config.get("rms_norm_eps", 1e-6)))
    theta, rope_type, p = rope_of(config)
    w.add_rope_freq_base(theta)
    w.add_rope_dimension_count(head_dim(config))
    if config.get("head_dim"):
        w.add_key_length(int(config["head_dim"]))
        w.add_value_length(int(config["head_dim"]))
    if arch.gguf_arch == "llama":
        w.add_vocab_size(int(config["vocab_size"]))
    if rope_type == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(p["factor"]))
    elif rope_type == "yarn":
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(p["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(p["original_max_position_embeddings"]))
    elif rope_type not in ("default", "llama3"):
        raise UnsupportedModel(f"rope type {rope_type!r} is not supported for GGUF export")


def tensor_name_map(base: BaseModel) -> gguf.TensorNameMap:
    """gguf-py's HF → llama.cpp tensor names for ``base``'s architecture and depth."""
    return gguf.get_tensor_name_map(_MODEL_ARCH_BY_NAME[base.arch.gguf_arch], base.num_layers)


def gguf_tensor_name(name_map: gguf.TensorNameMap, hf_name: str) -> str:
    """llama.cpp's name of a HF tensor (``model.layers.0.self_attn.q_proj.weight`` → ``blk.0.attn_q.weight``).

    Raises:
        UnsupportedModel: gguf-py knows no name for it.
    """
    g = name_map.get_name(hf_name, try_suffixes=(".weight", ".bias"))
    if g is None:
        raise UnsupportedModel(f"tensor {hf_name!r} has no llama.cpp name")
    return g


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Reorder q/k rows from HF's rotate-half layout to llama.cpp's interleaved pairs.

    Within each head the rows ``[x0..x(d/2-1), y0..y(d/2-1)]`` become ``[x0, y0, x1, y1, ...]``. Works
    on weights ``[n_head*d, in]``, biases ``[n_head*d]`` and LoRA B matrices ``[n_head*d, rank]`` alike
    (the permutation acts on rows only, so ``permute(B) @ A == permute(B @ A)``).
    """
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def qk_heads(base: BaseModel, hf_name: str) -> int | None:
    """The head count to permute ``hf_name``'s rows by, or None when llama.cpp takes it as HF stores it."""
    if not base.arch.permute_qk:
        return None
    if ".self_attn.q_proj." in hf_name:
        return int(base.config["num_attention_heads"])
    if ".self_attn.k_proj." in hf_name:
        return int(base.config.get("num_key_value_heads") or base.config["num_attention_heads"])
    return None
