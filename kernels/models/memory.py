"""strop's memory machinery for long-context training, installed on a model in one call.

``enable_memory_features(model)`` installs, per model instance and reversibly:

    offload_activations   decoder-layer inputs kept in pinned host memory between forward and backward,
                          reloaded ahead of need (``kernels/offload.py``); turns gradient checkpointing
                          on if it was off
    tiled_mlp             each decoder MLP run over sequence chunks, recomputed chunk by chunk in
                          backward (``kernels/tiled_mlp.py``); ``"auto"`` tiles only when a chunk's
                          intermediates would pass ~1 GiB, so short sequences run the MLP untiled

Together they remove the two activation terms that grow with the sequence: L·T·H for the checkpointed
layer inputs (to host memory) and T·I for one layer's MLP intermediates during recompute (to one
chunk). What is left on the GPU at long context is one layer's attention and norm activations, the
logits path (strop's fused CE chunks it) and the weights.

Order with ``strop.kernels.models.patch_model``: patch first, then enable these. The tiled MLP wraps whatever
MLP forward is installed (patched, PEFT or HF); ``patch_model`` run afterwards would find an MLP forward
that is not HF's and leave that MLP on the reference path. Offloaded checkpointing does not interact with
patching. The chunked DPO loss (``kernels/losses/dpo.py``) is used by the DPO trainer glue, not
installed here.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .checkpointing import disable_offloaded_checkpointing, enable_offloaded_checkpointing
from .offload import DEFAULT_MIN_OFFLOAD_BYTES, ActivationOffloader
from .tiled_mlp import DEFAULT_CHUNK_BUDGET_BYTES, TiledMLPReport, disable_tiled_mlp, enable_tiled_mlp

__all__ = ["MemoryReport", "disable_memory_features", "enable_memory_features"]

logger = logging.getLogger("strop.kernels")


@dataclass
class MemoryReport:
    """What :func:`enable_memory_features` installed, and why anything was not.

    Attributes:
        offloader: The activation offloader (None when offload is off); ``offloader.stats`` holds host memory
            (``host_bytes``, ``peak_host_bytes``) and the schedule counters, updated as the model trains.
        tiled_mlp: The tiled-MLP report (None when tiling is off).
        skipped: Feature → reason it is off.
    """

    offloader: ActivationOffloader | None = None
    tiled_mlp: TiledMLPReport | None = None
    skipped: dict[str, str] = field(default_factory=dict)

    def host_memory(self) -> dict[str, int]:
        """Host bytes held by offloaded activations now and at peak (0 without offload)."""
        stats = self.offloader.stats if self.offloader is not None else None
        return {
            "host_bytes": stats.host_bytes if stats else 0,
            "peak_host_bytes": stats.peak_host_bytes if stats else 0,
        }

    def summary(self) -> dict[str, str]:
        """One line per feature, e.g. ``{"offload_activations": "on: ...", "tiled_mlp": "on: 32 MLPs ..."}``."""
        out = {}
        if self.offloader is not None:
            s = self.offloader.stats
            out["offload_activations"] = (
                f"on: {s.offloaded} inputs offloaded so far, peak host {s.peak_host_bytes / 2**30:.2f} GiB"
                + (f", kept on device: {s.kept}" if s.kept else "")
                + (
                    f", {s.saved_offloaded} activations of layers without recompute offloaded"
                    f" ({s.saved_prefetched} prefetched, {s.copy_waits} copy waits)"
                    if s.saved_offloaded
                    else ""
                )
                + (f", torch checkpoint: {s.torch_checkpoint}" if s.torch_checkpoint else "")
            )
        else:
            out["offload_activations"] = "off: " + self.skipped.get("offload_activations", "not requested")
        if self.tiled_mlp is not None and self.tiled_mlp.tiled:
            out["tiled_mlp"] = f"on: {len(self.tiled_mlp.tiled)} MLPs, chunks={self.tiled_mlp.num_chunks}"
            if self.tiled_mlp.skipped:
                out["tiled_mlp"] += f"; untiled: {sorted(set(self.tiled_mlp.skipped.values()))}"
        else:
            out["tiled_mlp"] = "off: " + self.skipped.get("tiled_mlp", "not requested")
        return out

    def __str__(self) -> str:
        return "\n".join(["strop memory features:"] + [f"  {k}: {v}" for k, v in self.summary().items()])


def enable_memory_features(
    model: nn.Module,
    *,
    offload_activations: bool = True,
    tiled_mlp_chunks: int | str | None = "auto",
    tiled_mlp_budget_bytes: int = DEFAULT_CHUNK_BUDGET_BYTES,
    min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES,
    keep_last_layers: int = 1,
    **offload_options: Any,
) -> MemoryReport:
    """Install offloaded activation checkpointing and the tiled MLP on an HF or PEFT Llama-family model.

    Args:
        model: A transformers causal LM or a PEFT model around one.
        offload_activations: Offload checkpointed layer inputs to pinned host memory.
        tiled_mlp_chunks: Chunks per MLP call, ``"auto"``, or None/0 for no tiling.
        tiled_mlp_budget_bytes: ``"auto"``'s bound on one chunk's MLP intermediates.
        min_offload_bytes: Layer inputs smaller than this stay on the GPU.
        keep_last_layers: Checkpointed layers at the end whose inputs stay on the GPU.
        **offload_options: Passed to :func:`~strop.kernels.models.enable_offloaded_checkpointing`
            (``offload_cpu_tensors``, ``preserve_rng_state``, ``trace``).

    Returns:
        A :class:`MemoryReport`. Undo with :func:`disable_memory_features`.
    """
    disable_memory_features(model)  # re-enabling replaces the previous installation
    report = MemoryReport()
    if offload_activations:
        try:
            report.offloader = enable_offloaded_checkpointing(
                model, min_offload_bytes=min_offload_bytes, keep_last=keep_last_layers, **offload_options
            )
        except ValueError as e:
            report.skipped["offload_activations"] = str(e)
    else:
        report.skipped["offload_activations"] = "offload_activations=False"
    if tiled_mlp_chunks:
        report.tiled_mlp = enable_tiled_mlp(model, tiled_mlp_chunks, budget_bytes=tiled_mlp_budget_bytes)
        if not report.tiled_mlp.tiled:
            report.skipped["tiled_mlp"] = "; ".join(sorted(set(report.tiled_mlp.skipped.values())))
    else:
        report.skipped["tiled_mlp"] = f"tiled_mlp_chunks={tiled_mlp_chunks!r}"
    for feature, why in report.skipped.items():
        logger.info("strop.kernels memory: %s off: %s", feature, why)
    return report


def disable_memory_features(model: nn.Module) -> None:
    """Undo :func:`enable_memory_features` (a no-op on a model without them)."""
    disable_tiled_mlp(model)
    disable_offloaded_checkpointing(model)
