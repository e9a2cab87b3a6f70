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

Attention is ``kernels/trainers/shared_prompt.py``'s (:func:`attend` over :class:`Rows`, the one owner of the
shared-prefix layout; DPO/ORPO/SimPO pairs are its other users: a prompt and two suffixes), put in transformers'
attention interface (``ATTENTION``) and swapped into the model's configs around the forward and the backward
(checkpointed layers recompute in backward): the prompt and the first completion by SDPA with ``is_causal``
(flash/cuDNN on CUDA), then every later completion query at once by SDPA over the row's keys with a boolean mask
[Σn, P + Σn]. No attention mask tensor over the whole row is built ([L, L] would be quadratic in the prompt), and
the mask interface returns none for this attention.

Where it applies (``reason``): causal self-attention over the whole row (no sliding window, no attention soft-cap, no
attention dropout); anything else trains the padded rows.
"""

from __future__ import annotations

import contextlib

import torch

from strop.kernels.trainers.shared_prompt import Rows, attend, config_reason

ATTENTION = "strop_shared_prefix"
_LAYOUT = (
    "_strop_shared_prefix"  # the config attribute the attention reads the layout from (a plain attribute:
)
# autograd may run a checkpointed layer's recompute on its own thread, where a context variable would not be set)

Layout = Rows  # one group's row: the prompt, then each sample's completion inputs


def layout(prompt: int, lengths: list[int]) -> Rows:
    return Rows.single(prompt, lengths)


def inputs(
    prompt: list[int], completions: list[list[int]], device
) -> tuple[torch.Tensor, torch.Tensor, Layout]:
    """``(tokens [1, L], positions [1, L], layout)`` of a group whose samples are ``completions`` (each one's
    tokens minus the last, which no position predicts from)."""
    p = len(prompt)
    tokens = list(prompt) + [t for c in completions for t in c]
    positions = list(range(p)) + [p + i for c in completions for i in range(len(c))]
    row = [torch.tensor([xs], dtype=torch.long, device=device) for xs in (tokens, positions)]
    return row[0], row[1], layout(p, [len(c) for c in completions])


def predicting_rows(lay: Layout, sample_lengths: list[int], device) -> torch.Tensor:
    """The row positions whose hidden states predict each sample's tokens, sample by sample: the prompt's last
    position for its first token, then its own positions (``sample_lengths``: each sample's tokens)."""
    (prompt,), (lengths,) = lay.prompts, lay.suffixes
    out, start = [], prompt
    for n_inputs, n_tokens in zip(lengths, sample_lengths, strict=True):
        if n_tokens != n_inputs + 1:
            raise ValueError(f"a sample of {n_tokens} tokens has {n_inputs} inputs in the row")
        out += [prompt - 1, *range(start, start + n_inputs)]
        start += n_inputs
    return torch.tensor(out, dtype=torch.long, device=device)


def reason(model) -> str | None:
    """Why the model's attention is not plain causal self-attention over a row (None: the layout applies)."""
    from strop.trainer_svc.core.decode_step import model_parts

    parts = model_parts(model)
    if parts.sliding is not None:
        return "sliding-window attention"
    return config_reason(parts.configs)


def attention(module, query, key, value, attention_mask=None, dropout: float = 0.0, scaling=None, **kwargs):
    """transformers' attention interface for one group's row (``query`` [1, Hq, L, D], ``key``/``value``
    [1, Hkv, L, D]) → ([1, L, Hq, D], None)."""
    if dropout:
        raise ValueError("shared-prefix attention has no dropout")
    return attend(getattr(module.config, _LAYOUT), query, key, value, scaling), None


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
