"""Offloaded activation checkpointing: decoder-layer inputs live in pinned host memory between forward and backward.

What. Plain gradient checkpointing keeps one tensor per decoder layer alive from forward to backward: the
layer's input hidden states ``[B, T, H]``, from which backward recomputes the layer. This module keeps
that tensor in host memory instead:

    forward(layer i)    copy x_i → pinned host buffer on a side stream, then run the layer under no_grad;
                        x_i's GPU memory is released once the copy is done (``record_stream``)
    backward(layer i)   wait for x_i's reload, start reloading x_{i-1} on the side stream (double
                        buffering: at most two reloaded inputs exist), restore the forward's RNG and
                        autocast state, recompute the layer with grad from x_i, backpropagate

Why. At long context the checkpointed inputs are what grows with the sequence: L · B · T · H · 2 bytes,
e.g. 32 layers × 256K tokens × 4096 × bf16 = 64 GiB on an 8B Llama. Offloaded, the GPU holds at most two
of them (≈2 GiB there) and the host holds the rest. The copies run on their own stream, overlapped with the
layer compute (a layer's forward at 8K tokens on an 8B shape takes ~10× its input's PCIe copy time).

Memory accounting, per training step with L checkpointed layers and input size S = B·T·H·itemsize:

    GPU, plain checkpointing      L · S  (all inputs, held until their layer's backward)
    GPU, offloaded                ≤ 2 · S (the last layer's input, kept; one reload in flight) + one layer's
                                  recompute activations (as plain checkpointing)
    host (pinned)                 (L − 1) · S at the end of forward, falling as backward reloads them
                                  (``ActivationOffloader.stats.peak_host_bytes``)

What is saved per layer: the host copy of its first positional input (or, where offload does not apply,
the input itself on its device), the other positional tensor inputs, the RNG state (CPU and the input's
CUDA device) and the autocast state at forward time. Keyword arguments (attention mask, position
embeddings, position ids) stay bound in the layer call HF hands over, shared by all layers.

Where offload does not apply the same function recomputes from the input kept on its device (plain
checkpointing), and the reason is logged once: the last checkpointed layer (its input is the first one
backward needs, so a round trip would only add latency), inputs under ``min_offload_bytes`` (4 MiB by
default: 512 tokens of a 4096-wide bf16 state; Unsloth measured plain checkpointing 2.8 % faster at 256
tokens and offload 5.9 % faster at 1024 on a B200), and inputs already on the CPU. A layer whose keyword
arguments hold a tensor that requires grad runs ``torch.utils.checkpoint`` (non-reentrant) instead,
because this function returns gradients for positional inputs only.

Layers without recompute (``save_layers``). Recompute costs a layer's forward again in backward (about a
third of a QLoRA step's matmul time); keeping the activations on the GPU instead costs ~1.8 GiB per
8B-shape layer at 16K tokens. A third option uses the host link: ``save_layers`` of the checkpointed layers
(evenly spaced, never the last) run their forward once, with grad, under ``saved_tensors_hooks`` that copy
every saved activation (floating, ≥ ``min_offload_bytes``, not a weight or a tensor the layer's keyword
arguments hold; the same memory saved by several ops once) to pinned host memory on the side stream. In backward they take part in the same reload
chain as the checkpointed inputs: reaching the layer above starts their reload, reaching them starts the
reload of the call before. GPU cost: one layer's reloaded activations plus the next reload in flight, and
at most ``max_inflight_bytes`` of device-to-host copies queued in forward (a save beyond it waits for the
oldest copy, so a forward that outruns the link stalls instead of holding an unbounded backlog). Link cost:
each such layer's activations cross it twice per step, so how many layers pay off depends on the measured
bandwidth against the layer's compute time; ``bench/train_bench.py`` sweeps it (``strop-offload-sN``).

Gradients reach the layer's parameters the way reentrant checkpointing delivers them: the recompute's
``torch.autograd.backward`` accumulates into ``param.grad`` during the outer backward. So train with
``loss.backward()`` (every trainer does); ``torch.autograd.grad(loss, params)`` does not see them. A
zero-size "anchor" input that requires grad makes every layer output require grad, so LoRA parameters
get gradients even when the embedding output does not require grad (no ``enable_input_require_grads``
needed).

HF integration (transformers 5.17 – 5.24): every decoder layer derives from ``GradientCheckpointingLayer``,
which calls ``self._gradient_checkpointing_func(layer_call, *args)`` with the keyword arguments bound in
``layer_call`` (``partial(forward, self, **kwargs)`` in 5.24's forward wrapper, ``partial(super().__call__,
**kwargs)`` in older ``__call__`` wrappers) when ``self.gradient_checkpointing`` is set and the module
trains. Either form is an opaque callable here; without grad it is simply called. ``enable_offloaded_checkpointing``
sets that attribute per layer instance to this module's checkpoint function and wraps the model's
``_set_gradient_checkpointing`` (what ``gradient_checkpointing_enable``/``_disable`` and TRL's
``disable_gradient_checkpointing`` call), so a later re-enable by a trainer keeps the offloaded function.
``disable_offloaded_checkpointing`` restores HF's function.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

__all__ = [
    "DEFAULT_MAX_INFLIGHT_BYTES",
    "DEFAULT_MIN_OFFLOAD_BYTES",
    "ActivationOffloader",
    "OffloadStats",
    "OffloadedCheckpointFunction",
    "ReplayState",
    "checkpoint_reference",
    "disable_offloaded_checkpointing",
    "enable_offloaded_checkpointing",
    "offloaded_checkpoint",
]

logger = logging.getLogger("strop.kernels")

# 512 tokens of a 4096-wide bf16 hidden state. Below it the copy latency is not hidden by the layer's compute
# (Unsloth PR #3867, B200, Llama-3.2-1B: plain checkpointing 2.8 % faster at 256 tokens, offload 5.9 % at 1024).
DEFAULT_MIN_OFFLOAD_BYTES = 4 << 20
# Queued device-to-host copies beyond which a save waits: about one 8B layer's activations at 16K tokens.
DEFAULT_MAX_INFLIGHT_BYTES = 2 << 30


# ---- replay of the forward's RNG and autocast state (shared with tiled_mlp) ---------------------------


@dataclass
class ReplayState:
    """What a recompute needs so it computes exactly what the forward did: RNG and autocast state."""

    device: torch.device
    cpu_rng: torch.Tensor | None
    cuda_rng: torch.Tensor | None
    autocast: tuple[tuple[str, bool, torch.dtype, bool], ...]

    @classmethod
    def capture(cls, device: torch.device, preserve_rng: bool = True) -> ReplayState:
        """Snapshot the current RNG (CPU and ``device``'s CUDA generator) and autocast state."""
        types = ("cpu",) if device.type == "cpu" else (device.type, "cpu")
        autocast = tuple(
            (t, torch.is_autocast_enabled(t), torch.get_autocast_dtype(t), torch.is_autocast_cache_enabled())
            for t in types
        )
        cpu_rng = torch.get_rng_state() if preserve_rng else None
        cuda_rng = torch.cuda.get_rng_state(device) if preserve_rng and device.type == "cuda" else None
        return cls(device, cpu_rng, cuda_rng, autocast)

    @contextlib.contextmanager
    def replay(self) -> Iterator[None]:
        """Run the block under the captured state; the caller's RNG state is restored afterwards."""
        cuda = self.device.type == "cuda"
        devices = (
            [self.device.index if self.device.index is not None else torch.cuda.current_device()]
            if cuda
            else []
        )
        with contextlib.ExitStack() as stack:
            if self.cpu_rng is not None:
                stack.enter_context(torch.random.fork_rng(devices=devices, device_type="cuda"))
                torch.set_rng_state(self.cpu_rng)
                if self.cuda_rng is not None:
                    torch.cuda.set_rng_state(self.cuda_rng, self.device)
            for device_type, enabled, dtype, cache in self.autocast:
                stack.enter_context(
                    torch.autocast(device_type=device_type, enabled=enabled, dtype=dtype, cache_enabled=cache)
                )
            yield


# ---- reference -------------------------------------------------------------------------------------------


def checkpoint_reference(function: Callable[..., Any], *args: Any) -> Any:
    """What offloaded checkpointing must compute: torch's own non-reentrant checkpoint of ``function(*args)``."""
    return torch.utils.checkpoint.checkpoint(function, *args, use_reentrant=False)


# ---- the offloader: side stream, saved inputs, reload schedule -------------------------------------------


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
    trace: list[tuple[str, int | None]] | None = None


class _Record:
    """One checkpointed call's saved input: on the host, being reloaded, or kept on its device."""

    __slots__ = (
        "__weakref__",
        "device",
        "device_tensor",
        "host",
        "layer",
        "nbytes",
        "offloaded",
        "offloader",
        "prev",
        "ready",
    )

    def __init__(self, offloader: ActivationOffloader, x: torch.Tensor, layer: int | None) -> None:
        self.offloader = offloader
        self.layer = layer
        self.device = x.device
        self.nbytes = x.numel() * x.element_size()
        self.offloaded = False
        self.device_tensor: torch.Tensor | None = None
        self.host: torch.Tensor | None = None
        self.ready: torch.cuda.Event | None = None
        # The call checkpointed just before this one: the next one backward will most likely need.
        self.prev: weakref.ref[_Record | _SavedGroup] | None = None

    def drop_host(self) -> None:
        if self.host is not None:
            self.host = None
            self.offloader.stats.host_bytes -= self.nbytes

    def __del__(
        self,
    ) -> None:  # a graph freed without backward (e.g. eval with grad on) returns its host memory
        with contextlib.suppress(Exception):
            self.drop_host()


class _Saved:
    """One saved activation of a no-recompute layer: its host copy, then its reloaded device copy."""

    __slots__ = (
        "__weakref__",
        "device",
        "device_tensor",
        "group",
        "host",
        "nbytes",
        "ready",
        "source",
        "version",
    )

    def __init__(self, group: _SavedGroup, t: torch.Tensor) -> None:
        self.group = group  # strong: the group lives as long as one of its saved tensors does
        self.device = t.device
        self.nbytes = t.numel() * t.element_size()
        self.version = t._version
        self.source = weakref.ref(t)  # to check for in-place writes while the original lives
        self.host: torch.Tensor | None = None
        self.device_tensor: torch.Tensor | None = None
        self.ready: torch.cuda.Event | None = None

    def drop_host(self) -> None:
        if self.host is not None:
            self.host = None
            self.group.offloader.stats.host_bytes -= self.nbytes

    def __del__(self) -> None:  # a graph freed without backward returns its host memory
        with contextlib.suppress(Exception):
            self.drop_host()


def _check_unmodified(t: torch.Tensor | None, saved: int) -> None:
    """Raise as autograd does when a saved tensor (None: no longer alive, nothing to check) was written to."""
    if t is not None and t._version != saved:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"a tensor of shape {list(t.shape)} saved at version {saved} is now at version {t._version} (saved "
            "by a layer without recompute, strop.kernels.offload save_layers; autograd's own check cannot see "
            "through the saved-tensor hooks, so this one raises instead)"
        )


