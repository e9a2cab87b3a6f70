"""Patch a Llama-family or Gemma HF model (plain or PEFT-wrapped) onto strop's kernels, per instance and reversibly.

``patch_model`` swaps the ``forward`` of individual module instances (``types.MethodType``), never a
class and never HF source, for model_type llama, mistral, qwen2 (q/k/v bias), qwen3 (per-head q/k
RMSNorm before RoPE), gemma2 and gemma3_text, transformers 5.17 – 5.24:

    rms_norm             every decoder RMSNorm (Qwen3's and Gemma 3's q_norm/k_norm, Gemma's four per layer)
                         → ``rms_norm`` (Gemma's in GEMMA mode: x̂ · (1 + w) in fp32, cast last)
    rope, lora_qkv       the attention forward: fused LoRA Q/K/V (``lora_qkv``), RoPE in place
                         (``rope_qk``), then HF's own attention interface (eager/SDPA/flash/flex, with
                         Mistral's, Qwen's and Gemma's sliding window, Gemma's ``query_pre_attn_scalar``
                         scaling and Gemma 2's ``softcap``, exactly as HF's forward passes them) and o_proj
    lora_o               o_proj → ``lora_linear``
    lora_mlp             the MLP → ``lora_mlp`` (SwiGLU; GeGLU for gelu configs: Gemma's
                         ``hidden_activation`` gelu_pytorch_tanh)
    fused_cross_entropy  the *ForCausalLM forward, only when called with ``labels``: the loss comes from
                         ``fused_linear_cross_entropy`` (labels shifted as HF's ForCausalLMLoss does,
                         ``num_items_in_batch`` as HF's denominator, Gemma's ``final_logit_softcapping``
                         applied in the kernel) and ``logits`` is None. Without labels
                         (generation, DPO's logits) or with ``logits_to_keep``/``return_dict=False`` the
                         original forward runs and returns logits as usual. Code that needs logits *and*
                         a loss from one call (HF ``Trainer`` with ``compute_metrics``) should patch with
                         ``fused_cross_entropy=False``.

Gemma. The embedding (HF's ScaledWordEmbedding, × √hidden) is left as HF's; a tied head is the embedding
weight (frozen under LoRA, so no head gradient is computed; a trainable one gets its gradient from the
fused CE into the one shared parameter). Gemma 3's per-layer-type RoPE needs nothing here: the decoder layer
hands each attention its own (cos, sin). Because ``post_feedforward_layernorm`` follows the MLP, the MLP is
not its layer's last op, so the recompute never skips its down projection (``kernels/lora/mlp.py``).

Fallbacks, never silently wrong. A part whose fast path does not apply keeps the reference (HF/PEFT)
path and says why: in the returned :class:`PatchReport` and on ``logging.getLogger("strop.kernels")``.
Checked when patching: unknown model_type, an attention/MLP/norm class or forward that is not HF's,
lora_dropout > 0, DoRA or another LoRA variant, PEFT ``lora_bias``, more than one active adapter, a
trainable base weight or bias (PEFT ``bias != "none"``), a base layer that is neither ``nn.Linear`` nor
NF4 ``Linear4bit``, a non-SwiGLU/GeGLU activation, a wrapped or custom LM head or loss. Checked again on
every call (adapters can be switched, disabled or merged after patching): the same conditions, plus
dtypes PEFT would treat differently (no autocast and adapter/base dtypes other than the input's, where
PEFT computes the LoRA term in fp32), extra call arguments (PEFT ``adapter_names``), and a KV cache (the
attention then runs HF's forward). A runtime fallback is logged once per module and reason.

TRL. TRL 1.16's SFTTrainer and DPOTrainer install their own chunked "fused LM head" on the model
(``trl.trainer.utils.add_fused_lm_head``) and call ``model(..., fused_lm_head=True)``, reading per-token
``log_probs``/``entropy``/``is_top1`` from it, never ``outputs.logits``. Both orders compose: patched
first, TRL's head wraps this forward and runs the (patched) backbone itself; patched after, calls with
``fused_lm_head`` are handed to TRL's forward. So under those trainers the loss is TRL's chunked kernel
over strop's backbone, ``logits=None`` is never seen by them, and this module's fused CE serves plain
``labels=`` calls (HF ``Trainer``, custom loops). ``strop.kernels.trainers.strop_sft_trainer_class()`` (the
trainer service's SFT engine) answers SFTTrainer's fused-head calls with strop's per-token log-prob kernel
instead (``kernels/trainers/sft.py``).

In-place dx: the fused QKV and MLP write dx over their input (the RMSNorm output that HF drops after
the projections and no autograd node saves; see ``kernels/lora_linear.py``). ``inplace_dx=False`` turns
that off. o_proj never does it (its input is the attention output, which SDPA/flash save).
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from strop.common.archs import KERNEL_MODEL_TYPES, SlidingWindow, arch_of, moe_sizes

from ..lora.linear import FP8_ATTR, LoRAProj, attach_fp8, detach_fp8, fp8_reason, lora_linear, lora_qkv
from ..lora.mlp import lora_mlp
from ..ops.fp8 import fp8_device_reason
from ..ops.rmsnorm import RMSNormMode
from .hf import Swaps, previous_forward, scaled_logits_reason, unwrap_peft
from .moe_experts import experts_forward, experts_reason
from .saved_attention import attention_call

__all__ = [
    "COMPONENTS", "FP8_BASE_CHOICES", "SUPPORTED_MODEL_TYPES", "PatchReport", "patch_model", "unpatch_model",
]  # fmt: skip

logger = logging.getLogger("strop.kernels")

COMPONENTS = ("rms_norm", "rope", "lora_qkv", "lora_o", "lora_mlp", "fused_cross_entropy")
SUPPORTED_MODEL_TYPES = KERNEL_MODEL_TYPES  # strop.common.archs: the one architecture table
FP8_BASE_CHOICES = (False, True, "dx")  # patch_model(fp8_base=...): exact; FP8 forward and dx; FP8 dx only
# where HF's attention forward reads the sliding window it passes to the attention interface
_WINDOW: dict[SlidingWindow, Callable[[nn.Module], int | None] | None] = {
    SlidingWindow.NONE: None,
    SlidingWindow.CONFIG: lambda attn: getattr(attn.config, "sliding_window", None),
    SlidingWindow.LAYER: lambda attn: attn.sliding_window,
}
_ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu", "gelu_pytorch_tanh": "geglu_tanh"}
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


@dataclass
class PatchReport:
    """What ``patch_model`` patched, per component, and why anything was left on the reference path.

    Attributes:
        model_type: The HF ``config.model_type``.
        patched: component → names of the modules whose forward now runs strop's kernels.
        skipped: component → {module name (or "model"): reason it kept the reference path}.
        notes: Facts worth showing beside the report (e.g. how the CE patch composes with TRL).
    """

    model_type: str | None = None
    patched: dict[str, list[str]] = field(default_factory=lambda: {c: [] for c in COMPONENTS})
    skipped: dict[str, dict[str, str]] = field(default_factory=lambda: {c: {} for c in COMPONENTS})
    notes: list[str] = field(default_factory=list)
    fp8_bytes: int = 0  # device memory of the FP8 copies (fp8_base=True)

    def summary(self) -> dict[str, str]:
        """One line per component, e.g. ``{"lora_mlp": "patched 32/32", "rope": "off: ..."}``."""
        out = {}
        for c in COMPONENTS:
            done, skip = len(self.patched[c]), self.skipped[c]
            line = f"patched {done}/{done + len(skip)}"
            if skip:
                reasons = sorted(set(skip.values()))
                line += "; reference path: " + "; ".join(reasons)
            out[c] = line
        return out

    def __str__(self) -> str:
        lines = [f"strop kernels on {self.model_type}:"] + [f"  {k}: {v}" for k, v in self.summary().items()]
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])


@dataclass
class _State:
    """Per patched model: the swaps to undo (their ``active`` is the switch every patched forward checks),
    and the reasons already logged."""

    swaps: Swaps = field(default_factory=lambda: Swaps("patch"))
    logged: set = field(default_factory=set)
    report: PatchReport = field(default_factory=PatchReport)
    # fp8_base=True: weak references to the bases given FP8 copies, and why → projections left exact
    fp8_bases: list = field(default_factory=list)
    fp8_exact: dict = field(default_factory=dict)

    @property
    def active(self) -> bool:
        return self.swaps.active

    def fallback(self, module: nn.Module, reason: str) -> None:
        key = (id(module), reason)
        if key not in self.logged:
            self.logged.add(key)
            logger.warning("strop.kernels: reference path for %s: %s", type(module).__name__, reason)


def _swap(state: _State, module: nn.Module, new: Callable) -> None:
    state.swaps.forward(module, new, owner=state)


def _ours(module: nn.Module) -> tuple[_State, Callable]:
    return previous_forward(module, "patch")


# ---- projections: which fast-path spec a (PEFT) linear layer has right now, or why not ----------------


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


def _base_weight(base: nn.Module) -> torch.Tensor | None:
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
    """Why the fast path cannot run ``base`` (whose weight, from ``_base_weight``, is ``w``), or None."""
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


def _spec(layer: nn.Module, x: torch.Tensor | None = None) -> LoRAProj | str:
    """The layer's projection as a ``LoRAProj`` for this call, or the reason PEFT/HF must run it."""
    lora = _is_lora(layer)
    base = _base_layer(layer) if lora else layer
    w = _base_weight(base)
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


