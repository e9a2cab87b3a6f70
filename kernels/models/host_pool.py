"""The host memory that offloaded activations live in: one pool per offloader, which every saved copy goes through.

The offloader (``offload.py``) decides what to save and when to reload it; the records it keeps
(``offload_records.py``: layer inputs, the activations of layers without recompute) and the saved attention outputs
(``saved_attention.py``) hold their host copies here. Each of them depends on this pool, not on the offloader: the
pool owns the copies in both directions (a side stream per device, a bound on queued device-to-host bytes), the
host-memory accounting against the budget (as the pinned allocator holds blocks: rounded up to a power of two), the
counters and the schedule trace.
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

import torch

__all__ = [
    "DEFAULT_MAX_INFLIGHT_BYTES",
    "DEFAULT_MIN_OFFLOAD_BYTES",
    "HostPool",
    "OffloadStats",
    "host_block_bytes",
]

# 512 tokens of a 4096-wide bf16 hidden state. Below it the copy latency is not hidden by the layer's compute
# (Unsloth PR #3867's comparison: plain checkpointing faster at 256 tokens, offload faster at 1024).
DEFAULT_MIN_OFFLOAD_BYTES = 4 << 20
# Queued device-to-host copies beyond which a save waits: about one 8B layer's activations at 16K tokens.
DEFAULT_MAX_INFLIGHT_BYTES = 2 << 30


def host_block_bytes(nbytes: int) -> int:
    """The pinned host memory a copy of ``nbytes`` takes: torch's caching host allocator rounds a block up to a
    power of two."""
    return 1 << max(0, nbytes - 1).bit_length() if nbytes > 0 else 0


@dataclass
class OffloadStats:
    """Counters of an :class:`ActivationOffloader` (host memory in bytes of the saved copies).

    Attributes:
        offloaded: Layer calls whose input went to host memory.
        kept: Layer calls whose input stayed on its device, by reason.
        torch_checkpoint: Layer calls handed to ``torch.utils.checkpoint``, by reason.
        host_bytes: Host memory held now by offloaded inputs.
        peak_host_bytes: The most host memory offloaded inputs held at once.
        offloaded_bytes: Bytes copied to the host in total.
        prefetch_hits: Backward reloads (layer inputs, saved-activation layers) started ahead of need.
        prefetch_misses: Backward reloads started only when needed (first one of a chain, unusual orders).
        saved_offloaded: Activations of no-recompute layers (``save_layers``) copied to host memory.
        saved_kept: Activations of no-recompute layers left where they were (parameters, small or integer
            tensors, the layer's keyword tensors).
        saved_kept_bytes: Bytes of those that are activations (device memory the saved layers hold; weights
            and keyword tensors, alive anyway, not counted).
        saved_prefetched: Of ``saved_offloaded``, those reloaded ahead of need.
        copy_waits: Times the forward waited for a device-to-host copy (backlog over ``max_inflight_bytes``).
        attention_saved: Attention outputs kept in host memory for the recompute (``save_attention``).
        qkv_saved: Of those, the ones that kept their q, k, v too (``save_qkv``).
        host_full: Layer inputs, saved activations and attention outputs left on the device because host memory
            was at ``host_budget_bytes``.
        trace: ``(event, layer)`` pairs in order, when tracing is on (tests): ``save:offload``,
            ``save:keep``, ``save:activations`` (a no-recompute layer's forward ended), ``prefetch``,
        ``fetch:hit``, ``fetch:miss``, ``fetch:kept``.
    """

    offloaded: int = 0
    kept: dict[str, int] = field(default_factory=dict)
    torch_checkpoint: dict[str, int] = field(default_factory=dict)
    host_bytes: int = 0
    peak_host_bytes: int = 0
    offloaded_bytes: int = 0
    prefetch_hits: int = 0
    prefetch_misses: int = 0
    saved_offloaded: int = 0
    saved_kept: int = 0
    saved_kept_bytes: int = 0
    saved_prefetched: int = 0
    copy_waits: int = 0
    attention_saved: int = 0
    qkv_saved: int = 0
    host_full: int = 0
    trace: list[tuple[str, int | None]] | None = None


class HostPool:
    """Pinned host memory for one offloader's copies: accounting, copies, counters.

    Args:
        min_offload_bytes: Tensors smaller than this stay on their device.
        offload_cpu_tensors: Copy CPU tensors to a separate host buffer and run the schedule as on CUDA (tests
            the machinery on a CPU host).
        max_inflight_bytes: Device-to-host copies allowed to be queued at once; a copy beyond it waits for the
            oldest (bounds the GPU memory a forward that outruns the host link holds).
        host_budget_bytes: The host memory the copies may hold at once (None: no bound), counted as the pinned
            allocator holds them.
        trace: Record the schedule in ``stats.trace``.
    """

    def __init__(
        self,
        *,
        min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES,
        offload_cpu_tensors: bool = False,
        max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
        host_budget_bytes: int | None = None,
        trace: bool = False,
    ) -> None:
        if host_budget_bytes is not None and host_budget_bytes < 0:
            raise ValueError(f"host_budget_bytes must be ≥ 0, got {host_budget_bytes}")
        if min_offload_bytes < 0:
            raise ValueError(f"min_offload_bytes must be ≥ 0, got {min_offload_bytes}")
        if max_inflight_bytes < 0:
            raise ValueError(f"max_inflight_bytes must be ≥ 0, got {max_inflight_bytes}")
        self.host_budget_bytes = host_budget_bytes
        self.min_offload_bytes = min_offload_bytes
        self.offload_cpu_tensors = offload_cpu_tensors
        self.max_inflight_bytes = max_inflight_bytes
        self.stats = OffloadStats(trace=[] if trace else None)
        self._host_blocks = 0  # what the copies hold in the pinned allocator's blocks
        self._inflight: collections.deque[tuple[torch.cuda.Event, int]] = collections.deque()
        self._inflight_bytes = 0
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    # -- bookkeeping

    def event(self, name: str, layer: int | None) -> None:
        """Record a schedule event in ``stats.trace`` (when tracing)."""
        if self.stats.trace is not None:
            self.stats.trace.append((name, layer))

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    # -- host memory accounting (every copy to the host goes through these)

    @staticmethod
    def block(nbytes: int, pinned: bool) -> int:
        """The host memory a copy of ``nbytes`` holds: a pinned one rounded up as the pinned allocator does."""
        return host_block_bytes(nbytes) if pinned else nbytes

    def host_room(self, nbytes: int | tuple[int, ...], pinned: bool = True, reserve: int = 0) -> bool:
        """Whether copies of ``nbytes`` (one size or several) to the host stay within ``host_budget_bytes`` with
        ``reserve`` bytes still free after them (what the forward's later layer inputs will need); counts a
        refusal."""
        if self.host_budget_bytes is None:
            return True
        sizes = nbytes if isinstance(nbytes, tuple) else (nbytes,)
        if self._host_blocks + sum(self.block(n, pinned) for n in sizes) + reserve <= self.host_budget_bytes:
            return True
        self.stats.host_full += 1
        return False

    def hold_host(self, nbytes: int, pinned: bool = True) -> None:
        """A copy of ``nbytes`` now lives in host memory."""
        s = self.stats
        s.host_bytes += nbytes
        s.peak_host_bytes = max(s.peak_host_bytes, s.host_bytes)
        self._host_blocks += self.block(nbytes, pinned)

    def release_host(self, nbytes: int, pinned: bool = True) -> None:
        """A host copy of ``nbytes`` is gone (reloaded, or its graph freed)."""
        self.stats.host_bytes -= nbytes
        self._host_blocks -= self.block(nbytes, pinned)

    # -- copies (side stream on CUDA; plain clones for CPU tensors under offload_cpu_tensors)

    def copy_to_host(self, x: torch.Tensor) -> torch.Tensor:
        """Start copying ``x`` to a new host buffer; x's device block is not reused before the copy is done.

        At most ``max_inflight_bytes`` of copies are left queued: beyond that the caller waits for the
        oldest, so a forward that outruns the link does not hold an unbounded backlog of GPU memory.
        """
        dense = bool(torch.ops.aten.is_non_overlapping_and_dense(x))
        if not x.is_cuda:  # CPU under offload_cpu_tensors: the "host copy" is a separate buffer
            return x.detach().clone(memory_format=torch.preserve_format if dense else torch.contiguous_format)
        compute = torch.cuda.current_stream(x.device)
        side = self._side_stream(x.device)
        nbytes = x.numel() * x.element_size()
        inflight = self._inflight
        while inflight and (
            inflight[0][0].query() or self._inflight_bytes + nbytes > self.max_inflight_bytes
        ):
            done, n = inflight.popleft()
            if not done.query():
                self.stats.copy_waits += 1
                done.synchronize()
            self._inflight_bytes -= n
        side.wait_stream(compute)  # x is produced by work queued on the compute stream
        with torch.cuda.stream(side):
            # a dense tensor keeps its strides (one linear copy); any other comes back contiguous
            if dense:
                host = torch.empty_strided(x.shape, x.stride(), dtype=x.dtype, pin_memory=True)
            else:
                host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
            host.copy_(x.detach(), non_blocking=True)
            done = torch.cuda.Event()
            done.record(side)
        x.record_stream(side)  # x's block is not reused before the copy is done, even once the caller drops x
        inflight.append((done, nbytes))
        self._inflight_bytes += nbytes
        return host

    def copy_to_device(
        self, host: torch.Tensor, device: torch.device
    ) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """Start copying ``host`` back to ``device``; the event (None on the CPU) marks the copy done."""
        if not (host.is_pinned() and device.type == "cuda"):
            return host.to(device), None
        compute = torch.cuda.current_stream(device)
        side = self._side_stream(device)
        # Allocated on the compute stream: its block may still be read by queued compute work, so the side
        # stream waits for that work before writing into it.
        buf = torch.empty_strided(host.shape, host.stride(), dtype=host.dtype, device=device)
        side.wait_stream(compute)
        with torch.cuda.stream(side):
            buf.copy_(host, non_blocking=True)
            ready = torch.cuda.Event()
            ready.record(side)
        buf.record_stream(side)  # safe to free even if nobody waits on `ready`
        return buf, ready
