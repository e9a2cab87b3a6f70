"""The forwards ``patch_model`` swaps in, one factory per module kind: RMSNorm, a LoRA linear (o_proj), the
MLP, the attention (fused LoRA Q/K/V, RoPE in place, HF's attention interface) and the *ForCausalLM (fused
linear cross-entropy when called with ``labels``). Each runs the original forward when the patch is off, for
arguments it does not handle, or when a projection's spec (``proj_spec.py``) says why it cannot run.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable

import torch
from torch import nn

from strop.common.archs import SlidingWindow, arch_of, moe_sizes

from ..lora.linear import LoRAProj, lora_linear, lora_qkv
from ..lora.mlp import lora_mlp
from ..lora.stash import stash, take_stashed
from ..ops.rmsnorm import RMSNormMode
from .hf import scaled_logits_reason
from .patch_state import PatchState, patched
from .proj_spec import layer_spec
from .saved_attention import attention_call, replayed_qkv, saved_qkv_projections

# where HF's attention forward reads the sliding window it passes to the attention interface
_WINDOW: dict[SlidingWindow, Callable[[nn.Module], int | None] | None] = {
    SlidingWindow.NONE: None,
    SlidingWindow.CONFIG: lambda attn: getattr(attn.config, "sliding_window", None),
    SlidingWindow.LAYER: lambda attn: attn.sliding_window,
}


def _layer_specs(state: PatchState, owner: nn.Module, layers, x) -> list[LoRAProj] | None:
    # A checkpointed layer's recompute takes the specs its forward read (``kernels/lora/stash.py``): it must compute
    # what the forward computed, from the same projections, and reading them costs some twenty attribute and dict
    # look-ups a projection and pass.
    tag = ("patched_forwards.specs", id(owner))
    specs = take_stashed(tag)
    if specs is not None:
        return specs
    specs = [layer_spec(m, x) for m in layers]
    bad = next((s for s in specs if isinstance(s, str)), None)
    if bad is not None:
        state.fallback(owner, bad)
        return None
    stash(tag, specs)
    return specs


# the attribute each HF RMSNorm keeps its epsilon in
NORM_EPS = {RMSNormMode.LLAMA: "variance_epsilon", RMSNormMode.GEMMA: "eps"}


def norm_forward(inplace_backward: bool, mode: RMSNormMode) -> Callable:
    from ..ops.rmsnorm import rms_norm

    eps_attr = NORM_EPS[mode]

    def forward(self, hidden_states, *args, **kwargs):
        state, prev = patched(self)
        if not state.active or args or kwargs:
            return prev(hidden_states, *args, **kwargs)
        eps = getattr(self, eps_attr)
        return rms_norm(hidden_states, self.weight, eps, inplace_backward=inplace_backward, mode=mode)

    return forward


def linear_forward() -> Callable:
    def forward(self, x, *args, **kwargs):
        state, prev = patched(self)
        if not state.active or args or kwargs:
            return prev(x, *args, **kwargs)
        specs = _layer_specs(state, self, (self,), x)
        return prev(x) if specs is None else lora_linear(x, *specs[0])

    return forward


def mlp_forward(activation: str, inplace: bool, output_unused_in_recompute: bool) -> Callable:
    def forward(self, x, *args, **kwargs):
        state, prev = patched(self)
        if not state.active or args or kwargs:
            return prev(x, *args, **kwargs)
        specs = _layer_specs(state, self, (self.gate_proj, self.up_proj, self.down_proj), x)
        if specs is None:
            return prev(x)
        return lora_mlp(
            x,
            *specs,
            activation=activation,
            inplace_dx=inplace,
            output_unused_in_recompute=output_unused_in_recompute,
        )

    return forward


def router_forward(normalize: bool, fp32_weights: bool) -> Callable:
    """HF's Qwen3-MoE / Mixtral top-k router (``*TopKRouter``) with its softmax, top-k and renormalisation on the
    fused router op (``kernels/ops/moe_router.py``); its linear layer stays torch's (the router weight's gradient,
    where the router trains). Returns what HF's forward returns: (logits, weights, experts). ``normalize``: the top-k
    weights divided by their sum (Mixtral always, Qwen3-MoE by ``norm_topk_prob``); ``fp32_weights``: handed to the
    experts in fp32 (``Moe.router_fp32_weights``), else in the logits' dtype."""
    from ..ops.moe_router import moe_router

    def forward(self, hidden_states, *args, **kwargs):
        state, prev = patched(self)
        if not state.active or args or kwargs:
            return prev(hidden_states, *args, **kwargs)
        logits = nn.functional.linear(hidden_states.reshape(-1, self.hidden_dim), self.weight)
        dtype = torch.float32 if fp32_weights else logits.dtype
        weights, experts = moe_router(logits, self.top_k, normalize=normalize, out_dtype=dtype)
        return logits, weights, experts

    return forward


