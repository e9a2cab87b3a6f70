"""What ``patch_model`` did to one model: the report it returns and the state its patched forwards read.

:class:`PatchReport` says per component what was patched and why anything kept the reference path;
:class:`PatchState` holds the swapped forwards (their ``active`` is the switch every patched forward checks) and
logs each runtime fallback once per module and reason.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from torch import nn

from .hf import Swaps, previous_forward

logger = logging.getLogger("strop.kernels")

COMPONENTS = ("rms_norm", "rope", "lora_qkv", "lora_o", "lora_mlp", "moe_router", "fused_cross_entropy")


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
class PatchState:
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


def swap_forward(state: PatchState, module: nn.Module, new: Callable) -> None:
    state.swaps.forward(module, new, owner=state)


def patched(module: nn.Module) -> tuple[PatchState, Callable]:
    """The patch's state and the forward it replaced on ``module`` (called by every patched forward)."""
    return previous_forward(module, "patch")
