"""What the activation offloader holds between forward and backward.

``InputRecord``: one checkpointed layer's input — its pinned host copy (or the tensor itself where offload does
not apply), the forward's replay state, and its place in the reload chain. ``SavedGroup``: the saved activations
of a layer that is not recomputed (``save_layers``), packed by ``saved_tensors_hooks`` into ``SavedTensor``s with
host copies, deduplicated by memory and layout. Both keep their host copies in the offloader's :class:`~strop.kernels.models.host_pool.HostPool`.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

if TYPE_CHECKING:
    from .host_pool import HostPool


class InputRecord:
    """One checkpointed call's saved input: on the host, being reloaded, or kept on its device."""

    __slots__ = (
        "__weakref__",
        "device",
        "device_tensor",
        "host",
        "layer",
        "nbytes",
        "offloaded",
        "pool",
        "prev",
        "ready",
    )

    def __init__(self, pool: HostPool, x: torch.Tensor, layer: int | None) -> None:
        self.pool = pool
        self.layer = layer
        self.device = x.device
        self.nbytes = x.numel() * x.element_size()
        self.offloaded = False
        self.device_tensor: torch.Tensor | None = None
        self.host: torch.Tensor | None = None
        self.ready: torch.cuda.Event | None = None
        # The call checkpointed just before this one: the next one backward will most likely need.
        self.prev: weakref.ref[InputRecord | SavedGroup] | None = None

    def drop_host(self) -> None:
        if self.host is not None:
            self.host = None
            self.pool.release_host(self.nbytes, self.device.type == "cuda")

    def start_reload(self) -> None:
        """Start copying the input back to its device (a no-op when it is not on the host)."""
        if self.host is None:
            return
        self.device_tensor, self.ready = self.pool.copy_to_device(self.host, self.device)
        # The pinned block is recycled only after the copy completes (torch's host allocator records the
        # copy's stream), so the host copy can go now.
        self.drop_host()

    def prefetch(self) -> None:
        """Start reloading ahead of need, if on the host and not reloading yet (the reload chain)."""
        if self.host is not None and self.device_tensor is None:
            self.pool.event("prefetch", self.layer)
            self.start_reload()

    def __del__(
        self,
    ) -> None:  # a graph freed without backward (e.g. eval with grad on) returns its host memory
        with contextlib.suppress(Exception):
            self.drop_host()


class SavedTensor:
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

    def __init__(self, group: SavedGroup, t: torch.Tensor) -> None:
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
            self.group.pool.release_host(self.nbytes, self.device.type == "cuda")

    def __del__(self) -> None:  # a graph freed without backward returns its host memory
        with contextlib.suppress(Exception):
            self.drop_host()


def check_unmodified(t: torch.Tensor | None, saved: int) -> None:
    """Raise as autograd does when a saved tensor (None: no longer alive, nothing to check) was written to."""
    if t is not None and t._version != saved:
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"a tensor of shape {list(t.shape)} saved at version {saved} is now at version {t._version} (saved "
            "by a layer without recompute, strop.kernels.models.offload save_layers; autograd's own check cannot see "
            "through the saved-tensor hooks, so this one raises instead)"
        )


class SavedGroup:
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
        "pool",
        "prev",
        "reached",
        "shared",
    )

    def __init__(self, pool: HostPool, layer: int | None, shared: set[int]) -> None:
        self.pool = pool
        self.layer = layer
        # storage addresses of what outlives the step anyway (the layer's weights, its keyword tensors):
        # kept where they are, never copied
        self.shared = shared
        self.items: list[weakref.ref[SavedTensor]] = []
        # (data_ptr, shape, stride, dtype) -> (the tensor, its SavedTensor): dedup within the layer, and the
        # originals held until the layer's forward ends so that in-place writes to them can be checked
        self.index: dict[tuple, tuple[torch.Tensor, SavedTensor]] = {}
        self.prev: weakref.ref[Any] | None = None
        self.reached = False

    # forward
    def pack(self, t: torch.Tensor) -> tuple[SavedGroup, Any, int]:
        off = self.pool
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
            return self._keep(t, outlives)
        # The same memory seen again (the same tensor, or another view with the same layout, e.g. each
        # projection's 2-D view of the normed input): one copy. Every indexed original is held until seal,
        # so an address cannot be reused for other data in between.
        key = (t.data_ptr(), tuple(t.shape), t.stride(), t.dtype)
        hit = self.index.get(key)
        if hit is not None and hit[1].version == t._version:
            return self, hit[1], t._version
        if not off.host_room(t.numel() * t.element_size(), t.is_cuda):
            return self._keep(t, False)
        item = SavedTensor(self, t)
        item.host = off.copy_to_host(t)
        self.items.append(weakref.ref(item))
        self.index[key] = (t, item)
        s = off.stats
        s.saved_offloaded += 1
        s.offloaded_bytes += item.nbytes
        off.hold_host(item.nbytes, t.is_cuda)
        return self, item, t._version

    def _keep(self, t: torch.Tensor, outlives: bool) -> tuple[SavedGroup, Any, int]:
        """A saved tensor left where it is (see :meth:`pack`)."""
        off = self.pool
        off.stats.saved_kept += 1
        if not outlives:
            off.stats.saved_kept_bytes += t.numel() * t.element_size()
        # Detached: a saved output returned with its grad_fn would make a cycle through the graph
        # (node → packed value → tensor → node) that Python's collector cannot see, leaking the graph.
        # The detached alias shares t's version counter, so in-place writes are still seen at unpack.
        return self, t.detach(), t._version

    def seal(self) -> None:
        """End of the layer's forward: check for in-place writes after saving, drop the dedup index."""
        entries, self.index = list(self.index.values()), {}
        for t, item in entries:
            check_unmodified(t, item.version)
        self.pool.event("save:activations", self.layer)

    # backward
    @property
    def host(self) -> bool:
        """Whether some of the group's activations are still only in host memory (for the reload chain)."""
        return any(
            (i := r()) is not None and i.host is not None and i.device_tensor is None for r in self.items
        )

    def prefetch(self) -> None:
        if self.host:
            self.pool.event("prefetch", self.layer)
            self._reload(prefetched=True)

    def _reload(self, prefetched: bool) -> None:
        for r in self.items:
            item = r()
            if item is not None and item.host is not None and item.device_tensor is None:
                item.device_tensor, item.ready = self.pool.copy_to_device(item.host, item.device)
                item.drop_host()
                self.pool.stats.saved_prefetched += prefetched

    def unpack(self, handle: tuple[SavedGroup, Any, int]) -> torch.Tensor:
        _, x, version = handle
        if not self.reached:
            self.reached = True
            if self.host:
                self.pool.stats.prefetch_misses += 1
                self.pool.event("fetch:miss", self.layer)
                self._reload(prefetched=False)
            else:
                self.pool.stats.prefetch_hits += 1
                self.pool.event("fetch:hit", self.layer)
            prev = self.prev() if self.prev is not None else None
            if prev is not None:
                prev.prefetch()
        if isinstance(x, torch.Tensor):
            check_unmodified(x, version)
            return x
        check_unmodified(x.source(), x.version)
        if x.device_tensor is None:
            if x.host is None:
                raise RuntimeError("offloaded activation: neither a host nor a device copy is left")
            x.device_tensor, x.ready = self.pool.copy_to_device(x.host, x.device)
            x.drop_host()
        if x.ready is not None:
            torch.cuda.current_stream(x.device).wait_event(x.ready)
            x.ready = None
        return x.device_tensor
