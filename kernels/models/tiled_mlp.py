"""Tiled MLP: a token-wise MLP run over sequence chunks, recomputed chunk by chunk in backward.

What. For an MLP ``y = f(x)`` that acts on each token independently (Llama's
``down(act(gate(x)) · up(x))``, with or without LoRA, HF's or a fused one), split the N = B·T tokens
into C chunks of ⌈N/C⌉ rows and

    forward    y[c] = f(x[c]) under no_grad, chunk by chunk, written into one output buffer
    backward   for each chunk: recompute y[c] = f(x[c]) with grad, then
               dx[c]  = ∂⟨dy[c], y[c]⟩/∂x[c]
               dθ    += ∂⟨dy[c], y[c]⟩/∂θ      for every parameter θ of f that requires grad (LoRA A/B),
                                               accumulated in fp32 across chunks

This is the untiled gradient with the token sum regrouped per chunk (fp32: equal to ≈1e-6 relative).

Why. An MLP's intermediates are ``[tokens, intermediate]``: gate, up, act(gate) and their product, each
3.5× the hidden width on Llama-3-8B. At 256K tokens one of them is 7 GiB in bf16, and autograd keeps
about four for backward, more than the checkpointed layer inputs of the whole model. Tiled, a chunk of
c tokens needs 4·c·I·itemsize in forward, about twice that in backward, whatever the sequence length.

Memory accounting: saved for backward are x (the MLP input, ``[N, H]``, which the untiled MLP saves too)
and, per chunk, the RNG state (so dropout replays the same mask). Live at once: one chunk's
intermediates, the full output y (forward) or dx (backward), and the fp32 parameter-gradient
accumulators (LoRA-sized).

Cost: one extra MLP forward per step (each chunk runs forward twice; untiled runs it once then
differentiates the saved graph). Use tiling where the memory is needed: ``num_chunks="auto"`` picks 1 (no
tiling, ``f(x)`` called directly) until a chunk's intermediates pass ``budget_bytes``.

Under strop's activation checkpointing the layer's recompute in backward would run the tiled forward once more,
but it saves nothing a chunk needs except x, and the recompute never reads the layer's output (only its graph:
``kernels/lora/mlp.py``, "Recompute without the down projection"). Where the MLP's output is the layer's output
up to the residual add (HF's Llama-family layer; not Gemma's, whose post-feedforward norm saves it), and no
dropout draws random numbers in it, :func:`enable_tiled_mlp` lets that forward skip every chunk and return
uninitialised memory of the output's shape: the backward recomputes each chunk from x as before, so the
gradients are bitwise the same, for one MLP forward less per layer and step (three GEMMs over every token).
The backward's own recompute of a chunk is differentiated, never read, so it runs under the same context: a
patched (fused LoRA) MLP built to skip it (``output_unused_in_recompute``: the Llama family) skips its down
projection there. Under checkpointing a tiled MLP then costs the GEMMs of an untiled one, and holds one chunk's
backward intermediates instead of all tokens'.

The MLP is an opaque callable: anything ``f(x)`` that maps ``[..., N, H]`` to ``[..., N, H']`` token by
token, with its trainable parameters passed explicitly (taken from the module when ``f`` is an
``nn.Module`` or a bound method of one). A chunk is presented as ``[1, c, H]`` (``[c, H]`` for 2-D
input), so batch rows can share a chunk.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from strop.common.archs import ARCHS

from ..lora.stash import recompute_outputs_unused, recompute_outputs_unused_now, recording_for_recompute
from .hf import Swaps, checkpoint_layers, previous_forward, unwrap_peft
from .replay import ReplayState

__all__ = [
    "DEFAULT_CHUNK_BUDGET_BYTES",
    "TiledMLPFunction",
    "TiledMLPReport",
    "auto_num_chunks",
    "disable_tiled_mlp",
    "enable_tiled_mlp",
    "tiled_mlp",
    "tiled_mlp_reference",
]

logger = logging.getLogger("strop.kernels")

# A chunk's four [c, intermediate] forward intermediates at most ~1 GiB: 9,362 tokens of Llama-3-8B's 14,336
# in bf16 — a GEMM M dimension far past where the H200 runs at full rate, so tiling costs the recompute only.
DEFAULT_CHUNK_BUDGET_BYTES = 1 << 30
_INTERMEDIATES = 4  # gate, up, act(gate), act(gate)·up


def tiled_mlp_reference(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """The untiled MLP: ``fn(x)`` in one call, differentiated by autograd."""
    return fn(x)


def auto_num_chunks(
    n_tokens: int,
    intermediate_size: int,
    itemsize: int,
    budget_bytes: int = DEFAULT_CHUNK_BUDGET_BYTES,
) -> int:
    """Chunks needed so one chunk's forward intermediates (4 × [c, intermediate]) fit ``budget_bytes``.

    Args:
        n_tokens: Tokens through the MLP (B·T).
        intermediate_size: The MLP's inner width.
        itemsize: Bytes per element of the compute dtype (2 for bf16).
        budget_bytes: Bytes allowed for one chunk's intermediates.

    Returns:
        At least 1; 1 means no tiling.
    """
    if n_tokens < 1:
        return 1
    per_token = _INTERMEDIATES * intermediate_size * itemsize
    rows = max(1, budget_bytes // per_token)
    return max(1, math.ceil(n_tokens / rows))


def _module_of(fn: Callable) -> nn.Module | None:
    if isinstance(fn, nn.Module):
        return fn
    owner = getattr(fn, "__self__", None)
    return owner if isinstance(owner, nn.Module) else None


def _trainable_params(fn: Callable) -> list[torch.Tensor]:
    module = _module_of(fn)
    return [] if module is None else [p for p in module.parameters() if p.requires_grad]


class TiledMLPFunction(torch.autograd.Function):
    """``apply(fn, num_chunks, preserve_rng, out_features, x, *params)`` → ``fn(x)``, tiled (module docstring).

    ``out_features``: fn's output width when the caller's layer never reads fn's output in a recompute (then such
    a forward computes nothing), else None.
    """

    @staticmethod
    def forward(ctx, fn, num_chunks, preserve_rng, out_features, x, *params):
        rows = x.reshape(-1, x.shape[-1])
        view = (1,) * (x.dim() - 2) if x.dim() > 2 else ()
        n = rows.shape[0]
        bounds = _chunk_bounds(n, num_chunks)
        replays: list[ReplayState] = []
        out = None
        run = bounds
        if out_features is not None and recompute_outputs_unused_now():
            # a recompute that reads nothing of the output (module docstring): x is all backward needs
            replays = [ReplayState.capture(x.device, preserve_rng) for _ in bounds]
            out = rows.new_empty(n, out_features)
            run = []
        # the chunks recompute in this function's backward, not in the layer's: they stash nothing for it
        with torch.no_grad(), recording_for_recompute(None):
            for start, end in run:
                replays.append(ReplayState.capture(x.device, preserve_rng))
                y = fn(rows[start:end].view(*view, end - start, rows.shape[1]))
                y = y.reshape(end - start, -1)
                if out is None:
                    out = y.new_empty(n, y.shape[1])
                out[start:end] = y
        ctx.fn, ctx.bounds, ctx.replays, ctx.view = fn, bounds, replays, view
        ctx.save_for_backward(x, *params)
        return out.view(*x.shape[:-1], out.shape[1])

    @staticmethod
    def backward(ctx, dy):
        x, *params = ctx.saved_tensors
        need_x = ctx.needs_input_grad[4]
        need = [p for p, n in zip(params, ctx.needs_input_grad[5:], strict=True) if n]
        rows = x.detach().reshape(-1, x.shape[-1])
        dy = dy.reshape(rows.shape[0], -1)
        dx = torch.empty_like(rows) if need_x else None
        acc: list[torch.Tensor | None] = [None] * len(need)
        for (start, end), replay in zip(ctx.bounds, ctx.replays, strict=True):
            xc = rows[start:end].view(*ctx.view, end - start, rows.shape[1]).detach().requires_grad_(need_x)
            # only yc's graph is differentiated, never its value: a patched Llama-family MLP skips its down projection
            with replay.replay(), torch.enable_grad(), recompute_outputs_unused():
                yc = ctx.fn(xc)
            wrt = ([xc] if need_x else []) + need
            if not wrt:
                break
            grads = torch.autograd.grad(
                yc, wrt, dy[start:end].reshape(yc.shape), allow_unused=True, materialize_grads=True
            )
            if need_x:
                dx[start:end] = grads[0].reshape(end - start, -1)
                grads = grads[1:]
            for i, g in enumerate(grads):
                # fp32 accumulation, so the sum over chunks rounds like one untiled GEMM would
                acc[i] = g.float() if acc[i] is None else acc[i].add_(g)
            del yc, grads
        it = iter(
            a.to(p.dtype) if a is not None and a.dtype != p.dtype else a
            for a, p in zip(acc, need, strict=True)
        )
        param_grads = [next(it) if n else None for n in ctx.needs_input_grad[5:]]
        return (None, None, None, None, None if dx is None else dx.view(x.shape), *param_grads)


def _chunk_bounds(n: int, num_chunks: int) -> list[tuple[int, int]]:
    size = max(1, math.ceil(n / max(1, num_chunks)))
    return [(s, min(s + size, n)) for s in range(0, n, size)]


def tiled_mlp(
    fn: Callable[[torch.Tensor], torch.Tensor],
    x: torch.Tensor,
    *,
    num_chunks: int | str = "auto",
    params: Sequence[torch.Tensor] | None = None,
    intermediate_size: int | None = None,
    budget_bytes: int = DEFAULT_CHUNK_BUDGET_BYTES,
    preserve_rng_state: bool = True,
    output_unused_in_recompute: bool = False,
) -> torch.Tensor:
    """Run the token-wise ``fn`` over ``x`` in sequence chunks, recomputing each chunk in backward.

    Args:
        fn: The MLP: an ``nn.Module``, a bound method of one, or any callable ``[..., c, H] → [..., c, H']``.
        x: ``[B, T, H]`` (or ``[N, H]``) input; any float dtype.
        num_chunks: Chunks over the B·T tokens, or ``"auto"`` (from ``intermediate_size`` and
            ``budget_bytes``). 1 calls ``fn(x)`` directly.
        params: Tensors ``fn`` uses that may need gradients; default: the trainable parameters of the
            module behind ``fn``. Only those that require grad get one.
        intermediate_size: The MLP's inner width, for ``"auto"``; default: ``fn``'s module's
            ``intermediate_size`` attribute, else 4·H.
        budget_bytes: ``"auto"``'s bound on one chunk's forward intermediates.
        preserve_rng_state: Replay each chunk's RNG state in the recompute (dropout inside ``fn``).
        output_unused_in_recompute: The caller's layer reads nothing of the output but its graph when strop's
            checkpoint recomputes it (its last op, up to a residual add): such a forward then computes nothing
            (module docstring). Applies to modules with a ``down_proj`` and no active dropout.

    Returns:
        ``fn(x)``, shape ``[..., H']``.

    Raises:
        ValueError: On a non-positive ``num_chunks`` or an input of fewer than 2 dims.
    """
    if not isinstance(x, torch.Tensor) or x.dim() < 2:
        raise ValueError(
            f"x must be a tensor of at least 2 dims [..., tokens, hidden], got {getattr(x, 'shape', x)}"
        )
    n_tokens = x.numel() // x.shape[-1] if x.shape[-1] else 0
    if num_chunks == "auto":
        inter = intermediate_size or getattr(_module_of(fn), "intermediate_size", None) or 4 * x.shape[-1]
        itemsize = x.element_size()
        if torch.is_autocast_enabled(x.device.type):
            itemsize = torch.tensor([], dtype=torch.get_autocast_dtype(x.device.type)).element_size()
        num_chunks = auto_num_chunks(n_tokens, int(inter), itemsize, budget_bytes)
    if not isinstance(num_chunks, int) or num_chunks < 1:
        raise ValueError(f"num_chunks must be a positive int or 'auto', got {num_chunks!r}")
    if num_chunks == 1 or n_tokens <= 1:
        return fn(x)
    params = list(_trainable_params(fn) if params is None else params)
    if not torch.is_grad_enabled() or not (x.requires_grad or any(p.requires_grad for p in params)):
        # Nothing to differentiate: the chunked forward alone (inference at long context).
        with torch.no_grad():
            return TiledMLPFunction.forward(_NoCtx(), fn, num_chunks, False, None, x)
    if output_unused_in_recompute and not _draws_random_numbers(fn):
        out_features = _out_features(fn)
    else:
        out_features = None
    return TiledMLPFunction.apply(fn, num_chunks, preserve_rng_state, out_features, x, *params)


def _draws_random_numbers(fn: Callable) -> bool:
    """Whether ``fn``'s module has an active dropout (its chunks' RNG states must come from running them)."""
    module = _module_of(fn)
    if module is None:
        return True  # an opaque callable: assume it may
    return any(isinstance(m, nn.Dropout) and m.p > 0 and m.training for m in module.modules())


def _out_features(fn: Callable) -> int | None:
    """The output width of a gated MLP module (its ``down_proj``), or None when it cannot be told."""
    down = getattr(_module_of(fn), "down_proj", None)
    width = getattr(down, "out_features", None)
    return width if isinstance(width, int) else None


class _NoCtx:
    """Stands in for autograd's ctx when the forward runs without a graph."""

    def save_for_backward(self, *tensors: torch.Tensor) -> None:
        pass


# ---- installing on a model -------------------------------------------------------------------------------


@dataclass
class TiledMLPReport:
    """What :func:`enable_tiled_mlp` tiled and what it left alone.

    Attributes:
        tiled: Names of the MLP modules whose forward now runs tiled.
        skipped: Module name → reason it was left alone.
        num_chunks: The chunk setting (an int, or ``"auto"``).
    """

    tiled: list[str] = field(default_factory=list)
    skipped: dict[str, str] = field(default_factory=dict)
    num_chunks: int | str = "auto"


def _mlp_modules(model: nn.Module) -> list[tuple[str, nn.Module, nn.Module]]:
    """(name, the ``mlp`` child, its decoder layer) of every decoder layer (Llama, Mistral, Qwen2/3, Gemma name
    it so)."""
    layers = {id(m) for m in checkpoint_layers(model)}
    return [
        (f"{name}.mlp" if name else "mlp", module.mlp, module)
        for name, module in model.named_modules()
        if id(module) in layers and isinstance(getattr(module, "mlp", None), nn.Module)
    ]


def enable_tiled_mlp(
    model: nn.Module,
    num_chunks: int | str = "auto",
    *,
    budget_bytes: int = DEFAULT_CHUNK_BUDGET_BYTES,
) -> TiledMLPReport:
    """Run every decoder layer's MLP tiled over sequence chunks; reversible with :func:`disable_tiled_mlp`.

    The MLP's current ``forward`` (HF's, PEFT's LoRA layers inside it, or strop's patched one: call
    ``patch_model`` first, since it leaves an MLP whose forward was already replaced on the reference path)
    becomes the opaque ``fn``; calls with extra arguments run it untiled.

    Args:
        model: An HF model or a PEFT model around one.
        num_chunks: Chunks per call, or ``"auto"`` (from each call's token count and the MLP's
            ``intermediate_size``).
        budget_bytes: ``"auto"``'s bound on one chunk's forward intermediates.

    Returns:
        A :class:`TiledMLPReport`.
    """
    if not (num_chunks == "auto" or (isinstance(num_chunks, int) and num_chunks >= 1)):
        raise ValueError(f"num_chunks must be a positive int or 'auto', got {num_chunks!r}")
    hf = unwrap_peft(model)
    if "_strop_tiled_mlp" in hf.__dict__:
        disable_tiled_mlp(model)
    swaps = Swaps("tiled")
    report = TiledMLPReport(num_chunks=num_chunks)
    arch = ARCHS.get(getattr(getattr(hf, "config", None), "model_type", None))
    for name, mlp, layer in _mlp_modules(hf):
        # HF's Llama-family layer ends in ``residual + mlp(...)``; Gemma's post-feedforward norm saves the output
        last_op = arch is not None and not arch.sandwich_norms and "forward" not in layer.__dict__
        if "forward" in mlp.__dict__ and getattr(mlp.__dict__["forward"], "_strop_tiled", False):
            report.skipped[name] = "already tiled"
            continue
        if "experts" in mlp._modules:
            # token-wise, but its router's logits are recorded once per call for the load-balancing loss (chunks
            # would record one entry each) and Mixtral's jitter draws random numbers
            report.skipped[name] = "mixture-of-experts block (router logits recorded per call)"
            continue
        inter = getattr(mlp, "intermediate_size", None) or getattr(
            getattr(mlp, "config", None), "intermediate_size", None
        )

        def forward(self, x, *args, _inter=inter, _last=last_op, **kwargs):
            owner, prev = previous_forward(self, "tiled")
            if not owner.active or args or kwargs or not isinstance(x, torch.Tensor) or x.dim() < 2:
                return prev(x, *args, **kwargs)
            return tiled_mlp(
                prev,
                x,
                num_chunks=num_chunks,
                params=_trainable_params(self),
                intermediate_size=_inter,
                budget_bytes=budget_bytes,
                output_unused_in_recompute=_last,
            )

        forward._strop_tiled = True
        swaps.forward(mlp, forward)
        report.tiled.append(name)
    if not report.tiled and not report.skipped:
        report.skipped["model"] = "no decoder layer with an `mlp` submodule"
    hf._strop_tiled_mlp = swaps
    for name, why in report.skipped.items():
        logger.info("strop.kernels tiled_mlp: %s left untiled: %s", name, why)
    return report


def disable_tiled_mlp(model: nn.Module) -> bool:
    """Undo :func:`enable_tiled_mlp`. A forward wrapped again by someone else after ours stays, switched to
    pass-through. Returns True if tiling was installed."""
    swaps: Swaps | None = unwrap_peft(model).__dict__.pop("_strop_tiled_mlp", None)
    if swaps is None:
        return False
    swaps.undo()
    return True