class _SavedGroup:
    """The saved activations of one decoder layer that runs without recompute (``save_layers``).

    The layer's forward runs with grad under ``saved_tensors_hooks(group.pack, group.unpack)``: every
    floating activation of at least ``min_offload_bytes`` is copied to pinned host memory on the side stream
    (a tensor saved by several ops once; dense tensors keep their strides, others come back contiguous, as
    with ``torch.autograd.graph.save_on_cpu``). Parameters and views of them (a linear's mm saves its
    frozen weight transposed), the layer's weights and buffers, small or integer tensors and the tensors the
    layer's keyword arguments hold (position embeddings, masks: alive for the whole forward anyway) stay
    where they are. The first unpack in backward marks the layer reached: its reloads are waited on and the
    reload of the previous checkpointed call (layer input or saved group) is issued.

    In-place writes to a saved tensor raise as autograd's own check would: for kept tensors at unpack, for
    offloaded ones at the end of the layer's forward (the originals are held until then, which also keeps
    their blocks from being reused under a copy still in flight) and at unpack while the original lives.
    ``backward(retain_graph=True)`` keeps the reloaded copies on the device until the graph goes; a second
    backward through it is not supported by the kernels that write in place.
    """

    __slots__ = (
        "__weakref__",
        "index",
        "items",
        "layer",
        "offloader",
        "prev",
        "reached",
        "shared",
    )

    def __init__(self, offloader: ActivationOffloader, layer: int | None, shared: set[int]) -> None:
        self.offloader = offloader
        self.layer = layer
        # storage addresses of what outlives the step anyway (the layer's weights, its keyword tensors):
        # kept where they are, never copied
        self.shared = shared
        self.items: list[weakref.ref[_Saved]] = []
        # (data_ptr, shape, stride, dtype) -> (the tensor, its _Saved): dedup within the layer, and the
        # originals held until the layer's forward ends so that in-place writes to them can be checked
        self.index: dict[tuple, tuple[torch.Tensor, _Saved]] = {}
        self.prev: weakref.ref[Any] | None = None
        self.reached = False

    # forward
    def pack(self, t: torch.Tensor) -> tuple[_SavedGroup, Any, int]:
        off = self.offloader
        outlives = (
            isinstance(t, nn.Parameter)
            or isinstance(t._base, nn.Parameter)  # e.g. the transposed weight a linear's mm saves
            or t.untyped_storage().data_ptr() in self.shared
        )
        if (
            outlives
            or not t.is_floating_point()
            or t.numel() * t.element_size() < off.min_offload_bytes
            or not (t.is_cuda or (t.device.type == "cpu" and off.offload_cpu_tensors))
        ):
            off.stats.saved_kept += 1
            if not outlives:
                off.stats.saved_kept_bytes += t.numel() * t.element_size()
            # Detached: a saved output returned with its grad_fn would make a cycle through the graph
            # (node → packed value → tensor → node) that Python's collector cannot see, leaking the graph.
            # The detached alias shares t's version counter, so in-place writes are still seen at unpack.
            return self, t.detach(), t._version
        # The same memory seen again (the same tensor, or another view with the same layout, e.g. each
        # projection's 2-D view of the normed input): one copy. Every indexed original is held until seal,
        # so an address cannot be reused for other data in between.
        key = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
        hit = self.index.get(key)
        if hit is not None and hit[1].version == t._version:
            return self, hit[1], t._version
        item = _Saved(self, t)
        item.host = off.copy_to_host(t)
        self.items.append(weakref.ref(item))
        self.index[key] = (t, item)
        s = off.stats
        s.saved_offloaded += 1
        s.offloaded_bytes += item.nbytes
        s.host_bytes += item.nbytes
        s.peak_host_bytes = max(s.peak_host_bytes, s.host_bytes)
        return self, item, t._version

    def seal(self) -> None:
        """End of the layer's forward: check for in-place writes after saving, drop the dedup index."""
        entries, self.index = list(self.index.values()), {}
        for t, item in entries:
            _check_unmodified(t, item.version)
        self.offloader._event("save:activations", self.layer)

    # backward
    @property
    def host(self) -> bool:
        """Whether some of the group's activations are still only in host memory (for the reload chain)."""
        return any(
            (i := r()) is not None and i.host is not None and i.device_tensor is None for r in self.items
        )

    def prefetch(self) -> None:
        if self.host:
            self.offloader._event("prefetch", self.layer)
            self._reload(prefetched=True)

    def _reload(self, prefetched: bool) -> None:
        for r in self.items:
            item = r()
            if item is not None and item.host is not None and item.device_tensor is None:
                item.device_tensor, item.ready = self.offloader.copy_to_device(item.host, item.device)
                item.drop_host()
                self.offloader.stats.saved_prefetched += prefetched

    def unpack(self, handle: tuple[_SavedGroup, Any, int]) -> torch.Tensor:
        _, x, version = handle
        if not self.reached:
            self.reached = True
            if self.host:
                self.offloader.stats.prefetch_misses += 1
                self.offloader._event("fetch:miss", self.layer)
                self._reload(prefetched=False)
            else:
                self.offloader.stats.prefetch_hits += 1
                self.offloader._event("fetch:hit", self.layer)
            prev = self.prev() if self.prev is not None else None
            if prev is not None:
                self.offloader.prefetch(prev)
        if isinstance(x, torch.Tensor):
            _check_unmodified(x, version)
            return x
        _check_unmodified(x.source(), x.version)
        if x.device_tensor is None:
            if x.host is None:
                raise RuntimeError("offloaded activation: neither a host nor a device copy is left")
            x.device_tensor, x.ready = self.offloader.copy_to_device(x.host, x.device)
            x.drop_host()
        if x.ready is not None:
            torch.cuda.current_stream(x.device).wait_event(x.ready)
            x.ready = None
        return x.device_tensor


