"""Patching a mixture-of-experts layer's experts (Qwen3-MoE, Mixtral) onto the grouped expert GEMM.

``patch_model`` calls :func:`experts_reason` when it patches an MoE layer and, where it is None, swaps the PEFT-wrapped
experts module's forward for :func:`experts_forward`'s: the router's choices go to
:func:`~strop.kernels.lora.moe.lora_moe_experts` with the frozen expert stacks and PEFT's factors read on every call
(adapters can be switched, disabled or merged after patching; then HF + PEFT's forward runs and the reason is logged
once, as for every patched module).
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn

__all__ = ["expert_factors", "expert_wrappers", "experts_forward", "experts_reason"]


def expert_wrappers(experts: nn.Module) -> tuple[nn.Module, dict[str, nn.Module]]:
    """The HF experts module under PEFT's nested ``ParamWrapper``s, and the wrappers by parameter name."""
    wrappers = {}
    while "base_layer" in experts._modules:
        wrappers[getattr(experts, "parameter_name", "")] = experts
        experts = experts._modules["base_layer"]
    return experts, wrappers


def experts_reason(experts: nn.Module, arch) -> str | None:
    """Why the grouped expert GEMM cannot run this experts module (checked when patching), or None."""
    base, wrappers = expert_wrappers(experts)
    if arch.moe.activation != "swiglu" or getattr(base, "is_transposed", False):
        return f"{arch.model_type} experts: not the SwiGLU gate_up/down layout the grouped GEMM takes"
    if set(wrappers) != {"gate_up_proj", "down_proj"}:
        return "experts without LoRA on both gate_up_proj and down_proj run HF's expert path"
    if not (type(base).__name__.endswith("Experts") and "forward" not in base.__dict__):
        return f"{type(base).__name__}'s forward is not HF's"
    return None


def expert_factors(wrapper: nn.Module, base: nn.Module):
    """(W, A, B, scale) of one ``ParamWrapper`` for this call, or the reason PEFT must run it."""
    from ..lora.moe import peft_expert_factors

    if wrapper.merged or wrapper.disable_adapters:
        return "adapters merged or disabled"
    active = [a for a in wrapper.active_adapters if a in wrapper.lora_A]
    if len(active) != 1:
        return f"{len(active)} active adapters"
    w = base._parameters.get(wrapper.parameter_name)
    if w.requires_grad:
        return "trainable expert weights (the grouped GEMM computes no base-weight gradient)"
    a, b = peft_expert_factors(wrapper.lora_A[active[0]].weight, wrapper.lora_B[active[0]].weight, w.shape[0])
    return w, a, b, float(wrapper.scaling[active[0]])


def experts_forward(ours: Callable) -> Callable:
    """The patched forward of a PEFT-wrapped experts module; ``ours(module)`` gives (patch state, previous forward)."""
    from ..lora.moe import lora_moe_experts

    def forward(self, hidden_states, top_k_index=None, top_k_weights=None, *args, **kwargs):
        state, prev = ours(self)
        if not state.active or args or kwargs or top_k_index is None:
            return prev(hidden_states, top_k_index, top_k_weights, *args, **kwargs)
        base, wrappers = expert_wrappers(self)
        parts = [expert_factors(wrappers[n], base) for n in ("gate_up_proj", "down_proj")]
        bad = next((p for p in parts if isinstance(p, str)), None)
        if bad is not None:
            state.fallback(self, bad)
            return prev(hidden_states, top_k_index, top_k_weights)
        return lora_moe_experts(hidden_states, top_k_index, top_k_weights, *parts)

    return forward
