"""A mixture-of-experts layer's experts with LoRA, on the grouped expert GEMM: tokens grouped by expert, two projections.

HF's Qwen3-MoE / Mixtral experts module, given the router's choices (``top_k_index [T, k]``) and weights
(``top_k_weights [T, k]``), computes for every token t and each chosen expert e::

    g, u = split(x_t · GU_eᵀ)          GU [E, 2·I, H]: gate rows, then up rows
    y_t += w_{t,e} · (silu(g) · u) · D_eᵀ          D [E, H, I]

and PEFT's ``target_parameters`` LoRA adds ``s · B_e A_e`` to GU_e and D_e (``trainer_svc/core/moe.py``). Here the
T·k routed copies are put in expert order once (``kernels/ops/moe_routing.py``: the stable sort of the expert ids by a
counting sort; ``offsets`` from their counts), gathered, run through
:func:`~strop.kernels.ops.moe_gemm.moe_lora_gemm` for gate/up and again for down (torch's grouped GEMM over the merged
stack), and each token's k rows summed back (``kernels/ops/moe_rows.py``: fp32, no atomics; the gather's backward is
the same sum). Each routed row's weight multiplies its activation, ``w · (h Dᵀ) = (w · h) Dᵀ``, inside the SwiGLU kernel
(:class:`RoutedSwiGLUFunction`: ``kernels/ops/swiglu.py`` with a row scale, whose backward also gives the weights'
gradient, the router's gradient path): the [M, I] activation is scaled instead of the [M, H] down product, which
saves the weighting's own passes over that product (a multiply, its saved input and its two backward products), and
silu·mul's eager intermediates. The gather, the GEMMs, the activation and the sum each have their own backward.

PEFT's factors are reshaped, never copied: ``lora_A.weight [E·r, in]`` → ``[E, r, in]``; ``lora_B.weight
[out, E·r]`` (expert e's columns at ``e::E``) → ``[E, out, r]`` as a permuted view.
"""

from __future__ import annotations

import torch

from ..ops.moe_gemm import moe_lora_gemm
from ..ops.moe_routing import route_plan
from ..ops.moe_rows import combine_rows, gather_rows
from ..ops.swiglu import swiglu_bwd, swiglu_fwd
from ..ops.utils import compute_dtype
from .stash import recompute_outputs_unused_now

__all__ = ["RoutedSwiGLUFunction", "lora_moe_experts", "peft_expert_factors"]


def peft_expert_factors(
    lora_a: torch.Tensor, lora_b: torch.Tensor, experts: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """PEFT ``ParamWrapper`` factors as per-expert stacks: A ``[E, r, in]`` and B ``[E, out, r]`` (views)."""
    a = lora_a.view(experts, -1, lora_a.shape[-1])
    b = lora_b.view(lora_b.shape[0], -1, experts).permute(2, 0, 1)
    return a, b


class RoutedSwiGLUFunction(torch.autograd.Function):
    """``w[m] · silu(g[m]) · u[m]`` for the gate/up product ``gu`` [M, 2·I] (gate columns first) and one weight a row
    ``w`` [M]; saves gu and w, recomputes the activation, and writes the gradient of gu into gu's storage (the grouped
    GEMM's output, which nothing else reads)."""

    @staticmethod
    def forward(ctx, gu: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        g, u = gu.chunk(2, dim=-1)
        ctx.save_for_backward(gu, w)
        return swiglu_fwd(g, u, row_scale=w)

    @staticmethod
    def backward(ctx, dh: torch.Tensor):
        gu, w = ctx.saved_tensors
        g, u = gu.chunk(2, dim=-1)
        dw = torch.zeros(w.shape, dtype=torch.float32, device=w.device)
        swiglu_bwd(dh.to(gu.dtype), g, u, inplace=True, row_scale=w, d_row_scale=dw)
        return gu, dw.to(w.dtype)


def lora_moe_experts(
    x: torch.Tensor,
    top_k_index: torch.Tensor,
    top_k_weights: torch.Tensor,
    gate_up: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float],
    down: tuple[torch.Tensor, torch.Tensor, torch.Tensor, float],
    *,
    output_unused_in_recompute: bool = False,
) -> torch.Tensor:
    """The experts' output for ``x [T, H]`` (HF's experts forward with PEFT's LoRA, by the grouped GEMM).

    Args:
        x: [T, H] hidden states.
        top_k_index: [T, k] chosen experts; top_k_weights: [T, k] their weights.
        gate_up: (GU [E, 2·I, H], A [E, r, H], B [E, 2·I, r], scale).
        down: (D [E, H, I], A [E, r, I], B [E, H, r], scale).
            GU and D may be 16-bit tensors or :class:`~strop.kernels.ops.moe_gemm.Nf4Experts` stacks.
        output_unused_in_recompute: The caller's layer reads nothing of the output but its graph when strop's
            checkpoint recomputes it (``recompute_outputs_unused``: the experts' sum is the layer's last op up to a
            reshape and the residual add, as in HF's Qwen3-MoE and Mixtral layers). That recompute, which runs the
            whole layer where torch's non-reentrant checkpoint stops at the down projection's input, then skips
            the down product (its merge there too: the backward merges the stack itself, into the scratch buffer's
            second slot) and the sum, as torch's does; the gradients are the same bit for bit (the backward reads
            only what the nodes hold, computed the same way).

    Returns:
        [T, H] in x's dtype.
    """
    experts = gate_up[0].shape[0]
    k = top_k_index.shape[-1]
    # the routing plan (kernels/ops/moe_routing.py, the stable sort's by a counting sort, no host sync): each
    # expert's first sorted row (int32: the grouped GEMMs' row ends are views of it), each sorted row's token, the
    # sorted row of token t's i-th copy at inv[t·k + i], and the weights in expert order in the compute dtype, as
    # HF's weighting product has them
    offsets, token, inv, w = route_plan(top_k_index, top_k_weights, experts, compute_dtype(x))
    xs = gather_rows(x, token, inv, k)
    gu = moe_lora_gemm(xs, offsets, *gate_up)
    h = RoutedSwiGLUFunction.apply(gu, w)
    # split: the down projection ends the layer; its product then saves nothing, so a checkpointed recompute stops
    # before it (and before the sum, which saves nothing either); strop's reentrant checkpoint, which recomputes the
    # whole layer, says so instead, and the product and the sum are skipped
    unused = output_unused_in_recompute and recompute_outputs_unused_now()
    out = moe_lora_gemm(h, offsets, *down, split=True, output_unused=unused)
    return combine_rows(out, token, inv, k, x.dtype, output_unused=unused)
