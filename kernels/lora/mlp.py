"""Fused LoRA gated MLP (SwiGLU / GeGLU) over frozen dense or NF4 bases, with hand-written backward.

Forward, x [N, H] (leading dims flattened), each projection as in ``kernels/lora_linear.py``
(frozen W, optional frozen bias, optional adapter A/B with scale s):

    e   = x W_gᵀ + b_g + s_g (x A_gᵀ) B_gᵀ        [N, I]   gate
    g   = x W_uᵀ + b_u + s_u (x A_uᵀ) B_uᵀ        [N, I]   up
    h   = act(e) · g                              [N, I]   act = silu (SwiGLU) or gelu / gelu-tanh (GeGLU)
    out = h W_dᵀ + b_d + s_d (h A_dᵀ) B_dᵀ        [N, H]   down

The gate and up adapters share one GEMM, u_gu = x [A_g; A_u]ᵀ. The activation is
``kernels/swiglu.py``'s fused kernel, and it adds the adapters' terms: e and g are held as the base GEMMs'
outputs x W_gᵀ + b_g and x W_uᵀ + b_u, and the kernel adds s_g u_g B_gᵀ and s_u u_u B_uᵀ in fp32 to each tile as
it reads it (``swiglu.LowRank``), in the forward and again in the backward, so e and g with their LoRA terms
are never written (nor rounded to the compute dtype) and no separate pass over them updates them.

Saved for backward: x, e, g and the small LoRA factors u_gu = x[A_g; A_u]ᵀ and u_d = h A_dᵀ. Never h:
the backward recomputes it. Every base weight is dequantized again in the backward (NF4), never kept.

Backward, dout [N, H]:

    dh   = dout W_d + g_d A_d,           g_d = s_d · dout B_d        [N, r_d]   (g_d A_d added by act_bwd)
    dB_d = s_d · doutᵀ u_d
    de, dg, h = act_bwd(dh, e, g)        one kernel, written over e, g and dh (see below)
    dA_d = g_dᵀ h
    then the gate/up pair exactly as the fused QKV of lora_linear.py, with dy = (de, dg):
    dx   = de W_g + dg W_u + [g_g g_u][A_g; A_u],   dA = [g_g g_u]ᵀ x,   dB_i = s_i dy_iᵀ u_i

In-place writes, and why each is safe: e, g and dh are private to this Function (created in its
forward/backward, never returned), and after the activation backward nothing needs e, g or dh again, so
the kernel writes de over e, dg over g and the recomputed h over dh (peak backward memory: three
[N, I] buffers). Their version counters are bumped, so a second backward through the same graph raises
rather than reading gradients as activations. dx goes into x's storage only with ``inplace_dx=True``,
under the conditions documented in ``kernels/lora_linear.py`` (last read of x is the dA GEMM).

Dtype contract: as ``kernels/lora_linear.py`` (compute dtype = autocast's, else x's; e, g, h in it).

Recompute without the down projection. A checkpointed layer is run again in backward only to rebuild what
its ops saved; its output's value is never read, only its graph. Where the MLP's output is the layer's
output up to a residual add (HF's Llama-family decoder layer: ``residual + mlp(norm(h))``, its last op), the
recompute needs x, e, g and u_d from this Function and nothing of ``out``. Under :func:`recompute_outputs_unused`
(entered by strop's checkpoint around its recompute) an MLP built with ``output_unused_in_recompute`` skips
``h W_dᵀ`` and the down adapter's product, a third of the MLP's forward GEMM work, and returns uninitialised
memory of out's shape. The gradients are bitwise those of the full recompute: backward reads only the saved
tensors, which are computed the same way. Not so in Gemma's layer, ``residual + post_feedforward_layernorm(mlp(…))``:
the norm saves the MLP's output for its backward, so ``patch_model`` never sets the flag there
(``Arch.sandwich_norms``), and its recompute computes the down projection.

Such a recompute computes h only for u_d = h A_dᵀ ([N, r]): one activation pass over [N, I] and a GEMM reading
h, ~0.7 ms a layer at 16K tokens of an 8B shape on the H200. So the forward that strop's checkpoint runs under
:func:`recording_for_recompute` stashes its u_d (N·r values, 0.5 MiB at 16K tokens and r = 16), and the recompute
takes it from the :class:`RecomputeStash` instead of making h. u_d is the same tensor the recompute would compute
(the same ops on the same inputs), so the gradients stay bitwise those of the full recompute.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
from collections.abc import Iterator, Sequence

import torch

from ..ops.swiglu import LowRank, geglu_bwd, geglu_fwd, swiglu_bwd, swiglu_fwd
from .linear import (
    Frozen,
    LoRAProj,
    as_rows_for,
    backward_projections,
    check_proj,
    compute_dtype,
    forward_projections,
    lora_linear_reference,
    lora_terms,
    mm_scaled,
    no_autocast,
    out_features,
    weight,
    with_factors,
)

__all__ = [
    "ACTIVATIONS",
    "LoRAMLPFunction",
    "RecomputeStash",
    "lora_mlp",
    "lora_mlp_reference",
    "recompute_outputs_unused",
    "recompute_outputs_unused_now",
    "recording_for_recompute",
]

class RecomputeStash:
    """Small tensors the ops of a checkpointed layer computed in its forward, for the same ops in its recompute.

    The recompute runs the layer's ops again in the same order, so the stash is first in, first out. Each item
    carries a tag (the op and the shape it stands for); a take whose tag differs from the next item's raises,
    since it would mean the recompute is not running the forward's ops.
    """

    def __init__(self) -> None:
        self._items: collections.deque[tuple[tuple, torch.Tensor]] = collections.deque()

    def __len__(self) -> int:
        return len(self._items)

    def put(self, tag: tuple, t: torch.Tensor) -> None:
        self._items.append((tag, t))

    def take(self, tag: tuple) -> torch.Tensor | None:
        """The next item, which must carry ``tag``; None when the stash is empty (the op recomputes it)."""
        if not self._items:
            return None
        got, t = self._items.popleft()
        if got != tag:
            raise RuntimeError(f"recompute stash: the recompute asked for {tag}, the forward stashed {got}")
        return t


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
    """Around a checkpointed layer's forward: ops that can spare their recompute some work stash it in ``stash``
    (None: they stash nothing, e.g. inside a tiled MLP, whose chunks recompute on their own)."""
    token = _RECORDING.set(stash)
    try:
        yield
    finally:
        _RECORDING.reset(token)


@contextlib.contextmanager
def recompute_outputs_unused(stash: RecomputeStash | None = None) -> Iterator[None]:
    """While a checkpointed layer is recomputed for its backward: its output's value will not be read, and ops
    may take what the layer's forward stashed for them in ``stash``."""
    token = _OUTPUTS_UNUSED.set((stash,))
    try:
        yield
    finally:
        _OUTPUTS_UNUSED.reset(token)