def _specs(state: _State, owner: nn.Module, layers, x) -> list[LoRAProj] | None:
    specs = [_spec(m, x) for m in layers]
    bad = next((s for s in specs if isinstance(s, str)), None)
    if bad is not None:
        state.fallback(owner, bad)
        return None
    return specs


# ---- forwards --------------------------------------------------------------------------------------


# the attribute each HF RMSNorm keeps its epsilon in
_NORM_EPS = {RMSNormMode.LLAMA: "variance_epsilon", RMSNormMode.GEMMA: "eps"}


def _norm_forward(inplace_backward: bool, mode: RMSNormMode) -> Callable:
    from ..ops.rmsnorm import rms_norm

    eps_attr = _NORM_EPS[mode]

    def forward(self, hidden_states, *args, **kwargs):
        state, prev = _ours(self)
        if not state.active or args or kwargs:
            return prev(hidden_states, *args, **kwargs)
        eps = getattr(self, eps_attr)
        return rms_norm(hidden_states, self.weight, eps, inplace_backward=inplace_backward, mode=mode)

    return forward


def _linear_forward() -> Callable:
    def forward(self, x, *args, **kwargs):
        state, prev = _ours(self)
        if not state.active or args or kwargs:
            return prev(x, *args, **kwargs)
        specs = _specs(state, self, (self,), x)
        return prev(x) if specs is None else lora_linear(x, *specs[0])

    return forward