def _trains(*modules: nn.Module) -> bool:
    return any(p.requires_grad for m in modules for p in m.parameters())


def attention_forward(model_type: str, rope: bool, qkv: bool, inplace: bool) -> Callable:
    from ..ops.rope import rope_qk

    arch = arch_of(model_type)
    sliding, qk_norm, softcap = _WINDOW[arch.sliding_window], arch.qk_norm, arch.attn_softcap

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, *args, **kwargs):
        state, prev = patched(self)
        cached = kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None
        if not state.active or args or cached or position_embeddings is None:
            return prev(hidden_states, position_embeddings, attention_mask, *args, **kwargs)
        kwargs.pop("cache", None)
        kwargs.pop("past_key_values", None)
        hf = sys.modules[type(self).__module__]
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        specs = (
            _layer_specs(state, self, (self.q_proj, self.k_proj, self.v_proj), hidden_states) if qkv else None
        )
        cos, sin = position_embeddings

        def prepare(q, k, v):  # the projections' outputs to attention's q, k, v: heads, the q/k norm, RoPE
            q, k, v = q.view(hidden_shape), k.view(hidden_shape), v.view(hidden_shape)
            if qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
            q, k = rope_qk(q, k, cos, sin) if rope else hf.apply_rotary_pos_emb(q, k, cos, sin)
            return q, k, v

        # q, k, v from strop's fused projections: a recomputed layer may take them from its forward (saved_attention's
        # save_qkv), after strop's in-place RoPE where nothing else follows the projections (Llama's family), else as
        # the projections return them (a q/k norm, or HF's RoPE), the rest of ``prepare`` run in attention's backward
        # (a q/k norm's weights frozen: that backward returns no gradient for them)
        after_rope = specs is not None and rope and not qk_norm
        projected = (
            specs is not None and not after_rope and not (qk_norm and _trains(self.q_norm, self.k_norm))
        )
        saved = replayed_qkv() if after_rope or projected else None
        deferred, projections = None, ()
        if saved is not None:
            q, k, v = saved_qkv_projections(
                hidden_states, specs, saved, *((cos, sin) if after_rope else (None, None)), inplace_dx=inplace
            )
            deferred = None if after_rope else prepare
        else:
            if specs is not None:
                q, k, v = lora_qkv(hidden_states, *specs, inplace_dx=inplace)
            else:
                q, k, v = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
            projections = (q, k, v) if projected else ()
            q, k, v = prepare(q, k, v)
        interface = hf.ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, hf.eager_attention_forward
        )
        if sliding is not None:
            kwargs["sliding_window"] = sliding(self)
        if softcap:  # Gemma 2 (eager, flash and flex honour it; HF's SDPA refuses it, as HF's forward would)
            kwargs["softcap"] = self.attn_logit_softcapping
        out, weights = (
            attention_call(  # HF's interface, or the output saved for a checkpointed layer's recompute
                interface,
                self,
                q,
                k,
                v,
                attention_mask,
                dropout=0.0 if not self.training else self.attention_dropout,
                scaling=self.scaling,
                keep_qkv=(q, k, v) if after_rope else projections,
                prepare=deferred,
                **kwargs,
            )
        )
        out = out.reshape(*input_shape, -1).contiguous()
        return self.o_proj(out), weights

    return forward


