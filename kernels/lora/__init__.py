"""LoRA projections as autograd functions over a frozen dense or NF4 base: ``y = xW + s·(xA)B``, backward
computing dX, dA and dB only (the base gets no gradient)."""

from .linear import LoRAProj, lora_linear, lora_qkv
from .mlp import lora_mlp

__all__ = ["LoRAProj", "lora_linear", "lora_mlp", "lora_qkv"]
