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

q, k and v kept too (``save_qkv``). With o and lse saved, the recompute still runs the fused LoRA Q/K/V projections
and RoPE for one purpose: attention's backward reads q, k and v. At 16K tokens of an 8B Llama those projections are
a [16384, 4096] x [4096, 6144] GEMM, about 1.2 ms a layer on an H200, for 192 MiB of q, k and v. So the forward also
copies the q, k and v attention read (after RoPE) to pinned host memory; they reload behind o and lse, on their own
event, which only attention's backward waits for (after the layer's MLP recompute and backward); the reload starts
as the layer above begins its attention backward, not as it ends it, since the recompute no longer runs the
projections that hid the link's time for o and lse (130 MiB a layer, ~2.5 ms at the ~52 GB/s measured); and the
recompute replaces the projections and RoPE by a node (:class:`_SavedQKVFunction`) that returns them and whose
backward is RoPE's backward followed by the fused Q/K/V's (``kernels/lora/linear.py``'s ``backward_projections``, on
the same saved input x and LoRA factor u = x Aᵀ the projections' own node would hold). The gradients are bitwise
those of the recompute: the reloaded q, k, v are the values the recompute would compute (the same ops on the same
input), and the backward runs the same ops on the same gradients. Device memory at the step's peak grows by at most
one layer's q, k, v (reloaded a layer early, beside what the layer above still holds; the reloaded q, k, v otherwise
take the place of the recomputed ones, which the recompute also holds until attention's backward). Applies where the
attention forward's projections are strop's fused LoRA Q/K/V and the host has room for them beside o and lse;
elsewhere the recompute computes them. Where only strop's in-place RoPE follows the projections (Llama's family),
the q, k, v kept are RoPE's output, as above. Where a q/k norm comes between (Qwen3, Qwen3-MoE, Gemma 3), they are
the projections' own outputs, and the recompute hands them to the saved attention node as they are: its backward
runs the norm and RoPE on them (the forward's ops, under its autocast), attention's backward, then theirs. So the
reload is read where Llama's is, in attention's backward, and the recompute holds the projections alone until then.
The norm's weights must be frozen (the node returns no gradient for them); a layer whose norm trains recomputes q,
k, v.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from ..lora.linear import (
    Frozen,
    LoRAProj,
    as_rows_for,
    compute_dtype,
    factors_of,
    no_autocast,
    node_backward,
    with_factors,
)
from ..ops import varlen_attention
from ..ops.rope import rope_qk_grads
from ..ops.varlen_attention import Packing, rows_of

if TYPE_CHECKING:
    from .host_pool import HostPool

__all__ = [
    "AttentionSaves",
    "attention_call",
    "recording",
    "replayed_qkv",
    "replaying",
    "saved_qkv_projections",
]

logger = logging.getLogger("strop.kernels")


@dataclass
class _Saved:
    """One attention call's saved o and lse: on the host (``host``), then reloading or on the device (``device``);
    with ``save_qkv``, its q, k, v the same way (``qkv_host``, then ``qkv``, ready at ``qkv_ready``)."""

    kernel: str
    host: list[torch.Tensor] = field(default_factory=list)
    device: list[torch.Tensor] = field(default_factory=list)
    ready: torch.cuda.Event | None = None
    extra: tuple = ()
    qkv_host: list[torch.Tensor] = field(default_factory=list)
    qkv: list[torch.Tensor] = field(default_factory=list)
    qkv_ready: torch.cuda.Event | None = None

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
    # attention calls that qualify also keep their q, k, v (the module docstring's ``save_qkv``)
    qkv: bool = False
    # a resident layer's saves (``resident_layers``): kept where they are, on the device, never copied
    on_device: bool = False

    def keep(self, s: _Saved, tensors: tuple[torch.Tensor, ...], qkv: tuple[torch.Tensor, ...] = ()) -> None:
        """Start copying ``tensors`` (o, lse) and then ``qkv`` of ``s`` to the host (forward); on the device, hold
        them."""
        if self.on_device:
            s.device.extend(tensors)
            s.qkv.extend(qkv)
            return
        off = self.pool
        for dest, ts in ((s.host, tensors), (s.qkv_host, qkv)):
            for t in ts:
                dest.append(off.copy_to_host(t))
                off.hold_host(t.numel() * t.element_size(), t.is_cuda)

    def reload(self) -> None:
        """Start reloading every saved tensor not reloading yet (as the layer above ends its attention backward, or
        as this layer's recompute starts): each call's o and lse, then its q, k, v, which the recompute reads
        later (attention's backward), behind their own event."""
        off = self.pool
        for s in self.saved:
            for host, dest, event in ((s.host, s.device, "ready"), (s.qkv_host, s.qkv, "qkv_ready")):
                for t in host:
                    buf, ready = off.copy_to_device(t, s.extra[0])
                    setattr(s, event, ready)
                    dest.append(buf)
                    off.release_host(t.numel() * t.element_size(), buf.is_cuda)
                host.clear()

    def __del__(
        self,
    ) -> None:  # a graph freed without backward (eval with grad on, an error) returns its host memory
        with contextlib.suppress(Exception):
            for s in self.saved:
                for t in (*s.host, *s.qkv_host):
                    self.pool.release_host(t.numel() * t.element_size(), t.is_pinned())
                s.host, s.qkv_host = [], []

    def take(self) -> _Saved:
        if self.cursor >= len(self.saved):
            raise RuntimeError("saved attention: the recompute ran more attention calls than the forward")
        s = self.saved[self.cursor]
        self.cursor += 1
        if s.host or s.qkv_host:
            self.reload()
        s.wait()
        return s

    def next_qkv(self) -> list[torch.Tensor] | None:
        """In the recompute, before the next attention call: its saved q, k, v (reloading; attention's backward
        waits for them), handed over once; None where that call saved none."""
        if self.cursor >= len(self.saved):
            return None
        s = self.saved[self.cursor]
        if s.qkv_host:
            self.reload()
        qkv, s.qkv = s.qkv, []
        return qkv or None


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
    module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: Any, dropout: float, kwargs: dict
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
    # e.g. an fp32 q/k norm over 16-bit projections: the saved path's kernels take one dtype (SDPA casts itself)
    if not q.dtype == k.dtype == v.dtype:
        return "q, k, v of different dtypes"
    return None


def _expand_kv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    rep = q.shape[1] // k.shape[1]
    if rep == 1:
        return k, v
    return k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)


