"""strop's memory modes, installed on a model in one call: ``apply_memory_mode(model, mode, step=...)``.

A mode is a row of ``MEMORY_MODES`` (``common/memory_modes.py``, the one table); this module owns the rules
around the table — whether the host has room for what a mode offloads, how much host memory the copies may
hold, the device budget for budgeted recompute — and installs, per model instance and reversibly:

    offload_activations   decoder-layer inputs kept in pinned host memory between forward and backward,
                          reloaded ahead of need (``offload.py``); turns gradient checkpointing on if it was off
    tiled_mlp             each decoder MLP run over sequence chunks, recomputed chunk by chunk in backward
                          (``tiled_mlp.py``); ``"auto"`` tiles only when a chunk's intermediates would pass
                          ~1 GiB, so short sequences run the MLP untiled
    budgeted recompute    only as many layers recompute as the device budget needs (``recompute.py``)

Offload and tiling remove the two activation terms that grow with the sequence: L·T·H for the checkpointed
layer inputs (to host memory) and T·I for one layer's MLP intermediates during recompute (to one chunk).

Order with ``strop.kernels.models.patch_model``: patch first, then apply the mode. The tiled MLP wraps whatever
MLP forward is installed (patched, PEFT or HF); ``patch_model`` run afterwards would find an MLP forward that is
not HF's and leave that MLP on the reference path.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from torch import nn

from strop.common.memory_modes import DEFAULT_MEMORY_MODE, MEMORY_MODES, MemoryFeatures, MemoryMode

from .checkpointing import disable_offloaded_checkpointing, enable_offloaded_checkpointing
from .hf import unwrap_peft
from .offload import DEFAULT_MIN_OFFLOAD_BYTES, ActivationOffloader
from .recompute import BudgetedRecompute, RecomputePlan, enable_budgeted_recompute
from .tiled_mlp import DEFAULT_CHUNK_BUDGET_BYTES, TiledMLPReport, disable_tiled_mlp, enable_tiled_mlp

__all__ = [
    "InstalledMode",
    "MemoryReport",
    "StepShape",
    "apply_memory_mode",
    "host_available_bytes",
    "host_room",
    "memory_budget_bytes",
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
    """What the memory features installed (offload and tiling), and why anything was not.

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
    save_qkv: bool = False,
    host_budget_bytes: int | None = None,
    resident_layers: int = 0,
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
        save_qkv: With ``save_attention``, the q, k, v attention read are kept too; the recompute skips the
            fused Q/K/V projections and RoPE.
        host_budget_bytes: Host memory the offloaded copies may hold at once (None: unbounded); past it, layer
            inputs stay on the GPU (``ActivationOffloader``).
        resident_layers: The last checkpointed layers that keep their input and saved attention on the GPU
            (:func:`~strop.kernels.models.enable_offloaded_checkpointing`).
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
                model,
                min_offload_bytes=min_offload_bytes,
                keep_last=keep_last_layers,
                save_layers=save_layers,
                offload_cpu_tensors=offload_cpu_tensors,
                preserve_rng_state=preserve_rng_state,
                trace=trace,
                save_attention=save_attention,
                save_qkv=save_qkv,
                host_budget_bytes=host_budget_bytes,
                resident_layers=resident_layers,
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


@dataclass
class InstalledMode:
    """What :func:`apply_memory_mode` installed: remove it with :meth:`remove`, call :meth:`step_end` after steps."""

    mode: MemoryMode | None  # None: features that are no table entry (a benchmark's variant)
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
        parts = [f"memory mode {self.mode.value if self.mode else self.features}"]
        if self.memory is not None:
            parts += [f"{k}: {v}" for k, v in self.memory.summary().items()]
        if self.recompute is not None:
            parts.append(f"budgeted recompute: {self.recompute.plan or 'planned after the first step'}")
        return "; ".join(parts + self.notes)


@dataclass(frozen=True)
class StepShape:
    """What one optimizer step's forward holds on the residual stream, which the host-room rule sizes from.

    Attributes:
        rows: Sequences in one forward (preference methods: chosen and rejected rows, KTO: each row and its KL row).
        seq_len: Tokens per row.
        checkpointed: The model checkpoints its layers (the modes whose offload needs host room offload only then).
    """

    rows: int
    seq_len: int
    checkpointed: bool = True


