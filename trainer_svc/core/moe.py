"""Mixture-of-experts sessions (Qwen3-MoE, Mixtral, gpt-oss): what LoRA targets, the router, the auxiliary loss.

transformers (5.x) holds an MoE layer's experts fused: one experts module with 3-D ``gate_up_proj``
``[experts, 2·I, H]`` and ``down_proj`` ``[experts, H, I]`` parameters (gpt-oss: transposed, with biases), loaded
from per-expert checkpoint tensors where the checkpoint has them. There is no per-expert ``nn.Linear`` to wrap,
so PEFT targets the parameters themselves (``LoraConfig.target_parameters``: its ``ParamWrapper`` adds
``s · B_e A_e`` to every expert ``e`` with a rank-r pair per expert, gate and up sharing one pair because they are
one fused parameter). strop maps the usual projection names onto that: ``gate_proj`` and ``up_proj`` (which must
come together) → ``experts.gate_up_proj``, ``down_proj`` → ``experts.down_proj``; q/k/v/o stay module targets.

The router is frozen unless a LoRA config asks for it (``train_router``): then PEFT trains a full copy of it
(``modules_to_save``), saved with the adapter. The load-balancing loss is the model's own
(``load_balancing_loss_func`` in each modeling file), added as the config says: ``router_aux_loss_coef`` times it
when ``output_router_logits`` is true, nothing otherwise.

bitsandbytes quantizes ``nn.Linear`` layers only, so the experts — most of an MoE model's weights — would stay in
the compute dtype. A 4-bit session (quantized on load or prequantized) of Qwen3-MoE or Mixtral holds them in strop's
own NF4 storage instead (:func:`hold_experts_in_nf4`: the memory default of every 4-bit load, no flag): the same
NF4 code book, blocks of 64 and double quant as the attention's, per expert, dequantized inside the grouped expert
GEMM (and for the call where HF's expert loop runs). The adapter records it (:func:`expert_quant_metadata`, the
scale statistics in ``write_nf4_stats``'s file) so exports merge into the experts as trained
(``export_svc/core/moe.ExpertNf4``). gpt-oss keeps 16-bit experts (transposed stacks with biases, no kernel).
:func:`expert_note` says which in the session's facts.
"""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from typing import Any

from strop.common.archs import MOE_ARCHS, moe_sizes
from strop.common.errors import InvalidArgument

# the projection names a LoRA config may give for an MoE layer's experts, and the fused parameter each one is
EXPERT_TARGETS = {"gate_proj": "gate_up_proj", "up_proj": "gate_up_proj", "down_proj": "down_proj"}


def moe_arch(config: Any):
    """The MoE :class:`~strop.common.archs.Arch` of an HF config (object or dict), None for a dense model."""
    model_type = config.get("model_type") if isinstance(config, dict) else getattr(config, "model_type", None)
    return MOE_ARCHS.get(str(model_type))


@dataclass(frozen=True)
class PeftTargets:
    """What PEFT's ``LoraConfig`` gets for a session's targets."""

    target_modules: list[str]
    target_parameters: list[str]
    modules_to_save: list[str]


