"""Installing offloaded checkpointing on a transformers model (``enable_offloaded_checkpointing``) and removing it.

Every decoder layer derives from ``GradientCheckpointingLayer``, which calls its ``_gradient_checkpointing_func``
when checkpointing is on; the install points each layer's at the offloader and wraps the model's
``_set_gradient_checkpointing`` so that a trainer's later re-enable keeps the offloaded function. See
:mod:`strop.kernels.models.offload` for what the offloader does.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .hf import Swaps, checkpoint_layers, unwrap_peft
from .offload import DEFAULT_MAX_INFLIGHT_BYTES, DEFAULT_MIN_OFFLOAD_BYTES, ActivationOffloader

__all__ = ["disable_offloaded_checkpointing", "enable_offloaded_checkpointing", "spread"]

logger = logging.getLogger("strop.kernels")


_MISSING = object()


@dataclass
class _Install:
    offloader: ActivationOffloader
    layers: list[nn.Module]
    keep_last: int
    save_layers: int
    resident_layers: int
    hf_funcs: list[Any]  # what HF last set as each layer's _gradient_checkpointing_func (or _MISSING)
    flags_before: list[bool]
    enabled_by_us: bool
    hf_touched: bool = False
    swaps: Swaps = field(default_factory=lambda: Swaps("offload"))

    def apply(self) -> tuple[int, int, int]:
        """Point every layer that HF checkpoints at the offloaded function; the last ones keep their input,
        ``save_layers`` of the others (evenly spaced) skip the recompute. Returns (checkpointed, kept, saved)."""
        on = [i for i, layer in enumerate(self.layers) if layer.gradient_checkpointing]
        resident = set(on[max(0, len(on) - self.resident_layers) :]) if self.resident_layers else set()
        keep = (set(on[max(0, len(on) - self.keep_last) :]) if self.keep_last else set()) | resident
        # never the last checkpointed layer: backward needs its activations first, no reload could hide
        saved = set(spread([i for i in on[:-1] if i not in keep], self.save_layers))
        offloaded = [i for i in on if i not in keep and i not in saved]
        for i in on:
            self.layers[i]._gradient_checkpointing_func = functools.partial(
                self.offloader.checkpoint,
                layer=i,
                offload=i not in keep,
                save=i in saved,
                module=self.layers[i] if i in saved else None,
                inputs_after=sum(j > i for j in offloaded),
                resident=i in resident,
            )
        return len(on), len(keep), len(saved)


def spread(items: list[int], k: int) -> list[int]:
    """``k`` of ``items`` evenly spaced (all of them when k ≥ len): e.g. 3 of 0..8 → 1, 4, 7.

    Spacing matters on both passes: in forward each saved layer's copies overlap the next layers' compute,
    in backward its reload overlaps the recompute of the layers above it.
    """
    n = len(items)
    k = max(0, min(k, n))
    return [items[int((j + 0.5) * n / k)] for j in range(k)]


def enable_offloaded_checkpointing(
    model: nn.Module,
    *,
    min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES,
    keep_last: int = 1,
    save_layers: int = 0,
    offload_cpu_tensors: bool = False,
    preserve_rng_state: bool = True,
    max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
    save_attention: bool = False,
    save_qkv: bool = False,
    host_budget_bytes: int | None = None,
    resident_layers: int = 0,
    trace: bool = False,
) -> ActivationOffloader:
    """Make an HF (or PEFT-wrapped HF) model checkpoint its decoder layers with offloaded inputs.

    Layers that already have gradient checkpointing on (e.g. HF's ``every_n_layers``) keep exactly that
    set; when none has, all are turned on. Reversible with :func:`disable_offloaded_checkpointing`;
    calling it again on an installed model returns the installed offloader.

    Args:
        model: A transformers model whose decoder layers are ``GradientCheckpointingLayer``s, or a PEFT
            model around one.
        min_offload_bytes: Inputs smaller than this stay on their device.
        keep_last: How many of the last checkpointed layers keep their input on the device.
        save_layers: How many of the other checkpointed layers (evenly spaced, never the last) are not
            recomputed: their saved activations go to pinned host memory in forward and come back ahead of
            need in backward. Each such layer saves one layer's recompute and moves its activations over the
            host link twice (≈ 1.8 GiB per 8B-shape layer at 16K tokens with strop's kernels); how many pay
            off depends on the link's bandwidth.
        offload_cpu_tensors: Exercise the offload path with CPU tensors (tests).
        preserve_rng_state: Replay the forward's RNG in the recompute (dropout).
        max_inflight_bytes: Device-to-host copies queued at once before a save waits for the oldest.
        save_attention: Offloaded layers also keep their attention output in host memory, so the recompute
            skips attention's forward (``kernels/models/saved_attention.py``).
        save_qkv: With ``save_attention``, the q, k, v attention read are kept too, so the recompute skips the
            fused Q/K/V projections and RoPE.
        host_budget_bytes: Host memory the copies may hold at once (None: unbounded); past it, inputs stay on
            the device and attention is recomputed, layer by layer as the forward reaches them.
        resident_layers: How many of the last checkpointed layers keep their input and, with ``save_attention``,
            their attention output (and q, k, v with ``save_qkv``) on the device: their recompute skips what the
            offloaded layers' does, for device memory instead of host-link time (meant for steps whose copies
            take as long as their forward, as an MoE layer's; measured there: bench/RESULTS.md).
        trace: Record the schedule in ``offloader.stats.trace``.

    Returns:
        The :class:`ActivationOffloader`; its ``stats`` report host memory and the schedule.

    Raises:
        ValueError: If the model has no ``GradientCheckpointingLayer``, or ``keep_last``, ``save_layers``,
            ``resident_layers`` or ``max_inflight_bytes`` is negative.
    """
    hf = unwrap_peft(model)
    existing = hf.__dict__.get("_strop_offload")
    if existing is not None:
        return existing.offloader
    if keep_last < 0:
        raise ValueError(f"keep_last must be ≥ 0, got {keep_last}")
    if save_layers < 0:
        raise ValueError(f"save_layers must be ≥ 0, got {save_layers}")
    if resident_layers < 0:
        raise ValueError(f"resident_layers must be ≥ 0, got {resident_layers}")
    layers = checkpoint_layers(hf)
    if not layers:
        raise ValueError(
            f"{type(hf).__name__} has no transformers GradientCheckpointingLayer: offloaded checkpointing "
            "hooks HF's per-layer checkpoint function and cannot apply"
        )
    offloader = ActivationOffloader(
        min_offload_bytes=min_offload_bytes,
        offload_cpu_tensors=offload_cpu_tensors,
        preserve_rng_state=preserve_rng_state,
        max_inflight_bytes=max_inflight_bytes,
        save_attention=save_attention,
        save_qkv=save_qkv,
        host_budget_bytes=host_budget_bytes,
        trace=trace,
    )
    flags = [bool(layer.gradient_checkpointing) for layer in layers]
    state = _Install(
        offloader=offloader,
        layers=layers,
        keep_last=keep_last,
        save_layers=save_layers,
        resident_layers=resident_layers,
        hf_funcs=[layer.__dict__.get("_gradient_checkpointing_func", _MISSING) for layer in layers],
        flags_before=flags,
        enabled_by_us=not any(flags),
    )
    if state.enabled_by_us:
        for layer in layers:
            layer.gradient_checkpointing = True
    original_set = hf._set_gradient_checkpointing

    def _set_gradient_checkpointing(*args: Any, **kwargs: Any) -> Any:
        # gradient_checkpointing_enable/disable (and TRL's disable_gradient_checkpointing) land here: let HF
        # set its flags and function, remember the function, then put the offloaded one back.
        result = original_set(*args, **kwargs)
        state.hf_touched = True
        state.hf_funcs = [layer.__dict__.get("_gradient_checkpointing_func", _MISSING) for layer in layers]
        state.apply()
        return result

    state.swaps.set(hf, "_set_gradient_checkpointing", _set_gradient_checkpointing)
    hf._strop_offload = state
    on, kept, saved = state.apply()
    logger.info(
        "strop.kernels offload: %d/%d decoder layers checkpointed with offloaded inputs (last %d kept on "
        "device, %d not recomputed: activations in host memory)",
        on,
        len(layers),
        kept,
        saved,
    )
    return offloader


def disable_offloaded_checkpointing(model: nn.Module) -> bool:
    """Undo :func:`enable_offloaded_checkpointing`: HF's checkpoint function (and flags we set) come back.

    Returns:
        True if the model had offloaded checkpointing installed.
    """
    hf = unwrap_peft(model)
    state: _Install | None = hf.__dict__.get("_strop_offload")
    if state is None:
        return False
    for layer, func, flag in zip(state.layers, state.hf_funcs, state.flags_before, strict=True):
        if func is _MISSING:
            layer.__dict__.pop("_gradient_checkpointing_func", None)
        else:
            layer._gradient_checkpointing_func = func
        if state.enabled_by_us and not state.hf_touched:
            layer.gradient_checkpointing = flag
    state.swaps.undo()
    del hf._strop_offload
    return True
