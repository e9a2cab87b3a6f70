"""Decode-time forwards for a PEFT model over an NF4 base: each LoRA-wrapped bitsandbytes ``Linear4bit`` computes
``nf4_lora_decode`` (``kernels/ops/nf4_decode.py``) for calls of few rows, inside a ``with`` block only.

``nf4_decode_forwards(model)`` swaps the forward of every eligible PEFT ``lora.Linear4bit`` instance (one active
adapter, no DoRA, no LoRA bias, not merged, an NF4 base whose rows are whole quantization blocks, not in
bitsandbytes' CPU inference layout) and, when it swapped any, switches strop's training patch
(``kernels/models/patch.py``) to pass-through for the block: the patched MLP and attention call the fused
training kernels on the projections directly, so the decode forwards would never be reached. The RMSNorms the patch
had swapped keep strop's ``rms_norm`` kernel meanwhile (Llama-mode norms: one launch instead of HF's six). Calls with more
rows than ``MAX_DECODE_ROWS`` (a prefill) or extra arguments go to PEFT's own forward. Everything is put back on
exit; nothing outside the block changes (training never sees these forwards).
"""

from __future__ import annotations

import contextlib
import logging

import torch
from torch import nn

from ..ops.nf4_decode import MAX_DECODE_ROWS, NF4DecodeWeight, kernel_can_run, nf4_lora_decode
from ..ops.rmsnorm import rms_norm
from .hf import Swaps, previous_forward

__all__ = ["decode_reason", "nf4_decode_forwards"]

_TAG = "nf4decode"
logger = logging.getLogger("strop.kernels")


def decode_reason(module: nn.Module) -> str | None:
    """Why ``module`` (a PEFT LoRA layer) cannot take the NF4 decode forward; None if it can."""
    base = getattr(module, "base_layer", None)
    weight = getattr(base, "weight", None)
    qs = getattr(weight, "quant_state", None)
    if qs is None or getattr(qs, "quant_type", None) != "nf4":
        return "base is not an NF4 Linear4bit"
    if getattr(qs, "packing_format_for_cpu", False) or (
        weight.device.type == "cpu" and getattr(base, "support_avx512bf16_for_cpu", False)
    ):
        return "bitsandbytes' CPU inference layout (or may repack into it)"
    if not kernel_can_run(weight.device):
        return f"the kernel needs CUDA (or TRITON_INTERPRET=1), the weight is on {weight.device.type}"
    if getattr(module, "merged", False) or getattr(module, "disable_adapters", False):
        return "adapter merged or disabled"
    active = list(getattr(module, "active_adapters", []))
    if len(active) != 1 or active[0] not in module.lora_A:
        return f"{len(active)} active adapters"
    a = active[0]
    if module.use_dora.get(a, False) or getattr(module, "lora_bias", {}).get(a, False):
        return "DoRA or LoRA bias"
    if module.lora_A[a].bias is not None or module.lora_B[a].bias is not None:
        return "LoRA layers with bias"
    drop = module.lora_dropout[a]
    if not isinstance(drop, nn.Identity) and drop.training:
        return "LoRA dropout in training mode"
    try:
        NF4DecodeWeight(weight)
    except ValueError as exc:
        return str(exc)
    return None


def _forward(self, x, *args, **kwargs):
    _, prev = previous_forward(self, _TAG)
    rows = x.numel() // x.shape[-1] if x.dim() else 0
    if args or kwargs or rows > MAX_DECODE_ROWS:
        return prev(x, *args, **kwargs)
    base = self.base_layer
    w, a = self.__dict__["_strop_nf4decode_weight"], self.active_adapters[0]
    inp = x.dtype
    if base.compute_dtype is not None and x.dtype != base.compute_dtype:
        x = x.to(base.compute_dtype)  # as bitsandbytes' Linear4bit does
    lora_a, lora_b = self.lora_A[a].weight, self.lora_B[a].weight
    xa = torch.nn.functional.linear(x.reshape(-1, x.shape[-1]).to(lora_a.dtype), lora_a)
    y = nf4_lora_decode(x, w, xa, lora_b, float(self.scaling[a]), base.bias)
    return y.to(inp)


