"""The Llama-family architectures strop handles, and the facts every layer needs about each (no torch).

Mixtures of experts (:data:`MOE_ARCHS`: Qwen3-MoE, Mixtral, gpt-oss) are a second table of the same
:class:`Arch` rows with a :class:`Moe` part: their attention is a dense arch's, their MLP a router and experts
that transformers (5.x) holds fused, as 3-D ``gate_up_proj``/``down_proj`` parameters of one experts module,
whatever the checkpoint's layout. :data:`MODEL_TYPES` stays the dense archs (what every dense path handles).

One table, :data:`ARCHS`: Hugging Face ``model_type`` → what transformers builds (model and config class),
where its modeling file puts biases, norms and the sliding window, and what llama.cpp calls it and
expects (``general.architecture``; whether q/k rows are permuted from HF's rotate-half layout to the
interleaved pairs llama.cpp's ``llama`` arch applies RoPE to). The export service, the kernels' model
patching, the trainer and the test fixtures all read it; none keeps its own list.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any


class Bias(enum.StrEnum):
    """When a projection carries a bias in HF's modeling file."""

    NEVER = "never"
    ALWAYS = "always"
    ATTENTION_BIAS = "attention_bias"  # when ``config.attention_bias`` is true
    MLP_BIAS = "mlp_bias"  # when ``config.mlp_bias`` is true

    def applies(self, config: dict[str, Any]) -> bool:
        """Whether a model of ``config`` has this bias."""
        if self is Bias.ALWAYS:
            return True
        if self is Bias.NEVER:
            return False
        return bool(config.get(self.value, False))


class SlidingWindow(enum.StrEnum):
    """Where HF's attention forward takes the sliding window it passes to the attention interface."""

    NONE = "none"  # full attention always (llama)
    CONFIG = "config"  # ``attn.config.sliding_window``, None for full attention (mistral)
    LAYER = "layer"  # ``attn.sliding_window``, set per layer from ``config.layer_types`` (qwen2, qwen3)


class TopKNorm(enum.StrEnum):
    """How a router turns its top-k choices into the weights the experts' outputs are summed with."""

    CONFIG = "config"  # softmax over all experts, top-k kept, renormalized when ``config.norm_topk_prob``
    ALWAYS = "always"  # softmax over all experts, top-k kept and renormalized (Mixtral)
    TOPK_SOFTMAX = "topk_softmax"  # top-k of the logits, softmax over those k (gpt-oss)


@dataclass(frozen=True)
class Moe:
    """What a mixture-of-experts architecture adds to its :class:`Arch` (HF's modeling file and checkpoint).

    Attributes:
        num_experts_key: the config key of the expert count.
        intermediate_key: the config key of one expert's intermediate size.
        router: the router's module name under ``mlp`` (a ``weight`` of shape ``[experts, hidden]``).
        router_bias: the router has a bias too.
        topk_norm: how the top-k routing weights are formed.
        expert_bias: the fused expert parameters carry biases (``gate_up_proj_bias``, ``down_proj_bias``).
        transposed: the fused parameters are stored ``[experts, in, out]`` (HF's ``is_transposed``), not
            ``[experts, out, in]``; gate and up then interleave along ``out`` (gpt-oss) instead of being halves.
        checkpoint_experts: the per-expert tensor names a checkpoint holds under
            ``model.layers.{i}.{checkpoint_mlp}.experts.{e}.`` as (gate, up, down); empty when the checkpoint
            holds the fused parameters as the model does.
        checkpoint_mlp: the MLP's name in the checkpoint (Mixtral's ``block_sparse_moe``).
        activation: the experts' activation: ``swiglu`` (``silu(gate) · up``) or gpt-oss's clamped
            ``(up + 1) · gate · σ(α · gate)``.
        shared_experts: the architecture adds always-on shared experts (none of these three does).
        router_fp32_weights: the router hands the experts its top-k weights in fp32 (Mixtral); else cast to the
            router logits' dtype (Qwen3-MoE).
    """

    num_experts_key: str
    intermediate_key: str
    router: str
    topk_norm: TopKNorm
    router_bias: bool = False
    expert_bias: bool = False
    transposed: bool = False
    checkpoint_experts: tuple[str, str, str] | tuple[()] = ()
    checkpoint_mlp: str = "mlp"
    activation: str = "swiglu"
    shared_experts: bool = False
    router_fp32_weights: bool = False