def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, packing: Packing | None = None
) -> tuple[str, tuple, tuple]:
    """(kernel, (o, lse), extra for backward) of causal attention, o in [B, H, T, d]; with ``packing`` (a shared
    prompt's packed sequences), that call's attention, o in [B·T, H, d] rows."""
    if packing is not None:
        o, lse, extra = varlen_attention.forward(rows_of(q), rows_of(k), rows_of(v), packing, scale)
        return "packed", (o, lse), (q.device, packing, extra)
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
    if s.kernel == "packed":
        _, packing, extra = s.extra
        grads = varlen_attention.backward(
            g, rows_of(q), rows_of(k), rows_of(v), o, lse, extra, packing, scale
        )
        b, _, n, d = q.shape
        return tuple(
            dt.view(b, n, t.shape[1], d).transpose(1, 2) for dt, t in zip(grads, (q, k, v), strict=True)
        )
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
    """Returns the saved o; backward is attention's backward on (q, k, v, o, lse). With ``prepare``, the q, k, v
    given are the projections' outputs, and backward first runs ``prepare`` on them (the q/k norm and RoPE, under the
    forward's autocast), then attention's backward, then ``prepare``'s backward."""

    @staticmethod
    def forward(ctx, q, k, v, holder, scale):
        s: _Saved = holder[0]
        o, lse = s.device[0], s.device[1]
        del s.device[:2]
        ctx.info, ctx.scale, ctx.o, ctx.lse, ctx.saves, ctx.prepare = s, scale, o, lse, holder[1], holder[2]
        if ctx.prepare is not None:  # backward runs it as the forward would have
            device = q.device.type
            ctx.autocast = (torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.save_for_backward(q, k, v)
        return o.view_as(o)

    @staticmethod
    def backward(ctx, g):
        q, k, v = ctx.saved_tensors
        o, lse = ctx.o, ctx.lse
        # the layer whose backward comes next: its o and lse start back as this attention backward ends, into the
        # memory this layer's leave; with its q, k, v saved too (save_qkv) its recompute has no projections for
        # the reload to overlap, so it starts as this backward begins, past the MLP backward (where a layer's
        # backward holds the most: its e and g, [N, I] each, against o, lse, q, k, v of the layer below)
        prev = ctx.saves.prev() if ctx.saves.prev is not None else None
        ctx.saves = None
        early = prev is not None and any(s.qkv_host for s in prev.saved)  # q, k, v it did keep
        if early:
            prev.reload()
        if ctx.info.qkv_ready is not None:  # q, k, v reloaded (save_qkv): their copies are done
            torch.cuda.current_stream(q.device).wait_event(ctx.info.qkv_ready)
            ctx.info.qkv_ready = None
        prepare, ctx.prepare = ctx.prepare, None
        # q, k, v as the projections returned them: the norm and RoPE, on a graph of their own
        if prepare is not None:
            projections = [t.detach().requires_grad_() for t in (q, k, v)]
            enabled, dtype = ctx.autocast
            with torch.enable_grad(), torch.autocast(q.device.type, dtype=dtype, enabled=enabled):
                prepared = prepare(*projections)
            q, k, v = (t.detach() for t in prepared)
        if g.stride() != o.stride():  # the kernels take dO in O's layout
            g = torch.empty_like(o).copy_(g)
        dq, dk, dv = _backward(ctx.info, g, q, k, v, o, lse, ctx.scale)
        ctx.o = ctx.lse = None
        del o, lse, g
        if prepare is not None:
            dq, dk, dv = torch.autograd.grad(prepared, projections, (dq, dk, dv))
            del prepared, projections
        if prev is not None and not early:
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
    keep_qkv: tuple[torch.Tensor, ...] = (),
    prepare: Callable[..., tuple[torch.Tensor, ...]] | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, Any]:
    """The attention of a patched attention forward: HF's ``interface`` unless a layer's saved output applies.

    q [B, H, T, d], k/v [B, H_kv, T, d] as HF's interfaces take them; returns (o [B, T, H, d], None) as they do.
    ``keep_qkv``: the fused LoRA Q/K/V's q, k, v that :func:`saved_qkv_projections` can stand for in the recompute
    (these q, k, v after in-place RoPE, or the projections' outputs before a q/k norm), so they may be saved too
    (``save_qkv``). ``prepare`` (in a recompute whose attention output and projections were saved): q, k, v are the
    projections' outputs, and ``prepare`` makes attention's q, k, v of them, run only in attention's backward.
    """
    mode = _MODE.get()
    # a call saves q, k, v only where it saves o and lse: prepare comes only with a saved output to replay
    assert prepare is None or (mode is not None and mode.replay), "prepare outside a recompute"
    if mode is None:
        return interface(module, q, k, v, mask, dropout=dropout, scaling=scaling, **kwargs)
    if mode.replay:
        s = mode.saves.take()
        if s.kernel == "none":
            assert prepare is None, "q, k, v saved for a call that saved no attention output"
            return interface(module, q, k, v, mask, dropout=dropout, scaling=scaling, **kwargs)
        o = _SavedAttentionFunction.apply(q, k, v, [s, mode.saves, prepare], scaling)
        return _output(o, q, s.kernel), None
    packing = _packing_of(mask, q, k, v)
    reason = _reason(module, q, k, v, None if packing is not None else mask, dropout, kwargs)
    saves, pool = mode.saves, mode.saves.pool
    # o is q-shaped in q's dtype, lse [B, H, T] fp32
    sizes = (q.numel() * q.element_size(), q[..., 0].numel() * 4)
    if reason is None and not saves.on_device and not pool.host_room(sizes, q.is_cuda, reserve=saves.reserve):
        reason = "host memory at the offloader's host_budget_bytes: attention recomputed"
    if reason is not None:
        _log_once(reason)
        saves.saved.append(_Saved("none"))
        return interface(module, q, k, v, mask, dropout=dropout, scaling=scaling, **kwargs)
    qkv = keep_qkv if saves.qkv else ()
    if (
        qkv
        and not saves.on_device
        and not pool.host_room(
            (*sizes, *(t.numel() * t.element_size() for t in qkv)), q.is_cuda, saves.reserve
        )
    ):
        _log_once("host memory at the offloader's host_budget_bytes: q, k, v recomputed")
        qkv = ()
    kernel, (o, lse), extra = _forward(q, k, v, scaling, packing)
    s = _Saved(kernel, extra=extra)
    saves.keep(s, (o, lse), qkv)
    pool.stats.attention_saved += 1
    pool.stats.qkv_saved += bool(qkv)
    saves.saved.append(s)
    return _output(o, q, kernel), None


