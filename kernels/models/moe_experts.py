"""Patching a mixture-of-experts layer's experts (Qwen3-MoE, Mixtral) onto the grouped expert GEMM.

``patch_model`` calls :func:`experts_reason` when it patches an MoE layer and, where it is None, swaps the PEFT-wrapped
experts module's forward for :func:`experts_forward`'s: the router's choices go to
:func:`~strop.kernels.lora.moe.lora_moe_experts` with the frozen expert stacks and PEFT's factors read on every call
(adapters can be switched, disabled or merged after patching; then HF + PEFT's forward runs and the reason is logged
once, as for every patched module).

NF4 experts (:func:`quantize_experts`): strop's own 4-bit storage of the fused stacks (bitsandbytes quantizes
``nn.Linear`` only), read by the grouped GEMM, which dequantizes a stack just before its GEMM; HF's forward gets the
stacks dequantized for its call. :func:`quantizing_experts_on_load` quantizes each stack as the loader sets it, so a
load never holds every layer's 16-bit experts at once.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn

__all__ = [
    "EXPERT_STACKS",
    "expert_factors",
    "expert_wrappers",
    "experts_forward",
    "experts_reason",
    "nf4_expert_modules",
    "nf4_experts",
    "nf4_placeholders",
    "nf4_storage_as_parameters",
    "quantize_experts",
    "quantizing_experts_on_load",
]

EXPERT_STACKS = ("gate_up_proj", "down_proj")  # the fused expert parameters NF4 storage holds
_NF4 = (
    "_strop_nf4"  # an experts module's NF4 stacks: {parameter name: (shape, dtype, blocksize2, placeholder)}
)
SHARDABLE_ROLES = ("packed", "absmax", "absmax2")  # the storage that grows with the stack (not code2, offset)
_WORDS = "_strop_nf4_words"  # storage held as words (nf4_storage_as_parameters): {key: dtype quantized}


def _experts_layout(module: nn.Module) -> bool:
    """An HF experts module of the SwiGLU [E, out, in] layout (Qwen3-MoE, Mixtral), not a PEFT wrapper."""
    return (
        type(module).__name__.endswith("Experts")
        and "base_layer" not in module._modules
        and not getattr(module, "is_transposed", False)
    )


def _fused_experts(module: nn.Module) -> bool:
    """An experts module of :func:`_experts_layout` holding both fused 3-D stacks."""
    params = module._parameters
    return _experts_layout(module) and all(
        params.get(n) is not None and params[n].dim() == 3 for n in EXPERT_STACKS
    )


def _quantize_stack(w: torch.Tensor, double_quant: bool):
    """(``w`` as :class:`Nf4Experts`, the placeholder its parameter holds from now on: a stride-0 view of one
    element, the shape without the memory)."""
    from strop.kernels.ops.moe_gemm import Nf4Experts

    q = Nf4Experts.quantize(w, double_quant=double_quant)
    return q, torch.empty((), dtype=w.dtype, device=w.device).expand(w.shape)


def _keep_nf4(module: nn.Module, pname: str, q, placeholder: torch.Tensor) -> None:
    """Hold ``q`` as the module's ``pname`` stack: its non-persistent buffers, and the hooks that give HF's forward
    the dense stack for its call."""
    for role, t in q.tensors().items():
        module.register_buffer(f"{pname}_nf4_{role}", t, persistent=False)
    held = module.__dict__.get(_NF4)
    if held is None:
        held = module.__dict__[_NF4] = {}
        module.register_forward_pre_hook(_materialize)
        module.register_forward_hook(_release)
    held[pname] = (q.shape, q.dtype, q.blocksize2, placeholder)


def quantize_experts(model: nn.Module, *, double_quant: bool = True) -> list[str]:
    """Hold every fused experts module's ``gate_up_proj``/``down_proj`` as NF4 (:class:`Nf4Experts`); the names of
    the stacks quantized by this call (a stack already NF4 is left as it is).

    Each stack is quantized where it lies and kept as non-persistent buffers of its module; the parameter stays
    (PEFT's ``target_parameters`` wraps it, counts read its shape) but holds no memory: a stride-0 view of one
    element, frozen. The grouped expert GEMM reads the NF4 buffers (:func:`experts_forward`); any other caller of
    the module's forward (HF's expert loop: kernels off, adapters disabled or merged) runs on the stack
    dequantized by :func:`nf4_dequantize` for that call, so every path computes with the same weights. Quantize on
    the device the model trains on: moving the model afterwards would expand the placeholders.
    """
    done = []
    for name, module in model.named_modules():
        if not _fused_experts(module):
            continue
        held = module.__dict__.get(_NF4, {})
        for pname in EXPERT_STACKS:
            if pname in held:
                continue
            param = module._parameters[pname]
            param.requires_grad_(False)
            q, placeholder = _quantize_stack(param.data, double_quant)
            _keep_nf4(module, pname, q, placeholder)
            param.data = placeholder
            done.append(f"{name}.{pname}".removeprefix("base_model.model."))
    return done


@contextmanager
def quantizing_experts_on_load(dtype: torch.dtype, *, double_quant: bool = True) -> Iterator[None]:
    """While a model loads in this thread, quantize each fused expert stack as :func:`quantize_experts` would, at
    the moment the loader sets its loaded value on the module, after casting it to ``dtype`` (the session's compute
    dtype, which a prequantized checkpoint's 16-bit tensors are cast to after its load).

    transformers' loader builds the model on the meta device and sets each parameter (a fused stack: after its
    per-expert checkpoint tensors are merged) with ``setattr``, flagged ``_is_hf_initialized``; torch calls the
    global parameter-registration hooks there, and this one hands back the frozen placeholder instead, the 16-bit
    value going as soon as the loader drops it (at its next parameter). A load then holds the 4-bit model plus a
    few 16-bit stacks at a time (the one being merged, its per-expert tensors, the previous one), not the whole
    16-bit experts. The NF4 tensors become the module's buffers when the context exits: transformers replaces every
    non-persistent buffer with an empty one after loading the weights (and initialises them again: RoPE's
    ``inv_freq``), which would wipe codes registered during the load. The codes are those of
    :func:`quantize_experts` on the loaded model: the same function of the same tensor on the same device. Other
    threads' registrations (another session training) and values the loader did not read from the checkpoint (a
    missing key initialised later) are left alone; :func:`quantize_experts` after the load takes any stack this
    did not.
    """
    thread = threading.get_ident()
    pending: list[tuple[nn.Module, str, object, torch.Tensor]] = []

    def hook(module: nn.Module, name: str, param: nn.Parameter) -> nn.Parameter | None:
        if (
            threading.get_ident() != thread
            or name not in EXPERT_STACKS
            or param.dim() != 3
            or param.is_meta
            or not getattr(param, "_is_hf_initialized", False)
            or not _experts_layout(module)
        ):
            return None
        q, placeholder = _quantize_stack(param.data.to(dtype), double_quant)
        pending.append((module, name, q, placeholder))
        out = nn.Parameter(placeholder, requires_grad=False)
        out._is_hf_initialized = True  # loaded: transformers must not initialise it again
        return out

    handle = torch.nn.modules.module.register_module_parameter_registration_hook(hook)
    try:
        yield
    finally:
        handle.remove()
    for module, name, q, placeholder in pending:  # the load succeeded: its stacks' NF4 become buffers
        _keep_nf4(module, name, q, placeholder)


def nf4_experts(module: nn.Module, pname: str):
    """The :class:`Nf4Experts` stack an experts module holds for ``pname``, or None (16-bit)."""
    from strop.kernels.ops.moe_gemm import Nf4Experts

    held = module.__dict__.get(_NF4, {}).get(pname)
    if held is None:
        return None
    shape, dtype, bs2, _ = held
    # buffers, or frozen parameters where FSDP2 shards them (nf4_storage_as_parameters): inside the forward of
    # a layer FSDP2 gathered, its parameters are the whole tensors
    buf = {**module._buffers, **module._parameters}
    nested = f"{pname}_nf4_absmax2" in buf
    words = module.__dict__.get(_WORDS, {})

    def stored(key: str) -> torch.Tensor:  # the tensor as quantized: words viewed back as their bytes
        t = buf[key]
        return t.view(torch.uint8).view(words[key]) if key in words else t

    return Nf4Experts(
        packed=stored(f"{pname}_nf4_packed"),
        absmax=stored(f"{pname}_nf4_absmax"),
        absmax2=stored(f"{pname}_nf4_absmax2") if nested else None,
        code2=buf[f"{pname}_nf4_code2"] if nested else None,
        offset=buf[f"{pname}_nf4_offset"] if nested else None,
        shape=shape,
        dtype=dtype,
        blocksize2=bs2,
    )


def nf4_expert_modules(model: nn.Module) -> dict[str, nn.Module]:
    """The experts modules holding NF4 stacks, by name (PEFT's prefix and wrappers left out of the name)."""
    return {
        n.removeprefix("base_model.model.").replace(".base_layer", ""): m
        for n, m in model.named_modules()
        if _NF4 in m.__dict__
    }


def nf4_storage_as_parameters(model: nn.Module) -> int:
    """Hold each NF4 stack's codes and absmax statistics (``SHARDABLE_ROLES``) as frozen parameters of its
    experts module instead of buffers, so that FSDP2 (``fully_shard``, which shards parameters and leaves buffers
    whole on every rank) shards them with their decoder layer and gathers them for its forward and backward; the
    number of tensors moved. The code book and offset of the double quantization (1 KiB and 4 bytes) stay buffers.

    Each tensor is held as words of the stack's compute dtype: a view of the same bytes (no copy), flat. FSDP2
    wraps every parameter it shards as an ``nn.Parameter`` that some torch versions create requiring gradients
    before freezing it again, which an integer tensor (the uint8 codes, the nested absmax codes) cannot; and a
    mixed-precision cast to the compute dtype, if a policy set one, leaves words already of that dtype alone (an
    fp32 statistic would be rounded). Readers (:func:`nf4_experts`) view the words back as the bytes quantized.

    Raises:
        ValueError: A tensor's bytes do not fill whole words of the compute dtype.
    """
    todo = []  # every tensor checked before any moves: a refusal leaves the model as it was
    for module in nf4_expert_modules(model).values():
        for pname, (_, dtype, _, _) in module.__dict__[_NF4].items():
            for role in SHARDABLE_ROLES:
                key = f"{pname}_nf4_{role}"
                t = module._buffers.get(key)
                if t is None:
                    continue
                size = t.numel() * t.element_size()
                if size % dtype.itemsize:
                    raise ValueError(
                        f"{key}: its {size} bytes are not whole {dtype} words, which FSDP2 shards"
                    )
                todo.append((module, key, t, dtype))
    for module, key, t, dtype in todo:
        del module._buffers[key]
        module._non_persistent_buffers_set.discard(key)
        words = t.reshape(-1).view(torch.uint8).view(dtype)
        module.register_parameter(key, nn.Parameter(words, requires_grad=False))
        module.__dict__.setdefault(_WORDS, {})[key] = t.dtype
    return len(todo)


def nf4_placeholders(model: nn.Module) -> list[nn.Parameter]:
    """The frozen stride-0 placeholders the NF4 stacks' parameters hold (one element each, the stack's shape):
    what FSDP2 must leave alone (sharding one would copy its expert rows out, 16-bit, onto every rank)."""
    return [
        _params(module, pname)
        for module in nf4_expert_modules(model).values()
        for pname in module.__dict__[_NF4]
    ]


def _params(module: nn.Module, pname: str) -> nn.Parameter:
    # under PEFT's forward the parameter sits in a parametrization (``parametrizations.<name>.original``)
    par = getattr(module, "parametrizations", None)
    if par is not None and pname in par:
        return par[pname].original
    return module._parameters[pname]


def _materialize(module: nn.Module, args) -> None:
    """HF's forward is about to run: the stacks' dense values for this call (autograd keeps what it saves)."""
    for pname, (_, dtype, _, _) in module.__dict__[_NF4].items():
        _params(module, pname).data = nf4_experts(module, pname).dequantize(dtype)


def _release(module: nn.Module, args, output) -> None:
    for pname, (*_, placeholder) in module.__dict__[_NF4].items():
        _params(module, pname).data = placeholder


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
    return nf4_experts(base, wrapper.parameter_name) or w, a, b, float(wrapper.scaling[active[0]])


def experts_forward(ours: Callable, output_unused_in_recompute: bool = False) -> Callable:
    """The patched forward of a PEFT-wrapped experts module; ``ours(module)`` gives (patch state, previous forward).
    ``output_unused_in_recompute``: its layer ends in the experts' sum (``lora_moe_experts``)."""
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
        return lora_moe_experts(
            hidden_states,
            top_k_index,
            top_k_weights,
            *parts,
            output_unused_in_recompute=output_unused_in_recompute,
        )

    return forward
