"""Which fast-path spec a (PEFT) linear layer has right now, or why HF/PEFT must run it.

A spec is a :class:`~strop.kernels.lora.linear.LoRAProj` (base weight, the active adapter's factors and scale,
bias) read from the layer on every call: adapters can be switched, disabled or merged between calls. A reason
(a string) sends the call to the reference path; the patched forwards (``patched_forwards.py``) log it once.
"""

from __future__ import annotations

import torch
from torch import nn

from ..lora.linear import FP8_ATTR, LoRAProj, detach_fp8

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


# Every patched forward builds its projections' specs on every call (adapters can be switched, disabled or merged
# between calls), so these read submodules, parameters and PEFT's per-adapter dicts from the module's own tables:
# ``module.name`` for a submodule or parameter goes through ``nn.Module.__getattr__``, and ``hasattr`` of a missing
# name raises inside it, ~1-3 µs each, some twenty times per projection and call.


def _submodule(m: nn.Module, name: str) -> nn.Module | None:
    return m._modules.get(name)


def _param(m: nn.Module, name: str) -> torch.Tensor | None:
    """``m.name`` for a parameter (FSDP2 swaps its unsharded parameter into this table), else the attribute."""
    if name in m._parameters:
        return m._parameters[name]
    return getattr(m, name, None)


def _is_lora(m: nn.Module) -> bool:
    mods = m._modules
    return "lora_A" in mods and "base_layer" in mods and hasattr(m, "scaling")


def _base_layer(m: nn.Module) -> nn.Module:
    """PEFT's ``get_base_layer``: the innermost ``base_layer`` of tuner layers wrapping one another."""
    while "base_layer" in m._modules:
        m = m._modules["base_layer"]
    return m


def base_weight(base: nn.Module) -> torch.Tensor | None:
    """``base.weight``, with its NF4 quant state where FSDP2 has gathered it as a plain tensor.

    ``fully_shard`` holds a bitsandbytes ``Params4bit`` as a sharded DTensor, and the whole weight it gathers for
    a forward or backward is a plain tensor without the ``quant_state`` (absmax, block size, shape) beside the
    codes. ``Linear4bit`` keeps its own reference to that state for this case (bitsandbytes' forward restores it
    with ``fix_4bit_weight_quant_state_from_module``); the fast path puts it back the same way, on the gathered
    tensor, which FSDP2 keeps from step to step.
    """
    w = _param(base, "weight")
    qs = base.__dict__.get("quant_state")
    if w is not None and qs is not None and getattr(w, "quant_state", None) is None:
        w.quant_state = qs
    return w


def _base_reason(base: nn.Module, w: torch.Tensor | None) -> str | None:
    """Why the fast path cannot run ``base`` (whose weight, from ``base_weight``, is ``w``), or None."""
    qs = getattr(w, "quant_state", None)
    if qs is not None:
        if qs.quant_type != "nf4":
            return f"4-bit quant_type {qs.quant_type!r} (only NF4 has a fast path)"
    elif type(base) is not nn.Linear or w.dtype not in _FLOATS:
        return f"base layer {type(base).__name__} is neither nn.Linear nor an NF4 Linear4bit"
    if w.requires_grad:
        return "trainable base weight (the fast path computes no base-weight gradient)"
    bias = _param(base, "bias")
    if bias is not None and bias.requires_grad:
        return "trainable base bias (PEFT bias != 'none')"
    return None


def _adapter_reason(layer: nn.Module, adapter: str) -> str | None:
    d = layer.__dict__
    drop = _submodule(layer, "lora_dropout")._modules[adapter]
    if isinstance(drop, nn.Dropout) and drop.p > 0:
        return f"lora_dropout={drop.p} > 0"
    if d.get("use_dora", {}).get(adapter, False):
        return "DoRA (use_dora=True)"
    variants = d.get("lora_variant", {})
    if adapter in variants:
        return f"LoRA variant {type(variants[adapter]).__name__}"
    if d.get("lora_bias", {}).get(adapter, False):
        return "PEFT lora_bias=True"
    factor_a = _submodule(layer, "lora_A")._modules[adapter]
    factor_b = _submodule(layer, "lora_B")._modules[adapter]
    if type(factor_a) is not nn.Linear or type(factor_b) is not nn.Linear:
        return "adapter factors are not nn.Linear"
    if d.get("fan_in_fan_out", False):
        return "fan_in_fan_out"
    return None


def layer_spec(layer: nn.Module, x: torch.Tensor | None = None) -> LoRAProj | str:
    """The layer's projection as a ``LoRAProj`` for this call, or the reason PEFT/HF must run it."""
    lora = _is_lora(layer)
    base = _base_layer(layer) if lora else layer
    w = base_weight(base)
    reason = _base_reason(base, w)
    if reason:
        return reason
    bias = _param(base, "bias")
    proj = LoRAProj(w, None, None, 1.0, bias)
    if lora and layer.merged and FP8_ATTR in w.__dict__:
        detach_fp8(w)  # merging wrote the adapter into the base: its FP8 copies are of the unmerged weight
    if lora and not layer.merged and not layer.disable_adapters:
        factors_a = _submodule(layer, "lora_A")._modules
        active = [a for a in layer.active_adapters if a in factors_a]
        if len(active) > 1:
            return f"{len(active)} active adapters"
        if active:
            a = active[0]
            reason = _adapter_reason(layer, a)
            if reason:
                return reason
            factor_b = _submodule(layer, "lora_B")._modules[a]
            proj = LoRAProj(
                w, _param(factors_a[a], "weight"), _param(factor_b, "weight"), float(layer.scaling[a]), bias
            )
    elif lora and layer.merged and layer.disable_adapters:
        return "adapters disabled while merged (PEFT unmerges in its forward)"
    if x is not None and not torch.is_autocast_enabled(x.device.type):
        reason = _dtype_reason(base, proj, x.dtype)
        if reason:
            return reason
    return proj


def _dtype_reason(base: nn.Module, proj: LoRAProj, dtype: torch.dtype) -> str | None:
    if getattr(proj.base, "quant_state", None) is not None:
        # bitsandbytes' Linear4bit computes in compute_dtype, which it sets to x's dtype on its first
        # fp32/bf16 call (Linear4bit.set_compute_type).
        cdt = base.compute_dtype if getattr(base, "compute_type_is_set", False) else None
        if cdt is None:
            cdt = dtype if dtype in (torch.float32, torch.bfloat16) else base.compute_dtype
        if (cdt or dtype) != dtype:
            return f"without autocast Linear4bit computes in {cdt}, the input is {dtype}"
    elif proj.base.dtype != dtype:
        return f"without autocast the base weight is {proj.base.dtype}, the input {dtype}"
    if proj.lora_A is not None and (proj.lora_A.dtype != dtype or proj.lora_B.dtype != dtype):
        return f"without autocast PEFT computes the LoRA term in {proj.lora_A.dtype}, the input is {dtype}"
    return None
