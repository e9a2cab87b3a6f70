"""The memory modes: what a job may trade device memory for (``MemoryMode``, an API enum) and the one table of what
each installs (``MEMORY_MODES``). The rules around the table — the host-room rule, the host and device budgets —
and the installing are ``strop.kernels.models.apply_memory_mode``'s. Torch-free: the SDK and the CLI read it."""

from __future__ import annotations

import enum
from dataclasses import dataclass

__all__ = ["DEFAULT_MEMORY_MODE", "MEMORY_MODES", "MemoryFeatures", "MemoryMode"]


class MemoryMode(enum.StrEnum):
    """How a job trades device memory for speed; :data:`MEMORY_MODES` says what each installs."""

    UNSPECIFIED = "UNSPECIFIED"
    STANDARD = "STANDARD"
    LONG_CONTEXT = "LONG_CONTEXT"
    MAX_SPEED = "MAX_SPEED"

    @classmethod
    def _missing_(cls, value):
        # the lower-case names and "" parse too: the CLI's --memory-mode takes "standard", "long_context",
        # "max_speed" and "" (the default mode), as the proto's enum names read in a shell
        return cls.__members__.get(str(value).upper() or "UNSPECIFIED")


@dataclass(frozen=True)
class MemoryFeatures:
    """What a memory mode installs on a CUDA device with strop's kernels (the one table: :data:`MEMORY_MODES`).

    Attributes:
        gradient_checkpointing: True forces it on, False off (the budget decides per layer), None leaves the
            job's ``gradient_checkpointing`` setting.
        offload_layer_inputs: Checkpointed layer inputs live in pinned host memory between forward and backward.
        offload_needs_host_room: Offload only when a step's layer inputs fit in half the host's available
            memory (otherwise the inputs stay on the device); attention outputs, and then q, k, v, are saved only
            when they fit there too.
        tiled_mlp: Each decoder MLP runs over sequence chunks (``"auto"``: only when a chunk's intermediates
            would pass ~1 GiB).
        budgeted_recompute: The first step measures one layer's activations; then only as many layers
            recompute as the memory budget needs.
        default_budget_fraction: The budget when the job gives none, as a fraction of the device's memory.
        save_attention: Offloaded layers keep their attention output and log-sum-exp in host memory, so the
            recompute in backward skips attention's forward.
        save_qkv: With ``save_attention``, the q, k, v attention read are kept there too, so the recompute also
            skips the fused Q/K/V projections (and RoPE where nothing else follows them; a q/k norm and RoPE run in
            attention's backward instead: ``kernels/models/saved_attention.py``); where the host has no room for
            them beside the attention outputs, the recompute computes them.
        host_budget_fraction: The share of the host's available memory (at install) the offloaded copies may
            hold; past it, layer inputs stay on the device and attention is recomputed (0: unbounded).
        save_layers: Evenly spaced offloaded layers that skip the recompute, their activations in host memory
            (no mode sets it; a benchmark's variant may).
        resident_layers: The last checkpointed layers keep their input and saved attention on the device instead
            of copying them over the host link (no mode sets it: on the MoE step it is meant for, eight such layers
            gained little on an H100, bench/RESULTS.md; a benchmark's variant may).
        step_graphs: SFT micro-steps of a repeated batch shape replay as CUDA graphs, forward and backward
            (``kernels/models/step_graph.py``): the host's dispatch off the step where it sets the pace (small
            models); a step that cannot be captured runs eagerly, saying why. No mode sets it until the GPU
            measures it; a benchmark's ``-g1`` variant does.
    """

    gradient_checkpointing: bool | None
    offload_layer_inputs: bool
    offload_needs_host_room: bool
    tiled_mlp: bool
    budgeted_recompute: bool
    default_budget_fraction: float = 0.0
    save_attention: bool = False
    save_qkv: bool = False
    host_budget_fraction: float = 0.0
    save_layers: int = 0
    step_graphs: bool = False
    resident_layers: int = 0


# The measurements behind each row: bench/RESULTS.md, "training: memory-allowed mode, offloaded checkpointing",
# "attention outputs kept for the recompute" and "saved attention in the standard mode".
MEMORY_MODES: dict[MemoryMode, MemoryFeatures] = {
    # offloading the layer inputs costs no step time at a few thousand tokens per row and takes a quarter off the
    # peak; keeping the offloaded layers' attention outputs (reloaded one layer early) makes the recompute skip
    # attention for a few GiB of host memory, and keeping their q, k, v too skips the Q/K/V projections for a
    # device peak higher by at most one layer's q, k, v — each only when the host has room for it (apply_memory_mode)
    MemoryMode.STANDARD: MemoryFeatures(None, True, True, False, False, save_attention=True, save_qkv=True),
    # what host memory holds goes there, layer inputs first (an attention output is saved only with room left for
    # the inputs still to come), the rest stays on the device; the MLP runs over sequence chunks
    MemoryMode.LONG_CONTEXT: MemoryFeatures(
        True, True, False, True, False, save_attention=True, host_budget_fraction=0.8
    ),
    MemoryMode.MAX_SPEED: MemoryFeatures(False, False, False, False, True, default_budget_fraction=0.9),
}
DEFAULT_MEMORY_MODE = MemoryMode.STANDARD
