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
default, ``host_pool.DEFAULT_MIN_OFFLOAD_BYTES``: below it a copy's latency is not hidden by the layer's
compute), and inputs already on the CPU. A layer whose keyword arguments hold a tensor that requires grad runs
``torch.utils.checkpoint`` (non-reentrant) instead, because this function returns gradients for positional
inputs only.

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

import functools
import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..lora.stash import RecomputeStash, recompute_outputs_unused, recording_for_recompute
from . import saved_attention
from .host_pool import (
    DEFAULT_MAX_INFLIGHT_BYTES,
    DEFAULT_MIN_OFFLOAD_BYTES,
    HostPool,
    OffloadStats,
)
from .offload_records import InputRecord, SavedGroup
from .replay import ReplayState, checkpoint_reference
from .saved_attention import AttentionSaves

__all__ = [
    "DEFAULT_MAX_INFLIGHT_BYTES",
    "DEFAULT_MIN_OFFLOAD_BYTES",
    "ActivationOffloader",
    "OffloadStats",
    "OffloadedCheckpointFunction",
    "offloaded_checkpoint",
]

logger = logging.getLogger("strop.kernels")


# ---- the offloader: side stream, saved inputs, reload schedule -------------------------------------------


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
        save_attention: Keep each offloaded layer's attention output and log-sum-exp in host memory, so its
            recompute skips attention's forward (``kernels/models/saved_attention.py``).
        save_qkv: With ``save_attention``, also keep the q, k, v attention read, so the recompute skips the fused
            Q/K/V projections and RoPE too (``saved_attention.py``, "q, k and v kept too").
        host_budget_bytes: The host memory the copies may hold at once (None: no bound). A copy that would pass
            it stays on its device instead: the input of a layer recomputes from device memory, an attention
            output is recomputed, an activation of a no-recompute layer stays where it is. Counted as the pinned
            allocator holds them (blocks rounded up to a power of two).
        trace: Record the schedule in ``stats.trace``.
    """

    def __init__(
        self,
        *,
        min_offload_bytes: int = DEFAULT_MIN_OFFLOAD_BYTES,
        offload_cpu_tensors: bool = False,
        preserve_rng_state: bool = True,
        max_inflight_bytes: int = DEFAULT_MAX_INFLIGHT_BYTES,
        save_attention: bool = False,
        save_qkv: bool = False,
        host_budget_bytes: int | None = None,
        trace: bool = False,
    ) -> None:
        self.pool = HostPool(
            min_offload_bytes=min_offload_bytes,
            offload_cpu_tensors=offload_cpu_tensors,
            max_inflight_bytes=max_inflight_bytes,
            host_budget_bytes=host_budget_bytes,
            trace=trace,
        )
        self.save_attention = save_attention
        self.save_qkv = save_qkv
        self.preserve_rng_state = preserve_rng_state
        self._last: weakref.ref[InputRecord | SavedGroup] | None = None
        self._last_attention: weakref.ref[AttentionSaves] | None = None
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
            f"saved_kept={s.saved_kept}, saved_prefetched={s.saved_prefetched}, copy_waits={s.copy_waits}, "
            f"attention_saved={s.attention_saved}, qkv_saved={s.qkv_saved}, host_full={s.host_full}, host_budget_bytes={self.host_budget_bytes})"
        )

    # -- the pool's parts the offloader reads

    @property
    def stats(self) -> OffloadStats:
        return self.pool.stats

    @property
    def host_budget_bytes(self) -> int | None:
        return self.pool.host_budget_bytes

    def _log_once(self, reason: str, level: int = logging.INFO) -> None:
        if reason not in self._logged:
            self._logged.add(reason)
            logger.log(level, "strop.kernels offload: %s", reason)

    def keep_reason(self, x: torch.Tensor, offload: bool) -> str | None:
        """Why ``x`` stays on its device (plain recompute), or None when it goes to host memory."""
        pool = self.pool
        if not offload:
            return "last checkpointed layer keeps its input on the device (backward needs it first)"
        if x.device.type == "cpu" and not pool.offload_cpu_tensors:
            return "input on the CPU (already in host memory): plain recompute"
        if x.device.type not in ("cpu", "cuda"):
            return f"input on {x.device.type}: offload supports CUDA only; plain recompute"
        nbytes = x.numel() * x.element_size()
        if nbytes < pool.min_offload_bytes:
            return f"input of {nbytes} bytes < min_offload_bytes={pool.min_offload_bytes}: plain recompute"
        if not pool.host_room(nbytes, x.is_cuda):
            return (
                f"host memory at host_budget_bytes={pool.host_budget_bytes}: plain recompute from the device"
            )
        return None

    # -- forward: save

    def attention_saves(self, reserve: int = 0, on_device: bool = False) -> AttentionSaves:
        """A layer call's saved attention outputs, linked to the previous call's, whose reload the end of its
        attention backward starts (``kernels/models/saved_attention.py``). ``reserve``: host bytes its saves must
        leave free for the layer inputs the forward offloads after it (inputs come first: an input kept on the
        device costs device memory, an attention output not saved only its recompute). ``on_device``: a resident
        layer's, held on the device (no copy, no host room needed)."""
        saves = AttentionSaves(
            self.pool, prev=self._last_attention, reserve=reserve, qkv=self.save_qkv, on_device=on_device
        )
        self._last_attention = weakref.ref(saves)
        return saves

    def _link(self, item: InputRecord | SavedGroup) -> None:
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
        group = SavedGroup(self.pool, layer, shared)
        self._link(group)
        try:
            with torch.autograd.graph.saved_tensors_hooks(group.pack, group.unpack):
                out = function(*args)
        finally:
            group.seal()  # also on an exception (e.g. OOM): no index left to hold host copies in a cycle
        return out

    def save(self, x: torch.Tensor, layer: int | None, offload: bool) -> InputRecord:
        """Start saving ``x`` (before the layer runs, so a device-to-host copy overlaps its compute)."""
        rec = InputRecord(self.pool, x, layer)
        self._link(rec)
        reason = self.keep_reason(x, offload)
        if reason is not None:
            self.stats.kept[reason] = self.stats.kept.get(reason, 0) + 1
            self._log_once(reason)
            rec.device_tensor = x.detach()
            self.pool.event("save:keep", layer)
            return rec
        host = self.pool.copy_to_host(x)
        rec.host, rec.offloaded = host, True
        s = self.stats
        s.offloaded += 1
        s.offloaded_bytes += rec.nbytes
        self.pool.hold_host(rec.nbytes, x.is_cuda)
        self.pool.event("save:offload", layer)
        return rec

    # -- backward: reload

    def fetch(self, rec: InputRecord | None) -> torch.Tensor:
        """The saved input on its device, ready for the compute stream; prefetches the previous call's."""
        if rec is None:
            raise RuntimeError(
                "offloaded checkpoint: backward through this layer ran twice (retain_graph); offloaded "
                "checkpointing frees the saved layer input after the first backward"
            )
        if not rec.offloaded:
            self.pool.event("fetch:kept", rec.layer)
        elif rec.device_tensor is not None:
            self.stats.prefetch_hits += 1
            self.pool.event("fetch:hit", rec.layer)
        else:
            self.stats.prefetch_misses += 1
            self.pool.event("fetch:miss", rec.layer)
            rec.start_reload()
        x, ready = rec.device_tensor, rec.ready
        rec.device_tensor, rec.ready = None, None
        if x is None:
            raise RuntimeError(
                "offloaded checkpoint: the saved layer input was already consumed (backward twice?)"
            )
        # Issue the next reload before this layer's recompute is queued, so the two overlap.
        prev = rec.prev() if rec.prev is not None else None
        if prev is not None:
            prev.prefetch()
        if ready is not None:
            torch.cuda.current_stream(rec.device).wait_event(ready)
        return x

    # -- the checkpoint function HF calls

    def torch_checkpoint_reason(self, function: Callable[..., Any], args: tuple) -> str | None:
        """Why this call must go to ``torch.utils.checkpoint`` instead, or None."""
        if not args or not isinstance(args[0], torch.Tensor) or not args[0].is_floating_point():
            return "first positional argument is not a floating tensor"
        recorded = _recorded_outputs()
        if recorded:
            # HF records these (an MoE's router logits, for the aux loss) with hooks inside the layer; under this
            # function's no-grad forward they would be recorded detached and their loss would give no gradient
            return f"the layer's {', '.join(recorded)} are recorded by HF's output hooks for the loss"
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
        inputs_after: int = 0,
        resident: bool = False,
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
            inputs_after: Layer inputs the forward offloads after this one, for which this layer's saved attention
                output leaves host room (``attention_saves``).
            resident: With ``offload=False``, the layer's saved attention (o, lse and q, k, v, as the offloaded
                layers save them) stays on the device: its recompute skips them as theirs does, and nothing of it
                crosses the host link (``enable_offloaded_checkpointing``'s ``resident_layers``).
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
        meta: dict[str, Any] = {"inputs_after": inputs_after, "resident": resident and not offload}
        device = args[0].device
        if device not in self._anchors:
            self._anchors[device] = torch.empty(0, device=device, requires_grad=True)
        anchor = self._anchors[device]
        outputs = OffloadedCheckpointFunction.apply(function, self, (layer, offload, meta), anchor, *args)
        return _unflatten(outputs, meta["template"])


def _recorded_outputs() -> list[str]:
    """What HF's output capturing records from inside the running layer (hidden states are recorded outside it)."""
    try:
        from transformers.utils.output_capturing import _active_collector
    except ImportError:  # a transformers without output capturing records nothing this way
        return []
    collected = _active_collector.get()
    return sorted(
        k for k in collected or () if not k.startswith("_") and k not in ("hidden_states", "attentions")
    )


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
        ctx.attention = None
        if offloader.save_attention and ctx.record.offloaded:
            block = offloader.pool.block(ctx.record.nbytes, x.is_cuda)
            ctx.attention = offloader.attention_saves(reserve=meta["inputs_after"] * block)
        elif offloader.save_attention and meta["resident"]:
            ctx.attention = offloader.attention_saves(on_device=True)
        elif offloader.save_attention:
            # a layer that saves nothing (its input kept on the device) ends the chain: the saves of the layer below
            # it reload at their own recompute, not while the layers above it hold theirs
            offloader._last_attention = None
        ctx.stash = RecomputeStash()  # what the layer's ops hand their recompute (kernels/lora/stash.py)
        with torch.no_grad(), saved_attention.recording(ctx.attention), recording_for_recompute(ctx.stash):
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
        # the recompute rebuilds what the layer's ops saved; its output's value is never read (only its graph),
        # so a patched MLP that is the layer's last op skips its down projection (kernels/lora/mlp.py)
        with (
            ctx.replay.replay(),
            torch.enable_grad(),
            recompute_outputs_unused(ctx.stash),
            saved_attention.replaying(ctx.attention),
        ):
            out = ctx.function(*args)
        ctx.attention = ctx.stash = None
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
