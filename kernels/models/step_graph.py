"""A training micro-step replayed as a CUDA graph: ``loss = fn(*inputs); loss.backward()`` captured once per input
shape, then one launch a step instead of the host's few hundred a layer.

Why. Where a step's GPU work is short the host's dispatch sets the pace: at the Llama-3.2-1B shape and 2 × 2048 tokens
strop's step is 163 ms of which the GPU computes 54, with no waits on the GPU (bench/RESULTS.md, session 29); the
host spends ~6 ms a layer in Python, autograd and launches. Replaying captured work removes all of it.

What is captured. The forward and the backward as one graph: ``fn``'s outputs (a loss, and any metrics computed from
the same forward, as device tensors), and the backward of the first output accumulating into every trainable
parameter's ``.grad``. The gradients are allocated before the capture (zeros, the parameter's layout) and kept, so the
captured accumulation is an in-place add into fixed memory and micro-steps accumulate as eager ones do; zero them in
place between optimizer steps (:meth:`StepGraph.zero_grads`), or set them to None as optimizers do: before each
replay every ``.grad`` is made the graphs' tensor again (zeroed where it was None, holding an eager step's value where
one made a new one), so the graph never writes into a gradient nothing reads. One graph rather than torch's ``make_graphed_callables`` (a forward graph
and a backward graph joined by an autograd Function): gradients that a layer's backward accumulates itself, as strop's
offloaded checkpoint does (``offload.py``: its recompute's ``backward`` writes ``.grad`` during the outer one), are in
the graph too, and the capture neither empties the allocators' caches (``torch.cuda.graph`` does, which made the next
activation offload allocate pinned host memory anew: ``decode_step.py``) nor stops other threads' CUDA calls
(``capture_error_mode="thread_local"``: another session on the device keeps running).

Shapes. A graph replays fixed shapes and addresses: each distinct input signature (shapes, dtypes, devices) gets its
own graph after ``warmup`` eager steps of that signature (Triton's autotuning and the allocator settle first), up to
``max_graphs`` of them, all drawing on one private memory pool (they never replay at once); other signatures run
eagerly. Each call copies its inputs into the graph's static inputs, replays, and returns the outputs, which the next
replay of that graph overwrites (clone what must outlive the step). Before a capture one more step of that
signature runs on the capture stream, its gradients put back afterwards (what a step sets up lazily for a stream is
then set up outside the capture): a capture costs a step's time once.

What cannot be captured (the step then runs eagerly from there on, the reason kept in :attr:`StepGraph.reasons`):
anything that makes the host wait on the GPU (``.item()``, ``.tolist()``, a data-dependent shape, an event's
``query()`` or ``synchronize()``: recording and waiting on events is fine), RNG state reads (``torch.utils.checkpoint``'s
``preserve_rng_state``: a model without dropout, :func:`random_free`, can turn it off exactly). strop's offloaded
checkpoint does both (its copies' backpressure queries events; it saves the RNG state), so the trainer does not
combine it with step graphs. A failed capture leaves the parameters and gradients as they were; the step
it was taken for then runs eagerly, so no step is lost or counted twice, and no other signature is tried again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

__all__ = ["StepGraph", "capture_stream", "random_free"]

log = logging.getLogger("strop.kernels")

_CAPTURE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def capture_stream(device: torch.device) -> torch.cuda.Stream:
    """A side stream per device to capture CUDA graphs on (capture cannot run on the default stream), kept for the
    process (the training step's graphs here, the sampler's decode step: ``trainer_svc/core/decode_step.py``)."""
    if device not in _CAPTURE_STREAMS:
        _CAPTURE_STREAMS[device] = torch.cuda.Stream(device=device)
    return _CAPTURE_STREAMS[device]


def random_free(model: torch.nn.Module) -> bool:
    """Whether ``model``'s training forward draws no random numbers: every ``nn.Dropout`` at p = 0 (PEFT's LoRA
    dropout included) and every dropout probability its config names (attention's, HF's hidden dropouts) 0. Then a
    checkpoint's recompute needs no saved RNG state (its default reads the CUDA generator's state, which a CUDA graph
    capture cannot: :class:`StepGraph`), and dropping it is exact."""
    for m in model.modules():
        if isinstance(m, torch.nn.modules.dropout._DropoutNd) and m.p > 0:
            return False
        config = getattr(m, "config", None)
        if config is not None and hasattr(config, "to_dict"):
            for key, value in config.to_dict().items():
                if "dropout" in key and isinstance(value, (int, float)) and value > 0:
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
        self._pool = None
        self._grads: list[torch.Tensor] | None = None  # the gradients every graph accumulates into
        self.failed: str | None = None  # a capture's failure: every signature eager from then on

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
        """Make every parameter's ``.grad`` the tensor the graphs add into, with the value it has: a gradient set to
        None (``zero_grad(set_to_none=True)``) is that tensor zeroed, one an eager step created is copied into it."""
        if self._grads is None:
            with torch.no_grad():
                self._grads = [torch.zeros_like(p) if p.grad is None else p.grad for p in self.params]
        zero = []
        for p, kept in zip(self.params, self._grads, strict=True):
            if p.grad is kept:
                continue
            if p.grad is None:
                zero.append(kept)
            else:
                kept.copy_(p.grad)
            p.grad = kept
        if zero:
            torch._foreach_zero_(zero)

    def _capture(self, key: tuple, inputs) -> _Graph | None:
        device = inputs[0].device
        # the gradients the captured backward adds into: allocated at the first capture, in the parameters' layout,
        # keeping what earlier micro-steps of this optimizer step accumulated
        self._bind_grads()
        static = [x.detach().clone().requires_grad_(x.requires_grad) for x in inputs]
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        stream = capture_stream(device)
        torch.cuda.synchronize(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        # autocast as the caller has it, without its cache of casts, which is emptied before the capture and after
        # it: a weight's cast cached by an eager step would be read by the graph as it stood then (never recast at
        # a replay, after the optimizer changed the weight); one cached while capturing (an autocast region inside
        # fn turns caching back on) would hand eager code memory that only replays write
        dev = device.type
        no_cache = torch.autocast(
            dev,
            dtype=torch.get_autocast_dtype(dev),
            enabled=torch.is_autocast_enabled(dev),
            cache_enabled=False,
        )
        try:
            with torch.cuda.stream(stream), no_cache:
                # one step on the capture stream first, its gradients then put back: whatever the step sets up
                # lazily for a stream (a cuBLAS workspace, a plan) is set up outside the capture
                before = [p.grad.clone() for p in self.params]
                out = self.fn(*static)
                (out if isinstance(out, tuple) else (out,))[0].backward()
                del out
                self._bind_grads()  # (an AccumulateGrad that replaced a gradient: bound back)
                torch._foreach_copy_(self._grads, before)
                del before
                torch.clear_autocast_cache()
                graph.capture_begin(pool=self._pool, capture_error_mode="thread_local")
                try:
                    out = self.fn(*static)
                    out = out if isinstance(out, tuple) else (out,)
                    out[0].backward()
                    outputs = tuple(t.detach() for t in out)
                finally:
                    graph.capture_end()
                    torch.clear_autocast_cache()
            torch.cuda.current_stream(device).wait_stream(stream)
        except Exception as exc:  # a host sync or an uncapturable op somewhere in the step
            torch.cuda.synchronize(device)
            reason = f"CUDA graph capture failed, eager steps: {type(exc).__name__}: {exc}"[:500]
            self.reasons[key] = self.failed = reason
            log.warning("%s", reason)
            return None
        g = self.graphs[key] = _Graph(graph, static, outputs)
        self.stats.captured.append(key)
        log.info("captured a training step as a CUDA graph for inputs %s", [s[0] for s in key])
        return g
