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

from torch import nn

from strop.common.trainer_types import DEFAULT_MEMORY_MODE, MEMORY_MODES, MemoryFeatures, MemoryMode

from .checkpointing import disable_offloaded_checkpointing, enable_offloaded_checkpointing
from .offload import DEFAULT_MIN_OFFLOAD_BYTES, ActivationOffloader
from .recompute import BudgetedRecompute, RecomputePlan, enable_budgeted_recompute
from .tiled_mlp import DEFAULT_CHUNK_BUDGET_BYTES, TiledMLPReport, disable_tiled_mlp, enable_tiled_mlp

__all__ = [
    "InstalledMode",
    "MemoryReport",
    "apply_memory_mode",
    "disable_memory_features",
    "enable_memory_features",
    "host_available_bytes",
]

logger = logging.getLogger("strop.kernels")

# cgroup v2, then v1: a container's limit, usage and usage breakdown (a pod sees the node's /proc/meminfo)
_CGROUP_FILES = (
    ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current", "/sys/fs/cgroup/memory.stat"),
    (
        "/sys/fs/cgroup/memory/memory.limit_in_bytes",
        "/sys/fs/cgroup/memory/memory.usage_in_bytes",
        "/sys/fs/cgroup/memory/memory.stat",
    ),
)


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # cgroup v2 writes "max" for no limit


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _inactive_file(stat_path: str) -> int:
    """Reclaimable page cache in a cgroup's usage (``inactive_file``; v1: ``total_inactive_file``), 0 if unread."""
    try:
        with open(stat_path) as f:
            fields = dict(line.split()[:2] for line in f if line.strip())
    except (OSError, ValueError):
        return 0
    value = fields.get("inactive_file", fields.get("total_inactive_file", "0"))
    return int(value) if value.isdigit() else 0


def host_available_bytes() -> int | None:
    """Host memory this process can still take: ``MemAvailable``, capped by the container's cgroup limit less its
    working set (usage less reclaimable page cache, as the kubelet counts it); None when neither can be read."""
    available = _meminfo_available()
    for limit_path, usage_path, stat_path in _CGROUP_FILES:
        limit, usage = _read_int(limit_path), _read_int(usage_path)
        if limit is not None and usage is not None and limit < 1 << 60:  # v1 writes ~2^63 for no limit
            room = max(0, limit - max(0, usage - _inactive_file(stat_path)))
            available = room if available is None else min(available, room)
            break
    return available


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
    save_layers: int = 0,
    save_attention: bool = False,
    host_budget_bytes: int | None = None,
    offload_cpu_tensors: bool = False,
    preserve_rng_state: bool = True,
    trace: bool = False,
) -> MemoryReport:
    """Install offloaded activation checkpointing and the tiled MLP on an HF or PEFT Llama-family model.

    Args:
        model: A transformers causal LM or a PEFT model around one.
        offload_activations: Offload checkpointed layer inputs to pinned host memory.
        tiled_mlp_chunks: Chunks per MLP call, ``"auto"``, or None/0 for no tiling.
        tiled_mlp_budget_bytes: ``"auto"``'s bound on one chunk's MLP intermediates.
        min_offload_bytes: Layer inputs smaller than this stay on the GPU.
        keep_last_layers: Checkpointed layers at the end whose inputs stay on the GPU.
        save_layers: Evenly spaced checkpointed layers that skip the recompute, their saved activations in
            pinned host memory (:func:`~strop.kernels.models.enable_offloaded_checkpointing`).
        save_attention: Offloaded layers keep their attention output in host memory; the recompute skips
            attention's forward.
        host_budget_bytes: Host memory the offloaded copies may hold at once (None: unbounded); past it, layer
            inputs stay on the GPU (``ActivationOffloader``).
        offload_cpu_tensors: Exercise the offload path with CPU tensors (tests, the CPU smoke benchmark).
        preserve_rng_state: Replay the forward's RNG in the recompute (dropout).
        trace: Record the offload schedule in ``offloader.stats.trace``.

    Returns:
        A :class:`MemoryReport`. Undo with :func:`disable_memory_features`.
    """
    disable_memory_features(model)  # re-enabling replaces the previous installation
    report = MemoryReport()
    if offload_activations:
        try:
            report.offloader = enable_offloaded_checkpointing(
                model, min_offload_bytes=min_offload_bytes, keep_last=keep_last_layers, save_layers=save_layers,
                offload_cpu_tensors=offload_cpu_tensors, preserve_rng_state=preserve_rng_state, trace=trace,
                save_attention=save_attention, host_budget_bytes=host_budget_bytes,
            )  # fmt: skip
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


