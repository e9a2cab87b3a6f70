"""One forward over a prompt's group with the prompt computed once: GRPO's training layout (``grpo.py``).

A GRPO group is G completions of one prompt. Padded into G rows, the prompt's P tokens are run G times through the
forward, the recompute and the backward, each copy computing exactly what the others do (at 4K prompt tokens, 128
new and G = 8: 33.9K positions trained where 5.1K differ). Here the group is one row instead:

    tokens      prompt (P)  |  sample 1's completion minus its last token (n_1)  |  sample 2's (n_2)  | …
    positions   0 … P−1     |  P … P+n_1−1                                      |  P … P+n_2−1       | …
    attention   the prompt: causal over itself; a completion token: every prompt key and its own sample's earlier
                tokens, never another sample's

so each sample's tokens see the keys, values and RoPE positions its padded row gives them, the prompt once. The hidden
state predicting a sample's first token is the prompt's last (shared: its gradient is the sum over the samples,
as the padded rows' copies sum into the same LoRA weights); the others are the sample's own positions.

Attention is this module's function in transformers' attention interface (``ATTENTION``), swapped into the model's
configs around the forward and the backward (checkpointed layers recompute in backward): the prompt's causal
attention by SDPA with ``is_causal`` (flash/cuDNN on CUDA), then every completion query at once by SDPA over the
prompt's and the completions' keys with a boolean mask [Σn, P + Σn]. No attention mask tensor over the whole row is
built ([L, L] would be quadratic in the prompt), and the mask interface returns none for this attention.

Beside ``kernels/trainers/shared_prompt.py`` (DPO/ORPO pairs): that one shares the token-wise ops of TRL's
``[2B, T]`` rows and runs attention in those rows (q/k/v gathered back), so its attention FLOPs and K/V gather are
the unshared batch's; here the prompt's attention runs once, which is where a group of 8 at a long prompt spends
(at 64K tokens attention's FLOPs pass the projections'). Moving the pairs onto this attention (G = 2) would leave one
owner; not done yet.

Where it applies (``reason``): causal self-attention over the whole row (no sliding window, no attention soft-cap, no
attention dropout); anything else trains the padded rows.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn.functional as F

ATTENTION = "strop_shared_prefix"
_LAYOUT = (
    "_strop_shared_prefix"  # the config attribute the attention reads the layout from (a plain attribute:
)
# autograd may run a checkpointed layer's recompute on its own thread, where a context variable would not be set)


@dataclass
class Layout:
    """One group's row: ``prompt`` tokens, then each sample's completion inputs (``lengths``)."""

    prompt: int
    lengths: list[int]
    completion_mask: torch.Tensor | None  # [Σn, P + Σn] bool: which keys each completion query sees

    @property
    def width(self) -> int:
        return self.prompt + sum(self.lengths)


def layout(prompt: int, lengths: list[int], device: str | torch.device) -> Layout:
    n = sum(lengths)
    if n == 0:
        return Layout(prompt, lengths, None)
    sample = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    index = torch.arange(n)
    own = (sample[:, None] == sample[None, :]) & (index[:, None] >= index[None, :])
    mask = torch.cat([torch.ones(n, prompt, dtype=torch.bool), own], dim=1)
    return Layout(prompt, lengths, mask.to(device))


def inputs(
    prompt: list[int], completions: list[list[int]], device
) -> tuple[torch.Tensor, torch.Tensor, Layout]:
    """``(tokens [1, L], positions [1, L], layout)`` of a group whose samples are ``completions`` (each one's
    tokens minus the last, which no position predicts from)."""
    p = len(prompt)
    tokens = list(prompt) + [t for c in completions for t in c]
    positions = list(range(p)) + [p + i for c in completions for i in range(len(c))]
    row = [torch.tensor([xs], dtype=torch.long, device=device) for xs in (tokens, positions)]
    return row[0], row[1], layout(p, [len(c) for c in completions], device)


def predicting_rows(lay: Layout, sample_lengths: list[int], device) -> torch.Tensor:
    """The row positions whose hidden states predict each sample's tokens, sample by sample: the prompt's last
    position for its first token, then its own positions (``sample_lengths``: each sample's tokens)."""
    out, start = [], lay.prompt
    for n_inputs, n_tokens in zip(lay.lengths, sample_lengths, strict=True):
        if n_tokens != n_inputs + 1:
            raise ValueError(f"a sample of {n_tokens} tokens has {n_inputs} inputs in the row")
        out += [lay.prompt - 1, *range(start, start + n_inputs)]
        start += n_inputs
    return torch.tensor(out, dtype=torch.long, device=device)


def reason(model) -> str | None:
    """Why the model's attention is not plain causal self-attention over a row (None: the layout applies)."""
    from strop.trainer_svc.core.decode_step import model_parts

    parts = model_parts(model)
    if parts.sliding is not None:
        return "sliding-window attention"
    for c in parts.configs:
        if getattr(c, "attn_logit_softcapping", None):
            return "attention logit soft-capping"
        if getattr(c, "attention_dropout", 0.0):
            return "attention dropout"
    return None


def attention(module, query, key, value, attention_mask=None, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention interface for one group's row (``query`` [1, Hq, L, D], ``key``/``value``
    [1, Hkv, L, D]) → ([1, L, Hq, D], None)."""
    lay: Layout = getattr(module.config, _LAYOUT)
    p = lay.prompt
    if dropout:
        raise ValueError("shared-prefix attention has no dropout")
    groups = query.shape[1] // key.shape[1]
    out = [
        F.scaled_dot_product_attention(
            query[:, :, :p],
            key[:, :, :p],
            value[:, :, :p],
            is_causal=True,
            scale=scaling,
            enable_gqa=groups > 1,
        )
    ]
    if lay.completion_mask is not None:
        # the kv heads repeated to the query heads: SDPA's memory-efficient kernel takes the mask, not GQA
        k = key.repeat_interleave(groups, dim=1) if groups > 1 else key
        v = value.repeat_interleave(groups, dim=1) if groups > 1 else value
        out.append(
            F.scaled_dot_product_attention(
                query[:, :, p:], k, v, attn_mask=lay.completion_mask, scale=scaling
            )
        )
    return torch.cat(out, dim=2).transpose(1, 2).contiguous(), None


def _no_mask(*args, **kwargs):
    return None  # the attention builds its own (the completion queries'); none over the whole row


def register() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION, attention)
    AttentionMaskInterface.register(ATTENTION, _no_mask)


@contextlib.contextmanager
def active(model, lay: Layout):
    """The model's attention is this layout's while the block runs (the forward and its backward)."""
    from strop.trainer_svc.core.decode_step import model_parts

    register()
    configs = model_parts(model).configs
    before = [(c, c._attn_implementation_internal) for c in configs]
    for c in configs:
        c._attn_implementation_internal = ATTENTION
        setattr(c, _LAYOUT, lay)
    try:
        yield
    finally:
        for c, impl in before:
            c._attn_implementation_internal = impl
            if hasattr(c, _LAYOUT):
                delattr(c, _LAYOUT)
