"""What llama.cpp expects of an architecture: its metadata keys, tensor names and q/k row order.

- architecture metadata (``<arch>.block_count``, ``context_length``, ``embedding_length``,
  ``feed_forward_length``, ``attention.head_count[_kv]``, ``attention.layer_norm_rms_epsilon``,
  ``attention.key_length/value_length``, ``rope.freq_base``, ``rope.dimension_count``, rope scaling)
  from ``config.json``; ``general.architecture`` is the registry's ``gguf_arch`` (``strop.common.archs``:
  ``llama`` for Llama and Mistral, ``qwen2``, ``qwen3``, ``gemma2``, ``gemma3``);
- tensor names from gguf-py's ``TensorNameMap`` (``blk.N.attn_q.weight`` …);
- q/k weights and biases (and LoRA B rows) of an arch with ``permute_qk`` reordered from HF's
  rotate-half rows to llama.cpp's interleaved pairs;
- Gemma (:data:`GEMMA_IN_LLAMA_CPP`): norm weights stored ``+1`` (HF's Gemma RMSNorm scales by ``1 + w``,
  llama.cpp's by ``w``), the sliding window and soft-caps as metadata, and a refusal
  (:func:`gguf_refusals`) of every config setting llama.cpp hard-codes otherwise.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import gguf
import numpy as np
import torch

from strop.common.archs import Arch, TopKNorm, head_dim, moe_sizes
from strop.export_svc.core.base_source import BaseModel
from strop.export_svc.core.errors import TargetRefused, UnsupportedModel

# gguf-py's architecture enum by llama.cpp's name for it (general.architecture)
_MODEL_ARCH_BY_NAME = {name: arch for arch, name in gguf.MODEL_ARCH_NAMES.items()}


def rope_of(config: dict[str, Any], layer_type: str = "full_attention") -> tuple[float, str, dict[str, Any]]:
    """(theta, rope_type, parameters) from transformers 5's ``rope_parameters`` or 4's ``rope_scaling``.

    A config with one RoPE per layer type (Gemma 3: ``{"full_attention": …, "sliding_attention": …}``)
    gives ``layer_type``'s; llama.cpp's ``rope.*`` keys are the full-attention layers'.
    """
    rp = config.get("rope_parameters")
    if isinstance(rp, dict) and isinstance(rp.get(layer_type), dict):
        rp = rp[layer_type]
    elif isinstance(rp, dict) and isinstance(rp.get("full_attention"), dict):
        rp = rp["full_attention"]  # no RoPE of its own for this layer type: transformers uses the full one
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
    if arch.moe is not None:  # llama.cpp's MoE keys (convert_hf_to_gguf writes the same for these archs)
        experts, used, inter = moe_sizes(config)
        w.add_expert_count(experts)
        w.add_expert_used_count(used)
        if arch.moe.intermediate_key != "intermediate_size":
            w.add_expert_feed_forward_length(inter)
    gemma = GEMMA_IN_LLAMA_CPP.get(arch.gguf_arch)
    if gemma is not None:
        w.add_sliding_window(int(config["sliding_window"]))
        if gemma.softcaps:
            w.add_attn_logit_softcapping(float(config["attn_logit_softcapping"]))
        if gemma.softcaps or config.get("final_logit_softcapping") is not None:
            w.add_final_logit_softcapping(float(config["final_logit_softcapping"]))
        if gemma.reads_layer_keys:
            w.add_rope_freq_base_swa(rope_of(config, "sliding_attention")[0])
            w.add_sliding_window_pattern([t == "sliding_attention" for t in layer_types_of(config, gemma)])


@dataclass(frozen=True)
class GemmaInLlamaCpp:
    """What llama.cpp's loader does with a Gemma arch's settings, where it does not just read a key.

    From ``src/llama-model.cpp`` (``load_hparams``, cases ``LLM_ARCH_GEMMA2``/``GEMMA3``) and
    ``src/models/gemma2-iswa.cpp``/``gemma3.cpp`` (the graphs); what the llama.cpp vendored in
    llama-cpp-python 0.3.36 reads was measured (a file with the key changed computes otherwise, or not):

    - layer ``il`` is sliding when ``il % period < period - 1`` (``set_swa_pattern``). Gemma 3 reads
      ``attention.sliding_window_pattern`` (a period or one bool per layer) over that default and
      ``rope.freq_base_swa`` over its sliding layers' hard-coded base 10,000; Gemma 2 reads neither;
    - ``f_attention_scale``: ``1/sqrt(n_embd / n_head)`` for the 27B (recognised by its layer count),
      ``1/sqrt(head_dim)`` otherwise; neither ``query_pre_attn_scalar`` nor ``attention.scale`` is read;
    - Gemma 2 sets ``attn_soft_cap = true`` and always caps the final logits (50 and 30 when the keys are
      absent); Gemma 3 never caps attention, and caps the final logits only when ``final_logit_softcapping``
      is in the file;
    - Gemma 3's sliding layers rotate with scale 1 whatever the full layers' RoPE scaling;
    - the feed-forward is ``LLM_FFN_GELU`` (tanh approximation), q/k/v/o carry no biases, and Gemma 2's
      gguf-py tensor list has no ``output``: llama.cpp reads ``token_embd`` as the output projection.
    """

    swa_period: int
    big_layers: int  # the 27B's layer count, whose attention scale is 1/sqrt(hidden / heads)
    softcaps: bool  # llama.cpp always caps attention and final logits (Gemma 2), else attention never
    reads_layer_keys: bool  # sliding_window_pattern and rope.freq_base_swa are read (Gemma 3)
    output_tensor: bool  # an untied ``lm_head`` can be written as ``output.weight``

    def default_layer_types(self, n_layers: int) -> list[str]:
        p = self.swa_period
        return ["sliding_attention" if i % p < p - 1 else "full_attention" for i in range(n_layers)]


GEMMA_IN_LLAMA_CPP: dict[str, GemmaInLlamaCpp] = {
    "gemma2": GemmaInLlamaCpp(
        swa_period=2, big_layers=46, softcaps=True, reads_layer_keys=False, output_tensor=False
    ),
    "gemma3": GemmaInLlamaCpp(
        swa_period=6, big_layers=62, softcaps=False, reads_layer_keys=True, output_tensor=True
    ),
}


def layer_types_of(config: dict[str, Any], gemma: GemmaInLlamaCpp) -> list[str]:
    """Each layer's attention type (``config.layer_types``; transformers' default pattern when absent)."""
    return list(config.get("layer_types") or gemma.default_layer_types(int(config["num_hidden_layers"])))


def gguf_refusals(config: dict[str, Any], arch: Arch) -> list[str]:
    """The settings of ``config`` that llama.cpp's ``arch.gguf_arch`` would not reproduce (empty: none).

    A Gemma GGUF is refused rather than written with another model's function: llama.cpp fixes these
    settings in code (:class:`GemmaInLlamaCpp`), so no metadata key could carry a different value.
    """
    if arch.moe is not None:
        if arch.moe.topk_norm is TopKNorm.CONFIG and not config.get("norm_topk_prob", False):
            return [
                f"norm_topk_prob false: llama.cpp's {arch.gguf_arch} always renormalizes the top-k routing weights"
            ]
        return []
    gemma = GEMMA_IN_LLAMA_CPP.get(arch.gguf_arch)
    if gemma is None:
        return []
    why = []
    name = arch.gguf_arch
    n_layers = int(config["num_hidden_layers"])
    layer_types = layer_types_of(config, gemma)
    pattern = gemma.default_layer_types(n_layers)
    if not gemma.reads_layer_keys and layer_types != pattern:
        why.append(
            f"layer_types {layer_types}: llama.cpp's {name} makes layer i sliding exactly when "
            f"i % {gemma.swa_period} < {gemma.swa_period - 1} ({pattern})"
        )
    if set(layer_types) - {"sliding_attention", "full_attention"}:
        why.append(f"layer_types {layer_types}: llama.cpp's {name} knows sliding and full attention only")
    window = config.get("sliding_window")
    if "sliding_attention" in layer_types and not (isinstance(window, int) and window > 0):
        why.append(
            f"sliding_window {window!r}: llama.cpp's {name} needs a window size for its sliding layers"
        )
    hidden, heads = int(config["hidden_size"]), int(config["num_attention_heads"])
    big = n_layers == gemma.big_layers
    want = hidden / heads if big else float(head_dim(config))
    scalar = config.get("query_pre_attn_scalar")
    if not isinstance(scalar, int | float) or float(scalar) != want:
        basis = "hidden_size / num_attention_heads, as for its 27B" if big else "head_dim"
        why.append(
            f"query_pre_attn_scalar {scalar!r}: llama.cpp's {name} with {n_layers} layers scales attention by "
            f"1/sqrt({want:g}) ({basis}) and reads no setting for it"
        )
    for key in ("attn_logit_softcapping", "final_logit_softcapping"):
        v = config.get(key)
        if gemma.softcaps and not isinstance(v, int | float):
            why.append(
                f"{key} {v!r}: llama.cpp's {name} always soft-caps (at its default when the key is absent)"
            )
        if not gemma.softcaps and key == "attn_logit_softcapping" and v is not None:
            why.append(f"{key} {v!r}: llama.cpp's {name} does not soft-cap attention")
    _, rope_type, _ = rope_of(config)
    if rope_type not in ("default", "linear"):
        why.append(f"rope_type {rope_type!r}: llama.cpp's {name} takes default or linear RoPE only")
    if gemma.reads_layer_keys:
        _, local_type, _ = rope_of(config, "sliding_attention")
        if local_type != "default":
            why.append(
                f"sliding_attention rope_type {local_type!r}: llama.cpp's {name} rotates sliding layers unscaled"
            )
    act = config.get("hidden_activation") or config.get("hidden_act")
    if act != "gelu_pytorch_tanh":
        why.append(f"hidden_activation {act!r}: llama.cpp's {name} computes GELU's tanh approximation")
    if config.get("attention_bias"):
        why.append(f"attention_bias true: llama.cpp's {name} has no attention biases")
    if config.get("use_bidirectional_attention"):
        why.append(f"use_bidirectional_attention true: llama.cpp's {name} attends causally")
    if not gemma.output_tensor and not config.get("tie_word_embeddings", True):
        why.append(f"tie_word_embeddings false: llama.cpp's {name} uses token_embd as the output projection")
    return why


def check_gguf_model(config: dict[str, Any], arch: Arch) -> None:
    """Raise TargetRefused naming every setting llama.cpp would not reproduce (:func:`gguf_refusals`)."""
    why = gguf_refusals(config, arch)
    if why:
        raise TargetRefused(
            f"a {arch.model_type} model with these settings cannot be a GGUF llama.cpp computes correctly: "
            + "; ".join(why)
        )


def norm_offset(arch: Arch, hf_name: str) -> float:
    """What llama.cpp's norm weight adds to HF's: 1 for Gemma's ``x̂ · (1 + w)`` norms, else 0."""
    return 1.0 if arch.gemma_norms and hf_name.endswith("norm.weight") else 0.0


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
