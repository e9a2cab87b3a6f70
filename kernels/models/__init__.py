"""Model surgery on transformers (and PEFT-wrapped) models: kernel patching, and the memory modes
(``apply_memory_mode``, the one entry point) with their building blocks — offloaded checkpointing, the tiled MLP,
budgeted recompute. Every install is reversible and per instance."""

from .checkpointing import disable_offloaded_checkpointing, enable_offloaded_checkpointing
from .memory import InstalledMode, MemoryReport, StepShape, apply_memory_mode
from .offload import ActivationOffloader, offloaded_checkpoint
from .patch import PatchReport, patch_model, unpatch_model
from .recompute import BudgetedRecompute, RecomputePlan, enable_budgeted_recompute
from .tiled_mlp import disable_tiled_mlp, enable_tiled_mlp, tiled_mlp

__all__ = [
    "ActivationOffloader",
    "BudgetedRecompute",
    "InstalledMode",
    "MemoryReport",
    "PatchReport",
    "RecomputePlan",
    "StepShape",
    "apply_memory_mode",
    "disable_offloaded_checkpointing",
    "disable_tiled_mlp",
    "enable_budgeted_recompute",
    "enable_offloaded_checkpointing",
    "enable_tiled_mlp",
    "offloaded_checkpoint",
    "patch_model",
    "tiled_mlp",
    "unpatch_model",
]
