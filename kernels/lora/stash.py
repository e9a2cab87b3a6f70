"""What a checkpointed layer's forward hands its recompute: small values its ops computed, taken back instead of
computed again.

A checkpointed layer runs its forward twice: once without grad (strop's checkpoint, ``kernels/models/offload.py``)
and again in backward to rebuild what its ops save. The second run computes the same values from the same inputs,
and some of them cost host launches or device passes out of proportion to their size:

    the adapters' factors in the compute dtype   casts (and the stacked A) of every LoRA projection: ~16 kernel
                                                 launches a layer, values of the adapters' size (2.6 MiB a layer
                                                 of an 8B model at r = 16)
    the down adapter's u_d = h A_dᵀ               an activation pass over [N, I] and a GEMM reading h, for N·r
                                                 values (``kernels/lora/mlp.py``)
    each projection's spec (base, active          some twenty attribute and dict look-ups a projection in Python
    adapter, scale: ``models/proj_spec.py``)      (``models/patched_forwards.py``), no device work

Under :func:`recording_for_recompute` (around the first run) the ops :func:`stash` such values in a
:class:`RecomputeStash`; under :func:`recompute_outputs_unused` (around the recompute) they :func:`take_stashed` them
back. Every item is filed under a tag naming what it stands for: the op, the identity of the parameters it was made
from, its shapes; a take finds the items of its tag first in, first out, and None where there is none (the op then
computes the value, as without a stash). The tag holds no parameter version: FSDP2 gathers a sharded parameter
again for the backward, into the same tensor, which counts as a write; the values are the forward's either way.
The values taken are the ones the recompute would compute (the same ops on the same inputs and parameters), so the
gradients do not change by a bit. The stash lives on the layer's checkpoint node and is freed with it.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
from collections.abc import Iterator
from typing import Any

__all__ = [
    "RecomputeStash",
    "recompute_outputs_unused",
    "recompute_outputs_unused_now",
    "recording_for_recompute",
    "stash",
    "take_stashed",
]


class RecomputeStash:
    """Values the ops of a checkpointed layer computed in its forward, for the same ops in its recompute: filed
    by tag, first in, first out under each tag."""

    def __init__(self) -> None:
        self._items: dict[tuple, collections.deque[Any]] = {}

    def __len__(self) -> int:
        return sum(len(q) for q in self._items.values())

    def put(self, tag: tuple, value: Any) -> None:
        self._items.setdefault(tag, collections.deque()).append(value)

    def take(self, tag: tuple) -> Any:
        """The oldest item filed under ``tag``, or None (the op computes the value itself)."""
        queue = self._items.get(tag)
        if not queue:
            return None
        value = queue.popleft()
        if not queue:
            del self._items[tag]
        return value


# The stash a checkpointed layer's forward puts into (None: nothing is stashed), and, during its recompute,
# a one-item tuple with the stash to take from (None when the recompute has none).
_RECORDING: contextvars.ContextVar[RecomputeStash | None] = contextvars.ContextVar(
    "strop_recompute_recording", default=None
)
_OUTPUTS_UNUSED: contextvars.ContextVar[tuple[RecomputeStash | None] | None] = contextvars.ContextVar(
    "strop_recompute_outputs_unused", default=None
)


@contextlib.contextmanager
def recording_for_recompute(stash: RecomputeStash | None) -> Iterator[None]:
    """Around a checkpointed layer's forward: ops put what their recompute can take into ``stash`` (None: they
    put nothing, e.g. inside a tiled MLP, whose chunks recompute in its own backward)."""
    token = _RECORDING.set(stash)
    try:
        yield
    finally:
        _RECORDING.reset(token)


@contextlib.contextmanager
def recompute_outputs_unused(stash: RecomputeStash | None = None) -> Iterator[None]:
    """While a checkpointed layer is recomputed for its backward: its output's value will not be read, and ops
    may take what the layer's forward put in ``stash``."""
    token = _OUTPUTS_UNUSED.set((stash,))
    try:
        yield
    finally:
        _OUTPUTS_UNUSED.reset(token)


def recompute_outputs_unused_now() -> bool:
    """Whether the code running now is a recompute under :func:`recompute_outputs_unused`."""
    return _OUTPUTS_UNUSED.get() is not None


def stash(tag: tuple, value: Any) -> None:
    """Keep ``value`` for this op's recompute, when a checkpointed layer's forward is recording."""
    recording = _RECORDING.get()
    if recording is not None:
        recording.put(tag, value)


def take_stashed(tag: tuple) -> Any:
    """In a recompute: the value this op's forward stashed under ``tag``; else None (compute it)."""
    recompute = _OUTPUTS_UNUSED.get()
    if recompute is None or recompute[0] is None:
        return None
    return recompute[0].take(tag)