def _is_llama_norm(module: nn.Module) -> bool:
    # Gemma's norms (x̂·(1 + w), epsilon in ``eps``) are left to HF's forward
    return type(module).__name__.endswith("RMSNorm") and hasattr(module, "variance_epsilon")


def _norm_forward(self, x, *args, **kwargs):
    if args or kwargs:
        _, prev = previous_forward(self, _TAG)
        return prev(x, *args, **kwargs)
    return rms_norm(x, self.weight, self.variance_epsilon)


def probe_reason(module: nn.Module, rows: int = 4) -> str | None:
    """Run the kernel once on ``module``'s weight against bitsandbytes' own dequantization (``rows`` rows: the
    decode's, so the tile it compiles is the one decoding uses; no LoRA) and
    say why not to use it: it failed (a compile error on a toolchain not yet seen) or its result is off by more than
    a layout error could hide behind (1% of the largest output; a correct kernel differs by summation order and one
    output rounding, ~0.4% at bf16). None when it agrees."""
    import bitsandbytes.functional as bnbf

    base = module.base_layer
    w = base.weight
    dtype = base.compute_dtype or torch.float32
    g = torch.Generator(device=w.device).manual_seed(0)
    x = torch.randn(rows, w.quant_state.shape[1], generator=g, device=w.device).to(dtype)
    try:
        y = nf4_lora_decode(x, NF4DecodeWeight(w)).float()
    except Exception as exc:  # a compile or launch failure: the layer keeps PEFT's forward
        return f"nf4_lora_decode failed: {type(exc).__name__}: {exc}"[:300]
    ref = x.float() @ bnbf.dequantize_4bit(w.data, w.quant_state).to(dtype).float().T
    err, scale = float((y - ref).abs().max()), float(ref.abs().max())
    if not err <= 1e-2 * scale:
        return f"nf4_lora_decode disagrees with bitsandbytes by {err:.3g} (outputs up to {scale:.3g})"
    return None


@contextlib.contextmanager
def nf4_decode_forwards(model: nn.Module, notes: list[str] | None = None, rows: int = 4):
    """Inside: eligible PEFT LoRA layers over NF4 bases decode through ``nf4_lora_decode`` (see module docstring).

    ``rows`` is how many rows a decode step has: above ``MAX_DECODE_ROWS`` nothing is swapped (the kernel would
    never be called). The kernel is first checked once against bitsandbytes on one layer at that row count
    (``probe_reason``); if that fails nothing is swapped and the reason is appended to ``notes`` (and logged).
    Yields the number of layers swapped."""
    swaps = Swaps(_TAG)
    swapped: list[nn.Module] = []
    patched_owners = []
    try:
        eligible = [
            m
            for m in model.modules()
            if type(m).__name__ == "Linear4bit" and hasattr(m, "lora_A") and decode_reason(m) is None
        ]
        if rows > MAX_DECODE_ROWS:
            eligible = []
        reason = probe_reason(eligible[0], rows) if eligible else None
        if reason is not None:
            logger.warning("strop.kernels: NF4 decode kernel not used: %s", reason)
            if notes is not None:
                notes.append(reason)
            eligible = []
        for module in eligible:
            module.__dict__["_strop_nf4decode_weight"] = NF4DecodeWeight(module.base_layer.weight)
            swaps.forward(module, _forward)
            swapped.append(module)
        if swapped:
            seen = set()
            for module in model.modules():
                if "_strop_patch_owner" in module.__dict__:
                    owner, _ = previous_forward(module, "patch")
                    if id(owner) not in seen and owner.swaps.active:
                        seen.add(id(owner))
                        patched_owners.append(owner)
            for owner in patched_owners:
                owner.swaps.active = False
            for module in model.modules():
                if "_strop_patch_owner" in module.__dict__ and _is_llama_norm(module):
                    swaps.forward(module, _norm_forward)
        yield len(swapped)
    finally:
        for owner in patched_owners:
            owner.swaps.active = True
        swaps.undo()
        for module in swapped:
            module.__dict__.pop("_strop_nf4decode_weight", None)