@dataclass(frozen=True)
class Arch:
    """One Hugging Face architecture.

    Attributes:
        model_type: ``config.model_type``.
        hf_class: the ``*ForCausalLM`` class (``config.architectures[0]``; what vLLM's registry knows).
        hf_config_class: the transformers config class.
        gguf_arch: llama.cpp's ``general.architecture`` (Mistral converts as ``llama``).
        permute_qk: llama.cpp wants q/k rows reordered from HF's rotate-half halves to interleaved pairs.
        qkv_bias: when q/k/v projections carry a bias.
        o_bias: when o_proj carries a bias.
        mlp_bias: when gate/up/down projections carry a bias.
        qk_norm: per-head RMSNorm on q and k before RoPE (``self_attn.q_norm``/``k_norm``).
        sliding_window: where the attention forward reads its sliding window.
        gemma_norms: Gemma's RMSNorm: the weight is stored as an offset (``x̂ · (1 + w)``), normalized and
            scaled in fp32 and cast to the input's dtype last (Llama casts x̂ before scaling by w).
        sandwich_norms: each sublayer's output is normalized before its residual add
            (``post_attention_layernorm`` on the attention output, ``post_feedforward_layernorm`` on the
            MLP's), and ``pre_feedforward_layernorm`` feeds the MLP.
        embed_scale: the embedding output is multiplied by ``√hidden_size`` (rounded to the weights' dtype).
        rope_per_layer_type: ``config.rope_parameters`` holds one RoPE per layer type
            (``{"full_attention": …, "sliding_attention": …}``).
        attn_softcap: the attention forward passes ``softcap=config.attn_logit_softcapping`` to the attention
            interface (Gemma 2; Gemma 3's config has the key but its forward never passes it).
        moe: the mixture-of-experts facts (:data:`MOE_ARCHS`), None for a dense arch.
        no_kernels: why strop's kernels do not patch this arch (HF + PEFT runs it); empty when they do.
    """

    model_type: str
    hf_class: str
    hf_config_class: str
    gguf_arch: str
    permute_qk: bool
    qkv_bias: Bias = Bias.NEVER
    o_bias: Bias = Bias.NEVER
    mlp_bias: Bias = Bias.NEVER
    qk_norm: bool = False
    sliding_window: SlidingWindow = SlidingWindow.NONE
    gemma_norms: bool = False
    sandwich_norms: bool = False
    embed_scale: bool = False
    rope_per_layer_type: bool = False
    attn_softcap: bool = False
    moe: Moe | None = None
    no_kernels: str = ""


ARCHS: dict[str, Arch] = {
    a.model_type: a
    for a in (
        Arch(
            "llama",
            "LlamaForCausalLM",
            "LlamaConfig",
            "llama",
            permute_qk=True,
            qkv_bias=Bias.ATTENTION_BIAS,
            o_bias=Bias.ATTENTION_BIAS,
            mlp_bias=Bias.MLP_BIAS,
        ),
        # llama.cpp converts MistralForCausalLM with its llama arch (same tensors, same permutation)
        Arch(
            "mistral",
            "MistralForCausalLM",
            "MistralConfig",
            "llama",
            permute_qk=True,
            sliding_window=SlidingWindow.CONFIG,
        ),
        Arch(
            "qwen2",
            "Qwen2ForCausalLM",
            "Qwen2Config",
            "qwen2",
            permute_qk=False,
            qkv_bias=Bias.ALWAYS,
            sliding_window=SlidingWindow.LAYER,
        ),
        Arch(
            "qwen3",
            "Qwen3ForCausalLM",
            "Qwen3Config",
            "qwen3",
            permute_qk=False,
            qkv_bias=Bias.ATTENTION_BIAS,
            o_bias=Bias.ATTENTION_BIAS,
            qk_norm=True,
            sliding_window=SlidingWindow.LAYER,
        ),
        # Gemma 2 and Gemma 3 (text): GeGLU (tanh), (1 + w) RMSNorms around each sublayer, √hidden embedding
        # scale, tied embeddings, alternating sliding-window layers; Gemma 2 soft-caps attention and final
        # logits (config values), Gemma 3 has per-head q/k norms and a RoPE per layer type instead.
        Arch(
            "gemma2",
            "Gemma2ForCausalLM",
            "Gemma2Config",
            "gemma2",
            permute_qk=False,
            qkv_bias=Bias.ATTENTION_BIAS,
            o_bias=Bias.ATTENTION_BIAS,
            sliding_window=SlidingWindow.LAYER,
            gemma_norms=True,
            sandwich_norms=True,
            embed_scale=True,
            attn_softcap=True,
        ),
        Arch(
            "gemma3_text",
            "Gemma3ForCausalLM",
            "Gemma3TextConfig",
            "gemma3",
            permute_qk=False,
            qkv_bias=Bias.ATTENTION_BIAS,
            o_bias=Bias.ATTENTION_BIAS,
            qk_norm=True,
            sliding_window=SlidingWindow.LAYER,
            gemma_norms=True,
            sandwich_norms=True,
            embed_scale=True,
            rope_per_layer_type=True,
        ),
    )
}
MODEL_TYPES: tuple[str, ...] = tuple(ARCHS)