def _mlp_forward(activation: str, inplace: bool, output_unused_in_recompute: bool) -> Callable:
    def forward(self, x, *args, **kwargs):
        state, prev = _ours(self)
        if not state.active or args or kwargs:
            return prev(x, *args, **kwargs)
        specs = _specs(state, self, (self.gate_proj, self.up_proj, self.down_proj), x)
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


def _attention_forward(model_type: str, rope: bool, qkv: bool, inplace: bool) -> Callable:
    from ..ops.rope import rope_qk

    arch = arch_of(model_type)
    sliding, qk_norm, softcap = _WINDOW[arch.sliding_window], arch.qk_norm, arch.attn_softcap

    def forward(self, hidden_states, position_embeddings=None, attention_mask=None, *args, **kwargs):
        state, prev = _ours(self)
        cached = kwargs.get("cache") is not None or kwargs.get("past_key_values") is not None
        if not state.active or args or cached or position_embeddings is None:
            return prev(hidden_states, position_embeddings, attention_mask, *args, **kwargs)
        kwargs.pop("cache", None)
        kwargs.pop("past_key_values", None)
        hf = sys.modules[type(self).__module__]
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        specs = _specs(state, self, (self.q_proj, self.k_proj, self.v_proj), hidden_states) if qkv else None
        if specs is not None:
            q, k, v = lora_qkv(hidden_states, *specs, inplace_dx=inplace)
        else:
            q, k, v = self.q_proj(hidden_states), self.k_proj(hidden_states), self.v_proj(hidden_states)
        q, k, v = q.view(hidden_shape), k.view(hidden_shape), v.view(hidden_shape)
        if qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cos, sin = position_embeddings
        q, k = rope_qk(q, k, cos, sin) if rope else hf.apply_rotary_pos_emb(q, k, cos, sin)
        interface = hf.ALL_ATTENTION_FUNCTIONS.get_interface(
            self.config._attn_implementation, hf.eager_attention_forward
        )
        if sliding is not None:
            kwargs["sliding_window"] = sliding(self)
        if softcap:  # Gemma 2 (eager, flash and flex honour it; HF's SDPA refuses it, as HF's forward would)
            kwargs["softcap"] = self.attn_logit_softcapping
        out, weights = attention_call(  # HF's interface, or the output saved for a checkpointed layer's recompute
            interface, self, q, k, v, attention_mask,
            dropout=0.0 if not self.training else self.attention_dropout, scaling=self.scaling, **kwargs,
        )  # fmt: skip
        out = out.reshape(*input_shape, -1).contiguous()
        return self.o_proj(out), weights

    return forward


