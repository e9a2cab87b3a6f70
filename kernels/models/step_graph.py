"""A training micro-step replayed as a CUDA graph: ``loss = fn(*inputs); loss.backward()`` captured once per input
shape, then one launch a step instead of the host's few hundred a layer.

Why. Where a step's GPU work is short (small models, few tokens a step), the host's Python, autograd bookkeeping and
launches, a few ms a layer, set the pace, and a checkpointed layer pays them twice (forward and recompute).
Replaying captured work removes them; the measured gain is in bench/RESULTS.md (issue 39).

What is captured. The forward and the backward as one graph: ``fn``'s outputs (a loss, and any metrics computed from
the same forward, as device tensors), and the backward of the first output accumulating into the ``.grad`` of every
trainable parameter the step reaches (those an eager step of it gives a gradient; the others keep None, as eagerly).
Those gradients are allocated before the capture (zeros, the parameter's layout) and kept, so the captured
accumulation (autograd's in-place add into a defined gradient) writes fixed memory and micro-steps accumulate as eager
ones do; zero them in place between optimizer steps (:meth:`StepGraph.zero_grads`), or set them to None as optimizers
do: before each replay every such ``.grad`` is made the graphs' tensor again (zeroed where it was None, holding an
eager step's value where one made a new one), so the graph never writes into a gradient nothing reads. One graph
rather than torch's ``make_graphed_callables`` (a forward graph and a backward graph joined by an autograd Function):
gradients that a layer's backward accumulates itself are in the graph too, and the capture does not empty the pinned
host allocator's cache (``torch.cuda.graph`` does, which made the next activation offload allocate pinned host memory
anew: ``decode_step.py``); the device allocator's cache is emptied first, as there, since no cached block is released
while a capture runs. ``capture_error_mode="thread_local"``: the capturing thread's unsafe calls fail the capture.

Shapes. A graph replays fixed shapes and addresses: each distinct input signature (shapes, dtypes, devices) gets its
own graph after ``warmup`` eager steps of that signature (Triton's autotuning and the allocator settle first), up to
``max_graphs`` of them, all drawing on one private memory pool (they never replay at once); other signatures run
eagerly. Each call copies its inputs into the graph's static inputs, replays, and returns the outputs, which the next
replay of any of this object's graphs may overwrite (clone what must outlive the step). Before a capture one more
step of that signature runs on the capture stream (what a step sets up lazily for a stream is then set up outside
the capture), with the gradients set aside and put back afterwards: a capture costs a step's time once.

What cannot be captured: anything that makes the host wait on the GPU (``.item()``, ``.tolist()``, a data-dependent
shape, an event's ``query()`` or ``synchronize()``; recording and waiting on events is fine) and RNG state reads
(``torch.utils.checkpoint``'s ``preserve_rng_state``: a model without dropout, :func:`random_free`, can turn it off
exactly). The step before a capture runs as the capture will (:func:`as_if_capturing`: transformers' capture-safe
paths) with torch's sync debug mode warning: a synchronizing call there keeps the signature from being captured at
all, since a capture the driver invalidates leaves torch 2.11's generator and
allocator mid-capture (later RNG calls and ``empty_cache`` fail). A capture that fails otherwise (an RNG state read
fails cleanly) leaves the parameters and gradients as they were. Either way that step runs eagerly, no step is lost
or counted twice, every later signature runs eagerly too (no second try), and the reason is kept in
:attr:`StepGraph.reasons`. strop's offloaded checkpoint does both (its copies' backpressure queries events; it saves
the RNG state), so the trainer does not combine it with step graphs.

Other tenants. Captures (this module's and the sampler's decode step) take one process-wide lock, each on its own
stream. In torch 2.11 the default CUDA generator is marked capturing for the whole capture: another thread's CUDA RNG
call during those few hundred milliseconds (once per shape and job) raises; step graphs are opt-in.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["CAPTURE_LOCK", "StepGraph", "as_if_capturing", "random_free"]

log = logging.getLogger("strop.kernels")

# held while a CUDA graph is captured in this process (step graphs, the sampler's decode step): one capture at a
# time, and no device-cache emptying of another capture's under way
CAPTURE_LOCK = threading.Lock()


@contextlib.contextmanager
def as_if_capturing():
    """transformers' ``is_tracing`` true for the duration, as it is while a CUDA graph is captured: its code takes the
    paths that read nothing back from the device (an explicit attention mask built where an eager call would first
    ask ``attention_mask.all()``), so a step run eagerly under this shows the syncs and builds the kernels' plans
    that the captured step would. Process-wide while it lasts (another thread's transformers code takes those paths
    too: the same attention, by another kernel)."""
    import sys

    utils = sys.modules.get("transformers.utils.import_utils")
    if utils is None or not hasattr(utils, "is_cuda_stream_capturing"):
        yield
        return
    real = utils.is_cuda_stream_capturing
    utils.is_cuda_stream_capturing = lambda: True
    try:
        yield
    finally:
        utils.is_cuda_stream_capturing = real


# config keys whose positive value makes a training forward draw random numbers: dropout probabilities (attention's,
# HF's hidden dropouts; GPT-2-style ``*_pdrop``) and Mixtral's ``router_jitter_noise`` (its block scales the router's
# input by uniform noise while training)
_RANDOM_CONFIG_KEYS = ("dropout", "pdrop", "jitter")


def random_free(model: torch.nn.Module) -> bool:
    """Whether ``model``'s training forward draws no random numbers: every ``nn.Dropout`` at p = 0 (PEFT's LoRA
    dropout included) and every dropout probability or router jitter its config names 0
    (``_RANDOM_CONFIG_KEYS``). Then a checkpoint's recompute needs no saved RNG state (its default reads the CUDA
    generator's state, which a CUDA graph capture cannot: :class:`StepGraph`), and dropping it is exact."""
    for m in model.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0:
            return False
        config = getattr(m, "config", None)
        if config is not None and hasattr(config, "to_dict"):
            for key, value in config.to_dict().items():
                random = any(k in key for k in _RANDOM_CONFIG_KEYS)
                if random and isinstance(value, (int, float)) and value > 0:
                    return False
    return True


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: list[torch.Tensor]
    outputs: tuple[torch.Tensor, ...]