def host_room(model: nn.Module, step: StepShape) -> tuple[bool, bool, bool]:
    """Whether one step's checkpointed layer inputs fit in half the host's available memory; whether their
    attention outputs (the same size: [rows, seq, heads · head_dim], plus an fp32 log-sum-exp per head) fit there
    beside them; and whether the q, k, v attention read fit there beside both. Unknown host memory claims no room.
    Every layer is counted as saving all three, including layers that will not (a sliding window shorter than the
    sequence, projections not strop's): the rule errs toward recomputing."""
    from .host_pool import host_block_bytes as pinned

    cfg = model.config
    layers = int(getattr(cfg, "num_hidden_layers", 0) or 0)
    hidden = int(getattr(cfg, "hidden_size", 0) or 0)
    heads = int(getattr(cfg, "num_attention_heads", 0) or 0)
    kv_heads = int(getattr(cfg, "num_key_value_heads", 0) or heads)
    head_dim = int(getattr(cfg, "head_dim", 0) or 0) or (hidden // heads if heads else 0)
    itemsize = model.get_input_embeddings().weight.element_size()  # the residual stream's dtype
    tokens = step.rows * step.seq_len
    need = layers * pinned(tokens * hidden * itemsize)
    attention = layers * (pinned(tokens * heads * head_dim * itemsize) + pinned(tokens * heads * 4))  # o, lse
    qkv = layers * (
        pinned(tokens * heads * head_dim * itemsize) + 2 * pinned(tokens * kv_heads * head_dim * itemsize)
    )
    half = (host_available_bytes() or 0) // 2
    if need > half:
        logger.info("%.1f GiB of layer inputs, %.1f GiB host available", need / 2**30, 2 * half / 2**30)
        return False, False, False
    return True, need + attention <= half, need + attention + qkv <= half


def memory_budget_bytes(features: MemoryFeatures, device: str | None, requested_bytes: int = 0) -> int:
    """The device-memory budget budgeted recompute plans for: the request, else the mode's default fraction of
    the device, never more than the device holds (0 for modes without budgeted recompute)."""
    if not features.budgeted_recompute:
        return 0
    if device is None or not str(device).startswith("cuda"):
        if requested_bytes > 0:
            return requested_bytes
        raise ValueError("budgeted recompute needs a CUDA device or a positive budget_bytes")
    import torch

    total = torch.cuda.get_device_properties(torch.device(device)).total_memory
    budget = requested_bytes or int(features.default_budget_fraction * total)
    if budget > total:
        logger.warning(
            "a memory budget of %.1f GiB exceeds the device's %.1f GiB: planning for the device",
            budget / 2**30,
            total / 2**30,
        )
        budget = total
    return budget


def apply_memory_mode(
    model: nn.Module,
    mode: MemoryMode | MemoryFeatures,
    *,
    step: StepShape,
    budget_bytes: int = 0,
    device: str | None = None,
    offload_cpu_tensors: bool = False,
    min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES,
) -> InstalledMode:
    """Install a memory mode reversibly: the one owner of what a mode means on a model.

    The mode is ``MEMORY_MODES[mode]`` (the one table), or a :class:`MemoryFeatures` made from a table entry with
    ``dataclasses.replace`` (e.g. a benchmark's ``save_layers``). This function owns the rules around the table:
    the host-room rule (offload needing host room happens only when the step's layer inputs fit in half the
    host's available memory, attention outputs and then their q, k, v are saved only when they fit there too),
    the host budget (the mode's fraction of what the host has), and the device budget (``memory_budget_bytes``).

    Args:
        model: A (patched) HF or PEFT model; gradient checkpointing as the caller set it.
        mode: A memory mode (UNSPECIFIED is the default mode) or its features.
        step: What one step's forward holds (the host-room rule sizes from it).
        budget_bytes: Budgeted recompute's device-memory budget; 0: the mode's default share of ``device``.
        device: Where the model trains (``"cuda:0"``…); the budget's default needs a CUDA device.
        offload_cpu_tensors: Exercise the offload path on the CPU (tests, the CPU smoke benchmark).
        min_offload_bytes: Layer inputs and activations smaller than this stay on their device.
    """
    if isinstance(mode, MemoryFeatures):
        features = mode
        mode = next((m for m, f in MEMORY_MODES.items() if f == features), None)
    else:
        mode = DEFAULT_MEMORY_MODE if mode is MemoryMode.UNSPECIFIED else mode
        features = MEMORY_MODES[mode]
    installed = InstalledMode(mode, features, model)
    budget = memory_budget_bytes(features, device, budget_bytes)
    offload, save_attention, save_qkv = (
        features.offload_layer_inputs,
        features.save_attention,
        features.save_qkv,
    )
    if offload and features.offload_needs_host_room:
        inputs_fit, attention_fits, qkv_fits = (
            host_room(unwrap_peft(model), step) if step.checkpointed else (False, False, False)
        )
        if not inputs_fit:
            offload = False
            installed.notes.append("layer inputs stay on the device: no host room for a step's worth")
        elif save_attention and not attention_fits:
            save_attention = save_qkv = False
            installed.notes.append("attention recomputed: no host room for the outputs beside the inputs")
        elif save_attention and save_qkv and not qkv_fits:
            save_qkv = False
            installed.notes.append("q, k, v recomputed: no host room for them beside the attention outputs")
    host_budget_bytes = None
    available = host_available_bytes() if offload and features.host_budget_fraction > 0 else None
    if available is not None:
        host_budget_bytes = int(features.host_budget_fraction * available)
        installed.notes.append(f"host budget {host_budget_bytes / 2**30:.1f} GiB")
    try:
        if offload or features.tiled_mlp:
            installed.memory = enable_memory_features(
                model,
                offload_activations=offload,
                tiled_mlp_chunks="auto" if features.tiled_mlp else None,
                save_layers=features.save_layers,
                offload_cpu_tensors=offload_cpu_tensors,
                min_offload_bytes=min_offload_bytes,
                save_attention=save_attention,
                save_qkv=save_qkv,
                host_budget_bytes=host_budget_bytes,
                resident_layers=features.resident_layers,
            )
        if features.budgeted_recompute:
            installed.recompute = enable_budgeted_recompute(model, budget)
    except BaseException:
        installed.remove()  # nothing half-installed is left on the model
        raise
    return installed
