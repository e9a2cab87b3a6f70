"""Rotary position embedding on Q and K, in place, one launch for both.

Forward, for every (batch b, head h, token t) row x ∈ R^D, D even, split into halves x = [x₁, x₂] and
cos/sin rows c = [c₁, c₂], s = [s₁, s₂] of the same token (HF's rotate-half convention):

    y = x · c + rotate_half(x) · s,   rotate_half(x) = [−x₂, x₁]
    y₁ = x₁ c₁ − x₂ s₁
    y₂ = x₂ c₂ + x₁ s₂

which is HF ``apply_rotary_pos_emb(q, k, cos, sin)`` with cos/sin as HF's rotary module returns them:
``[B, T, D]`` per batch row and token, so packed ``position_ids`` (positions restarting inside a row)
need nothing special. A cos/sin batch of 1 broadcasts over B (HF's default ``position_ids`` is
``[1, T]``).

Shapes and dtypes: q [B, Hq, T, D], k [B, Hk, T, D] with any strides (the transposed views HF makes
from ``[B, T, H, D]`` projections are rotated where they lie), cos/sin [B or 1, T, D]. Loads are upcast
to fp32; results are rounded once to q's/k's dtype. HF rounds three times in bf16 (two products and the
sum), so ours is closer to the fp32 result, not bit-identical to HF.

Saved for backward: cos and sin only.

Backward: the map is linear, y = M x, so dx = Mᵀ dy:

    dx₁ = dy₁ c₁ + dy₂ s₂
    dx₂ = dy₂ c₂ − dy₁ s₁

With HF's cos/sin (both halves equal, c₁ = c₂, s₁ = s₂) that is the rotation by −θ. The kernel writes
dq and dk into the incoming gradients' storage (copied first only if a gradient is self-overlapping,
e.g. expanded). Like any in-place backward this assumes nothing else reads those gradient tensors
later, which holds when q/k feed attention, as in every HF decoder.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .utils import (
    cast_to,
    cdiv,
    check_float_tensor,
    check_same_device,
    interpreter_rows,
    is_writable_in_place,
    next_power_of_2,
)

__all__ = [
    "RoPEQKFunction",
    "rope_qk",
    "rope_qk_bwd",
    "rope_qk_bwd_reference",
    "rope_qk_fwd",
    "rope_qk_grads",
    "rope_qk_reference",
]


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., : x.shape[-1] // 2], x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)


def rope_qk_reference(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """HF ``apply_rotary_pos_emb`` in plain torch, out of place (pass fp32 tensors for an fp32 reference)."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin


