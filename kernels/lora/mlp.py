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
h, a memory-bound pass over the layer's largest operand. So the forward that strop's checkpoint runs stashes
its u_d (N·r values, 0.5 MiB at 16K tokens and r = 16) and the recompute takes it back instead of making h
(``kernels/lora/stash.py``). u_d is the same tensor the recompute would compute (the same ops on the same inputs),
so the gradients stay bitwise those of the full recompute.

Backward in token chunks. The activation backward needs dh = dout W_d + g_d A_d for every token, an [N, I] buffer
beside e and g, the largest the layer's backward holds. dh is made and consumed :data:`DH_CHUNK_BYTES` at a time
(the dh GEMM, the activation backward and the dA_d product per chunk of tokens, dA_d summed in fp32): the peak is
e, g and one chunk, 0.33 GiB less at 16K tokens of an 8B shape; the GEMMs keep M ≥ 4,096 rows there.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ..ops.fp8 import quantize_rows
from ..ops.swiglu import LowRank, geglu_bwd, geglu_fwd, swiglu_bwd, swiglu_fwd
from .linear import (
    Frozen,
    LoRAProj,
    as_proj,
    as_rows_for,
    backward_projections,
    check_proj,
    compute_dtype,
    factors_of,
    forward_projections,
    fp8_of,
    lora_linear_reference,
    lora_terms,
    mm_scaled,
    no_autocast,
    out_features,
    weight,
    with_factors,
)
from .stash import recompute_outputs_unused_now, stash, take_stashed

__all__ = [
    "ACTIVATIONS",
    "DH_CHUNK_BYTES",
    "LoRAMLPFunction",
    "lora_mlp",
    "lora_mlp_reference",
]

# The dh buffer of the chunked backward: 128 MiB is 4,681 tokens of Llama-3-8B's 14,336 in bf16, so 16K tokens
# run as 4 equal chunks of 4,096.
DH_CHUNK_BYTES = 128 << 20


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


def _rows(term: LowRank | None, start: int, end: int) -> LowRank | None:
    """The rows [start, end) of a term (its ``a`` is per token; ``b`` is shared)."""
    return None if term is None else LowRank(term.a[start:end], term.b, term.scale)


class LoRAMLPFunction(torch.autograd.Function):
    """The fused gated MLP of the module docstring over 2-D x in the compute dtype."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, ga, gb, ua, ub, da, db, frozen: _MLPFrozen) -> torch.Tensor:
        gate, up, down = with_factors(frozen, (ga, gb, ua, ub, da, db))
        dtype = frozen.dtype
        f_gu, f_d = factors_of((gate, up), dtype), factors_of((down,), dtype)
        # e and g stay the base's outputs: the activation adds their LoRA terms as it reads them
        (e, g), u_gu = forward_projections(x, (gate, up), dtype, f_gu, add_lora=False, stack=True)
        u_d_tag = None if f_d.a is None else ("lora_mlp.u_d", id(down.lora_A), x.shape[0])
        if frozen.output_unused_in_recompute and recompute_outputs_unused_now():
            # backward reads x, e, g, u_gu and u_d, never h: h is made only for u_d, and not at all when the
            # forward stashed u_d (see the module docstring)
            u_d = None if u_d_tag is None else take_stashed(u_d_tag)
            if u_d is None and u_d_tag is not None:
                u_d = _act_fwd(e, g, frozen.activation, lora_terms((gate, up), u_gu, f_gu)) @ f_d.a.t()
            out = e.new_empty(e.shape[0], out_features(down.base))  # never read: see the module docstring
        else:
            h = _act_fwd(e, g, frozen.activation, lora_terms((gate, up), u_gu, f_gu))
            (out,), u_d = forward_projections(h, (down,), dtype, f_d)
            if frozen.output_unused_in_recompute and u_d_tag is not None:
                stash(u_d_tag, u_d)
        ctx.save_for_backward(x, e, g, u_gu, u_d, ga, gb, ua, ub, da, db)
        ctx.frozen, ctx.factors = frozen, (f_gu, f_d)
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        x, e, g, u_gu, u_d, *factors = ctx.saved_tensors
        frozen = ctx.frozen
        dtype = frozen.dtype
        f_gu, f_d = ctx.factors
        ctx.factors = None
        gate, up, down = with_factors(frozen, factors)
        with no_autocast(x.device.type):
            dout = dout.to(dtype)
            n, inter = e.shape
            # one dequant for every chunk: nothing else dequantizes before the chunks end (FP8: each chunk's dout
            # rows are quantized as it runs; a row slice of one [N, 1] scale would start off cuBLASLt's 16-byte
            # alignment of scale vectors)
            f8 = fp8_of(down.base, dtype)
            w_d = weight(down.base, dtype) if f8 is None else None
            d_a_down = d_b_down = g_d = None
            if f_d.a is not None:
                g_d = mm_scaled(dout, f_d.b[0], down.scaling)
                d_b_down = mm_scaled(dout.t(), u_d, down.scaling).to(down.lora_B.dtype)
            terms = lora_terms((gate, up), u_gu, f_gu)
            # equal chunks of at most DH_CHUNK_BYTES (a small last chunk runs its GEMM at a poor tile fill)
            chunks = max(1, -(-n // max(1, DH_CHUNK_BYTES // (inter * e.element_size()))))
            rows = max(1, -(-n // chunks))
            dh = e.new_empty(rows, inter)
            for start in range(0, max(n, 1), rows):  # no tokens: one empty chunk (dA_d is then zeros)
                end = min(start + rows, n)
                if f8 is None:
                    dh_c = torch.mm(dout[start:end], w_d, out=dh[: end - start])
                else:
                    dh_c = f8.backward(*quantize_rows(dout[start:end]), dtype, out=dh[: end - start])
                # dh += g_d A_d as the kernel reads it; de over e, dg over g, the recomputed h over dh
                dh_term = None if g_d is None else LowRank(g_d[start:end], f_d.a)
                chunk_terms = [_rows(t, start, end) for t in terms]
                _act_bwd(dh_c, e[start:end], g[start:end], frozen.activation, chunk_terms, dh_term)
                if g_d is not None:
                    part = g_d[start:end].t() @ dh_c
                    d_a_down = part.float() if d_a_down is None else d_a_down.add_(part)
            del dh
            for t in (e, g):
                torch.autograd.graph.increment_version(t)
            if d_a_down is not None:
                d_a_down = d_a_down.to(down.lora_A.dtype)
            dx, d_a, d_b = backward_projections(
                x,
                u_gu,
                (e, g),
                (gate, up),
                dtype,
                f_gu,
                ctx.needs_input_grad[0],
                dx_out=x if frozen.inplace_dx else None,
            )
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
    projs = [as_proj(p) for p in (gate, up, down)]
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