def _output(o: torch.Tensor, q: torch.Tensor, kernel: str) -> torch.Tensor:
    """o as HF's attention functions return it, [B, T, H, d]."""
    if kernel == "packed":  # [B·T, H, d] rows
        b, h, n, d = q.shape
        return o.view(b, n, h, d)
    return o.transpose(1, 2)


def _packing_of(mask: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Packing | None:
    """A shared prompt's packed sequences for this call, or None: the rows its marker mask carries
    (``kernels/trainers/shared_prompt.py``'s ``Rows.packing_for``)."""
    rows = getattr(mask, "_strop_shared_prompts", None)
    return None if rows is None else rows.packing_for(q, k, v)


def replayed_qkv() -> list[torch.Tensor] | None:
    """In a layer's recompute, before its next attention call: the q, k, v that call's forward saved (``save_qkv``;
    after RoPE, or as the projections returned them), reloading: only attention's backward may read them; None
    where it saved none, or outside a recompute: compute them."""
    mode = _MODE.get()
    if mode is None or not mode.replay:
        return None
    return mode.saves.next_qkv()


class _SavedQKVFunction(torch.autograd.Function):
    """The fused LoRA Q/K/V (and RoPE, with ``cos`` and ``sin``) of a recomputed layer without their forward: returns
    the saved q, k, v; backward is RoPE's backward (``RoPEQKFunction``'s) where it stands for RoPE, then the fused
    Q/K/V's (``LoRAQKVFunction``'s), on x and u = x Aᵀ as that node saves them (module docstring)."""

    @staticmethod
    def forward(ctx, x, qa, qb, ka, kb, va, vb, frozen, qkv, cos, sin):
        projs = with_factors(frozen, (qa, qb, ka, kb, va, vb))
        factors = factors_of(projs, frozen.dtype)
        u = None if factors.a is None else x @ factors.a.t()  # as forward_projections computes it
        ctx.save_for_backward(x, u, qa, qb, ka, kb, va, vb, cos, sin)
        ctx.frozen, ctx.factors = frozen, factors
        return tuple(t.view_as(t) for t in qkv)

    @staticmethod
    def backward(ctx, dq, dk, dv):
        x, u, *factors, cos, sin = ctx.saved_tensors
        frozen, n = ctx.frozen, x.shape[0]
        projs = with_factors(frozen, factors)
        if cos is None:  # the projections' own [..., H·d] outputs
            dys = [d.reshape(n, -1).to(frozen.dtype) for d in (dq, dk, dv)]
        else:  # [B, H, T, d] back to the projections' [N, H·d] rows, as the attention forward's views return them
            dq, dk = rope_qk_grads(dq, dk, cos, sin)
            dys = [d.transpose(1, 2).reshape(n, -1).to(frozen.dtype) for d in (dq, dk, dv)]
        dx, d_a, d_b = node_backward(ctx, x, u, dys, projs)
        return dx, d_a[0], d_b[0], d_a[1], d_b[1], d_a[2], d_b[2], None, None, None, None


def saved_qkv_projections(
    hidden_states: torch.Tensor,
    specs: Sequence[LoRAProj],
    qkv: list[torch.Tensor],
    cos: torch.Tensor | None,
    sin: torch.Tensor | None,
    *,
    inplace_dx: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rope_qk`` over ``lora_qkv(hidden_states, *specs)``'s q and k, with v, in HF's [B, H, T, d] layout (without
    ``cos`` and ``sin``: ``lora_qkv``'s q, k, v as it returns them), from the saved ``qkv`` (:func:`replayed_qkv`)
    instead of computed: the graph of the two, neither's forward."""
    dtype = compute_dtype(hidden_states)
    x2, inplace = as_rows_for(hidden_states, dtype, inplace_dx)
    factors = [t for p in specs for t in (p.lora_A, p.lora_B)]
    with no_autocast(hidden_states.device.type):
        return _SavedQKVFunction.apply(x2, *factors, Frozen(specs, dtype, inplace), qkv, cos, sin)
