"""The step API's per-token losses (Tinker's built-in ``loss_fn``s), each a small function of per-token log-probs,
with a plain-torch reference from the full logits beside them.

Notation (Tinker's docs, https://tinker-docs.thinkingmachines.ai/tinker/losses/*; see
docs/design/tinker-wire.md §6): ``lp`` = the learner's log-prob of each target token, computed in this pass;
``q`` = ``logprobs``, the sampler's; ``A`` = ``advantages``; ``w`` = ``weights``; ``r = exp(lp − q)``. Every
loss is a plain **sum** over tokens and datums (no mean: gradients of several calls before one optimizer step
add up exactly, and a client's custom loss passed as ``weights = −∂C/∂lp`` is exact):

    cross_entropy         −Σ w·lp                                           (…/losses/cross-entropy)
    importance_sampling   −Σ r·A                                            (…/losses/importance-sampling)
    ppo                   −Σ min(r·A, clip(r, lo, hi)·A)                    (…/losses/ppo; lo, hi = 0.8, 1.2:
                                                                             "ε fixed to 0.2")
    cispo                 −Σ sg(clip(r, lo, hi))·lp·A                       (…/losses/cispo; lo, hi = 0, 4)
    dro                   −Σ (lp·A − ½β(lp − q)²)                           (…/losses/dro; β: the docs'
                                                                             example 0.05, our default)

``lo``/``hi`` are absolute ratio bounds (``clip_low_threshold``/``clip_high_threshold``), from the loss config
or per token from the datum. ``dro``'s β defaults to 0.05, the value of the docs' example (the docs give no
other default, and the SDK carries none: ``loss_fn_config`` is a free ``dict[str, float]``).

``weights`` on the RL losses: optional, and when given, each token's term is multiplied by its weight, a weight
of 0 dropping the token from the sum (its value, even non-finite, never reaches the loss). The docs' own RL datum example sends ``weights``
("0 for prompt, 1 for completion") with ``importance_sampling`` (https://tinker-docs.thinkingmachines.ai/tinker/
losses, "For RL losses, the Datum also includes…"), so refusing it broke that example; the docs' per-loss
formulas show no ``w``, so the multiplication is SkyRL's reading (its Tinker backend's JAX losses apply
``safe_loss_mask(term, weights)`` to every loss). The two readings agree wherever a weight-0 token has ``A = 0``
(the cookbook's datums: prompt tokens get ``A = 0``, and it strips its own ``mask`` key before sending,
``tinker_cookbook/rl/train.py`` ``_remove_mask``), except ``dro``, whose quadratic term would otherwise pull the
prompt tokens' log-probs toward the placeholder ``q = 0`` the cookbook writes there. ``gspo`` and
``stable_reinforce`` have no public definition and are not offered.

The log-probs come from the one chunked engine (``logps.py``: ``token_logps_rows``), so the full logits never
exist; :func:`per_token_loss_reference` computes the same from full logits in plain torch.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from .logps import token_logps_reference, token_logps_rows

__all__ = [
    "LOSSES",
    "LossSpec",
    "cispo_loss",
    "cross_entropy_loss",
    "dro_loss",
    "importance_sampling_loss",
    "per_token_loss",
    "per_token_loss_reference",
    "ppo_loss",
]

Tensor = torch.Tensor


def cross_entropy_loss(lp: Tensor, inputs: Mapping[str, Tensor], cfg: Mapping[str, float]) -> Tensor:
    return -(lp * inputs["weights"]).sum()


def _weighted(term: Tensor, inputs: Mapping[str, Tensor]) -> Tensor:
    """Each token's term times its ``weights`` entry when the datum has them; a weight of 0 drops the token."""
    w = inputs.get("weights")
    if w is None:
        return term
    return torch.where(w != 0, w * term, torch.zeros_like(term))


def importance_sampling_loss(lp: Tensor, inputs: Mapping[str, Tensor], cfg: Mapping[str, float]) -> Tensor:
    ratio = torch.exp(lp - inputs["logprobs"])
    return -_weighted(ratio * inputs["advantages"], inputs).sum()


def _bounds(inputs: Mapping[str, Tensor], cfg: Mapping[str, float]) -> tuple[Tensor | float, Tensor | float]:
    lo = inputs.get("clip_low_threshold", cfg["clip_low_threshold"])
    hi = inputs.get("clip_high_threshold", cfg["clip_high_threshold"])
    return lo, hi


def _clamp(x: Tensor, lo: Tensor | float, hi: Tensor | float) -> Tensor:
    lo_t = torch.as_tensor(lo, dtype=x.dtype, device=x.device)
    hi_t = torch.as_tensor(hi, dtype=x.dtype, device=x.device)
    return torch.minimum(torch.maximum(x, lo_t), hi_t)


def ppo_loss(lp: Tensor, inputs: Mapping[str, Tensor], cfg: Mapping[str, float]) -> Tensor:
    ratio = torch.exp(lp - inputs["logprobs"])
    adv = inputs["advantages"]
    lo, hi = _bounds(inputs, cfg)
    return -_weighted(torch.min(ratio * adv, _clamp(ratio, lo, hi) * adv), inputs).sum()