class ActivationOffloader:
    """Offloaded checkpointing state for one model: side streams, the reload chain, statistics.

    Its :meth:`checkpoint` has the signature of ``torch.utils.checkpoint.checkpoint`` as HF calls it
    (``function, *args``), plus the keywords ``layer`` and ``offload`` that the installer binds per layer.

    Args:
        min_offload_bytes: Inputs smaller than this stay on their device (plain recompute).
        offload_cpu_tensors: Copy CPU inputs to a separate host buffer and run the reload schedule as on
            CUDA (tests the machinery on a CPU host). Off by default: a CPU input is already in host memory.
        preserve_rng_state: Replay the forward's RNG state in the recompute (needed for dropout).
        max_inflight_bytes: Device-to-host copies allowed to be queued at once; a save beyond it waits for
            the oldest (bounds the GPU memory a forward that outruns the host link holds).
        trace: Record the schedule in ``stats.trace``.
    """

    def __init__(
        self,
        *,
        min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES,
        offload_cpu_tensors: bool = False,
        preserve_rng_state: bool = True,
        max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
        trace: bool = False,
    ) -> None:
        if min_offload_bytes < 0:
            raise ValueError(f"min_offload_bytes must be ≥ 0, got {min_offload_bytes}")
        if max_inflight_bytes < 0:
            raise ValueError(f"max_inflight_bytes must be ≥ 0, got {max_inflight_bytes}")
        self.max_inflight_bytes = max_inflight_bytes
        self._inflight: collections.deque[tuple[torch.cuda.Event, int]] = collections.deque()
        self._inflight_bytes = 0
        self.min_offload_bytes = min_offload_bytes
        self.offload_cpu_tensors = offload_cpu_tensors
        self.preserve_rng_state = preserve_rng_state
        self.stats = OffloadStats(trace=[] if trace else None)
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self._last: weakref.ref[_Record | _SavedGroup] | None = None
        self._logged: set[str] = set()
        # Zero-size leaves that require grad, one per device: passed to every call so the layer output
        # requires grad (and backward reaches the layer's LoRA parameters) even when its input does not.
        self._anchors: dict[torch.device, torch.Tensor] = {}

    def __repr__(self) -> str:
        s = self.stats
        return (
            f"ActivationOffloader(offloaded={s.offloaded}, kept={s.kept}, host_bytes={s.host_bytes}, "
            f"peak_host_bytes={s.peak_host_bytes}, prefetch_hits={s.prefetch_hits}, "
            f"prefetch_misses={s.prefetch_misses}, saved_offloaded={s.saved_offloaded}, "
            f"saved_kept={s.saved_kept}, saved_prefetched={s.saved_prefetched}, copy_waits={s.copy_waits})"
        )

    # -- bookkeeping

    def _event(self, name: str, layer: int | None) -> None:
        if self.stats.trace is not None:
            self.stats.trace.append((name, layer))

    def _log_once(self, reason: str, level: int = logging.INFO) -> None:
        if reason not in self._logged:
            self._logged.add(reason)
            logger.log(level, "strop.kernels offload: %s", reason)

    def _side_stream(self, device: torch.device) -> torch.cuda.Stream:
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device=device)
        return self._streams[device]

    def keep_reason(self, x: torch.Tensor, offload: bool) -> str | None:
        """Why ``x`` stays on its device (plain recompute), or None when it goes to host memory."""
        if not offload:
            return "last checkpointed layer keeps its input on the device (backward needs it first)"
        if x.device.type == "cpu" and not self.offload_cpu_tensors:
            return "input on the CPU (already in host memory): plain recompute"
        if x.device.type not in ("cpu", "cuda"):
            return f"input on {x.device.type}: offload supports CUDA only; plain recompute"
        nbytes = x.numel() * x.element_size()
        if nbytes < self.min_offload_bytes:
            return f"input of {nbytes} bytes < min_offload_bytes={self.min_offload_bytes}: plain recompute"
        return None

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

    # -- forward: save

    def _link(self, item: _Record | _SavedGroup) -> None:
        """Append to the reload chain: backward reaching ``item`` starts reloading the call saved before it."""
        last = self._last() if self._last is not None else None
        item.prev = weakref.ref(last) if last is not None else None
        self._last = weakref.ref(item)

    def run_saved(
        self, function: Callable[..., Any], args: tuple, layer: int | None, module: nn.Module | None = None
    ) -> Any:
        """Run ``function(*args)`` with grad and no recompute, its saved activations kept in host memory.

        ``module`` (the decoder layer) names the weights its ops may save as views (kept, not copied).
        """
        bound = function.keywords.values() if isinstance(function, functools.partial) else ()
        tensors = [v for value in bound for v in (value if isinstance(value, (tuple, list)) else (value,))]
        if module is not None:
            tensors += [*module.parameters(), *module.buffers()]
        shared = {v.untyped_storage().data_ptr() for v in tensors if isinstance(v, torch.Tensor)}
        group = _SavedGroup(self, layer, shared)
        self._link(group)
        try:
            with torch.autograd.graph.saved_tensors_hooks(group.pack, group.unpack):
                out = function(*args)
        finally:
            group.seal()  # also on an exception (e.g. OOM): no index left to hold host copies in a cycle
        return out

    def save(self, x: torch.Tensor, layer: int | None, offload: bool) -> _Record:
        """Start saving ``x`` (before the layer runs, so a device-to-host copy overlaps its compute)."""
        rec = _Record(self, x, layer)
        self._link(rec)
        reason = self.keep_reason(x, offload)
        if reason is not None:
            self.stats.kept[reason] = self.stats.kept.get(reason, 0) + 1
            self._log_once(reason)
            rec.device_tensor = x.detach()
            self._event("save:keep", layer)
            return rec
        host = self.copy_to_host(x)
        rec.host, rec.offloaded = host, True
        s = self.stats
        s.offloaded += 1
        s.offloaded_bytes += rec.nbytes
        s.host_bytes += rec.nbytes
        s.peak_host_bytes = max(s.peak_host_bytes, s.host_bytes)
        self._event("save:offload", layer)
        return rec

    # -- backward: reload

    def _start_reload(self, rec: _Record) -> None:
        if rec.host is None:
            return
        rec.device_tensor, rec.ready = self.copy_to_device(rec.host, rec.device)
        # The pinned block is recycled only after the copy completes (torch's host allocator records the
        # copy's stream), so the host copy can go now.
        rec.drop_host()

    def prefetch(self, item: _Record | _SavedGroup) -> None:
        """Start reloading a layer input or a layer's saved activations, if on the host and not yet reloading."""
        if isinstance(item, _SavedGroup):
            item.prefetch()
        elif item.host is not None and item.device_tensor is None:
            self._event("prefetch", item.layer)
            self._start_reload(item)

    def fetch(self, rec: _Record | None) -> torch.Tensor:
        """The saved input on its device, ready for the compute stream; prefetches the previous call's."""
        if rec is None:
            raise RuntimeError(
                "offloaded checkpoint: backward through this layer ran twice (retain_graph); offloaded "
                "checkpointing frees the saved layer input after the first backward"
            )
        if not rec.offloaded:
            self._event("fetch:kept", rec.layer)
        elif rec.device_tensor is not None:
            self.stats.prefetch_hits += 1
            self._event("fetch:hit", rec.layer)
        else:
            self.stats.prefetch_misses += 1
            self._event("fetch:miss", rec.layer)
            self._start_reload(rec)
        x, ready = rec.device_tensor, rec.ready
        rec.device_tensor, rec.ready = None, None
        if x is None:
            raise RuntimeError(
                "offloaded checkpoint: the saved layer input was already consumed (backward twice?)"
            )
        # Issue the next reload before this layer's recompute is queued, so the two overlap.
        prev = rec.prev() if rec.prev is not None else None
        if prev is not None:
            self.prefetch(prev)
        if ready is not None:
            torch.cuda.current_stream(rec.device).wait_event(ready)
        return x

    # -- the checkpoint function HF calls

    def torch_checkpoint_reason(self, function: Callable[..., Any], args: tuple) -> str | None:
        """Why this call must go to ``torch.utils.checkpoint`` instead, or None."""
        if not args or not isinstance(args[0], torch.Tensor) or not args[0].is_floating_point():
            return "first positional argument is not a floating tensor"
        bound = function.keywords if isinstance(function, functools.partial) else {}
        for name, value in bound.items():
            values = value if isinstance(value, (tuple, list)) else (value,)
            if any(isinstance(v, torch.Tensor) and v.requires_grad for v in values):
                return f"keyword argument {name!r} requires grad (only positional inputs get gradients here)"
        return None

    def checkpoint(
        self,
        function: Callable[..., Any],
        *args: Any,
        layer: int | None = None,
        offload: bool = True,
        save: bool = False,
        module: nn.Module | None = None,
        **_: Any,
    ) -> Any:
        """Checkpoint ``function(*args)`` with its first positional input offloaded to host memory.

        Args:
            function: The layer call (HF passes ``partial(forward, layer, **kwargs)``).
            *args: Positional inputs; ``args[0]`` (the hidden states) is the one offloaded.
            layer: Index used in logs and the trace.
            offload: False keeps the input on its device (the last checkpointed layer).
            save: Do not recompute this layer: run it with grad and keep its saved activations in host
                memory (:meth:`run_saved`), trading link bandwidth and host memory for the recompute.
            module: The layer, whose weights a saved layer keeps rather than copies.
            **_: ``torch.utils.checkpoint`` options (``use_reentrant``, …) are accepted and ignored.

        Returns:
            What ``function(*args)`` returns.
        """
        if not torch.is_grad_enabled():
            return function(*args)
        if save:
            return self.run_saved(function, args, layer, module)
        reason = self.torch_checkpoint_reason(function, args)
        if reason is not None:
            self.stats.torch_checkpoint[reason] = self.stats.torch_checkpoint.get(reason, 0) + 1
            self._log_once(f"torch.utils.checkpoint for this call: {reason}", logging.WARNING)
            return checkpoint_reference(function, *args)
        meta: dict[str, Any] = {}
        device = args[0].device
        if device not in self._anchors:
            self._anchors[device] = torch.empty(0, device=device, requires_grad=True)
        anchor = self._anchors[device]
        outputs = OffloadedCheckpointFunction.apply(function, self, (layer, offload, meta), anchor, *args)
        return _unflatten(outputs, meta["template"])


