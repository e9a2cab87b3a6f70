"""A base model loaded in a session: the one record the loader, the jobs, generation and the adapter files share."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from strop.common.trainer_types import KernelMode, LoraConfig, ModelFacts

__all__ = ["LoadedModel", "autocast_dtype"]


def autocast_dtype(compute_dtype: str | None, device_type: str) -> str | None:
    """The dtype a session computing in ``compute_dtype`` on ``device_type`` ("cuda", "cpu") trains in under autocast
    (the training arguments' ``bf16``/``fp16``: bfloat16 on any device, float16 on CUDA), or None (no autocast)."""
    if compute_dtype == "bfloat16" or (compute_dtype == "float16" and device_type == "cuda"):
        return compute_dtype
    return None


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

    def autocast_dtype(self) -> str | None:
        """The dtype this session's jobs compute in under autocast (the training arguments' ``bf16``/``fp16``:
        bfloat16 on any device, float16 on CUDA), or None (fp32: no autocast)."""
        return autocast_dtype(self.facts.compute_dtype, self.device.split(":")[0])

    def compute_autocast(self) -> contextlib.AbstractContextManager:
        """Autocast as this session's jobs train under it, for its other forwards (Generate, the retention's
        teacher-forced scoring, the step API's and GRPO's passes) to compute as training does. Without it a 16-bit
        input meeting the fp32 LoRA factors is PEFT's own arithmetic (the LoRA term in fp32, added after the base
        output's rounding), which strop's patched forwards leave to PEFT: another rounding of the model than the
        one trained, on the reference path."""
        dtype = self.autocast_dtype()
        if dtype is None:
            return contextlib.nullcontext()
        import torch

        return torch.autocast(torch.device(self.device).type, dtype=getattr(torch, dtype))