def peft_targets(
    hf_config, targets: list[str], linear_names: set[str], *, dropout: float, train_router: bool
) -> PeftTargets:
    """PEFT's targets for ``targets`` (projection names) on a model of ``hf_config``.

    Args:
        hf_config: the model's config.
        targets: the LoRA config's projection names (validated here for an MoE model).
        linear_names: leaf names of the model's ``nn.Linear``/4-bit layers (a Qwen3-MoE layer listed in
            ``mlp_only_layers`` keeps a dense MLP, whose gate/up/down are module targets too).
        dropout: the LoRA dropout (PEFT's expert wrapper cannot apply one: the input of ``x · (W + s·BA)`` is
            not separable per term).
        train_router: train the router (MoE only).

    Raises:
        InvalidArgument: ``train_router`` on a dense model; an unknown name; ``gate_proj`` without ``up_proj``
            (or the reverse) on fused experts; dropout > 0 with expert targets.
    """
    arch = moe_arch(hf_config)
    if arch is None:
        if train_router:
            raise InvalidArgument(
                f"train_router is for mixture-of-experts models; {getattr(hf_config, 'model_type', '?')!r} "
                "has no router"
            )
        return PeftTargets(list(targets), [], [])
    unknown = sorted(set(targets) - linear_names - set(EXPERT_TARGETS))
    if unknown:
        raise InvalidArgument(
            f"unknown target module(s) {unknown}; this model has {sorted(linear_names | set(EXPERT_TARGETS))}"
        )
    experts = [t for t in targets if t in EXPERT_TARGETS]
    if ("gate_proj" in experts) != ("up_proj" in experts):
        raise InvalidArgument(
            f"{arch.model_type} holds each expert's gate and up projections as one fused parameter "
            "(experts.gate_up_proj): target gate_proj and up_proj together, or neither"
        )
    if experts and dropout > 0:
        raise InvalidArgument(
            f"lora dropout {dropout} on the experts of {arch.model_type}: PEFT's LoRA on fused expert parameters "
            "has no dropout; use dropout 0 or leave gate_proj/up_proj/down_proj out of the targets"
        )
    params = sorted({f"experts.{EXPERT_TARGETS[t]}" for t in experts})
    modules = [t for t in targets if t in linear_names]
    return PeftTargets(modules, params, [f"mlp.{arch.moe.router}"] if train_router else [])


def expert_lora(hf_config, lora) -> bool:
    """Whether an adapter puts LoRA on a mixture of experts' experts; ``lora``: what holds its projection names as
    ``target_modules`` (a session's ``LoraConfig``, a step-API run's ``TrainingRunInfo``), None for no adapter."""
    return (
        moe_arch(hf_config) is not None
        and lora is not None
        and bool(set(lora.target_modules) & set(EXPERT_TARGETS))
    )


def aux_loss_coef(hf_config) -> float:
    """The weight of the load-balancing loss in the loss trained: ``router_aux_loss_coef`` when the config's
    ``output_router_logits`` is true, else 0 (also 0 for a dense model)."""
    text = getattr(hf_config, "get_text_config", lambda: hf_config)()
    if moe_arch(text) is None or not getattr(text, "output_router_logits", False):
        return 0.0
    return float(getattr(text, "router_aux_loss_coef", 0.0) or 0.0)


def _experts_go_nf4(hf_config, quantization: str) -> bool:
    """Whether a session's experts are held in NF4: a 4-bit session (``quantization``: its label, ``"none"`` for
    16-bit) of Qwen3-MoE or Mixtral. A DDP rank holds them so too (DDP leaves frozen tensors and buffers alone:
    ``dist_worker.frozen_names``), and so does an FSDP rank, whose sharding takes the NF4 storage
    (``fsdp.shard_nf4_experts``)."""
    arch = moe_arch(hf_config)
    return quantization != "none" and arch is not None and arch.model_type in NF4_EXPERT_ARCHS


def experts_in_nf4_while_loading(hf_config, quantization: str, dtype) -> AbstractContextManager:
    """The context a session's ``from_pretrained`` runs in: for a session whose experts go NF4
    (:func:`hold_experts_in_nf4`), each stack is cast to ``dtype`` (the session's compute dtype) and quantized as
    the loader sets it (``kernels/models/moe_experts.quantizing_experts_on_load``), so the load's peak is the 4-bit
    model plus one 16-bit stack; otherwise nothing."""
    if not _experts_go_nf4(hf_config, quantization):
        return nullcontext()
    from strop.kernels.models.moe_experts import quantizing_experts_on_load

    return quantizing_experts_on_load(dtype)


def hold_experts_in_nf4(model, hf_config, quantization: str) -> int:
    """Quantize a 4-bit session's fused expert stacks into strop's NF4 storage (``quantization``: the session's
    label, ``"none"`` for 16-bit) where the load has not already (:func:`experts_in_nf4_while_loading`); returns
    how many stacks this call quantized. Qwen3-MoE and Mixtral only (:func:`_experts_go_nf4`)."""
    if not _experts_go_nf4(hf_config, quantization):
        return 0
    from strop.kernels.models.moe_experts import quantize_experts

    return len(quantize_experts(model))