def cispo_loss(lp: Tensor, inputs: Mapping[str, Tensor], cfg: Mapping[str, float]) -> Tensor:
    ratio = torch.exp(lp - inputs["logprobs"])
    lo, hi = _bounds(inputs, cfg)
    return -_weighted(_clamp(ratio, lo, hi).detach() * lp * inputs["advantages"], inputs).sum()


def dro_loss(lp: Tensor, inputs: Mapping[str, Tensor], cfg: Mapping[str, float]) -> Tensor:
    q, adv = inputs["logprobs"], inputs["advantages"]
    return -_weighted(lp * adv - 0.5 * cfg["beta"] * (lp - q) ** 2, inputs).sum()


@dataclass(frozen=True)
class LossSpec:
    """What a loss reads: the per-token inputs it requires and accepts, and its config keys with defaults."""

    fn: Callable[[Tensor, Mapping[str, Tensor], Mapping[str, float]], Tensor]
    required: tuple[str, ...]
    optional: tuple[str, ...] = ()
    config: dict[str, float] = field(default_factory=dict)


_RL = ("target_tokens", "logprobs", "advantages")
_CLIPS = ("clip_low_threshold", "clip_high_threshold", "weights")

# The one table from a loss name to what it computes and reads (validation and the step API read it).
LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(cross_entropy_loss, ("target_tokens", "weights")),
    "importance_sampling": LossSpec(importance_sampling_loss, _RL, ("weights",)),
    "ppo": LossSpec(ppo_loss, _RL, _CLIPS, {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}),
    "cispo": LossSpec(cispo_loss, _RL, _CLIPS, {"clip_low_threshold": 0.0, "clip_high_threshold": 4.0}),
    "dro": LossSpec(dro_loss, _RL, ("weights",), {"beta": 0.05}),
}


def per_token_loss(
    loss_fn: str,
    rows: Tensor,
    weight: Tensor,
    inputs: Mapping[str, Tensor],
    cfg: Mapping[str, float] | None = None,
    *,
    bias: Tensor | None = None,
    chunk_size: int | None = None,
    softcap: float | None = None,
    logps: Callable[[Tensor, Tensor], Tensor] | None = None,
) -> tuple[Tensor, Tensor]:
    """``loss_fn`` over hidden rows [M, H] (one per scored token), chunked: (loss, per-token log-probs [M]).

    ``inputs`` hold [M] tensors (``target_tokens`` int64; the others fp32); ``cfg`` the loss config (defaults
    from :data:`LOSSES`). ``logps`` replaces the frozen-head engine (``token_logps_trainable_head`` for a LoRA
    on the head).
    """
    spec = LOSSES[loss_fn]
    targets = inputs["target_tokens"]
    if logps is None:
        lp = token_logps_rows(rows, weight, targets, bias, chunk_size=chunk_size, softcap=softcap)
    else:
        lp = logps(rows, targets)
    floats = {k: v.float() for k, v in inputs.items() if k != "target_tokens"}
    return spec.fn(lp, floats, {**spec.config, **(cfg or {})}), lp


def per_token_loss_reference(
    loss_fn: str,
    rows: Tensor,
    weight: Tensor,
    inputs: Mapping[str, Tensor],
    cfg: Mapping[str, float] | None = None,
    *,
    bias: Tensor | None = None,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`per_token_loss` from the full logits in plain torch, with the formulas written out again."""
    lp = token_logps_reference(rows, weight, inputs["target_tokens"], bias, softcap=softcap)
    c = {**LOSSES[loss_fn].config, **(cfg or {})}
    f = {k: v.float() for k, v in inputs.items() if k != "target_tokens"}
    if loss_fn == "cross_entropy":
        return -(lp * f["weights"]).sum(), lp
    q, adv = f["logprobs"], f["advantages"]
    w = f.get("weights", torch.ones_like(lp))
    ratio = (lp - q).exp()
    lo = f.get("clip_low_threshold", torch.full_like(lp, c.get("clip_low_threshold", 0.0)))
    hi = f.get("clip_high_threshold", torch.full_like(lp, c.get("clip_high_threshold", 0.0)))
    if loss_fn == "importance_sampling":
        loss = -(w * ratio * adv).sum()
    elif loss_fn == "ppo":
        clipped = torch.where(ratio < lo, lo, torch.where(ratio > hi, hi, ratio))
        loss = -(w * torch.minimum(ratio * adv, clipped * adv)).sum()
    elif loss_fn == "cispo":
        clipped = torch.where(ratio < lo, lo, torch.where(ratio > hi, hi, ratio)).detach()
        loss = -(w * clipped * lp * adv).sum()
    elif loss_fn == "dro":
        loss = -(w * lp * adv).sum() + 0.5 * c["beta"] * (w * F.mse_loss(lp, q, reduction="none")).sum()
    else:
        raise ValueError(f"unknown loss {loss_fn!r}")
    return loss, lp
