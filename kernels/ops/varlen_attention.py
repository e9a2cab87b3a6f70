"""Causal attention over packed sequences whose keys are gathered from the query rows: FlashAttention-2's
variable-length kernels, with a backward that sums each key row's gradient over the sequences that read it.

What. Rows ``q, k, v`` ``[N, H, D]`` (N positions, one row each; k and v may have fewer heads, grouped-query) and a
:class:`Packing`: the queries are split, in order, into S sequences (``cu_q``); sequence s reads the keys
``k[k_index[cu_k[s] : cu_k[s+1]]]``, a list of rows that may repeat rows other sequences read too. Causal is aligned
to the bottom right of each sequence's [queries × keys] block (FlashAttention-2's rule when the two lengths differ):
query i of a sequence of n queries and m keys sees keys 0 … i + m − n. A shared prompt is then one gather: the
prompt's and its first completion's queries over their own keys, and a later completion's queries over the prompt's
keys followed by its own.

    forward     kp = k[k_index], vp = v[k_index]   (one gather each: the prompt's rows once more per later sequence)
                o, lse = varlen_attention(q, kp, vp)  (one launch; o is q-shaped, in q's row order)
    backward    dq, dkp, dvp = its backward (one launch)
                dk = dkp[first] (each key row's first reader), then for each further reading, one ``index_add_``
                whose target rows are distinct (no two adds to one row in a launch: the same sums in the same
                order on every run), in fp32, rounded once

Against SDPA calls over slices of the rows (``shared_prompt.attend``'s other path), nothing is copied but the
gathered keys: no contiguous copies of q, k, v, no concatenation of the outputs, no zero-filled slice gradients to
add up. Kernels: CUDA in 16-bit (the caller asks :func:`flash_takes` first): ``aten._flash_attention_forward``
and ``_flash_attention_backward`` with cumulative sequence lengths; grouped-query heads are the kernel's own (key
heads unrepeated). Elsewhere (the CPU, fp32; tests) the same attention in fp32 math, one sequence at a time, its
backward by autograd over that math.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .utils import upload

__all__ = ["Packing", "backward", "flash_takes", "forward", "packed_attention", "rows_of"]


@dataclass(eq=False)
class Packing:
    """Where each packed sequence's queries and keys lie (device tensors, and the host's lengths).

    Attributes:
        cu_q: ``[S+1]`` int32: sequence s's queries are rows ``cu_q[s] … cu_q[s+1]`` of q (together all N rows).
        cu_k: ``[S+1]`` int32: its keys are packed rows ``cu_k[s] … cu_k[s+1]``.
        k_index: ``[K]`` int64: the row of k each packed key is.
        first: ``[N]`` int64: for each row of k, a packed position that reads it (every row is read).
        extra: Further readings, in groups whose rows are distinct: ``(rows [n], packed positions [n])``.
        lengths: ``(queries, keys)`` of each sequence, on the host.
    """

    cu_q: torch.Tensor
    cu_k: torch.Tensor
    k_index: torch.Tensor
    first: torch.Tensor
    extra: tuple[tuple[torch.Tensor, torch.Tensor], ...]
    lengths: tuple[tuple[int, int], ...]

    @property
    def max_q(self) -> int:
        """The longest sequence's queries."""
        return max((q for q, _ in self.lengths), default=0)

    @property
    def max_k(self) -> int:
        """The most keys a sequence reads."""
        return max((k for _, k in self.lengths), default=0)

    @classmethod
    def build(
        cls, sequences: list[tuple[int, int, list[tuple[int, int]]]], device: torch.device | str
    ) -> Packing:
        """From host-side sequences ``(query start, query count, key runs [(start, count), …])`` covering the rows
        in order, each row read by at least one sequence; the tensors copied to ``device`` once, without waiting
        for the device's queue (pinned host memory, asynchronous copies)."""
        cu_q, cu_k, runs, lengths = [0], [0], [], []
        for start, count, keys in sequences:
            if start != cu_q[-1]:
                raise ValueError(
                    f"sequences must cover the rows in order: one starts at {start}, not {cu_q[-1]}"
                )
            m = sum(n for _, n in keys)
            cu_q.append(start + count)
            cu_k.append(cu_k[-1] + m)
            runs.extend(keys)
            lengths.append((count, m))
        k_index = (
            torch.cat([torch.arange(s, s + n) for s, n in runs]) if runs else torch.zeros(0, dtype=torch.long)
        )
        rows = cu_q[-1]
        # each row's readings in packed order: the first goes to `first`, the r-th further to extra[r − 1]
        order = torch.argsort(k_index, stable=True)
        sorted_rows = k_index[order]
        counts = torch.bincount(k_index, minlength=rows)
        if rows and int(counts.min()) == 0:
            raise ValueError("every row must be read as a key by some sequence")
        starts = torch.cumsum(counts, 0) - counts
        rank = torch.arange(len(order)) - starts[sorted_rows]
        first = order[rank == 0]
        extra = tuple(
            (sorted_rows[rank == r], order[rank == r]) for r in range(1, int(counts.max()) if rows else 1)
        )

        return cls(
            upload(torch.tensor(cu_q, dtype=torch.int32), device),
            upload(torch.tensor(cu_k, dtype=torch.int32), device),
            upload(k_index, device),
            upload(first, device),
            tuple((upload(r, device), upload(p, device)) for r, p in extra),
            tuple(lengths),
        )


