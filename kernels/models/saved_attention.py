"""Attention outputs kept across an offloaded layer's recompute, so backward does not run attention forward twice.

A checkpointed layer is recomputed in backward only to rebuild what its ops save. Attention's backward needs q, k,
v, its output o and the log-sum-exp ``lse`` of each query row; the recompute rebuilds q, k, v with the projections
and RoPE (cheap at any length) and o, lse with attention's forward, which at long context is most of the layer:
at 128K tokens on an 8B Llama the causal attention forward is 2·T²·d ≈ 141 TFLOP per layer against ≈ 57 TFLOP
for all the layer's projections. This module keeps o and lse from the layer's first forward instead:

    forward (no grad)   o, lse = attention(q, k, v); o and lse go to pinned host memory on the offloader's side
                        stream, as the layer input does (o: B·T·H·d·2 bytes, the size of the layer input; lse:
                        B·H·T·4 bytes)
    backward            their reload starts when the layer above (in forward order, the next) ends its attention
                        backward, into the memory its o and lse leave: it overlaps the rest of that layer's backward
                        (RoPE, the q/k/v projections and norm) and this layer's norm and q/k/v recompute. A layer
                        with no such neighbour (the last one) reloads as its recompute starts
    recompute           attention's forward is replaced by a node that returns the reloaded o and whose backward is
                        attention's backward on (q, k, v, o, lse)

The gradients are those of attention's forward and backward run once: q, k, v are recomputed bitwise (the same
ops on the same input), o and lse are the forward's own. GPU memory at the step's peak is unchanged: the reloaded o
takes the place of the o the recompute would have made, and it is reloaded only when the layer above has freed its
own o (its attention backward done, past the MLP backward, where a layer's backward holds the most).

What it costs and saves: pinned host memory for every offloaded layer's o and lse, and more device-to-host copies
in the forward, against one attention forward per layer in the recompute. The saving grows with T² and the cost
with T; reloaded as above, the copies cost less than the skipped forwards at a few thousand tokens per row too. The
figures: bench/RESULTS.md, "attention outputs kept for the recompute (`save_attention`), at 16K and 128K tokens"
and "The attention output kept for the recompute, reloaded one layer early". STANDARD and LONG_CONTEXT both turn it
on where the host has room for it (``MemoryFeatures.save_attention``, ``apply_memory_mode``'s host-room rule).

Where it applies (anything else runs the model's attention interface as usual and the reason is logged once):
``config._attn_implementation == "sdpa"`` (whose semantics this reproduces), causal self-attention over the whole
sequence (no mask tensor: HF passes None when ``is_causal`` covers it), no sliding window shorter than the
sequence, no soft-cap, no dropout, and an attention kernel pair that returns lse: cuDNN's (what SDPA picks on
Hopper) or FlashAttention-2's on CUDA, the flash kernel on the CPU (tests). The layer's input must have been
offloaded (for a layer kept on the device, recomputing is what plain checkpointing does).
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .host_pool import HostPool

__all__ = ["AttentionSaves", "attention_call", "recording", "replaying"]

logger = logging.getLogger("strop.kernels")


@dataclass
class _Saved:
    """One attention call's saved o and lse: on the host (``host``), then reloading or on the device (``device``)."""

    kernel: str
    host: list[torch.Tensor] = field(default_factory=list)
    device: list[torch.Tensor] = field(default_factory=list)
    ready: torch.cuda.Event | None = None
    extra: tuple = ()

    def wait(self) -> None:
        if self.ready is not None:
            torch.cuda.current_stream(self.device[0].device).wait_event(self.ready)
            self.ready = None