# ---- autograd ------------------------------------------------------------------------------------------

_SLOT = object()


def _flatten(out: Any) -> tuple[list[torch.Tensor], Any]:
    if isinstance(out, torch.Tensor):
        return [out], None
    if isinstance(out, (tuple, list)):
        tensors = [o for o in out if isinstance(o, torch.Tensor)]
        return tensors, (type(out), [_SLOT if isinstance(o, torch.Tensor) else o for o in out])
    raise TypeError(f"offloaded checkpoint: the layer returned {type(out).__name__}; expected tensors")


def _unflatten(tensors: tuple[torch.Tensor, ...], template: Any) -> Any:
    if template is None:
        return tensors[0]
    kind, items = template
    it = iter(tensors)
    return kind(next(it) if item is _SLOT else item for item in items)


class OffloadedCheckpointFunction(torch.autograd.Function):
    """Reentrant-style checkpoint whose saved input lives in host memory (see the module docstring).

    ``apply(function, offloader, (layer, offload, meta), anchor, *args)`` returns the tensors of
    ``function(*args)``; ``meta["template"]`` says how to rebuild its structure.
    """

    @staticmethod
    def forward(ctx, function, offloader, spec, anchor, *args):
        layer, offload, meta = spec
        x = args[0]
        ctx.function, ctx.offloader, ctx.layer = function, offloader, layer
        ctx.replay = ReplayState.capture(x.device, offloader.preserve_rng_state)
        ctx.record = offloader.save(x, layer, offload)  # before the compute, so the copy overlaps it
        # Other positional tensors (HF passes none for Llama-family layers) are kept as they are.
        ctx.tensor_slots = [i for i, a in enumerate(args) if i > 0 and isinstance(a, torch.Tensor)]
        ctx.constants = [None if isinstance(a, torch.Tensor) else a for a in args]
        ctx.save_for_backward(*(args[i] for i in ctx.tensor_slots))
        with torch.no_grad():
            out = function(*args)
        tensors, meta["template"] = _flatten(out)
        return tuple(tensors)

    @staticmethod
    def backward(ctx, *grads):
        offloader: ActivationOffloader = ctx.offloader
        x = offloader.fetch(ctx.record)
        ctx.record = None
        args = list(ctx.constants)
        args[0] = x.detach().requires_grad_(ctx.needs_input_grad[4])
        for slot, t in zip(ctx.tensor_slots, ctx.saved_tensors, strict=True):
            args[slot] = t.detach().requires_grad_(ctx.needs_input_grad[4 + slot])
        with ctx.replay.replay(), torch.enable_grad():
            out = ctx.function(*args)
        tensors, _ = _flatten(out)
        pairs = [(o, g) for o, g in zip(tensors, grads, strict=True) if g is not None and o.requires_grad]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        input_grads = tuple(a.grad if isinstance(a, torch.Tensor) and a.requires_grad else None for a in args)
        return (None, None, None, None, *input_grads)