def flash_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool = True) -> bool:
    """Whether FlashAttention-2 trains attention of q ``[B, Hq, Lq, D]`` over k, v ``[B, Hkv, Lk, D]`` here (causal
    as the square case's flag says; SDPA's lower-right bias asks with ``causal=False``): SDPA's flash backend
    enabled, and torch's own check of its flash kernels (this GPU's generation and this build, 16-bit inputs of one
    dtype, the head dims it trains on this GPU, grouped-query heads)."""
    if not (q.is_cuda and torch.backends.cuda.flash_sdp_enabled()):
        return False
    from torch.backends.cuda import SDPAParams, can_use_flash_attention

    return can_use_flash_attention(SDPAParams(q, k, v, None, 0.0, causal, q.shape[1] != k.shape[1]))


def rows_of(t: torch.Tensor) -> torch.Tensor:
    """``[B, H, L, D]`` (as HF's attention functions take q, k, v) → the ``[B·L, H, D]`` rows packed attention takes:
    a view where t is a transposed ``[B, L, H, D]``, as projections give them."""
    b, h, n, d = t.shape
    return t.transpose(1, 2).reshape(b * n, h, d)


def _math(q, kp, vp, packing: Packing, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernels' attention in fp32 math, a sequence at a time: o [N, H, D] in q's dtype, lse [H, N] fp32."""
    groups = q.shape[1] // kp.shape[1]
    outs, lses = [], []
    qs = ks = 0
    for nq, nk in packing.lengths:
        qi = q[qs : qs + nq].float().transpose(0, 1)  # [H, nq, D]
        ki = kp[ks : ks + nk].float().transpose(0, 1).repeat_interleave(groups, 0)
        vi = vp[ks : ks + nk].float().transpose(0, 1).repeat_interleave(groups, 0)
        scores = qi @ ki.transpose(1, 2) * scale
        i = torch.arange(nq, device=q.device)[:, None]
        j = torch.arange(nk, device=q.device)[None, :]
        scores = scores.masked_fill(j > i + (nk - nq), float("-inf"))
        lse = torch.logsumexp(scores, -1)  # [H, nq]
        outs.append((torch.exp(scores - lse[..., None]) @ vi).transpose(0, 1))
        lses.append(lse)
        qs, ks = qs + nq, ks + nk
    return torch.cat(outs).to(q.dtype), torch.cat(lses, 1)


def _forward(q, kp, vp, packing: Packing, scale: float) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16):
        o, lse, rng, unused, _ = torch.ops.aten._flash_attention_forward(
            q, kp, vp, packing.cu_q, packing.cu_k, packing.max_q, packing.max_k, 0.0, True, False, scale=scale
        )
        return o, lse, (rng, unused)
    o, lse = _math(q, kp, vp, packing, scale)
    return o, lse, ()


def _backward(g, q, kp, vp, o, lse, extra: tuple, packing: Packing, scale: float):
    if extra:
        rng, unused = extra
        return torch.ops.aten._flash_attention_backward(
            g.contiguous(),
            q,
            kp,
            vp,
            o,
            lse,
            packing.cu_q,
            packing.cu_k,
            packing.max_q,
            packing.max_k,
            0.0,
            True,
            rng,
            unused,
            scale=scale,
        )
    leaves = [t.detach().requires_grad_() for t in (q, kp, vp)]
    with torch.enable_grad():
        out, _ = _math(*leaves, packing, scale)
    return torch.autograd.grad(out, leaves, g)


def forward(q, k, v, packing: Packing, scale: float | None) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """(o [N, Hq, D], lse, what :func:`backward` needs besides q, k, v) of the packed sequences' attention; ``scale``
    defaults to ``D^-1/2``."""
    kp, vp = k.index_select(0, packing.k_index), v.index_select(0, packing.k_index)
    return _forward(q, kp, vp, packing, _scale(q, scale))


def backward(g, q, k, v, o, lse, extra: tuple, packing: Packing, scale: float | None):
    """dq, dk, dv (q's and k's row layouts) of :func:`forward`'s o for the output gradient g: the kernel's backward
    over the gathered keys, each key row's gradient summed over the sequences that read it."""
    kp, vp = k.index_select(0, packing.k_index), v.index_select(0, packing.k_index)
    dq, dkp, dvp = _backward(g, q, kp, vp, o, lse, extra, packing, _scale(q, scale))
    return dq, *(_sum_readings(d, packing) for d in (dkp, dvp))


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return q.shape[-1] ** -0.5 if scale is None else scale


def _sum_readings(d: torch.Tensor, packing: Packing) -> torch.Tensor:
    """Each key row's gradient: the sum of its readings' [K, H, D] → [N, H, D], added in fp32 and rounded once to
    d's dtype where a row has several (as an attention kernel accumulates a key's gradient over its queries)."""
    full = d.index_select(0, packing.first)
    if not packing.extra:
        return full
    total = full.float()
    for rows, packed in packing.extra:
        total.index_add_(0, rows, d.index_select(0, packed).float())
    return total.to(d.dtype)


class _PackedAttention(torch.autograd.Function):
    """:func:`forward` and :func:`backward` as one autograd node (it saves k and v, gathering them again in
    backward: the gathered copies are larger)."""

    @staticmethod
    def forward(ctx, q, k, v, packing: Packing, scale: float | None):
        o, lse, extra = forward(q, k, v, packing, scale)
        ctx.save_for_backward(q, k, v, o, lse)
        ctx.packing, ctx.scale, ctx.extra = packing, scale, extra
        return o

    @staticmethod
    def backward(ctx, g):
        q, k, v, o, lse = ctx.saved_tensors
        return *backward(g, q, k, v, o, lse, ctx.extra, ctx.packing, ctx.scale), None, None


def packed_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, packing: Packing, scale: float | None = None
) -> torch.Tensor:
    """Causal attention of ``packing``'s sequences (module docstring): q ``[N, Hq, D]``, k and v ``[N, Hkv, D]``
    (rows, last dim contiguous) → o ``[N, Hq, D]`` in q's row order. ``scale`` defaults to ``D^-1/2``."""
    return _PackedAttention.apply(q, k, v, packing, scale)