NF4_EXPERT_ARCHS = ("qwen3_moe", "mixtral")  # fused SwiGLU stacks [E, out, in]: the grouped GEMM's layout


def _nf4_stacks(model) -> dict[str, Any]:
    """``{stack name: Nf4Experts}`` of a model's NF4 experts (names as the base checkpoint's model names)."""
    from strop.kernels.models.moe_experts import EXPERT_STACKS, nf4_expert_modules, nf4_experts

    return {
        f"{name}.{p}": nf4_experts(module, p)
        for name, module in nf4_expert_modules(model).items()
        for p in EXPERT_STACKS
    }


def holds_nf4_experts(model) -> bool:
    """Whether a session's experts are held in strop's NF4 storage (admission counts what HF's path dequantizes)."""
    from strop.kernels.models.moe_experts import nf4_expert_modules

    return bool(nf4_expert_modules(model))


def expert_quant_metadata(model) -> dict[str, str]:
    """``base_quant.experts*`` of a session whose experts are NF4 (what ``export_svc/core/moe.ExpertNf4`` reads);
    empty otherwise."""
    if moe_arch(getattr(model, "config", None) or {}) is None:
        return {}
    stacks = _nf4_stacks(model)
    if not stacks:
        return {}
    from strop.kernels.ops.nf4_format import nf4_digest

    name, first = next(iter(stacks.items()))
    return {
        "base_quant.experts": "nf4",
        "base_quant.experts_from": str(first.dtype).removeprefix("torch."),
        "base_quant.expert_stacks": str(len(stacks)),
        # one stack's codes and absmax statistics, which the exporter's re-creation must match
        "base_quant.experts_digest_stack": name,
        "base_quant.experts_digest": nf4_digest(first.packed, first.quant_state()),
    }


_WHOLE_STATS = "_strop_expert_nf4_stats"  # a model's expert_nf4_stats, kept before FSDP2 shards them


def keep_expert_nf4_stats(model) -> int:
    """Keep the NF4 experts' scale statistics (:func:`expert_nf4_stats`) of ``model`` as they are now, whole, in
    host memory (1 byte a block of 64 weights), for every later :func:`expert_nf4_stats`; returns how many tensors.
    Before FSDP2 shards them: a rank then holds a shard of each, and rank 0 writes the statistics file alone (at
    each checkpoint and with the adapter), where gathering them would be a collective."""
    model.__dict__.pop(_WHOLE_STATS, None)
    stats = expert_nf4_stats(model)
    model.__dict__[_WHOLE_STATS] = stats
    return len(stats)


def expert_nf4_stats(model) -> dict[str, Any]:
    """The NF4 experts' scale statistics by stack name, keyed as ``write_nf4_stats`` keys a layer's (absmax,
    offset, nested absmax and code): the double quantization's scales are not re-created bit for bit across
    devices, so the exporter reads the trainer's. Those kept by :func:`keep_expert_nf4_stats` where it ran."""
    kept = model.__dict__.get(_WHOLE_STATS)
    if kept is not None:
        return kept
    out = {}
    for name, q in _nf4_stacks(model).items():
        out[name + ".absmax"] = q.absmax.detach().cpu().contiguous()
        if q.nested:
            out[name + ".offset"] = q.offset.detach().float().cpu().reshape(1)
            out[name + ".nested_absmax"] = q.absmax2.detach().cpu().contiguous()
            out[name + ".nested_code"] = q.code2.detach().cpu().contiguous()
    return out


def expert_note(model, hf_config) -> str:
    """One line for the session's facts: experts per layer and per token, and how the experts are held."""
    arch = moe_arch(hf_config)
    if arch is None:
        return ""
    n, k, _ = moe_sizes(hf_config)
    if _nf4_stacks(model):
        held = "NF4 (strop's expert storage, dequantized in the grouped expert GEMM)"
    else:
        dtypes = sorted(
            {
                str(p.dtype).removeprefix("torch.")
                for name, p in model.named_parameters()
                if ".experts." in name
            }
        )
        held = f"{'/'.join(dtypes) or '?'} (bitsandbytes 4-bit covers nn.Linear layers only: the attention)"
    return f"MoE {arch.model_type}: {n} experts, {k} per token, experts held in {held}"