def _ce_reason(hf: nn.Module) -> str | None:
    head = hf.get_output_embeddings() if hasattr(hf, "get_output_embeddings") else None
    if head is None:
        return "the model has no LM head"
    if type(head) is not nn.Linear:
        return f"LM head is {type(head).__name__} (PEFT-wrapped or custom), not nn.Linear"
    if "_loss_function" in hf.__dict__ or getattr(hf, "loss_type", None) not in (None, "ForCausalLM"):
        return "custom loss function"
    return scaled_logits_reason(hf.config)  # Gemma's final soft-cap is applied in the kernel


def _causal_lm_forward() -> Callable:
    from transformers.modeling_outputs import CausalLMOutputWithPast, MoeCausalLMOutputWithPast

    from ..ops.fused_linear_ce import fused_linear_cross_entropy

    cache_fields = [f.name for f in dataclasses.fields(CausalLMOutputWithPast) if f.name in ("cache", "past_key_values")]  # fmt: skip

    def forward(self, *args, **kwargs):
        state, prev = _ours(self)
        if (
            not state.active
            or args
            or kwargs.get("labels") is None
            or kwargs.get("fused_lm_head")  # TRL's chunked head: its forward handles it
            or kwargs.get("return_dict") is False
            or not (isinstance(kwargs.get("logits_to_keep", 0), int) and kwargs.get("logits_to_keep", 0) == 0)
        ):
            return prev(*args, **kwargs)
        reason = _ce_reason(self)
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
        dtype = torch.get_autocast_dtype(hidden.device.type) if torch.is_autocast_enabled(hidden.device.type) else hidden.dtype  # fmt: skip
        bias = None if head.bias is None else head.bias.to(dtype)
        softcap = getattr(self.config, "final_logit_softcapping", None)  # HF: c · tanh(logits / c)
        loss = fused_linear_cross_entropy(
            hidden.reshape(-1, hidden.shape[-1]).to(dtype), head.weight.to(dtype),
            shift_labels.reshape(-1).to(hidden.device), bias,
            ignore_index=ignore_index, reduction="mean", num_items_in_batch=num_items,
            softcap=None if softcap is None else float(softcap),
        )  # fmt: skip
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
                loss=loss, aux_loss=aux, logits=None, hidden_states=outputs.hidden_states,
                attentions=outputs.attentions, router_logits=outputs.router_logits, **extra,
            )  # fmt: skip
        return CausalLMOutputWithPast(
            loss=loss,
            logits=None,
            hidden_states=outputs.hidden_states,
            attentions=outputs.attentions,
            **extra,
        )

    return forward