MOE_ARCHS: dict[str, Arch] = {
    a.model_type: a
    for a in (
        # Qwen3's attention (q/k norms); all experts routed, no shared expert; top-k renormalized as the config says
        Arch(
            "qwen3_moe",
            "Qwen3MoeForCausalLM",
            "Qwen3MoeConfig",
            "qwen3moe",
            permute_qk=False,
            qkv_bias=Bias.ATTENTION_BIAS,
            o_bias=Bias.ATTENTION_BIAS,
            qk_norm=True,
            sliding_window=SlidingWindow.LAYER,
            moe=Moe(
                "num_experts",
                "moe_intermediate_size",
                "gate",
                TopKNorm.CONFIG,
                checkpoint_experts=("gate_proj", "up_proj", "down_proj"),
            ),
        ),
        # Mistral's attention; llama.cpp converts MixtralForCausalLM with its llama arch (+ expert tensors)
        Arch(
            "mixtral",
            "MixtralForCausalLM",
            "MixtralConfig",
            "llama",
            permute_qk=True,
            sliding_window=SlidingWindow.CONFIG,
            moe=Moe(
                "num_local_experts",
                "intermediate_size",
                "gate",
                TopKNorm.ALWAYS,
                checkpoint_experts=("w1", "w3", "w2"),
                checkpoint_mlp="block_sparse_moe",
                router_fp32_weights=True,
            ),
        ),
        # attention sinks and biases, alternating sliding layers; fused, transposed, biased experts in the
        # checkpoint (the released weights are MXFP4, which strop does not load: only 16-bit copies)
        Arch(
            "gpt_oss",
            "GptOssForCausalLM",
            "GptOssConfig",
            "gpt-oss",
            permute_qk=False,
            qkv_bias=Bias.ATTENTION_BIAS,
            o_bias=Bias.ATTENTION_BIAS,
            sliding_window=SlidingWindow.LAYER,
            moe=Moe(
                "num_local_experts",
                "intermediate_size",
                "router",
                TopKNorm.TOPK_SOFTMAX,
                router_bias=True,
                expert_bias=True,
                transposed=True,
                activation="gpt_oss",
            ),
            no_kernels=(
                "gpt_oss has no fast path: its attention adds learned sinks (s_aux) and its RMSNorm scales in fp32 "
                "before the cast"
            ),
        ),
    )
}
MOE_MODEL_TYPES: tuple[str, ...] = tuple(MOE_ARCHS)
# what strop's kernels patch (an MoE's attention, norms and loss; its experts run HF's expert path)
KERNEL_MODEL_TYPES: tuple[str, ...] = MODEL_TYPES + tuple(t for t, a in MOE_ARCHS.items() if not a.no_kernels)


def arch_of(model_type: str) -> Arch | None:
    """The :class:`Arch` of ``model_type``, dense or mixture of experts; None when strop does not know it."""
    return ARCHS.get(model_type) or MOE_ARCHS.get(model_type)


def moe_sizes(config: Any) -> tuple[int, int, int]:
    """(experts, experts per token, one expert's intermediate size) of an MoE ``config``: an HF config object or its
    ``config.json`` dict. The expert count is read under either name transformers has used for the arch (5.24 keeps
    Qwen3-MoE's ``num_experts`` as ``num_local_experts``; released checkpoints say ``num_experts``).

    Raises:
        KeyError: not an arch of :data:`MOE_ARCHS`, or no expert count.
    """

    def get(key: str):
        return config.get(key) if isinstance(config, dict) else getattr(config, key, None)

    moe = MOE_ARCHS[str(get("model_type"))].moe
    n = next((get(k) for k in (moe.num_experts_key, "num_local_experts", "num_experts") if get(k)), None)
    if n is None:
        raise KeyError(f"{get('model_type')} config has no expert count ({moe.num_experts_key})")
    return int(n), int(get("num_experts_per_tok")), int(get(moe.intermediate_key))