def offloaded_checkpoint(
    function: Callable[..., Any],
    *args: Any,
    offloader: ActivationOffloader | None = None,
    layer: int | None = None,
    offload: bool = True,
    save: bool = False,
) -> Any:
    """Checkpoint ``function(*args)`` keeping ``args[0]`` in host memory until backward.

    Args:
        function: The computation to checkpoint (e.g. a decoder layer with its keyword arguments bound).
        *args: Positional inputs; gradients flow to the tensors among them.
        offloader: Shared state across the layers of one model (a fresh one when None: no prefetch chain).
        layer: Index for logs and traces.
        offload: False keeps ``args[0]`` on its device (plain recompute).
        save: No recompute: run with grad, the saved activations in host memory until backward.

    Returns:
        ``function(*args)``, computed under no_grad and recomputed in backward (``save``: computed once).
    """
    return (offloader or ActivationOffloader()).checkpoint(
        function, *args, layer=layer, offload=offload, save=save
    )


# ---- HF install ----------------------------------------------------------------------------------------

_MISSING = object()


def _hf_model(model: nn.Module) -> nn.Module:
    """The transformers PreTrainedModel inside a PEFT wrapper (or the model itself)."""
    get_base = getattr(model, "get_base_model", None)
    return get_base() if callable(get_base) else model


