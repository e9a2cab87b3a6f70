"""What every piece of model surgery needs from a transformers (or PEFT-wrapped) model, in one place.

- :func:`unwrap_peft`: the transformers ``PreTrainedModel`` inside a PEFT wrapper (or the model itself).
- :func:`checkpoint_layers`: the decoder layers HF's gradient checkpointing runs (``GradientCheckpointingLayer``).
- :func:`scaled_logits_reason`: why an LM head's logits are more than ``h Wᵀ + b`` (and Gemma's final soft-cap),
  which strop's fused CE and chunked losses compute.
- :class:`Swaps`: reversible per-instance attribute replacements — forwards (kernel patching, MLP tiling, the
  hidden-states head for DPO) and checkpoint functions (offloading). Each user holds one ``Swaps``; ``undo``
  restores in reverse order, and a replacement that something else wrapped again after ours is left in place
  with ours switched to pass-through (``active`` is False), so layered surgery comes off in any order.

A replaced forward finds its predecessor and its owner on the module itself (``_strop_<tag>_prev``,
``_strop_<tag>_owner``), never in a closure: ``copy.deepcopy`` of a patched model (TRL copies models for
reference policies) then carries forwards bound to the copy, never to the original's modules.
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable
from typing import Any

from torch import nn

__all__ = [
    "Swaps",
    "checkpoint_layers",
    "keep_trainable_fp32",
    "previous_forward",
    "scaled_logits_reason",
    "unwrap_peft",
]

_MISSING = object()


# config attributes by which some architectures scale the LM head's logits
_LOGIT_SCALINGS = ("logit_scale", "logits_scaling", "output_multiplier")


def scaled_logits_reason(config: Any) -> str | None:
    """Why the logits of a model of ``config`` are not ``h Wᵀ + b``, optionally soft-capped by a positive
    ``final_logit_softcapping`` (Gemma), which is all strop's fused CE and chunked losses apply; None if they are."""
    config = config.get_text_config() if hasattr(config, "get_text_config") else config
    for attr in _LOGIT_SCALINGS:
        value = getattr(config, attr, None)
        if value not in (None, 1.0):
            return f"config.{attr} is set ({value!r}: scaled logits)"
    softcap = getattr(config, "final_logit_softcapping", None)
    if softcap is not None and not (isinstance(softcap, int | float) and softcap > 0):
        return f"config.final_logit_softcapping={softcap!r} is not a positive number"
    return None


def unwrap_peft(model: nn.Module) -> nn.Module:
    """The transformers model inside a PEFT wrapper (``get_base_model()``), or ``model`` itself."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def keep_trainable_fp32(model: nn.Module) -> int:
    """Cast every trainable (LoRA) tensor back to fp32; returns how many were cast.

    TRL follows the QLoRA paper and casts adapters to bf16 on a 4-bit base; at small learning rates bf16
    swallows the updates (a DPO margin then does not move), so strop keeps adapters, and with them the
    optimizer state, in fp32. Call it before the optimizer exists.
    """
    import torch

    n = 0
    for p in model.parameters():
        if p.requires_grad and p.dtype != torch.float32:
            p.data = p.data.float()
            n += 1
    return n


def checkpoint_layers(model: nn.Module) -> list[nn.Module]:
    """The layers HF's gradient checkpointing wraps (decoder layers), in order."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


class Swaps:
    """One user's reversible replacements of instance attributes.

    Args:
        tag: Names the module-dict entries of replaced forwards (``_strop_<tag>_prev``/``_owner``), so that
            several users can layer forwards on one module.
    """

    def __init__(self, tag: str) -> None:
        self.tag = tag
        self.active = True
        self._entries: list[tuple[nn.Module, str, Any, Any]] = []  # (module, attribute, previous, ours)

    def __len__(self) -> int:
        return len(self._entries)

    def set(self, module: nn.Module, attr: str, value: Any) -> None:
        """``module.<attr> = value`` (an instance attribute), remembered for :meth:`undo`."""
        self._entries.append((module, attr, module.__dict__.get(attr, _MISSING), value))
        module.__dict__[attr] = value

    def forward(self, module: nn.Module, fn: Callable, owner: Any = None) -> Callable:
        """Bind ``fn(self, ...)`` as ``module``'s forward; it reaches the previous one with :func:`previous_forward`.

        The bound forward keeps the previous one's name, docstring and ``__wrapped__`` (so
        ``inspect.signature`` shows the original, which HF's Trainer and ``generate`` read).
        """
        prev = module.forward
        functools.update_wrapper(fn, getattr(prev, "__func__", prev), updated=())
        bound = types.MethodType(fn, module)
        module.__dict__[f"_strop_{self.tag}_prev"] = prev
        module.__dict__[f"_strop_{self.tag}_owner"] = owner if owner is not None else self
        self.set(module, "forward", bound)
        return bound

    def undo(self) -> None:
        """Restore every attribute that still holds our value; switch the rest to pass-through."""
        self.active = False
        for module, attr, previous, ours in reversed(self._entries):
            if module.__dict__.get(attr) is not ours:
                continue  # replaced again after us: left in place, and ours now passes through
            if previous is _MISSING:
                del module.__dict__[attr]
            else:
                module.__dict__[attr] = previous
            if attr == "forward":
                module.__dict__.pop(f"_strop_{self.tag}_prev", None)
                module.__dict__.pop(f"_strop_{self.tag}_owner", None)
        self._entries.clear()


def previous_forward(module: nn.Module, tag: str) -> tuple[Any, Callable]:
    """``(owner, previous forward)`` of the forward :meth:`Swaps.forward` bound on ``module`` under ``tag``."""
    return module.__dict__[f"_strop_{tag}_owner"], module.__dict__[f"_strop_{tag}_prev"]