def recompute_outputs_unused_now() -> bool:
    """Whether the code running now is a recompute under :func:`recompute_outputs_unused`."""
    return _OUTPUTS_UNUSED.get() is not None


ACTIVATIONS = ("swiglu", "geglu", "geglu_tanh")


def lora_mlp_reference(
    x: torch.Tensor, gate: Sequence, up: Sequence, down: Sequence, activation: str = "swiglu"
) -> torch.Tensor:
    """The module docstring's forward in plain torch, fp32 math (fp64 for fp64 x); projections as 5-tuples."""
    e = lora_linear_reference(x, *LoRAProj(*gate))
    g = lora_linear_reference(x, *LoRAProj(*up))
    if activation == "swiglu":
        a = torch.nn.functional.silu(e)
    else:
        a = torch.nn.functional.gelu(e, approximate="tanh" if activation == "geglu_tanh" else "none")
    return lora_linear_reference(a * g, *LoRAProj(*down))


def _act_fwd(e: torch.Tensor, g: torch.Tensor, activation: str, terms: Sequence) -> torch.Tensor:
    gate_term, up_term = terms
    if activation == "swiglu":
        return swiglu_fwd(e, g, gate_term=gate_term, up_term=up_term)
    approximate = "tanh" if activation == "geglu_tanh" else "none"
    return geglu_fwd(e, g, approximate=approximate, gate_term=gate_term, up_term=up_term)


def _act_bwd(
    dh: torch.Tensor, e: torch.Tensor, g: torch.Tensor, activation: str, terms: Sequence, dh_term
) -> None:
    # de over e, dg over g, recomputed h over dh.
    gate_term, up_term = terms
    kw = dict(inplace=True, h_out=dh, gate_term=gate_term, up_term=up_term, dh_term=dh_term)
    if activation == "swiglu":
        swiglu_bwd(dh, e, g, **kw)
    else:
        geglu_bwd(dh, e, g, approximate="tanh" if activation == "geglu_tanh" else "none", **kw)


class _MLPFrozen(Frozen):
    def __init__(
        self,
        projs: Sequence[LoRAProj],
        dtype: torch.dtype,
        inplace_dx: bool,
        activation: str,
        output_unused_in_recompute: bool = False,
    ) -> None:
        super().__init__(projs, dtype, inplace_dx)
        self.activation = activation
        self.output_unused_in_recompute = output_unused_in_recompute