def _checkpoint_layers(hf: nn.Module) -> list[nn.Module]:
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in hf.modules() if isinstance(m, GradientCheckpointingLayer)]


@dataclass
class _Install:
    offloader: ActivationOffloader
    layers: list[nn.Module]
    keep_last: int
    save_layers: int
    hf_funcs: list[Any]  # what HF last set as each layer's _gradient_checkpointing_func (or _MISSING)
    flags_before: list[bool]
    enabled_by_us: bool
    hf_touched: bool = False
    wrapper: Any = None
    set_gc_before: Any = _MISSING

    def apply(self) -> tuple[int, int, int]:
        """Point every layer that HF checkpoints at the offloaded function; the last ones keep their input,
        ``save_layers`` of the others (evenly spaced) skip the recompute. Returns (checkpointed, kept, saved)."""
        on = [i for i, layer in enumerate(self.layers) if layer.gradient_checkpointing]
        keep = set(on[max(0, len(on) - self.keep_last) :]) if self.keep_last else set()
        # never the last checkpointed layer: backward needs its activations first, no reload could hide
        saved = set(spread([i for i in on[:-1] if i not in keep], self.save_layers))
        for i in on:
            self.layers[i]._gradient_checkpointing_func = functools.partial(
                self.offloader.checkpoint,
                layer=i,
                offload=i not in keep,
                save=i in saved,
                module=self.layers[i] if i in saved else None,
            )
        return len(on), len(keep), len(saved)