def rope_qk_bwd_reference(
    dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The derived backward of the module docstring in fp32 torch (general cos/sin halves)."""
    half = cos.shape[-1] // 2
    c1, c2 = cos[..., :half].float().unsqueeze(1), cos[..., half:].float().unsqueeze(1)
    s1, s2 = sin[..., :half].float().unsqueeze(1), sin[..., half:].float().unsqueeze(1)

    def transpose_rotate(dy: torch.Tensor) -> torch.Tensor:
        dy1, dy2 = dy[..., :half].float(), dy[..., half:].float()
        return torch.cat((dy1 * c1 + dy2 * s2, dy2 * c2 - dy1 * s1), dim=-1)

    return transpose_rotate(dq), transpose_rotate(dk)


@triton.jit
def _rotate_heads(
    base_ptr,
    stride_h,
    stride_d,
    c1,
    c2,
    s1,
    s2,
    d,
    d_mask,
    tok_mask,
    HALF: tl.constexpr,
    N_HEADS: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BACKWARD: tl.constexpr,
):
    # base_ptr: [TOK] row bases, one per token; c1, c2, s1, s2: [TOK, BLOCK_D]; tiles are [TOK, BLOCK_H, BLOCK_D].
    for h0 in range(0, N_HEADS, BLOCK_H):
        h = h0 + tl.arange(0, BLOCK_H)
        mask = tok_mask[:, None, None] & (h < N_HEADS)[None, :, None] & d_mask[None, None, :]
        ptr1 = (
            base_ptr[:, None, None] + h[None, :, None].to(tl.int64) * stride_h + d[None, None, :] * stride_d
        )
        ptr2 = ptr1 + HALF * stride_d
        x1 = tl.load(ptr1, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(ptr2, mask=mask, other=0.0).to(tl.float32)
        if BACKWARD:
            y1 = x1 * c1[:, None, :] + x2 * s2[:, None, :]
            y2 = x2 * c2[:, None, :] - x1 * s1[:, None, :]
        else:
            y1 = x1 * c1[:, None, :] - x2 * s1[:, None, :]
            y2 = x2 * c2[:, None, :] + x1 * s2[:, None, :]
        # In place: each element is read and written by this program only, and both halves are loaded
        # before either is stored.
        tl.store(ptr1, cast_to(y1, base_ptr.dtype.element_ty), mask=mask)
        tl.store(ptr2, cast_to(y2, base_ptr.dtype.element_ty), mask=mask)


# fmt: skip on the signature: the pointers, one row of strides per tensor (q, k, cos, sin), the constexprs
@triton.jit
def _rope_qk_fwd_kernel(
    q_ptr, k_ptr, cos_ptr, sin_ptr,
    q_sb, q_sh, q_st, q_sd, k_sb, k_sh, k_st, k_sd, c_sb, c_st, c_sd, s_sb, s_st, s_sd,
    T, N_TOKENS, HALF: tl.constexpr, N_Q_HEADS: tl.constexpr, N_K_HEADS: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_HQ: tl.constexpr, BLOCK_HK: tl.constexpr, TOK: tl.constexpr, BACKWARD: tl.constexpr,
):  # fmt: skip
    # One program per TOK (batch, token) pairs (one compiled; a block under the interpreter): cos/sin are loaded
    # once and reused by all Hq + Hk heads. Serves both directions: BACKWARD=True applies the transposed map Mᵀ
    # (see the module docstring).
    tok = tl.program_id(0).to(tl.int64) * TOK + tl.arange(0, TOK)
    tok_mask = tok < N_TOKENS
    b = tok // T
    t = tok % T
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HALF
    cs_mask = tok_mask[:, None] & d_mask[None, :]
    c_row = (cos_ptr + b * c_sb + t * c_st)[:, None]
    s_row = (sin_ptr + b * s_sb + t * s_st)[:, None]
    c1 = tl.load(c_row + d[None, :] * c_sd, mask=cs_mask, other=0.0).to(tl.float32)
    c2 = tl.load(c_row + (d[None, :] + HALF) * c_sd, mask=cs_mask, other=0.0).to(tl.float32)
    s1 = tl.load(s_row + d[None, :] * s_sd, mask=cs_mask, other=0.0).to(tl.float32)
    s2 = tl.load(s_row + (d[None, :] + HALF) * s_sd, mask=cs_mask, other=0.0).to(tl.float32)
    q_base = q_ptr + b * q_sb + t * q_st
    _rotate_heads(
        q_base, q_sh, q_sd, c1, c2, s1, s2, d, d_mask, tok_mask, HALF, N_Q_HEADS, BLOCK_HQ, BACKWARD
    )
    k_base = k_ptr + b * k_sb + t * k_st
    _rotate_heads(
        k_base, k_sh, k_sd, c1, c2, s1, s2, d, d_mask, tok_mask, HALF, N_K_HEADS, BLOCK_HK, BACKWARD
    )


def _check(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    for name, t in (("q", q), ("k", k)):
        check_float_tensor(t, name, ndim=4)
    for name, t in (("cos", cos), ("sin", sin)):
        check_float_tensor(t, name, ndim=3)
    check_same_device(q=q, k=k, cos=cos, sin=sin)
    b, _, t, d = q.shape
    if (k.shape[0], k.shape[2], k.shape[3]) != (b, t, d):
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree on batch, tokens and head dim"
        )
    if d % 2:
        raise ValueError(f"head dim must be even for rotate-half RoPE, got {d}")
    if cos.shape != sin.shape:
        raise ValueError(f"cos {tuple(cos.shape)} and sin {tuple(sin.shape)} must have one shape")
    if cos.shape[0] not in (1, b) or tuple(cos.shape[1:]) != (t, d):
        raise ValueError(f"cos/sin must be [{b} or 1, {t}, {d}] (HF's rotary output), got {tuple(cos.shape)}")


def _launch(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, backward: bool) -> None:
    _check(q, k, cos, sin)
    b, hq, t, d = q.shape
    if q.numel() == 0 and k.numel() == 0:
        return
    for name, x in (("q" if not backward else "dq", q), ("k" if not backward else "dk", k)):
        if not is_writable_in_place(x):
            raise ValueError(f"{name} is self-overlapping (e.g. expanded) and cannot be rotated in place")
    # A broadcast cos/sin batch is read with batch stride 0.
    c_sb = 0 if cos.shape[0] == 1 else cos.stride(0)
    s_sb = 0 if sin.shape[0] == 1 else sin.stride(0)
    half = d // 2
    # untuned: ≤ 16 heads × 64 fp32 pairs per tile is 2,048 values per half for 4 warps (16 per lane),
    # so Hq=32 takes two tiles and Hk=8 one, and no lane idles on padding heads.
    block_hq = min(next_power_of_2(hq), 16)
    block_hk = min(next_power_of_2(k.shape[1]), 16)
    tok = interpreter_rows(b * t, block_hq * next_power_of_2(half))
    # fmt: skip below: one row per tensor's strides, as the kernel's signature
    _rope_qk_fwd_kernel[(cdiv(b * t, tok),)](
        q, k, cos, sin,
        q.stride(0), q.stride(1), q.stride(2), q.stride(3),
        k.stride(0), k.stride(1), k.stride(2), k.stride(3),
        c_sb, cos.stride(1), cos.stride(2), s_sb, sin.stride(1), sin.stride(2),
        t, b * t, HALF=half, N_Q_HEADS=hq, N_K_HEADS=k.shape[1], BLOCK_D=next_power_of_2(half),
        BLOCK_HQ=block_hq, BLOCK_HK=block_hk, TOK=tok, BACKWARD=backward, num_warps=4,
    )  # fmt: skip


def rope_qk_fwd(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Rotate q and k in place by the angles of cos/sin (one launch; any strides)."""
    _launch(q, k, cos, sin, backward=False)


def rope_qk_bwd(dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """Apply the transposed rotation to dq and dk in place (the rotation by −θ for HF cos/sin)."""
    _launch(dq, dk, cos, sin, backward=True)


def rope_qk_grads(
    dq: torch.Tensor, dk: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE's backward on autograd's gradients: rotated back in place where they are writable, else in copies."""
    dq, dk = (g if is_writable_in_place(g) else g.contiguous() for g in (dq, dk))
    rope_qk_bwd(dq, dk, cos, sin)
    return dq, dk


class RoPEQKFunction(torch.autograd.Function):
    """Autograd wrapper: rotates q/k in place, saves cos/sin, rotates the grads back in place.

    ``ctx.mark_dirty`` is not usable here: autograd refuses a Function that dirties a view input and
    returns two tensors, and HF's q/k are transposed views. So the forward returns storage aliases of
    the rotated q/k and bumps their version counters, which makes autograd raise (instead of computing
    wrong gradients) if anything had saved q, k or their base for its backward. The caller must treat
    the input q/k as consumed and use only the returned tensors, as HF's attention does.
    """

    @staticmethod
    def forward(
        ctx: torch.autograd.function.FunctionCtx,
        q: torch.Tensor,
        k: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        rope_qk_fwd(q, k, cos, sin)
        torch.autograd.graph.increment_version(q)
        torch.autograd.graph.increment_version(k)
        ctx.save_for_backward(cos, sin)
        return q.detach(), k.detach()

    @staticmethod
    def backward(ctx: torch.autograd.function.FunctionCtx, dq: torch.Tensor, dk: torch.Tensor):
        cos, sin = ctx.saved_tensors
        dq, dk = rope_qk_grads(dq, dk, cos, sin)
        return dq, dk, None, None


def rope_qk(
    q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding of q and k exactly as HF ``apply_rotary_pos_emb``, computed in place.

    Args:
        q: ``[B, Hq, T, D]``, any strides; overwritten with the result.
        k: ``[B, Hk, T, D]``, any strides; overwritten with the result.
        cos: ``[B or 1, T, D]`` as HF's rotary embedding returns it.
        sin: Same shape as ``cos``.

    Returns:
        ``(q, k)``: aliases of the input storage, rotated. The inputs are consumed: use only these.

    Raises:
        ValueError: On mismatched shapes, an odd head dim, or cos/sin that require grad (their gradient
            is not computed, and dropping it silently would be wrong).
    """
    if torch.is_grad_enabled() and (cos.requires_grad or sin.requires_grad):
        raise ValueError("rope_qk does not differentiate cos/sin; pass them detached")
    return RoPEQKFunction.apply(q, k, cos, sin)