@dataclass
class StepStats:
    """What the steps did: replays, eager steps, captures."""

    replayed: int = 0
    eager: int = 0
    captured: list[tuple] = field(default_factory=list)


class StepGraph:
    """``step(*inputs)``: ``out = fn(*inputs)``, ``out[0].backward()``, replayed as a CUDA graph per input signature.

    Args:
        fn: the step's forward: tensors in, a tensor or a tuple of tensors out (the first a scalar loss). It must
            read nothing else that changes between steps except through ``inputs`` and the parameters' values
            (updated in place by the optimizer, which the graph reads at their fixed addresses).
        params: the trainable parameters whose ``.grad`` the backward accumulates.
        warmup: eager steps of a signature before its capture.
        max_graphs: signatures captured at most; later ones run eagerly.
    """

    def __init__(
        self,
        fn: Callable[..., torch.Tensor | tuple[torch.Tensor, ...]],
        params: Sequence[torch.nn.Parameter],
        *,
        warmup: int = 2,
        max_graphs: int = 4,
    ) -> None:
        self.fn, self.params = fn, list(params)
        self.warmup, self.max_graphs = warmup, max_graphs
        self.graphs: dict[tuple, _Graph] = {}
        self.seen: dict[tuple, int] = {}
        self.reasons: dict[tuple, str] = {}  # signatures that run eagerly, and why
        self.stats = StepStats()
        self.failed: str | None = None  # why a capture failed: every signature eager from then on
        self._pool = None
        self._stream: torch.cuda.Stream | None = None  # this object's capture stream
        self._used: list[torch.nn.Parameter] | None = None  # the parameters the step gives a gradient
        self._grads: list[torch.Tensor] | None = None  # their gradients, which every graph accumulates into

    @staticmethod
    def signature(inputs: Sequence[torch.Tensor]) -> tuple:
        return tuple((tuple(t.shape), t.dtype, t.device, t.requires_grad) for t in inputs)

    def _eager(self, inputs) -> tuple[torch.Tensor, ...]:
        out = self.fn(*inputs)
        out = out if isinstance(out, tuple) else (out,)
        out[0].backward()
        self.stats.eager += 1
        return tuple(t.detach() for t in out)

    def _why_not(self, key: tuple, inputs) -> str | None:
        if key in self.reasons:
            return self.reasons[key]
        if self.failed is not None:  # what kept one step out of a graph keeps the others out: no second try
            return self.failed
        devices = {t.device for t in inputs} | {p.device for p in self.params}
        if len(devices) != 1 or next(iter(devices)).type != "cuda":
            return f"not one CUDA device ({', '.join(sorted(str(d) for d in devices))})"
        if len(self.graphs) >= self.max_graphs:
            return f"{self.max_graphs} signatures captured already"
        return None

    def step(self, *inputs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """One micro-step: the outputs of ``fn`` (detached), gradients accumulated into ``.grad``."""
        key = self.signature(inputs)
        g = self.graphs.get(key)
        if g is None:
            reason = self._why_not(key, inputs)
            self.seen[key] = self.seen.get(key, 0) + 1
            if reason is not None:
                self.reasons.setdefault(key, reason)
                return self._eager(inputs)
            if self.seen[key] <= self.warmup:
                return self._eager(inputs)
            g = self._capture(key, inputs)
            if g is None:
                return self._eager(inputs)
        for static, x in zip(g.inputs, inputs, strict=True):
            if static.data_ptr() != x.data_ptr():
                static.copy_(x)
        self._bind_grads()
        g.graph.replay()
        self.stats.replayed += 1
        return g.outputs

    def zero_grads(self) -> None:
        """Zero every parameter's gradient in place (the graphs accumulate into these tensors)."""
        grads = [p.grad for p in self.params if p.grad is not None]
        if grads:
            torch._foreach_zero_(grads)

    def _bind_grads(self) -> None:
        """Make every gradient the step reaches the tensor the graphs add into, with the value it has: a gradient set
        to None (``zero_grad(set_to_none=True)``) is that tensor zeroed, one an eager step created is copied into it."""
        if self._grads is None:
            with torch.no_grad():
                self._grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in self._used]
        zero = []
        for p, kept in zip(self._used, self._grads, strict=True):
            if p.grad is kept:
                continue
            if p.grad is None:
                zero.append(kept)
            else:
                kept.copy_(p.grad)
            p.grad = kept
        if zero:
            torch._foreach_zero_(zero)

    def _fail(self, key: tuple, reason: str) -> None:
        self.reasons[key] = self.failed = reason
        log.warning("%s", reason)

    def _pre_step(self, static, device) -> str | None:
        """One step on the capture stream with every gradient set aside (put back after, whatever happens): which
        parameters it reaches (the first time), and whether it made the host wait (torch's sync debug mode), which a
        capture cannot take; None when it did not. The debug mode and the warnings' capture are process-wide for
        that step: another thread's sync then also counts (the signature stays eager: the safe side)."""
        held = [p.grad for p in self.params]
        for p in self.params:
            p.grad = None
        previous = torch.cuda.get_sync_debug_mode()
        try:
            with warnings.catch_warnings(record=True) as seen, as_if_capturing():
                warnings.simplefilter("always")
                torch.cuda.set_sync_debug_mode("warn")
                try:
                    out = self.fn(*static)
                    (out if isinstance(out, tuple) else (out,))[0].backward()
                    del out
                finally:
                    torch.cuda.set_sync_debug_mode(previous)
            torch.cuda.synchronize(device)
            if self._used is None:
                self._used = [p for p in self.params if p.grad is not None]
        finally:
            for p, g in zip(self.params, held, strict=True):
                p.grad = g
        # torch's warning for each synchronizing call (not its note that the debug mode is a prototype, which
        # setting the mode itself issues)
        syncs = [str(w.message) for w in seen if "called a synchronizing" in str(w.message)]
        return f"the step makes the host wait on the GPU ({syncs[0][:200]})" if syncs else None

    def _capture(self, key: tuple, inputs) -> _Graph | None:
        device = inputs[0].device
        static = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=device)
        stream = self._stream
        # autocast as the caller has it, without its cache of casts, which is emptied before the capture and before
        # it ends: a weight's cast cached by an eager step would be read by the graph as it stood then (never
        # recast at a replay, after the optimizer changed the weight), and one cached while capturing (an autocast
        # region inside fn turns caching back on) would be pool memory another of these graphs may reuse
        dev = device.type
        no_cache = torch.autocast(
            dev,
            dtype=torch.get_autocast_dtype(dev),
            enabled=torch.is_autocast_enabled(dev),
            cache_enabled=False,
        )
        with CAPTURE_LOCK:
            torch.cuda.synchronize(device)
            stream.wait_stream(torch.cuda.current_stream(device))
            try:
                with torch.cuda.stream(stream), no_cache:
                    why = self._pre_step(static, device)
                    if why is not None:
                        self._fail(key, f"not captured, eager steps: {why}")
                        return None
                    self._bind_grads()  # the graphs' gradients: allocated at the first capture, keeping their values
                    if self._pool is None:
                        self._pool = torch.cuda.graph_pool_handle()
                    torch.clear_autocast_cache()
                    torch.cuda.empty_cache()  # (the device's: no cached block is released while capturing)
                    graph = torch.cuda.CUDAGraph()
                    graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                    try:
                        out = self.fn(*static)
                        out = out if isinstance(out, tuple) else (out,)
                        out[0].backward()
                        outputs = tuple(t.detach() for t in out)
                    finally:
                        torch.clear_autocast_cache()
                        graph.capture_end()
                torch.cuda.current_stream(device).wait_stream(stream)
            except Exception as exc:
                # an uncapturable op somewhere in the step (an RNG state read fails cleanly), or the step failing
                torch.clear_autocast_cache()
                torch.cuda.synchronize(device)
                self._fail(key, f"CUDA graph capture failed, eager steps: {type(exc).__name__}: {exc}"[:500])
                return None
        g = self.graphs[key] = _Graph(graph, static, outputs)
        self.stats.captured.append(key)
        log.info("captured a training step as a CUDA graph for inputs %s", [s[0] for s in key])
        return g
