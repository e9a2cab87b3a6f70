"""The architectures the exporter handles and what each means for the formats it writes.

One table: Hugging Face ``model_type`` → class name, llama.cpp architecture, whether llama.cpp wants
q/k rows permuted (its ``llama`` arch applies RoPE to interleaved pairs, HF to rotated halves), and
the tensors a checkpoint of a given config must hold (what vLLM's loader and strop's checks expect).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from strop.export_svc.core.errors import UnsupportedModel


@dataclass(frozen=True)
class ArchInfo:
    """How one Hugging Face architecture maps onto the export formats."""

    model_type: str
    hf_class: str
    gguf_arch: str  # general.architecture in GGUF
    permute_qk: bool  # llama.cpp's llama arch: HF rotate-half rows → interleaved pairs
    qkv_bias: bool  # q/k/v projections carry biases (qwen2)
    qk_norm: bool  # per-head RMSNorm on q and k (qwen3)


ARCHS: dict[str, ArchInfo] = {
    "llama": ArchInfo("llama", "LlamaForCausalLM", "llama", True, False, False),
    # llama.cpp converts MistralForCausalLM with its llama arch (same tensors, same permutation).
    "mistral": ArchInfo("mistral", "MistralForCausalLM", "llama", True, False, False),
    "qwen2": ArchInfo("qwen2", "Qwen2ForCausalLM", "qwen2", False, True, False),
    "qwen3": ArchInfo("qwen3", "Qwen3ForCausalLM", "qwen3", False, False, True),
}

LORA_LINEAR_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
# What vLLM's LoRA loader accepts for these models: the seven projections, plus the embedding modules
# its Llama/Qwen model classes declare (`embedding_modules`).
VLLM_LORA_MODULES = frozenset({*LORA_LINEAR_MODULES, "embed_tokens", "lm_head"})
# vLLM's `--max-lora-rank` choices (vllm/config/lora.py, MaxLoRARanks).
VLLM_MAX_LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)


def arch_of(config: dict[str, Any], *, where: str = "model") -> ArchInfo:
    """The ArchInfo of a config dict.

    Raises:
        UnsupportedModel: ``model_type`` is not one of llama, mistral, qwen2, qwen3.
    """
    model_type = config.get("model_type")
    info = ARCHS.get(str(model_type))
    if info is None:
        archs = config.get("architectures") or []
        raise UnsupportedModel(
            f"{where}: architecture {model_type!r} {archs} is not supported for export; "
            f"supported: {sorted(ARCHS)}"
        )
    return info


def head_dim(config: dict[str, Any]) -> int:
    hd = config.get("head_dim")
    return int(hd) if hd else int(config["hidden_size"]) // int(config["num_attention_heads"])


def expected_tensors(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor a dense checkpoint of ``config`` holds, with its shape (HF names)."""
    info = arch_of(config)
    h = int(config["hidden_size"])
    inter = int(config["intermediate_size"])
    nh = int(config["num_attention_heads"])
    nkv = int(config.get("num_key_value_heads") or nh)
    hd = head_dim(config)
    vocab = int(config["vocab_size"])
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    if not config.get("tie_word_embeddings", False):
        out["lm_head.weight"] = (vocab, h)
    attn_bias = info.qkv_bias or bool(config.get("attention_bias", False))
    for i in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (h,)
        out[p + "self_attn.q_proj.weight"] = (nh * hd, h)
        out[p + "self_attn.k_proj.weight"] = (nkv * hd, h)
        out[p + "self_attn.v_proj.weight"] = (nkv * hd, h)
        out[p + "self_attn.o_proj.weight"] = (h, nh * hd)
        if attn_bias:
            out[p + "self_attn.q_proj.bias"] = (nh * hd,)
            out[p + "self_attn.k_proj.bias"] = (nkv * hd,)
            out[p + "self_attn.v_proj.bias"] = (nkv * hd,)
        if config.get("attention_bias", False) and info.model_type in ("llama", "mistral"):
            out[p + "self_attn.o_proj.bias"] = (h,)
        if info.qk_norm:
            out[p + "self_attn.q_norm.weight"] = (hd,)
            out[p + "self_attn.k_norm.weight"] = (hd,)
        out[p + "mlp.gate_proj.weight"] = (inter, h)
        out[p + "mlp.up_proj.weight"] = (inter, h)
        out[p + "mlp.down_proj.weight"] = (h, inter)
        if config.get("mlp_bias", False):
            out[p + "mlp.gate_proj.bias"] = (inter,)
            out[p + "mlp.up_proj.bias"] = (inter,)
            out[p + "mlp.down_proj.bias"] = (h,)
    return out


DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


def config_dtype(config: dict[str, Any]) -> str:
    """The dtype a checkpoint's config declares (``dtype``, older ``torch_dtype``, or bnb's compute dtype)."""
    for key in ("dtype", "torch_dtype"):
        v = config.get(key)
        if isinstance(v, str) and v in DTYPES:
            return v
    q = config.get("quantization_config") or {}
    v = q.get("bnb_4bit_compute_dtype")
    if isinstance(v, str) and v in DTYPES:
        return v
    return "bfloat16"


def permute_qk(w: torch.Tensor, n_head: int) -> torch.Tensor:
    """Reorder q/k rows from HF's rotate-half layout to llama.cpp's interleaved pairs.

    Within each head the rows ``[x0..x(d/2-1), y0..y(d/2-1)]`` become ``[x0, y0, x1, y1, ...]``. Works
    on weights ``[n_head*d, in]``, biases ``[n_head*d]`` and LoRA B matrices ``[n_head*d, r]`` alike
    (the permutation acts on rows only, so ``permute(B) @ A == permute(B @ A)``).
    """
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