def ce_reason(hf: nn.Module) -> str | None:
    head = hf.get_output_embeddings() if hasattr(hf, "get_output_embeddings") else None
    if head is None:
        return "the model has no LM head"
    if type(head) is not nn.Linear:
        return f"LM head is {type(head).__name__} (PEFT-wrapped or custom), not nn.Linear"
    if "_loss_function" in hf.__dict__ or getattr(hf, "loss_type", None) not in (None, "ForCausalLM"):
        return "custom loss function"
    return scaled_logits_reason(hf.config)  # Gemma's final soft-cap is applied in the kernel


def causal_lm_forward() -> Callable:
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

    from ..ops.fused_linear_ce import fused_linear_cross_entropy

    cache_fields = [
        f.name for f in dataclasses.fields(CausalLMOutputWithPast) if f.name in ("cache", "past_key_values")
    ]

    def forward(self, *args, **kwargs):
        state, prev = patched(self)
        if (
            not state.active
            or args
            or kwargs.get("labels") is None
            or kwargs.get("fused_lm_head")  # TRL's chunked head: its forward handles it
            or kwargs.get("return_dict") is False
            or not (isinstance(kwargs.get("logits_to_keep", 0), int) and kwargs.get("logits_to_keep", 0) == 0)
        ):
            return prev(*args, **kwargs)
        reason = ce_reason(self)
        if reason:
            state.fallback(self, reason)
            return prev(*args, **kwargs)
        labels = kwargs.pop("labels")
        num_items = kwargs.pop("num_items_in_batch", None)
        shift_labels = kwargs.pop("shift_labels", None)
        ignore_index = kwargs.pop("ignore_index", -100)
        for k in ("logits_to_keep", "return_dict", "fused_lm_head"):
            kwargs.pop(k, None)
        moe = arch_of(self.config.model_type).moe
        if moe is not None:  # HF's MoE forward: router logits when asked, else as the config says
            routed = kwargs.get("output_router_logits")
            kwargs["output_router_logits"] = bool(
                self.config.output_router_logits if routed is None else routed
            )
        outputs = getattr(self, self.base_model_prefix)(**kwargs)
        hidden = outputs[0]
        if shift_labels is None:  # as HF's ForCausalLMLoss: token t predicts labels[t + 1]
            shift_labels = nn.functional.pad(labels, (0, 1), value=ignore_index)[..., 1:]
        head = self.get_output_embeddings()
        dtype = (
            torch.get_autocast_dtype(hidden.device.type)
            if torch.is_autocast_enabled(hidden.device.type)
            else hidden.dtype
        )
        bias = None if head.bias is None else head.bias.to(dtype)
        softcap = getattr(self.config, "final_logit_softcapping", None)  # HF: c · tanh(logits / c)
        loss = fused_linear_cross_entropy(
            hidden.reshape(-1, hidden.shape[-1]).to(dtype),
            head.weight.to(dtype),
            shift_labels.reshape(-1).to(hidden.device),
            bias,
            ignore_index=ignore_index,
            reduction="mean",
            num_items_in_batch=num_items,
            softcap=None if softcap is None else float(softcap),
        )
        extra = {name: getattr(outputs, name, None) for name in cache_fields}
        if moe is not None:
            aux = None
            if kwargs[
                "output_router_logits"
            ]:  # HF adds its own load-balancing loss, weighted as its forward does
                experts, top_k, _ = moe_sizes(self.config)
                balance = sys.modules[type(self).__module__].load_balancing_loss_func
                aux = balance(outputs.router_logits, experts, top_k, kwargs.get("attention_mask"))
                loss = loss + self.router_aux_loss_coef * aux.to(loss.device)
            return MoeCausalLMOutputWithPast(
                loss=loss,
                aux_loss=aux,
                logits=None,
                hidden_states=outputs.hidden_states,
                attentions=outputs.attentions,
                router_logits=outputs.router_logits,
                **extra,
            )
        return CausalLMOutputWithPast(
            loss=loss,
            logits=None,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            **extra,
        )

    return forward