@dataclass
class AttentionSaves:
    """The attention outputs of one checkpointed layer call, in call order (one per attention module).

    ``prev``: the saves of the layer call before this one in the forward (whose backward comes next), reloaded
    as this layer's attention backward ends (module docstring)."""

    pool: HostPool
    saved: list[_Saved] = field(default_factory=list)
    cursor: int = 0
    prev: weakref.ref[AttentionSaves] | None = None
    # host bytes the saves leave free for later layer inputs (ActivationOffloader.attention_saves)
    reserve: int = 0

    def keep(self, s: _Saved, tensors: tuple[torch.Tensor, ...]) -> None:
        """Start copying ``tensors`` of ``s`` to the host (forward)."""
        off = self.pool
        for t in tensors:
            s.host.append(off.copy_to_host(t))
            off.hold_host(t.numel() * t.element_size(), t.is_cuda)

    def reload(self) -> None:
        """Start reloading every saved tensor not reloading yet (as the layer above ends its attention backward, or
        as this layer's recompute starts)."""
        off = self.pool
        for s in self.saved:
            if not s.host:
                continue
            for t in s.host:
                buf, s.ready = off.copy_to_device(t, s.extra[0])
                s.device.append(buf)
                off.release_host(t.numel() * t.element_size(), buf.is_cuda)
            s.host = []

    def __del__(
        self,
    ) -> None:  # a graph freed without backward (eval with grad on, an error) returns its host memory
        with contextlib.suppress(Exception):
            for s in self.saved:
                for t in s.host:
                    self.pool.release_host(t.numel() * t.element_size(), t.is_pinned())
                s.host = []

    def take(self) -> _Saved:
        if self.cursor >= len(self.saved):
            raise RuntimeError("saved attention: the recompute ran more attention calls than the forward")
        s = self.saved[self.cursor]
        self.cursor += 1
        if s.host:
            self.reload()
        s.wait()
        return s


@dataclass
class _Mode:
    saves: AttentionSaves
    replay: bool


_MODE: contextvars.ContextVar[_Mode | None] = contextvars.ContextVar("strop_saved_attention", default=None)
_LOGGED: set[str] = set()
_CUDNN_REFUSED: set[tuple] = set()  # (heads, kv heads, head dim, dtype) cuDNN's attention refused


@contextlib.contextmanager
def recording(saves: AttentionSaves | None) -> Iterator[None]:
    """Around a checkpointed layer's forward (no grad): attention calls that qualify save o and lse in ``saves``."""
    if saves is None:
        yield
        return
    token = _MODE.set(_Mode(saves, replay=False))
    try:
        yield
    finally:
        _MODE.reset(token)


@contextlib.contextmanager
def replaying(saves: AttentionSaves | None) -> Iterator[None]:
    """Around the layer's recompute: the saved attention calls return their saved o (reload started here)."""
    if saves is None or not saves.saved:
        yield
        return
    saves.reload()
    saves.cursor = 0
    token = _MODE.set(_Mode(saves, replay=True))
    try:
        yield
    finally:
        _MODE.reset(token)
        saves.saved.clear()


def _log_once(reason: str) -> None:
    if reason not in _LOGGED:
        _LOGGED.add(reason)
        logger.info("strop.kernels saved attention: recomputing attention (%s)", reason)


def _reason(
    module: Any, q: torch.Tensor, k: torch.Tensor, mask: Any, dropout: float, kwargs: dict
) -> str | None:
    impl = getattr(getattr(module, "config", None), "_attn_implementation", None)
    if impl != "sdpa":
        return f"attention implementation {impl!r}, not 'sdpa'"
    if mask is not None:
        return "an attention mask tensor (padding or packing), not plain causal attention"
    if dropout:
        return "attention dropout"
    if not getattr(module, "is_causal", True) or q.shape[2] <= 1:
        return "not causal self-attention over a sequence"
    window = kwargs.get("sliding_window")
    if window is not None and window < k.shape[2]:
        return "a sliding window shorter than the sequence"
    if kwargs.get("softcap") is not None:
        return "attention logit soft-capping"
    if q.shape[1] % k.shape[1]:
        return "query heads not a multiple of key/value heads"
    if q.device.type not in ("cuda", "cpu"):
        return f"tensors on {q.device.type}"
    return None


def _expand_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rep = q.shape[1] // k.shape[1]
    if rep == 1:
        return k, v
    return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)


def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None
) -> tuple[str, tuple, tuple]:
    """(kernel, (o, lse), extra for backward) of causal attention, o in [B, H, T, d]."""
    aten = torch.ops.aten
    if q.device.type == "cpu":
        k, v = _expand_kv(q, k, v)
        o, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, True, scale=scale)
        return "cpu_flash", (o, lse), (q.device,)
    shape = (q.shape[1], k.shape[1], q.shape[-1], q.dtype)  # what cuDNN accepts or refuses, every layer alike
    if torch.backends.cuda.cudnn_sdp_enabled() and shape not in _CUDNN_REFUSED:
        try:
            r = aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, True, False, scale=scale)
            return "cudnn", (r[0], r[1]), (q.device, r[6], r[7], r[2], r[3], r[4], r[5])
        except RuntimeError as e:  # e.g. a head count or dtype cuDNN does not take: asked once per shape
            _CUDNN_REFUSED.add(shape)
            _log_once(f"cuDNN attention refused ({str(e).splitlines()[0][:120]}); FlashAttention-2 instead")
    k, v = _expand_kv(q, k, v)
    r = aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True, False, scale=scale)
    return "flash", (r[0], r[1]), (q.device, r[2], r[3], r[4], r[5], r[6], r[7])


