"""Budgeted recompute: checkpoint only as many decoder layers as a device-memory budget needs.

Full gradient checkpointing recomputes every decoder layer's forward in backward: on an 8B Llama that is
2·N_layers FLOPs per token (≈ 14.5 GFLOP of 46), paid to keep one [tokens, hidden] tensor per layer
instead of the layer's activations. When the user allows more device memory, strop spends it where it
buys the most: the last ``k`` layers run without checkpointing, the rest recompute, with ``k`` the largest
that keeps the step's peak under the budget.

``k`` is measured, not guessed. The first optimizer step is the calibration step: all layers checkpoint
except the last. Hooks around the last two layers' forwards record what each leaves allocated — for the
checkpointed one only its output, for the uncheckpointed one its output plus every activation its backward
will read — so their difference ``A`` is what un-checkpointing one more layer adds. With the step's peak
``P`` (reserved bytes, so allocator slack is counted) and ``G`` the bytes the step left behind for good
(the optimizer state AdamW creates in step 1):

    k = clamp(1 + floor((budget − margin − P − G) / A), 0, layers)

The peak with ``k`` free layers is at most ``P + G + (k − 1)·A``: the extra activations are all alive at
the end of the forward, and the uncheckpointed layers are the last ones, whose backward runs (and frees
them) before the checkpointed layers' recompute starts. From the second step on, the layers run the plan.
HF's own gradient_checkpointing_enable/disable calls (TRL wraps each DPO reference pass in them) reset the
flags; the planner puts its layout back before the first layer of every training forward. The plan depends
on the tokens per micro-batch; a run whose batches grow later (no packing, longer rows)
should budget for its longest batch or call :meth:`BudgetedRecompute.recalibrate`.

Numerics do not change: a checkpointed and an uncheckpointed layer compute the same gradients (the
recompute replays the RNG state).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Protocol

import torch
from torch import nn

from .hf import checkpoint_layers, unwrap_peft

__all__ = ["BudgetedRecompute", "MemoryMeter", "RecomputePlan", "enable_budgeted_recompute"]

logger = logging.getLogger("strop.kernels")

GiB = 1 << 30


class MemoryMeter(Protocol):
    """Where the planner reads device memory (CUDA's caching allocator by default)."""

    def allocated(self) -> int: ...
    def peak_reserved(self) -> int: ...
    def reset_peak(self) -> None: ...


class CudaMeter:
    def __init__(self, device: torch.device) -> None:
        self.device = device

    def allocated(self) -> int:
        return int(torch.cuda.memory_allocated(self.device))

    def peak_reserved(self) -> int:
        return int(torch.cuda.max_memory_reserved(self.device))

    def reset_peak(self) -> None:
        # cached blocks left by earlier work (a previous job in a long-lived service) would count as this
        # step's reserved peak and make the plan needlessly conservative
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(self.device)


@dataclass
class RecomputePlan:
    """What the calibration step measured and decided (bytes)."""

    layers: int
    uncheckpointed: int
    budget_bytes: int
    margin_bytes: int
    calibration_peak_bytes: int
    step_growth_bytes: int
    layer_activation_bytes: int
    predicted_peak_bytes: int
    reason: str = ""

    def summary(self) -> dict[str, str]:
        return {
            "recompute": f"{self.layers - self.uncheckpointed} of {self.layers} layers checkpointed",
            "budget": f"{self.budget_bytes / GiB:.1f} GiB (margin {self.margin_bytes / GiB:.1f})",
            "calibration_peak": f"{self.calibration_peak_bytes / GiB:.2f} GiB (+{self.step_growth_bytes / GiB:.2f} kept)",
            "activations_per_layer": f"{self.layer_activation_bytes / GiB:.3f} GiB",
            "predicted_peak": f"{self.predicted_peak_bytes / GiB:.2f} GiB",
            **({"note": self.reason} if self.reason else {}),
        }

    def __str__(self) -> str:
        return ", ".join(f"{k}: {v}" for k, v in self.summary().items())


class BudgetedRecompute:
    """Installed on a model by :func:`enable_budgeted_recompute`; call :meth:`step_end` after each step.

    Attributes:
        plan: None until the calibration step has ended, then the :class:`RecomputePlan` in force.
    """

    def __init__(
        self,
        model: nn.Module,
        budget_bytes: int,
        *,
        margin_bytes: int | None = None,
        meter: MemoryMeter | None = None,
    ) -> None:
        self.hf = hf = unwrap_peft(model)
        self.layers = checkpoint_layers(hf)
        if len(self.layers) < 2:
            raise ValueError("budgeted recompute needs a model with at least two GradientCheckpointingLayers")
        if budget_bytes <= 0:
            raise ValueError(f"budget_bytes must be positive, got {budget_bytes}")
        if meter is None:
            device = next(hf.parameters()).device
            if device.type != "cuda":
                raise ValueError(f"budgeted recompute measures CUDA memory; the model is on {device}")
            meter = CudaMeter(device)
        self.meter = meter
        self.budget = int(budget_bytes)
        self.margin = int(margin_bytes if margin_bytes is not None else max(GiB, 0.03 * budget_bytes))
        self.flags_before = [bool(layer.gradient_checkpointing) for layer in self.layers]
        self.enabled_by_us = not any(self.flags_before)
        self._input_hook_before = getattr(hf, "_require_grads_hook", None)
        if self.enabled_by_us:
            hf.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.plan: RecomputePlan | None = None
        self._handles: list = []
        self._deltas: dict[str, int] = {}
        # HF's gradient_checkpointing_enable/disable (TRL wraps every DPO reference pass in them) reset every
        # layer's flag. The layout (calibration or plan) is put back before the first layer of each training
        # forward; while checkpointing is off altogether it is left off.
        self._layout_handle = self.layers[0].register_forward_pre_hook(self._restore_layout)
        self.recalibrate()

    def _apply_layout(self) -> None:
        """Calibration (all but the last layer checkpoint) until a plan exists, then the plan."""
        n = len(self.layers)
        free = 1 if self.plan is None else self.plan.uncheckpointed
        for i, layer in enumerate(self.layers):
            layer.gradient_checkpointing = i < n - free

    def _restore_layout(self, module: nn.Module, args) -> None:
        if module.training and torch.is_grad_enabled() and any(x.gradient_checkpointing for x in self.layers):
            self._apply_layout()

    # ---- calibration ---------------------------------------------------------------------------------

    def recalibrate(self) -> None:
        """Make the next step a calibration step again (e.g. when the tokens per batch grow)."""
        self._remove_hooks()
        self.plan = None
        self._deltas.clear()
        self._apply_layout()
        for key, layer in (("free", self.layers[-1]), ("ckpt", self.layers[-2])):
            self._handles.append(layer.register_forward_pre_hook(self._pre_hook(key)))
            self._handles.append(layer.register_forward_hook(self._post_hook(key)))
        self.meter.reset_peak()
        self._start = self.meter.allocated()

    def _pre_hook(self, key: str):
        def hook(module: nn.Module, args) -> None:
            if module.training and torch.is_grad_enabled() and key not in self._deltas:
                self._deltas["_before_" + key] = self.meter.allocated()

        return hook

    def _post_hook(self, key: str):
        def hook(module: nn.Module, args, output) -> None:
            before = self._deltas.get("_before_" + key)
            if before is not None and key not in self._deltas:
                self._deltas[key] = self.meter.allocated() - before

        return hook

    def _remove_hooks(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def step_end(self) -> RecomputePlan | None:
        """After an optimizer step: the first call after calibration measures and applies the plan."""
        if self.plan is not None:
            return self.plan
        if "free" not in self._deltas or "ckpt" not in self._deltas:
            return None  # no training forward ran yet (e.g. an evaluation step)
        self._remove_hooks()
        n = len(self.layers)
        peak = self.meter.peak_reserved()
        growth = max(0, self.meter.allocated() - self._start)
        per_layer = self._deltas["free"] - self._deltas["ckpt"]
        headroom = self.budget - self.margin - peak - growth
        if per_layer <= 0:
            # Something else decided what the layers keep (another checkpoint wrapper, hooks of a framework):
            # the measurement says nothing, so recompute everywhere rather than guess.
            free, per_layer = 0, 0
            reason = "calibration saw no activation difference between the layers: every layer checkpoints"
        else:
            free = min(n, max(0, 1 + math.floor(headroom / per_layer)))
            reason = ""
            if free == 0:
                reason = "the budget is below what full recompute needs: every layer checkpoints"
            elif free == n:
                reason = "the whole model fits without recompute"
        self.plan = RecomputePlan(
            layers=n,
            uncheckpointed=free,
            budget_bytes=self.budget,
            margin_bytes=self.margin,
            calibration_peak_bytes=peak,
            step_growth_bytes=growth,
            layer_activation_bytes=per_layer,
            predicted_peak_bytes=peak + growth + (free - 1) * per_layer,
            reason=reason,
        )
        self._apply_layout()
        logger.info("strop.kernels budgeted recompute: %s", self.plan)
        return self.plan

    def remove(self) -> None:
        """Restore the checkpointing flags the model had before (and turn it off if we turned it on)."""
        self._remove_hooks()
        self._layout_handle.remove()
        if self.enabled_by_us:
            self.hf.gradient_checkpointing_disable()
            # enable() hooked the input embeddings to require grad; disable() leaves that hook on a PEFT model
            if self._input_hook_before is None and getattr(self.hf, "_require_grads_hook", None) is not None:
                self.hf.disable_input_require_grads()
        for layer, flag in zip(self.layers, self.flags_before, strict=True):
            layer.gradient_checkpointing = flag


def enable_budgeted_recompute(
    model: nn.Module,
    budget_bytes: int,
    *,
    margin_bytes: int | None = None,
    meter: MemoryMeter | None = None,
) -> BudgetedRecompute:
    """Checkpoint only as many decoder layers as ``budget_bytes`` of device memory requires.

    Args:
        model: An HF (or PEFT-wrapped) model whose decoder layers are ``GradientCheckpointingLayer``s, on
            CUDA. Gradient checkpointing is turned on (non-reentrant) if it was off.
        budget_bytes: The peak device memory (reserved by the caching allocator) the run may use.
        margin_bytes: Kept free below the budget; default max(1 GiB, 3% of the budget).
        meter: Where memory is read (tests pass a fake); default the model's CUDA device.

    Returns:
        The installed :class:`BudgetedRecompute`; call ``step_end()`` after every optimizer step (the
        first one plans) and ``remove()`` to undo.
    """
    return BudgetedRecompute(model, budget_bytes, margin_bytes=margin_bytes, meter=meter)
