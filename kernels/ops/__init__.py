"""Fused Triton ops with hand-written backward passes (one op per file; each documents its formula, shapes,
dtype contract and what it saves, and carries its ``<op>_reference`` in plain torch)."""

from .fused_linear_ce import fused_linear_cross_entropy
from .nf4 import dequantize_weight, nf4_dequantize
from .rmsnorm import rms_norm
from .rope import rope_qk
from .small_k import addmm_small_k_
from .swiglu import geglu, swiglu

__all__ = [
    "addmm_small_k_",
    "dequantize_weight",
    "fused_linear_cross_entropy",
    "geglu",
    "nf4_dequantize",
    "rms_norm",
    "rope_qk",
    "swiglu",
]