def _backward(s: _Saved, g: torch.Tensor, q, k, v, o, lse, scale):
    aten = torch.ops.aten
    if s.kernel == "cudnn":
        _, seed, offset, cq, ck, mq, mk = s.extra
        # no bias: the schema's non-optional attn_bias takes None as the undefined tensor autograd passes
        return aten._scaled_dot_product_cudnn_attention_backward(
            g, q, k, v, o, lse, seed, offset, None, cq, ck, mq, mk, 0.0, True, scale=scale
        )
    ke, ve = _expand_kv(q, k, v)
    if s.kernel == "cpu_flash":
        dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
            g, q, ke, ve, o, lse, 0.0, True, scale=scale
        )
    else:
        _, cq, ck, mq, mk, seed, offset = s.extra
        dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
            g, q, ke, ve, o, lse, cq, ck, mq, mk, 0.0, True, seed, offset, scale=scale
        )
    rep = q.shape[1] // k.shape[1]
    if rep > 1:  # the expanded heads' gradients summed back onto their key/value head
        b, _, t, d = dk.shape
        dk = dk.view(b, k.shape[1], rep, t, d).sum(2)
        dv = dv.view(b, v.shape[1], rep, t, d).sum(2)
    return dq, dk, dv


class _SavedAttentionFunction(torch.autograd.Function):
    """Returns the saved o; backward is attention's backward on (q, k, v, o, lse)."""

    @staticmethod
    def forward(ctx, q, k, v, holder, scale):
        s: _Saved = holder[0]
        o, lse = s.device[0], s.device[1]
        del s.device[:2]
        ctx.info, ctx.scale, ctx.o, ctx.lse, ctx.saves = s, scale, o, lse, holder[1]
        ctx.save_for_backward(q, k, v)
        return o.view_as(o)

    @staticmethod
    def backward(ctx, g):
        q, k, v = ctx.saved_tensors
        o, lse = ctx.o, ctx.lse
        if g.stride() != o.stride():  # the kernels take dO in O's layout
            g = torch.empty_like(o).copy_(g)
        dq, dk, dv = _backward(ctx.info, g, q, k, v, o, lse, ctx.scale)
        ctx.o = ctx.lse = None
        del o, lse, g
        # the layer whose backward comes next: its o and lse start back now, into the memory this layer's just left
        prev = ctx.saves.prev() if ctx.saves.prev is not None else None
        ctx.saves = None
        if prev is not None:
            prev.reload()
        return dq, dk, dv, None, None


def attention_call(
    interface: Callable[..., Any],
    module: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    mask: Any,
    *,
    dropout: float,
    scaling: float | None,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """The attention of a patched attention forward: HF's ``interface`` unless a layer's saved output applies.

    q [B, H, T, d], k/v [B, H_kv, T, d] as HF's interfaces take them; returns (o [B, T, H, d], None) as they do.
    """
    mode = _MODE.get()
    if mode is None:
        return interface(module, q, k, v, mask, dropout=dropout, scaling=scaling, **kwargs)
    if mode.replay:
        s = mode.saves.take()
        if s.kernel == "none":
            return interface(module, q, k, v, mask, dropout=dropout, scaling=scaling, **kwargs)
        o = _SavedAttentionFunction.apply(q, k, v, [s, mode.saves], scaling)
        return o.transpose(1, 2), None
    reason = _reason(module, q, k, mask, dropout, kwargs)
    # o is q-shaped in q's dtype, lse [B, H, T] fp32
    if reason is None and not mode.saves.pool.host_room(
        (q.numel() * q.element_size(), q[..., 0].numel() * 4), q.is_cuda, reserve=mode.saves.reserve
    ):
        reason = "host memory at the offloader's host_budget_bytes: attention recomputed"
    if reason is not None:
        _log_once(reason)
        mode.saves.saved.append(_Saved("none"))
        return interface(module, q, k, v, mask, dropout=dropout, scaling=scaling, **kwargs)
    kernel, (o, lse), extra = _forward(q, k, v, scaling)
    s = _Saved(kernel, extra=extra)
    mode.saves.keep(s, (o, lse))
    mode.saves.pool.stats.attention_saved += 1
    mode.saves.saved.append(s)
    return o.transpose(1, 2), None