@dataclass
class InstalledMode:
    """What :func:`apply_memory_mode` installed: remove it with :meth:`remove`, call :meth:`step_end` after steps."""

    mode: MemoryMode
    features: MemoryFeatures
    model: nn.Module | None = field(default=None, repr=False)
    memory: MemoryReport | None = None
    recompute: BudgetedRecompute | None = None
    notes: list[str] = field(default_factory=list)

    def step_end(self) -> RecomputePlan | None:
        """After each optimizer step; returns the budgeted-recompute plan once, when the first step made it."""
        if self.recompute is not None and self.recompute.plan is None:
            return self.recompute.step_end()
        return None

    def remove(self) -> None:
        if self.memory is not None:
            disable_memory_features(self.model)
        if self.recompute is not None:
            self.recompute.remove()

    def __str__(self) -> str:
        parts = [f"memory mode {self.mode.value}"]
        if self.memory is not None:
            parts += [f"{k}: {v}" for k, v in self.memory.summary().items()]
        if self.recompute is not None:
            parts.append(f"budgeted recompute: {self.recompute.plan or 'planned after the first step'}")
        return "; ".join(parts + self.notes)


def apply_memory_mode(
    model: nn.Module,
    mode: MemoryMode,
    *,
    budget_bytes: int = 0,
    allow_offload: bool = True,
    save_layers: int = 0,
    save_attention: bool | None = None,
    tiled_mlp: bool | None = None,
    host_budget_bytes: int | None = None,
    offload_cpu_tensors: bool = False,
    min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES,
) -> InstalledMode:
    """Install what ``MEMORY_MODES[mode]`` says (the one table of what a mode means), reversibly.

    Args:
        model: A (patched) HF or PEFT model; gradient checkpointing as the caller set it.
        mode: The memory mode (UNSPECIFIED is the default mode).
        budget_bytes: MAX_SPEED's device-memory budget (required for it).
        allow_offload: False when the caller found no host room for a step's layer inputs (modes whose
            offload needs host room then keep them on the device).
        save_layers: Layers that skip the recompute, their activations in host memory (with offload).
        save_attention: Offloaded layers keep their attention output for the recompute; None: the mode's own
            setting (``MemoryFeatures.save_attention``).
        tiled_mlp: The MLPs run tiled ("auto" chunks); None: the mode's own setting (``MemoryFeatures.tiled_mlp``).
        host_budget_bytes: Host memory the offloaded copies may hold; None: the mode's
            ``host_budget_fraction`` of :func:`host_available_bytes` now (unbounded for a fraction of 0, or when
            the host's memory cannot be read).
        offload_cpu_tensors: Exercise the offload path on the CPU (tests, the CPU smoke benchmark).
        min_offload_bytes: Layer inputs and activations smaller than this stay on their device.
    """
    mode = DEFAULT_MEMORY_MODE if mode is MemoryMode.UNSPECIFIED else mode
    features = MEMORY_MODES[mode]
    installed = InstalledMode(mode, features, model)
    offload = features.offload_layer_inputs and (allow_offload or not features.offload_needs_host_room)
    if features.offload_layer_inputs and not offload:
        installed.notes.append("layer inputs stay on the device: no host room for a step's worth")
    if features.budgeted_recompute and budget_bytes <= 0:
        raise ValueError(f"memory mode {mode.value} needs a positive budget_bytes")
    available = host_available_bytes() if host_budget_bytes is None and offload else None
    if available is not None and features.host_budget_fraction > 0:
        host_budget_bytes = int(features.host_budget_fraction * available)
    if host_budget_bytes is not None and offload:
        installed.notes.append(f"host budget {host_budget_bytes / 2**30:.1f} GiB")
    tiled = features.tiled_mlp if tiled_mlp is None else tiled_mlp
    try:
        if offload or tiled:
            installed.memory = enable_memory_features(
                model, offload_activations=offload, tiled_mlp_chunks="auto" if tiled else None,
                save_layers=save_layers, offload_cpu_tensors=offload_cpu_tensors, min_offload_bytes=min_offload_bytes,
                save_attention=features.save_attention if save_attention is None else save_attention,
                host_budget_bytes=host_budget_bytes,
            )  # fmt: skip
        if features.budgeted_recompute:
            installed.recompute = enable_budgeted_recompute(model, budget_bytes)
    except BaseException:
        installed.remove()  # nothing half-installed is left on the model
        raise
    return installed
