"""Rows that share a prompt: one forward over ``[prompt | suffix 1 | suffix 2 | …]``, the prompt computed once.

What. A preference pair (DPO, ORPO, SimPO: a prompt, its chosen and its rejected completion) and a GRPO group (a
prompt and G sampled completions) are one shape: a prefix and several suffixes. Run as TRL lays them out, a row per
suffix, every prompt token runs through the forward, the recompute and the backward once per suffix, computing what
the other copies compute (a decoder's state at a prompt position depends on the prompt alone). Here each prompt's
suffixes share one row:

    tokens      prompt (p)  | suffix 1 (n_1)              | suffix 2 (n_2)                        | … | padding
    positions   0 … p−1     | p … p+n_1−1                 | p … p+n_2−1                           | … | 0
    attends     causal      | prompt + its own, causal    | prompt + its own, causal (not suffix 1) | … | nothing

so each suffix's tokens see the keys, values and RoPE positions their own row gives them, and every token-wise op
(projections, norms, MLP) runs on each prompt token once. The backward through a prompt position sums its
suffixes' gradients, which is the chain rule of the shared computation.

Attention (:func:`attend`) builds no mask over the row, and makes two SDPA calls whatever the rows' lengths:
  - prompt + suffix 1 is a causal prefix of the row: one call with ``is_causal`` over the longest such prefix
    (flash on CUDA; a shorter row's positions past its own prefix are computed there and not used);
  - pairs alike (one later suffix, every row of the same lengths: the DPO bench, a long pair at batch 1): the
    rejected completion's queries over ``[prompt keys | its keys]`` with a lower-right causal bias (flash, no mask
    tensor; both key runs copied into one, linear in the row);
  - otherwise (several later suffixes: a GRPO group; pairs of other lengths): one call of the later positions'
    queries over the rows' keys with a boolean mask [B, later positions, keys] (its row's prompt keys, then its own
    suffix, causal), small since such suffixes are short or the pairs are a batch of short ones;
  - padding queries output zeros (no label reads them).
For pairs alike, attention's FLOPs are the prompt's once plus each completion's over the prompt and itself; the
masked call computes its whole [later positions × keys] block, masked entries included.

Packed (:data:`VARLEN`; by default on CUDA in 16-bit, rows up to :data:`PACKED_MAX_ROW` positions whose gathered
keys stay within :data:`PACKED_KEYS_MAX` of the rows): instead of those calls, one call of FlashAttention-2's variable-length kernels over the rows as
packed sequences (``kernels/ops/varlen_attention.py``, :meth:`Rows.packing`): each row's prompt and first suffix
over their own keys, each later suffix over its prompt's keys gathered in front of its own, causal aligned to the
bottom right; a row's padding runs on at the end of its last sequence (a padding query sees that sequence's keys;
no real query sees a padding key). q, k, v and the output stay in the rows' own layout, so nothing is copied but
the gathered keys and values (a pair: each prompt's once more), and the backward adds each prompt key's gradients
from the sequences that read it with one ``index_add_`` per further reading. That path has no cuDNN graph per
shape, so its lengths are not bucketed. A long prompt's GRPO group (G copies of the prompt's keys) keeps the calls
below.

Lengths in buckets (:data:`BUCKETS`, :func:`bucket`). On CUDA SDPA runs cuDNN's kernels first (Hopper and newer),
and torch caches a cuDNN graph per exact shape and strides of q, k, v and the mask: each new length builds a graph
for the forward and one for the backward of each call, which at a GRPO row of a few thousand tokens costs many
times the kernels' own time (bench/RESULTS.md, ``bench/experiments/sdpa_new_shape.py``). A GRPO row's length (the
prompt plus the completions) and a DPO batch's width change every step, so the training pass would pay that every
step. Each call's inputs are therefore copied into new tensors whose length
is rounded up to a bucket (eight an octave: at most 12.5% longer), zeros past the real positions, so a job's rows
reach SDPA in a few shapes that repeat. Exact: in the causal call the padded keys lie after every real query (never
seen) and the padded queries' outputs are dropped (their gradient is zero, so they add nothing to the keys' and
values'); in the masked call the padded keys are masked out and the padded queries see key 0 and are dropped.
The copies are linear in the row (three [B, H, L, D] tensors a call), the padding's attention FLOPs at most ~27%
more for the causal call. Rows past :data:`BUCKET_MAX` positions run at their exact lengths. Only ``attend``'s calls
are bucketed here: HF's ``sdpa`` on unshared rows and saved attention's cuDNN call (``kernels/models/saved_attention.py``)
meet the batch's width, which strop's SFT collator and DPO trainer (pairs run unshared) round up to a bucket
(:func:`bucketed_width`) where :data:`WIDTH_BUCKETS` says so; ORPO's, KTO's and SimPO's unshared rows still meet
each new width as a new shape.

Two ways in. TRL's preference rows: :func:`share_prompts` re-lays a ``[chosen; rejected]`` batch and hands the
model a marker 4-D mask that carries the :class:`Rows`; HF's ``sdpa`` attention function, wrapped by a
pass-through, runs :func:`attend` when it sees the marker (a checkpointed layer's recompute gets the same mask).
:meth:`SharedPrompts.unshare` gathers the hidden states back to ``[2B, T, H]`` for TRL's losses. GRPO's rows
(``trainer_svc/core/shared_prefix.py``): the model's attention implementation is swapped for one reading the
:class:`Rows` from the config around the forward and the backward.

Why. A pair of prompt P and completions C runs 2(P + C) tokens unshared and P + 2C shared: the DPO bench's
512 + 512 + 512 does 25% less GEMM work in the policy pass, its recompute and the reference pass. A GRPO group of
8 at a 4K prompt trains 5.1K positions instead of 33.9K.

When. Only where it is exact: every pair's chosen and rejected rows start with the same prompt tokens (TRL's
``keep_end`` truncation can cut them differently), rows are right-padded with contiguous completions, the model's
attention is ``sdpa`` (the one whose function the marker reaches), plain causal over the whole row
(:func:`config_reason`), and the shared batch has at least :data:`MIN_SAVING` fewer positions. Otherwise
:func:`share_prompts` returns the reason and the caller runs the batch as TRL laid it out.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from ..ops.utils import upload
from ..ops.varlen_attention import Packing, flash_takes, packed_attention, rows_of

__all__ = [
    "BUCKETS",
    "BUCKET_MAX",
    "MIN_SAVING",
    "WIDTH_BUCKETS",
    "PromptSharing",
    "Rows",
    "SharedPrompts",
    "attend",
    "bucket",
    "bucketed_width",
    "config_reason",
    "share_prompts",
]

logger = logging.getLogger("strop.kernels")

# Shared only when it removes at least this fraction of the batch's positions (padding counted).
MIN_SAVING = 0.1

# Whether attend's SDPA calls see lengths rounded up to a bucket (module docstring): None where cuDNN's SDPA may
# run (16-bit inputs on CUDA with cuDNN's SDPA enabled), True or False everywhere (tests, measurements).
BUCKETS: bool | None = None
# Rows longer than this run at their exact lengths: there a graph build is a small part of the step's attention
# (quadratic in the row), and the padded copies of q, k, v (up to 12.5% longer, held through the call and its
# backward) would count against the longest row that fits.
BUCKET_MAX = 65536
# Whether attend runs the rows as packed sequences on FlashAttention-2's variable-length kernels (module docstring,
# ``kernels/ops/varlen_attention.py``): None where those kernels take q, k, v (CUDA, 16-bit) and the keys gathered
# are at most PACKED_KEYS_MAX times the rows; True or False everywhere (tests, measurements).
VARLEN: bool | None = None
# A later suffix reads its prompt's keys as gathered copies: a GRPO group of G samples over a long prompt would hold
# G copies of the prompt's keys and values through the call and its backward, where the masked call holds none.
PACKED_KEYS_MAX = 2.0
# Rows longer than this keep the SDPA calls: what packing saves is copies, linear in the row, while attention's
# own time grows with its square, and there cuDNN's causal kernel (which the SDPA calls get on Hopper) is the one the
# long-context rows were measured with (bench/RESULTS.md); the packed call is FlashAttention-2's.
PACKED_MAX_ROW = 8192
# Whether strop's TRL trainers hand the model unshared batches (SFT rows, preference pairs run unshared) with their
# width rounded up to a bucket (:func:`bucketed_width`; ``kernels/trainers/sft.py``'s docstring): True or False as
# set; None where cuDNN's SDPA may run (``_glue.width_buckets``: a CUDA device, 16-bit compute, cuDNN's SDPA
# enabled, the model's attention ``sdpa``). It trades up to 12.5% more positions a step (GEMMs included) for the
# graph builds saved at widths not met before, and on a GPU the graph builds saved outweigh the padding by far
# (bench/RESULTS.md, "SFT batches of varying width": an 8B QLoRA job over rows of varied lengths).
WIDTH_BUCKETS: bool | None = None
# The columns bucketed_width pads, each with its padding value (None: the caller's pad token id).
_PAD_VALUES = {
    "input_ids": None,
    "labels": -100,
    "attention_mask": 0,
    "completion_mask": 0,
    "position_ids": 0,
}


def bucket(n: int) -> int:
    """``n`` rounded up to a multiple of 2^(⌊log2 n⌋ − 3), and of 16: eight lengths an octave, at most 12.5% more
    from 128 on (8,160 → 8,192; 8,271 → 9,216; 441 → 448), at most 15 more below."""
    if n <= 16:
        return 16
    step = max(16, 1 << (n.bit_length() - 4))
    return -(-n // step) * step


def bucketed_width(batch: dict[str, Any], pad_token_id: int, max_width: int | None = None) -> dict[str, Any]:
    """``batch`` (right-padded ``[B, width]`` rows) padded on the right to ``bucket(width)`` columns, at most
    ``max_width`` (when the width is within it) and left as it is past :data:`BUCKET_MAX`: ids ``pad_token_id``,
    labels -100, attention and completion masks 0, positions 0, columns no real query attends to (they lie after
    it, and are masked), no label scores and no token count includes. A batch with any other key is returned as it
    is."""
    if not batch.keys() <= _PAD_VALUES.keys():
        return batch
    width = batch["input_ids"].shape[1]
    target = bucket(width) if width <= BUCKET_MAX else width
    if max_width is not None and width <= max_width:
        target = min(target, max_width)
    if target == width:
        return batch
    return {
        key: F.pad(
            value, (0, target - width), value=pad_token_id if _PAD_VALUES[key] is None else _PAD_VALUES[key]
        )
        for key, value in batch.items()
    }


def _bucketed(q: torch.Tensor) -> bool:
    if BUCKETS is not None:
        return BUCKETS
    return (
        q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and torch.backends.cuda.cudnn_sdp_enabled()
    )


def _padded(x: torch.Tensor, length: int) -> torch.Tensor:
    """``x`` [B, H, n, D] in new contiguous memory of ``length`` ≥ n positions, zeros past n: its strides, like
    its shape, depend on ``length`` alone (a slice of a row keeps the row's strides, which would key a new graph)."""
    n = x.shape[2]
    return F.pad(x, (0, 0, 0, length - n)) if length > n else x.contiguous()


@dataclass(eq=False)
class Rows:
    """Where each row's prompt and suffixes lie: row b holds ``prompts[b]`` tokens, then suffixes of
    ``suffixes[b]`` tokens in order, then padding to ``width``."""

    prompts: tuple[int, ...]
    suffixes: tuple[tuple[int, ...], ...]
    width: int
    _masks: dict = field(default_factory=dict, repr=False)  # later_mask's and selectors', per device

    def __post_init__(self) -> None:
        for p, ns in zip(self.prompts, self.suffixes, strict=True):
            if p + sum(ns) > self.width:
                raise ValueError(f"a row of prompt {p} and suffixes {ns} is wider than {self.width}")

    @classmethod
    def single(cls, prompt: int, suffixes: list[int]) -> Rows:
        """One row, no padding (a GRPO group)."""
        return cls((prompt,), (tuple(suffixes),), prompt + sum(suffixes))

    @property
    def firsts(self) -> list[int]:
        """Each row's prompt + first suffix: the causal prefix of the row."""
        return [p + (ns[0] if ns else 0) for p, ns in zip(self.prompts, self.suffixes, strict=True)]

    @property
    def ends(self) -> list[int]:
        return [p + sum(ns) for p, ns in zip(self.prompts, self.suffixes, strict=True)]

    def lower_right(self) -> bool:
        """Whether every row has the same lengths and at most one later suffix: that suffix's queries are the last
        of [prompt | its keys], a lower-right causal block in every row."""
        alike = len(set(self.prompts)) == 1 and len(set(self.suffixes)) == 1
        return alike and sum(1 for n in self.suffixes[0][1:] if n) <= 1

    def selectors(self, length: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, 1, length, 1]`` bool each: the positions of each row's causal prefix, and of its later suffixes
        (built once per device: a tensor made from a list on every layer's call would copy host to device each time)."""
        key = ("selectors", length, str(device))
        if key not in self._masks:
            at = torch.arange(length)[None, :]
            f, e = torch.tensor(self.firsts)[:, None], torch.tensor(self.ends)[:, None]
            sel = (at < f, (at >= f) & (at < e))
            self._masks[key] = tuple(upload(x[:, None, :, None], device) for x in sel)
        return self._masks[key]

    def packed_keys(self, length: int) -> int:
        """Keys the packed sequences read over rows of ``length`` positions: every position once, and each prompt
        once more per later suffix that is not empty."""
        return sum(
            length + p * sum(1 for n in ns[1:] if n)
            for p, ns in zip(self.prompts, self.suffixes, strict=True)
        )

    def packing(self, length: int, device: torch.device | str) -> Packing:
        """The rows (of ``length`` positions each, flattened row after row) as packed causal sequences: a row's
        prompt and first suffix over their own keys; each later suffix over its prompt's keys, then its own; the
        row's padding appended to its last sequence (queries and keys), where no real query sees it. Built once
        per device."""
        key = ("packing", length, str(device))
        if key not in self._masks:
            sequences: list[tuple[int, int, list[tuple[int, int]]]] = []
            for b, (p, ns) in enumerate(zip(self.prompts, self.suffixes, strict=True)):
                base = b * length
                row: list[list] = []
                f = p + (ns[0] if ns else 0)
                if f:
                    row.append([base, f, [[base, f]]])
                start = base + f
                for n in ns[1:]:
                    if n:
                        row.append([start, n, ([[base, p]] if p else []) + [[start, n]]])
                    start += n
                pad = base + length - start
                if pad and row:  # the last sequence's queries and its own keys run on through the padding
                    row[-1][1] += pad
                    row[-1][2][-1][1] += pad
                elif pad:
                    row.append([start, pad, [[start, pad]]])
                sequences.extend((s, n, [tuple(r) for r in runs]) for s, n, runs in row)
            self._masks[key] = Packing.build(sequences, device)
        return self._masks[key]

    def packing_for(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> Packing | None:
        """The packed sequences :func:`attend` runs for q ``[B, Hq, L, D]`` and k over these rows, or None (its
        SDPA calls). Saved attention (``kernels/models/saved_attention.py``) keeps such a call's output for the
        recompute, finding these rows on the mask HF hands the attention function."""
        return self.packing(q.shape[2], q.device) if _packed(self, q, k, v) else None

    def later_mask(
        self, device: torch.device | str, queries: int | None = None, keys: int | None = None
    ) -> torch.Tensor:
        """``[B, 1, hi − lo, hi]`` bool over the positions ``lo = min(firsts) … hi = max(ends)`` of every row: a
        query of a later suffix (past its row's first) sees its row's prompt keys and its own suffix's earlier
        tokens and itself, never another suffix; any other query sees key 0 alone (its output is not used).
        ``queries``/``keys``: the mask padded to that many queries (seeing key 0 alone) and keys (seen by none).
        Built on ``device`` from the rows' segment ids (a [B, keys] copy to it): the [B, queries, keys] comparisons
        are elementwise work over the whole block, once a group and step, which the host's CPU would do far slower."""
        lo, hi = min(self.firsts), max(self.ends)
        qn, kn = queries or hi - lo, keys or hi
        key = (qn, kn, str(device))
        if key not in self._masks:
            seg = torch.full((len(self.prompts), kn), -1)  # 0 prompt, s the s-th suffix, -1 padding
            for b, (p, ns) in enumerate(zip(self.prompts, self.suffixes, strict=True)):
                seg[b, :p] = 0
                start = p
                for i, n in enumerate(ns, 1):
                    seg[b, start : start + n] = i
                    start += n
            seg = upload(seg, device)
            sq = torch.full((len(self.prompts), qn), -1, device=seg.device)
            sq[:, : hi - lo] = seg[:, lo:hi]
            sq, sk = sq[:, :, None], seg[:, None, :]
            j, i = torch.arange(kn, device=seg.device), torch.arange(lo, lo + qn, device=seg.device)
            later = sq >= 2
            mask = later & ((sk == 0) | ((sk == sq) & (j[None, None, :] <= i[None, :, None])))
            mask |= ~later & (j == 0)[None, None, :]
            self._masks[key] = mask.unsqueeze(1)
        return self._masks[key]


def _lower_right(q_len: int, kv_len: int, device: torch.device) -> Any:
    """The causal mask of ``q_len`` queries that are the last of ``kv_len`` keys: on CUDA torch's bias object (the
    flash kernel, nothing materialized), elsewhere the boolean tensor (the CPU has no kernel for the bias)."""
    from torch.nn.attention.bias import causal_lower_right

    bias = causal_lower_right(q_len, kv_len)
    return bias if device.type == "cuda" else bias._materialize(device)


def _packed(rows: Rows, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    if VARLEN is not None:
        return VARLEN
    b, _, length, _ = q.shape
    return (
        length <= PACKED_MAX_ROW
        and flash_takes(q, k, v)
        and rows.packed_keys(length) <= PACKED_KEYS_MAX * b * length
    )


def attend(
    rows: Rows, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float | None = None
) -> torch.Tensor:
    """Attention over rows laid out as ``rows`` says (see the module docstring): query ``[B, Hq, L, D]``, key and
    value ``[B, Hkv, L, D]`` → ``[B, L, Hq, D]``. Packed (:data:`VARLEN`): one variable-length flash call; a
    padding query attends within its row's last sequence (no label reads it, so its gradient is zero). Otherwise
    two SDPA calls at most, whatever the rows' lengths, padding positions zero."""
    q, k, v = query, key, value
    packing = rows.packing_for(q, k, v)
    if packing is not None:
        b, hq, length, d = q.shape
        return packed_attention(rows_of(q), rows_of(k), rows_of(v), packing, scale).view(b, length, hq, d)
    groups = q.shape[1] // k.shape[1]
    gqa = groups > 1
    firsts, ends = rows.firsts, rows.ends
    lo, first, end = min(firsts), max(firsts), max(ends)
    pad = end <= BUCKET_MAX and _bucketed(q)
    # prompt + first suffix, causal: a row shorter than the longest computes garbage past its own, replaced below
    qc, kc, vc = q[:, :, :first], k[:, :, :first], v[:, :, :first]
    if pad:
        qc, kc, vc = (_padded(x, bucket(first)) for x in (qc, kc, vc))
    causal = F.scaled_dot_product_attention(qc, kc, vc, is_causal=True, scale=scale, enable_gqa=gqa)
    causal = causal[:, :, :first]
    if end == lo:  # no later suffix
        later = None
    elif rows.lower_right():  # the prompt's keys and the one later suffix's, one run in every row
        p = rows.prompts[0]
        keys = torch.cat([k[:, :, :p], k[:, :, first:end]], 2)
        values = torch.cat([v[:, :, :p], v[:, :, first:end]], 2)
        ql = q[:, :, first:end]
        if gqa and q.is_cuda and not flash_takes(ql, keys, values, causal=False):
            # the bias's other kernel (memory-efficient) takes no grouped heads: without the repeat, SDPA would
            # materialize the [n, p + n] bias and run the math kernel
            keys, values, gqa = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1), False
        bias = _lower_right(end - first, keys.shape[2], q.device)
        later = F.scaled_dot_product_attention(ql, keys, values, attn_mask=bias, scale=scale, enable_gqa=gqa)
    else:  # several later suffixes, or rows of other lengths: one masked call over the later positions
        keys, values, ql = k[:, :, :end], v[:, :, :end], q[:, :, lo:end]
        if pad:
            qb, kb = bucket(end - lo), bucket(end)
            keys, values, ql = _padded(keys, kb), _padded(values, kb), _padded(ql, qb)
            mask = rows.later_mask(q.device, qb, kb)
        else:
            mask = rows.later_mask(q.device)
        if gqa:  # SDPA's memory-efficient kernel takes a mask, not grouped heads
            keys, values = keys.repeat_interleave(groups, 1), values.repeat_interleave(groups, 1)
        later = F.scaled_dot_product_attention(ql, keys, values, attn_mask=mask, scale=scale)[
            :, :, : end - lo
        ]
    length = q.shape[2]
    if len(set(firsts)) == 1 and len(set(ends)) == 1:  # every row alike: the pieces in order
        pieces = [causal] + (
            [] if later is None else [later]
        )  # here lo == first: later starts where causal ends
        if end < length:
            pieces.append(q.new_zeros(q.shape[0], q.shape[1], length - end, q.shape[3]))
        return torch.cat(pieces, 2).transpose(1, 2)
    # rows of other lengths: each position from the call that computed it for its row
    in_causal, in_later = rows.selectors(length, q.device)
    out = torch.where(in_causal, F.pad(causal, (0, 0, 0, length - first)), 0)
    if later is not None:
        out = torch.where(in_later, F.pad(later, (0, 0, lo, length - end)), out)
    return out.transpose(1, 2)


def config_reason(configs: list[Any], length: int | None = None) -> str | None:
    """Why models of these configs cannot attend over a shared row of ``length`` positions (None: they can):
    :func:`attend` is plain causal self-attention without dropout."""
    for cfg in configs:
        window = getattr(cfg, "sliding_window", None)
        if (
            window is not None
            and getattr(cfg, "use_sliding_window", True) is not False
            and (length is None or window < length)
        ):
            # a window over the rows would need its band in every call
            return "sliding-window attention" + ("" if length is None else f" (window {window} < {length})")
        if getattr(cfg, "attn_logit_softcapping", None):
            return "attention logit soft-capping"
        if getattr(cfg, "attention_dropout", 0.0):
            return "attention dropout"
    return None


@dataclass
class SharedPrompts:
    """A preference batch re-laid with one prompt per pair (see the module docstring).

    Attributes:
        input_ids: ``[B, L]`` token ids, ``[prompt | chosen | rejected | pad]`` per pair.
        attention_mask: ``[B, 1, L, L]``: a marker (an all-False broadcast view that carries ``rows``; HF's wrapped
            SDPA function runs :func:`attend` on it).
        position_ids: ``[B, L]``.
        index: ``[2B, T]`` flat index into the ``B·L`` shared positions for each position of the original rows
            (padding positions point at position 0 of their pair's row; their labels are masked).
        rows: Each pair's prompt and completion lengths.
        saved: Fraction of positions (padding counted) the shared batch does not run.
        host: The original ``[2B, T]`` input ids and completion mask as read into host memory (a caller may find
            the scored positions there without reading the device again).
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    index: torch.Tensor
    rows: Rows
    saved: float
    host: tuple[torch.Tensor, torch.Tensor]

    def model_kwargs(self) -> dict[str, torch.Tensor]:
        return {
            "input_ids": self.input_ids,
            "attention_mask": self.attention_mask,
            "position_ids": self.position_ids,
        }

    def unshare(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[B, L, H]`` hidden states of the shared batch → ``[2B, T, H]`` in the original rows' layout."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        index = self.index.to(flat.device)
        return flat.index_select(0, index.reshape(-1)).view(*index.shape, hidden.shape[-1])


_SDPA_WRAPPED = False


def _wrap_hf_sdpa() -> None:
    """Register a pass-through wrapper of HF's ``sdpa`` attention function that runs :func:`attend` when the mask
    is this module's marker (any other call is HF's function, unchanged). Idempotent."""
    global _SDPA_WRAPPED
    if _SDPA_WRAPPED:
        return
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS, AttentionInterface

    hf_sdpa = ALL_ATTENTION_FUNCTIONS["sdpa"]

    def sdpa_or_shared(module, query, key, value, attention_mask, *args, **kwargs):
        rows = getattr(attention_mask, "_strop_shared_prompts", None)
        if rows is None:
            return hf_sdpa(module, query, key, value, attention_mask, *args, **kwargs)
        if kwargs.get("dropout") or (args and args[0]):
            raise ValueError("shared-prompt attention has no dropout")
        return attend(rows, query, key, value, kwargs.get("scaling")), None

    AttentionInterface.register("sdpa", sdpa_or_shared)
    _SDPA_WRAPPED = True


def _prompt_and_length(
    attention_mask: torch.Tensor, completion_mask: torch.Tensor
) -> tuple[torch.Tensor, ...] | str:
    """Per row: valid length n and prompt length p, or why the rows are not right-padded prompt + completion."""
    am, cm = attention_mask.bool(), completion_mask.bool()
    pos = torch.arange(am.shape[1], device=am.device)
    n = am.sum(1)
    if not torch.equal(am, pos < n[:, None]):
        return "attention mask is not right padding"
    # the prompt: what precedes the first completion token (a row without one is all prompt)
    first = torch.where(cm.any(1), cm.int().argmax(1), n)
    if not torch.equal(cm, (pos >= first[:, None]) & (pos < n[:, None])):
        return "completion tokens are not one contiguous run to the end of the row"
    return n, first


def share_prompts(
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    completion_mask: torch.Tensor,
    *,
    attn_implementation: str | None,
    pad_token_id: int = 0,
) -> SharedPrompts | str:
    """Lay the ``[chosen; rejected]`` rows of a preference batch out with one prompt per pair.

    Args:
        input_ids: ``[2B, T]``: rows i < B chosen, row B + i the rejected answer to the same prompt (TRL's order).
        attention_mask: ``[2B, T]`` 0/1, right padding.
        completion_mask: ``[2B, T]`` 0/1, the completion tokens (after the prompt, before the padding).
        attn_implementation: The model's ``config._attn_implementation``.
        pad_token_id: Token id written at padding positions.

    Returns:
        The :class:`SharedPrompts`, or a one-line reason why the batch is run as it is.
    """
    if attn_implementation != "sdpa":
        return f"attention {attn_implementation!r} (the shared rows' attention is reached through sdpa's)"
    if input_ids.dim() != 2 or input_ids.shape[0] % 2 or input_ids.shape[0] == 0:
        return f"not [chosen; rejected] rows: input_ids {tuple(input_ids.shape)}"
    device = input_ids.device
    # one read of the batch into host memory: every check and index below is host work, with no other wait on the
    # device's queue, and the layout's tensors go back with copies that do not wait either
    host = torch.stack(
        [input_ids, attention_mask.to(input_ids.dtype), completion_mask.to(input_ids.dtype)]
    ).cpu()
    input_ids, attention_mask, completion_mask = host.unbind(0)
    lengths = _prompt_and_length(attention_mask, completion_mask)
    if isinstance(lengths, str):
        return lengths
    n, p = lengths
    two_b, t = input_ids.shape
    b = two_b // 2
    if not torch.equal(p[:b], p[b:]):
        return "a pair's chosen and rejected rows have prompts of different lengths"
    pos = torch.arange(t, device=input_ids.device)
    prompt = pos < p[:b, None]
    if not torch.equal(input_ids[:b][prompt], input_ids[b:][prompt]):
        return "a pair's chosen and rejected rows start with different prompt tokens"
    nc, nr, pp = n[:b], n[b:], p[:b]
    lengths_shared = nc + (nr - pp)
    width = int(lengths_shared.max())
    saved = 1.0 - (b * width) / (two_b * t)
    if saved < MIN_SAVING:
        return f"sharing would save {saved:.0%} of the positions (< {MIN_SAVING:.0%})"

    j = torch.arange(width, device=input_ids.device)[None, :]  # shared positions
    in_chosen = j < nc[:, None]  # prompt and chosen completion
    in_rejected = (j >= nc[:, None]) & (j < lengths_shared[:, None])
    # where each shared position's token comes from in the original rows: chosen row i, or rejected row B + i
    src_col = torch.where(in_rejected, j - nc[:, None] + pp[:, None], j)
    src_row = torch.arange(b, device=input_ids.device)[:, None] + torch.where(in_rejected, b, 0)
    valid = in_chosen | in_rejected
    ids = torch.where(valid, input_ids[src_row, src_col.clamp(max=t - 1)], pad_token_id)
    position_ids = torch.where(valid, src_col, 0)
    # original (row, column) → flat shared position
    col = pos[None, :]
    rows_b = torch.arange(two_b, device=input_ids.device) % b
    nc_row = nc[rows_b][:, None]
    p_row = pp[rows_b][:, None]
    is_rejected = (torch.arange(two_b, device=input_ids.device) >= b)[:, None]
    shared_col = torch.where(is_rejected & (col >= p_row), col - p_row + nc_row, col)
    shared_col = torch.where(col < n[:, None], shared_col, 0)
    index = rows_b[:, None] * width + shared_col
    p_list, c_list, r_list = pp.tolist(), (nc - pp).tolist(), (nr - pp).tolist()
    rows = Rows(tuple(p_list), tuple(zip(c_list, r_list, strict=True)), width)
    _wrap_hf_sdpa()
    # HF passes a 4-D mask on as it is: a function other than the wrapped SDPA would read "attend to nothing"
    # and produce NaN, never a silently wrong result
    marker = torch.zeros(1, 1, 1, 1, dtype=torch.bool, device=device).expand(b, 1, width, width)
    marker._strop_shared_prompts = rows
    ids, position_ids, index = (upload(t, device) for t in (ids, position_ids, index))
    return SharedPrompts(ids, marker, position_ids, index, rows, saved, (input_ids, completion_mask))


def _model_reason(hf: Any, length: int) -> str | None:
    """Why ``hf`` cannot run a shared layout of rows of ``length`` positions (None: it can)."""
    cfg = hf.config.get_text_config() if hasattr(hf.config, "get_text_config") else hf.config
    reason = config_reason([cfg], length)
    if reason is not None:
        return reason
    devices = set(getattr(hf, "hf_device_map", {}).values())
    if len(devices) > 1:
        return f"a model split over {len(devices)} devices (the mask marker would be copied between them)"
    return None


class PromptSharing:
    """One trainer's use of :func:`share_prompts`: the batches it shared, and each reason not to logged once.

    Args:
        method: The loss's name, for the log ("DPO", "ORPO", ...).
    """

    def __init__(self, method: str) -> None:
        self.method = method
        self.batches = 0
        self.reasons: set[str] = set()

    def layout(
        self, hf: Any, model_kwargs: dict[str, Any], completion_mask: torch.Tensor
    ) -> SharedPrompts | None:
        """The shared layout of the model call ``model_kwargs`` (ids, a 2-D mask, ``use_cache``) of the
        transformers model ``hf``, or None (run the call as it is)."""
        extra = sorted(set(model_kwargs) - {"input_ids", "attention_mask", "use_cache"})
        mask = model_kwargs.get("attention_mask")
        if extra:
            reason: SharedPrompts | str | None = f"model inputs {extra} besides input_ids/attention_mask"
        elif not isinstance(mask, torch.Tensor) or mask.dim() != 2:
            reason = "no 2-D attention mask"
        else:
            reason = _model_reason(hf, mask.shape[1])
        if reason is None:
            reason = share_prompts(
                model_kwargs["input_ids"],
                mask,
                completion_mask.to(mask.device),
                attn_implementation=getattr(hf.config, "_attn_implementation", None),
            )
        if isinstance(reason, str):
            return self.unshared(reason)
        self.batches += 1
        return reason

    def unshared(self, reason: str) -> None:
        """Note (once per reason) that a batch runs as it is; returns None."""
        if reason not in self.reasons:
            self.reasons.add(reason)
            logger.info("strop.kernels %s: pairs run unshared: %s", self.method, reason)