# ---- patching ---------------------------------------------------------------------------------------


def _is_hf_forward(module: nn.Module, class_suffix: str) -> bool:
    return type(module).__name__.endswith(class_suffix) and "forward" not in module.__dict__


def _kernels_can_run(model: nn.Module, device: str | torch.device | None) -> str | None:
    p = next(model.parameters(), None)
    where = torch.device(device).type if device is not None else p.device.type if p is not None else None
    if where in (None, "cuda") or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    what = f"the model runs on {where}" if device is not None else f"parameters on {where}"
    return f"{what}: the Triton kernels need CUDA (or TRITON_INTERPRET=1 in tests)"


def patch_model(
    model: nn.Module,
    *,
    rms_norm: bool = True,
    rope: bool = True,
    lora_mlp: bool = True,
    lora_qkv: bool = True,
    lora_o: bool = True,
    fused_cross_entropy: bool = True,
    inplace_dx: bool = True,
    fp8_base: bool | str = False,
    device: str | torch.device | None = None,
) -> PatchReport:
    """Swap module forwards of a Llama-family or Gemma model (plain HF or PEFT-wrapped) for strop's kernels.

    Patching a patched model first undoes the earlier patch. See the module docstring for what each
    component covers and when a part keeps the reference path.

    Args:
        model: A ``*ForCausalLM`` (or its backbone) of a model_type in ``SUPPORTED_MODEL_TYPES`` (llama,
            mistral, qwen2, qwen3, gemma2, gemma3_text), or a PEFT model wrapping one.
        rms_norm: Patch the RMSNorms.
        rope: Apply RoPE with the in-place kernel (replaces the attention forward).
        lora_mlp: Fused LoRA MLP.
        lora_qkv: Fused LoRA Q/K/V (replaces the attention forward).
        lora_o: LoRA o_proj.
        fused_cross_entropy: Fused linear cross-entropy for calls with ``labels``.
        inplace_dx: Let the fused QKV/MLP write dx over their input (safe here; see module docstring).
        fp8_base: Opt-in, inexact: True runs the patched projections' frozen base GEMMs (forward, recompute and
            the backward's dx) in FP8 e4m3 with rowwise scales under bf16 compute, each base holding two e4m3
            copies (``kernels/ops/fp8.py``: ~2 bytes a base weight more); ``"dx"`` only the backward's dx, from
            one copy (~1 byte a weight; the forward stays exact, and with it most of the learning a deep model
            loses to FP8). LoRA products, attention, norms and the LM head stay exact. Off by default: the
            default path is HF + PEFT's computation. Generation through the patched forwards uses them too.
            Needs a GPU of compute capability >= 8.9 (ValueError otherwise; ValueError too for a value other
            than False, True or "dx"); bases whose dims are not multiples of 16, or held off the training device
            (FSDP2 staging), or merged with their adapter later, keep exact GEMMs.
        device: Where the model will run; default: where its parameters are. A model held in host memory
            until FSDP2 moves it to the GPU as it shards it (``trainer_svc.core.fsdp``) is patched for the GPU.

    Returns:
        A :class:`PatchReport`.
    """
    # by identity: 1, 0 or "fwd" are refused before anything changes
    if not (fp8_base is False or fp8_base is True or fp8_base == "dx"):
        raise ValueError(f"fp8_base={fp8_base!r}: one of {FP8_BASE_CHOICES}")
    hf = unwrap_peft(model)
    if getattr(hf, "_strop_patch", None) is not None:
        unpatch_model(model)
    state = _State()
    report = state.report
    report.model_type = model_type = getattr(getattr(hf, "config", None), "model_type", None)
    wanted = dict(
        rms_norm=rms_norm, rope=rope, lora_qkv=lora_qkv, lora_o=lora_o, lora_mlp=lora_mlp,
        fused_cross_entropy=fused_cross_entropy,
    )  # fmt: skip

    def skip(component: str, name: str, reason: str) -> None:
        report.skipped[component][name] = reason
        logger.warning("strop.kernels: %s not patched on %s: %s", component, name, reason)

    backbone = getattr(hf, getattr(hf, "base_model_prefix", "model"), hf)
    blocker = None
    if model_type not in SUPPORTED_MODEL_TYPES:
        why = getattr(arch_of(str(model_type)), "no_kernels", "")
        blocker = (
            why
            or f"model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    elif not hasattr(backbone, "layers"):
        blocker = "no decoder layers found"
    else:
        blocker = _kernels_can_run(hf, device)
    if blocker:
        for c in COMPONENTS:
            if wanted[c]:
                skip(c, "model", blocker)
        return report

    target = torch.device(device) if device is not None else None  # where it trains, if not where it is
    if fp8_base:
        where = target or next((p.device for p in hf.parameters()), torch.device("cpu"))
        if why := fp8_device_reason(where):
            raise ValueError(f"fp8_base: {why}")
    hf._strop_patch = state
    arch = arch_of(model_type)
    names = {m: n for n, m in hf.named_modules()}
    # Gemma's MLP reads config.hidden_activation, the others' config.hidden_act
    act_key = "hidden_activation" if hasattr(hf.config, "hidden_activation") else "hidden_act"
    act_name = getattr(hf.config, act_key, None)
    activation = _ACTIVATIONS.get(act_name)
    norm_mode = RMSNormMode.GEMMA if arch.gemma_norms else RMSNormMode.LLAMA
    for layer in backbone.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if rms_norm:
            # In-place dx only where the norm's output gradient is read by nothing else: pre-norms, whose dy
            # comes from the projections' backward. Not Gemma's post-norms (their output feeds a residual add,
            # which hands one gradient tensor to both branches), nor q/k norms.
            if arch.sandwich_norms:
                norms = [(layer.input_layernorm, True), (layer.post_attention_layernorm, False),
                         (layer.pre_feedforward_layernorm, True), (layer.post_feedforward_layernorm, False)]  # fmt: skip
            else:
                norms = [(layer.input_layernorm, True), (layer.post_attention_layernorm, True)]
            if arch.qk_norm:
                norms += [(attn.q_norm, False), (attn.k_norm, False)]
            for norm, inplace in norms:
                if _is_hf_forward(norm, "RMSNorm") and hasattr(norm, _NORM_EPS[norm_mode]):
                    _swap(state, norm, _norm_forward(inplace, norm_mode))
                    report.patched["rms_norm"].append(names[norm])
                else:
                    skip("rms_norm", names[norm], f"{type(norm).__name__} is not HF's RMSNorm")
        projections = {"lora_qkv": (attn, (attn.q_proj, attn.k_proj, attn.v_proj)),
                       "lora_o": (attn.o_proj, (attn.o_proj,))}  # fmt: skip
        if "gate_proj" in mlp._modules:  # dense (an MoE model's dense layers too)
            projections["lora_mlp"] = (mlp, (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
        elif lora_mlp:  # an MoE layer: its experts on the grouped expert GEMM, or HF's expert loop and why
            experts = mlp._modules.get("experts")
            why = experts_reason(experts, arch) if experts is not None else "no experts module"
            if why:
                skip("lora_mlp", names[mlp], why)
            else:
                _swap(state, experts, experts_forward(_ours))
                report.patched["lora_mlp"].append(names[experts])
        ok = {"lora_mlp": False}
        for c, (owner, mods) in projections.items():
            reasons = [s for s in (_spec(m) for m in mods) if isinstance(s, str)]
            ok[c] = wanted[c] and not reasons
            if wanted[c] and reasons:
                skip(c, names[owner], reasons[0])
        if ok["lora_mlp"] and (activation is None or not _is_hf_forward(mlp, "MLP")):
            ok["lora_mlp"] = False
            why = f"activation {act_key}={act_name!r}" if activation is None else "MLP forward is not HF's"
            skip("lora_mlp", names[mlp], why)
        if fp8_base:
            for c, (_, mods) in projections.items():
                if ok[c] and (c != "lora_qkv" or _is_hf_forward(attn, "Attention")):
                    for m in mods:
                        base = _spec(m).base
                        why = fp8_reason(base)
                        if why is None and target is not None and base.device.type != target.type:
                            # held elsewhere until FSDP2 shards it: the weights it gathers carry no copies
                            why = f"base held on {base.device.type}, trained on {target.type}"
                        if why is not None:
                            state.fp8_exact[why] = state.fp8_exact.get(why, 0) + 1
                            continue
                        report.fp8_bytes += attach_fp8(base, forward=fp8_base is True).nbytes
                        state.fp8_bases.append(weakref.ref(base))
        if ok["lora_mlp"]:
            # HF's Llama-family decoder layer ends in ``residual + mlp(...)``: the MLP's output is the layer's
            # (kernels/lora/mlp.py). Gemma's ends in ``residual + post_feedforward_layernorm(mlp(...))``: the
            # norm saves the MLP's output for its backward, so the recompute must compute it.
            last_op = _is_hf_forward(layer, "DecoderLayer") and not arch.sandwich_norms
            _swap(state, mlp, _mlp_forward(activation, inplace_dx, last_op))
            report.patched["lora_mlp"].append(names[mlp])
        if ok["lora_o"]:
            _swap(state, attn.o_proj, _linear_forward())
            report.patched["lora_o"].append(names[attn.o_proj])
        if rope or ok["lora_qkv"]:
            if _is_hf_forward(attn, "Attention"):
                qkv = ok["lora_qkv"]
                _swap(state, attn, _attention_forward(model_type, rope, qkv, inplace_dx))
                if rope:
                    report.patched["rope"].append(names[attn])
                if qkv:
                    report.patched["lora_qkv"].append(names[attn])
            else:
                for c in ("rope", "lora_qkv"):
                    if wanted[c]:
                        skip(c, names[attn], f"{type(attn).__name__}'s forward is not HF's")
    if rms_norm:
        norm = getattr(backbone, "norm", None)
        if norm is not None and _is_hf_forward(norm, "RMSNorm") and hasattr(norm, _NORM_EPS[norm_mode]):
            _swap(state, norm, _norm_forward(False, norm_mode))
            report.patched["rms_norm"].append(names[norm])
        elif norm is not None:
            skip("rms_norm", names[norm], f"{type(norm).__name__} is not HF's RMSNorm")
    if fp8_base:
        exact = "".join(f"; {n} kept exact ({why})" for why, n in state.fp8_exact.items())
        gemms = "FP8 base GEMMs" if fp8_base is True else "FP8 dx GEMMs (forward exact)"
        report.notes.append(
            f"{gemms} (opt-in, inexact) on {len(state.fp8_bases)} projections: "
            f"{report.fp8_bytes / 2**30:.2f} GiB of e4m3 copies{exact}"
        )
    if fused_cross_entropy:
        reason = "the model is a bare backbone" if backbone is hf else _ce_reason(hf)
        if reason:
            skip("fused_cross_entropy", names[hf] or "model", reason)
        else:
            _swap(state, hf, _causal_lm_forward())
            report.patched["fused_cross_entropy"].append(names[hf] or type(hf).__name__)
            report.notes.append(
                "fused CE serves calls with labels; TRL's fused_lm_head=True calls run TRL's chunked LM head "
                "over the patched backbone, or strop's per-token kernel under strop_sft_trainer_class()"
            )
    logger.info("%s", report)
    return report


def unpatch_model(model: nn.Module) -> None:
    """Undo :func:`patch_model`: every swapped forward is restored (a no-op on an unpatched model).

    A forward that something else wrapped after patching (e.g. TRL's fused LM head, which captured the
    patched one) is left in place; the patched forward it calls is switched off and runs the original.
    """
    hf = unwrap_peft(model)
    state = hf.__dict__.pop("_strop_patch", None)
    if state is not None:
        state.swaps.undo()
        for ref in state.fp8_bases:
            base = ref()
            if base is not None:
                detach_fp8(base)
        state.fp8_bases.clear()