def spread(items: list[int], k: int) -> list[int]:
    """``k`` of ``items`` evenly spaced (all of them when k ≥ len): e.g. 3 of 0..8 → 1, 4, 7.

    Spacing matters on both passes: in forward each saved layer's copies overlap the next layers' compute,
    in backward its reload overlaps the recompute of the layers above it.
    """
    n = len(items)
    k = max(0, min(k, n))
    return [items[int((j + 0.5) * n / k)] for j in range(k)]


def enable_offloaded_checkpointing(
    model: nn.Module,
    *,
    min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES,
    keep_last: int = 1,
    save_layers: int = 0,
    offload_cpu_tensors: bool = False,
    preserve_rng_state: bool = True,
    max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
    trace: bool = False,
) -> ActivationOffloader:
    """Make an HF (or PEFT-wrapped HF) model checkpoint its decoder layers with offloaded inputs.

    Layers that already have gradient checkpointing on (e.g. HF's ``every_n_layers``) keep exactly that
    set; when none has, all are turned on. Reversible with :func:`disable_offloaded_checkpointing`;
    calling it again on an installed model returns the installed offloader.

    Args:
        model: A transformers model whose decoder layers are ``GradientCheckpointingLayer``s, or a PEFT
            model around one.
        min_offload_bytes: Inputs smaller than this stay on their device.
        keep_last: How many of the last checkpointed layers keep their input on the device.
        save_layers: How many of the other checkpointed layers (evenly spaced, never the last) are not
            recomputed: their saved activations go to pinned host memory in forward and come back ahead of
            need in backward. Each such layer saves one layer's recompute and moves its activations over the
            host link twice (≈ 1.8 GiB per 8B-shape layer at 16K tokens with strop's kernels); how many pay
            off depends on the link's bandwidth.
        offload_cpu_tensors: Exercise the offload path with CPU tensors (tests).
        preserve_rng_state: Replay the forward's RNG in the recompute (dropout).
        max_inflight_bytes: Device-to-host copies queued at once before a save waits for the oldest.
        trace: Record the schedule in ``offloader.stats.trace``.

    Returns:
        The :class:`ActivationOffloader`; its ``stats`` report host memory and the schedule.

    Raises:
        ValueError: If the model has no ``GradientCheckpointingLayer``, or ``keep_last``, ``save_layers`` or
            ``max_inflight_bytes`` is negative.
    """
    hf = _hf_model(model)
    existing = hf.__dict__.get("_strop_offload")
    if existing is not None:
        return existing.offloader
    if keep_last < 0:
        raise ValueError(f"keep_last must be ≥ 0, got {keep_last}")
    if save_layers < 0:
        raise ValueError(f"save_layers must be ≥ 0, got {save_layers}")
    layers = _checkpoint_layers(hf)
    if not layers:
        raise ValueError(
            f"{type(hf).__name__} has no transformers GradientCheckpointingLayer: offloaded checkpointing "
            "hooks HF's per-layer checkpoint function and cannot apply"
        )
    offloader = ActivationOffloader(
        min_offload_bytes=min_offload_bytes,
        offload_cpu_tensors=offload_cpu_tensors,
        preserve_rng_state=preserve_rng_state,
        max_inflight_bytes=max_inflight_bytes,
        trace=trace,
    )
    flags = [bool(layer.gradient_checkpointing) for layer in layers]
    state = _Install(
        offloader=offloader,
        layers=layers,
        keep_last=keep_last,
        save_layers=save_layers,
        hf_funcs=[layer.__dict__.get("_gradient_checkpointing_func", _MISSING) for layer in layers],
        flags_before=flags,
        enabled_by_us=not any(flags),
        set_gc_before=hf.__dict__.get("_set_gradient_checkpointing", _MISSING),
    )
    if state.enabled_by_us:
        for layer in layers:
            layer.gradient_checkpointing = True
    original_set = hf._set_gradient_checkpointing

    def _set_gradient_checkpointing(*args: Any, **kwargs: Any) -> Any:
        # gradient_checkpointing_enable/disable (and TRL's disable_gradient_checkpointing) land here: let HF
        # set its flags and function, remember the function, then put the offloaded one back.
        result = original_set(*args, **kwargs)
        state.hf_touched = True
        state.hf_funcs = [layer.__dict__.get("_gradient_checkpointing_func", _MISSING) for layer in layers]
        state.apply()
        return result

    state.wrapper = _set_gradient_checkpointing
    hf._set_gradient_checkpointing = _set_gradient_checkpointing
    hf._strop_offload = state
    on, kept, saved = state.apply()
    logger.info(
        "strop.kernels offload: %d/%d decoder layers checkpointed with offloaded inputs (last %d kept on "
        "device, %d not recomputed: activations in host memory)",
        on,
        len(layers),
        kept,
        saved,
    )
    return offloader


def disable_offloaded_checkpointing(model: nn.Module) -> bool:
    """Undo :func:`enable_offloaded_checkpointing`: HF's checkpoint function (and flags we set) come back.

    Returns:
        True if the model had offloaded checkpointing installed.
    """
    hf = _hf_model(model)
    state: _Install | None = hf.__dict__.get("_strop_offload")
    if state is None:
        return False
    for layer, func, flag in zip(state.layers, state.hf_funcs, state.flags_before, strict=True):
        if func is _MISSING:
            layer.__dict__.pop("_gradient_checkpointing_func", None)
        else:
            layer._gradient_checkpointing_func = func
        if state.enabled_by_us and not state.hf_touched:
            layer.gradient_checkpointing = flag
    if hf.__dict__.get("_set_gradient_checkpointing") is state.wrapper:
        if state.set_gc_before is _MISSING:
            del hf._set_gradient_checkpointing
        else:
            hf._set_gradient_checkpointing = state.set_gc_before
    del hf._strop_offload
    return True