def head_dim(config: dict[str, Any]) -> int:
    """Per-head dimension: ``head_dim`` when the config sets it, else ``hidden_size / num_attention_heads``."""
    hd = config.get("head_dim")
    return int(hd) if hd else int(config["hidden_size"]) // int(config["num_attention_heads"])


def expected_tensors(config: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """Every tensor a checkpoint of ``config`` holds, with its shape (HF names): a dense one, or a mixture of
    experts with per-expert tensors (Qwen3-MoE, Mixtral: what vLLM's classes load).

    Raises:
        KeyError: ``config["model_type"]`` is in neither :data:`ARCHS` nor, with a per-expert layout,
            :data:`MOE_ARCHS`.
    """
    arch = arch_of(str(config.get("model_type")))
    if arch is None or (arch.moe is not None and not arch.moe.checkpoint_experts):
        raise KeyError(f"no checkpoint layout for model_type {config.get('model_type')!r}")
    h = int(config["hidden_size"])
    inter = int(config["intermediate_size"])
    nh = int(config["num_attention_heads"])
    nkv = int(config.get("num_key_value_heads") or nh)
    hd = head_dim(config)
    vocab = int(config["vocab_size"])
    out: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
    if not config.get("tie_word_embeddings", False):
        out["lm_head.weight"] = (vocab, h)
    qkv_bias, o_bias, mlp_bias = (b.applies(config) for b in (arch.qkv_bias, arch.o_bias, arch.mlp_bias))
    for i in range(int(config["num_hidden_layers"])):
        p = f"model.layers.{i}."
        out[p + "input_layernorm.weight"] = (h,)
        out[p + "post_attention_layernorm.weight"] = (h,)
        if arch.sandwich_norms:
            out[p + "pre_feedforward_layernorm.weight"] = (h,)
            out[p + "post_feedforward_layernorm.weight"] = (h,)
        out[p + "self_attn.q_proj.weight"] = (nh * hd, h)
        out[p + "self_attn.k_proj.weight"] = (nkv * hd, h)
        out[p + "self_attn.v_proj.weight"] = (nkv * hd, h)
        out[p + "self_attn.o_proj.weight"] = (h, nh * hd)
        if qkv_bias:
            out[p + "self_attn.q_proj.bias"] = (nh * hd,)
            out[p + "self_attn.k_proj.bias"] = (nkv * hd,)
            out[p + "self_attn.v_proj.bias"] = (nkv * hd,)
        if o_bias:
            out[p + "self_attn.o_proj.bias"] = (h,)
        if arch.qk_norm:
            out[p + "self_attn.q_norm.weight"] = (hd,)
            out[p + "self_attn.k_norm.weight"] = (hd,)
        if arch.moe is not None and _sparse_layer(config, i):
            n_exp, _, inter_e = moe_sizes(config)
            m = f"{p}{arch.moe.checkpoint_mlp}."
            out[m + f"{arch.moe.router}.weight"] = (n_exp, h)
            gate, up, down = arch.moe.checkpoint_experts
            for e in range(n_exp):
                out[m + f"experts.{e}.{gate}.weight"] = (inter_e, h)
                out[m + f"experts.{e}.{up}.weight"] = (inter_e, h)
                out[m + f"experts.{e}.{down}.weight"] = (h, inter_e)
            continue
        out[p + "mlp.gate_proj.weight"] = (inter, h)
        out[p + "mlp.up_proj.weight"] = (inter, h)
        out[p + "mlp.down_proj.weight"] = (h, inter)
        if mlp_bias:
            out[p + "mlp.gate_proj.bias"] = (inter,)
            out[p + "mlp.up_proj.bias"] = (inter,)
            out[p + "mlp.down_proj.bias"] = (h,)
    return out


def _sparse_layer(config: dict[str, Any], i: int) -> bool:
    """Whether layer ``i`` of an MoE ``config`` has experts (Qwen3-MoE: not in ``mlp_only_layers`` and on the
    ``decoder_sparse_step``; Mixtral: every layer)."""
    if i in (config.get("mlp_only_layers") or []):
        return False
    step = int(config.get("decoder_sparse_step") or 1)
    return (i + 1) % step == 0
