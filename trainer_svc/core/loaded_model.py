"""A base model loaded in a session: the one record the loader, the jobs, generation and the adapter files share."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from strop.common.trainer_types import KernelMode, LoraConfig, ModelFacts

__all__ = ["LoadedModel"]


@dataclass
class LoadedModel:
    """A base model in memory, with its tokenizer, and (once attached) its PEFT adapter."""

    model: Any
    tokenizer: Any
    facts: ModelFacts
    model_dir: Path
    model_rel: str
    device: str
    lora: LoraConfig | None = None
    kernel_report: Any = None
    # the FP8 kernel mode it was loaded with (ON_FP8, ON_FP8_DX: FP8_KERNEL_MODES), None for exact kernels or none
    fp8_kernels: KernelMode | None = None
    extra: dict = field(default_factory=dict)
    # bytes the engine will still move onto ``device`` (a base staged in host memory for FSDP2, fsdp.py):
    # admission counts them against the device's free memory
    pending_device_bytes: int = 0