class LoRAMLPFunction(torch.autograd.Function):
    """The fused gated MLP of the module docstring over 2-D x in the compute dtype."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, ga, gb, ua, ub, da, db, frozen: _MLPFrozen) -> torch.Tensor:
        gate, up, down = with_factors(frozen, (ga, gb, ua, ub, da, db))
        # e and g stay the base's outputs: the activation adds their LoRA terms as it reads them
        (e, g), u_gu = forward_projections(x, (gate, up), frozen.dtype, add_lora=False)
        terms = lora_terms((gate, up), u_gu, frozen.dtype)
        recompute = _OUTPUTS_UNUSED.get() if frozen.output_unused_in_recompute else None
        if recompute is not None:
            # backward reads x, e, g, u_gu and u_d, never h: h is made only for u_d, and not at all when the
            # forward stashed u_d (see the module docstring)
            stash, u_d = recompute[0], None
            if down.lora_A is not None:
                tag = ("lora_mlp.u_d", x.shape[0], down.lora_A.shape[0])
                u_d = None if stash is None else stash.take(tag)
                if u_d is None:
                    u_d = _act_fwd(e, g, frozen.activation, terms) @ down.lora_A.to(frozen.dtype).t()
            out = e.new_empty(e.shape[0], out_features(down.base))  # never read: see the module docstring
        else:
            h = _act_fwd(e, g, frozen.activation, terms)
            (out,), u_d = forward_projections(h, (down,), frozen.dtype)
            stash = _RECORDING.get() if frozen.output_unused_in_recompute else None
            if stash is not None and u_d is not None:
                stash.put(("lora_mlp.u_d", x.shape[0], down.lora_A.shape[0]), u_d)
        ctx.save_for_backward(x, e, g, u_gu, u_d, ga, gb, ua, ub, da, db)
        ctx.frozen = frozen
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        x, e, g, u_gu, u_d, *factors = ctx.saved_tensors
        frozen = ctx.frozen
        dtype = frozen.dtype
        gate, up, down = with_factors(frozen, factors)
        with no_autocast(x.device.type):
            dout = dout.to(dtype)
            dh = dout @ weight(down.base, dtype)
            d_a_down = d_b_down = dh_term = None
            if down.lora_A is not None:
                g_d = mm_scaled(dout, down.lora_B.to(dtype), down.scaling)
                dh_term = LowRank(g_d, down.lora_A.to(dtype))  # dh += g_d A_d, added as the kernel reads dh
                d_b_down = mm_scaled(dout.t(), u_d, down.scaling).to(down.lora_B.dtype)
            _act_bwd(dh, e, g, frozen.activation, lora_terms((gate, up), u_gu, dtype), dh_term)
            for t in (e, g):
                torch.autograd.graph.increment_version(t)
            de, dg, h = e, g, dh
            if down.lora_A is not None:
                d_a_down = (g_d.t() @ h).to(down.lora_A.dtype)
            del h, dh
            dx, d_a, d_b = backward_projections(
                x, u_gu, (de, dg), (gate, up), dtype, ctx.needs_input_grad[0],
                dx_out=x if frozen.inplace_dx else None,
            )  # fmt: skip
        return dx, d_a[0], d_b[0], d_a[1], d_b[1], d_a_down, d_b_down, None


def lora_mlp(
    x: torch.Tensor,
    gate: Sequence,
    up: Sequence,
    down: Sequence,
    activation: str = "swiglu",
    *,
    inplace_dx: bool = False,
    output_unused_in_recompute: bool = False,
) -> torch.Tensor:
    """Gated MLP ``down(act(gate(x)) · up(x))`` with LoRA on any of the three projections.

    Args:
        x: ``[..., H]`` activations.
        gate: ``LoRAProj`` or tuple ``(base, lora_A, lora_B, scaling, bias)`` of the gate projection.
        up: Same for up.
        down: Same for down (input width I).
        activation: ``"swiglu"`` (silu), ``"geglu"`` (erf gelu) or ``"geglu_tanh"``.
        inplace_dx: Let the backward write dx into x's storage (see ``kernels/lora_linear.py``).
        output_unused_in_recompute: The caller's layer reads nothing of the output but its graph when
            recomputed for backward (the output is the layer's last op but a residual add): under
            :func:`recompute_outputs_unused` the down projection is skipped (module docstring).

    Returns:
        ``[..., H]`` in the compute dtype (autocast's, else x's).

    Raises:
        TypeError, ValueError: On unsupported weights, mismatched shapes/devices, a trainable base, or
            an unknown activation.
    """
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    projs = [LoRAProj(*p) for p in (gate, up, down)]
    projs = [p._replace(scaling=float(p.scaling)) for p in projs]
    check_proj(projs[0], "gate", x.shape[-1], x.device)
    check_proj(projs[1], "up", x.shape[-1], x.device)
    if out_features(projs[1].base) != out_features(projs[0].base):
        raise ValueError(f"up has {out_features(projs[1].base)} outputs, gate {out_features(projs[0].base)}")
    check_proj(projs[2], "down", out_features(projs[0].base), x.device)
    dtype = compute_dtype(x)
    x2, inplace = as_rows_for(x, dtype, inplace_dx)
    factors = [t for p in projs for t in (p.lora_A, p.lora_B)]
    with no_autocast(x.device.type):
        frozen = _MLPFrozen(projs, dtype, inplace, activation, output_unused_in_recompute)
        out = LoRAMLPFunction.apply(x2, *factors, frozen)
    return out.view(*x.shape[:-1], out.shape[-1])
