"""Fused Triton ops with hand-written backward passes (one op per file; each documents its formula, shapes,
dtype contract and what it saves, and carries its ``<op>_reference`` in plain torch).

The package imports its ops lazily, so the modules that need no Triton (``nf4_format``) import on a machine
without it (the export service's CPU nodes).
"""

from __future__ import annotations

import importlib

_OPS = {  # public name → the module that owns it
    "addmm_small_k_": "small_k",
    "dequantize_weight": "nf4",
    "fused_linear_cross_entropy": "fused_linear_ce",
    "geglu": "swiglu",
    "nf4_dequantize": "nf4",
    "rms_norm": "rmsnorm",
    "rope_qk": "rope",
    "swiglu": "swiglu",
}

__all__ = sorted(_OPS)


def __getattr__(name: str):
    if name not in _OPS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{_OPS[name]}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_OPS))
