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
                         ``hidden_activation`` gelu_pytorch_tanh); an MoE layer's experts → the grouped
                         expert GEMM (``kernels/models/moe_experts.py``)
    moe_router           an MoE layer's top-k router (Qwen3-MoE, Mixtral; PEFT's trainable copy too) → its
                         linear layer, then ``moe_router`` (softmax, top-k, renormalisation: one kernel each way)
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

import logging
import os
import weakref

import torch
from torch import nn

from strop.common.archs import KERNEL_MODEL_TYPES, TopKNorm, arch_of

from ..lora.linear import attach_fp8, detach_fp8, fp8_reason
from ..ops.fp8 import fp8_device_reason
from ..ops.rmsnorm import RMSNormMode
from .hf import unwrap_peft
from .moe_experts import experts_forward, experts_reason
from .patch_state import COMPONENTS, PatchReport, PatchState, patched, swap_forward
from .patched_forwards import (
    NORM_EPS,
    attention_forward,
    causal_lm_forward,
    ce_reason,
    linear_forward,
    mlp_forward,
    norm_forward,
    router_forward,
)
from .proj_spec import layer_spec

__all__ = [
    "COMPONENTS",
    "FP8_BASE_CHOICES",
    "SUPPORTED_MODEL_TYPES",
    "PatchReport",
    "patch_model",
    "unpatch_model",
]

logger = logging.getLogger("strop.kernels")

SUPPORTED_MODEL_TYPES = KERNEL_MODEL_TYPES  # strop.common.archs: the one architecture table
FP8_BASE_CHOICES = (False, True, "dx")  # patch_model(fp8_base=...): exact; FP8 forward and dx; FP8 dx only
_ACTIVATIONS = {"silu": "swiglu", "swish": "swiglu", "gelu": "geglu", "gelu_pytorch_tanh": "geglu_tanh"}


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
    moe_router: bool = True,
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
        lora_mlp: Fused LoRA MLP (an MoE layer's experts: the grouped expert GEMM).
        moe_router: An MoE layer's router on the fused router op.
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
    state = PatchState()
    report = state.report
    report.model_type = model_type = getattr(getattr(hf, "config", None), "model_type", None)
    wanted = dict(
        rms_norm=rms_norm,
        rope=rope,
        lora_qkv=lora_qkv,
        lora_o=lora_o,
        lora_mlp=lora_mlp,
        moe_router=moe_router,
        fused_cross_entropy=fused_cross_entropy,
    )

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
                norms = [
                    (layer.input_layernorm, True),
                    (layer.post_attention_layernorm, False),
                    (layer.pre_feedforward_layernorm, True),
                    (layer.post_feedforward_layernorm, False),
                ]
            else:
                norms = [(layer.input_layernorm, True), (layer.post_attention_layernorm, True)]
            if arch.qk_norm:
                norms += [(attn.q_norm, False), (attn.k_norm, False)]
            for norm, inplace in norms:
                if _is_hf_forward(norm, "RMSNorm") and hasattr(norm, NORM_EPS[norm_mode]):
                    swap_forward(state, norm, norm_forward(inplace, norm_mode))
                    report.patched["rms_norm"].append(names[norm])
                else:
                    skip("rms_norm", names[norm], f"{type(norm).__name__} is not HF's RMSNorm")
        projections = {
            "lora_qkv": (attn, (attn.q_proj, attn.k_proj, attn.v_proj)),
            "lora_o": (attn.o_proj, (attn.o_proj,)),
        }
        moe_layer = "gate_proj" not in mlp._modules
        if not moe_layer:  # dense (an MoE model's dense layers too)
            projections["lora_mlp"] = (mlp, (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
        elif lora_mlp:  # an MoE layer: its experts on the grouped expert GEMM, or HF's expert loop and why
            experts = mlp._modules.get("experts")
            why = experts_reason(experts, arch) if experts is not None else "no experts module"
            if why:
                skip("lora_mlp", names[mlp], why)
            else:
                # HF's Qwen3-MoE and Mixtral layers end in ``residual + block(...)``, the block's output being the
                # experts' sum reshaped: nothing reads its value in a recompute (kernels/lora/moe.py)
                last_op = (
                    _is_hf_forward(layer, "DecoderLayer")
                    and _is_hf_forward(mlp, "SparseMoeBlock")
                    and not arch.sandwich_norms
                )
                swap_forward(state, experts, experts_forward(patched, last_op))
                report.patched["lora_mlp"].append(names[experts])
        if moe_router and arch.moe is not None and moe_layer:
            gate = mlp._modules.get(arch.moe.router)
            # PEFT's modules_to_save (train_router) wraps the router: its frozen original and its trainable copy
            routers = (
                [m for m in gate.modules() if _is_hf_forward(m, "TopKRouter")] if gate is not None else []
            )
            if arch.moe.topk_norm not in (TopKNorm.CONFIG, TopKNorm.ALWAYS):
                skip("moe_router", names[mlp], f"{model_type}'s router: {arch.moe.topk_norm} weights")
            elif not routers:
                skip("moe_router", names[mlp], "no HF top-k router (a *TopKRouter with HF's forward)")
            else:
                for router in routers:
                    normalize = arch.moe.topk_norm is TopKNorm.ALWAYS or bool(router.norm_topk_prob)
                    swap_forward(state, router, router_forward(normalize, arch.moe.router_fp32_weights))
                    report.patched["moe_router"].append(names[router])
        ok = {"lora_mlp": False}
        for c, (owner, mods) in projections.items():
            reasons = [s for s in (layer_spec(m) for m in mods) if isinstance(s, str)]
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
                        base = layer_spec(m).base
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
            swap_forward(state, mlp, mlp_forward(activation, inplace_dx, last_op))
            report.patched["lora_mlp"].append(names[mlp])
        if ok["lora_o"]:
            swap_forward(state, attn.o_proj, linear_forward())
            report.patched["lora_o"].append(names[attn.o_proj])
        if rope or ok["lora_qkv"]:
            if _is_hf_forward(attn, "Attention"):
                qkv = ok["lora_qkv"]
                swap_forward(state, attn, attention_forward(model_type, rope, qkv, inplace_dx))
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
        if norm is not None and _is_hf_forward(norm, "RMSNorm") and hasattr(norm, NORM_EPS[norm_mode]):
            swap_forward(state, norm, norm_forward(False, norm_mode))
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
        reason = "the model is a bare backbone" if backbone is hf else ce_reason(hf)
        if reason:
            skip("fused_cross_entropy", names[hf] or "model", reason)
        else:
            swap_forward(state, hf, causal_lm_forward())
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
