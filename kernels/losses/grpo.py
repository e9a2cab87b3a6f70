"""GRPO's policy loss and its variants, one small function of per-token log-probs over the chunked log-prob engine
(``logps.py``), with a plain-torch reference from the full logits beside it.

For a step's sequences i (a prompt's group of G completions each; S sequences in the step, T tokens in all), each
completion token t of sequence i has: ``lp`` the learner's log-prob (this pass, differentiable), ``old`` the
log-prob under the weights that sampled it as the trainer computes them (the first policy update of a batch:
``lp`` detached), ``q`` the sampler's own log-prob, ``A_i`` the sequence's advantage, ``ref`` the reference's
log-prob (the base with the adapter disabled, only when β > 0). Then

    ratio     ρ_t = exp(lp_t − old_t)                           token level (GRPO, Dr. GRPO, DAPO)
              ρ_t = exp(mean_{u∈i}(lp_u − old_u))                GSPO (Zheng et al. 2025, eq. 7: one length-normalised
                                                                 ratio per sequence, differentiable through the mean)
    clipped   c_t = min(ρ_t A_i, clip(ρ_t, 1 − ε_low, 1 + ε_high) A_i)      (PPO's; DAPO's clip-higher: ε_high > ε_low)
    TIS       w_t = min(exp(old_t − q_t), C)                    truncated importance sampling between the trainer's
                                                                 and the sampler's numerics (Yao et al. 2025, "Your
                                                                 efficient RL framework secretly brings you
                                                                 off-policy RL training"); 1 when off
    KL        k_t = exp(ref_t − lp_t) − (ref_t − lp_t) − 1      Schulman's k3 estimator, as DeepSeekMath eq. 4
    term      ℓ_t = −w_t c_t + β k_t

and the loss aggregates the terms (``loss_type``):

    GRPO      (1/S) Σ_i (1/|i|) Σ_{t∈i} ℓ_t                     DeepSeekMath (Shao et al. 2024), eq. 3
    DR_GRPO   (1/(S·L)) Σ_i Σ_{t∈i} ℓ_t, L = max_new_tokens      Dr. GRPO (Liu et al. 2025), eq. 5: a constant
                                                                 normaliser, no length bias
    DAPO      (1/T) Σ_i Σ_{t∈i} ℓ_t                              DAPO (Yu et al. 2025), eq. 8: token-level mean

S and T are the whole step's (``num_seqs``, ``num_tokens`` in the config), so a step split into micro-batches sums
to the same loss and gradient as one pass over it. Advantages (group-normalised, with or without the std) are the
caller's (``group_advantages``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
import torch.nn.functional as F

from .logps import token_logps_reference, token_logps_rows

__all__ = [
    "LOSS_TYPES",
    "GrpoStats",
    "group_advantages",
    "grpo_loss",
    "grpo_loss_from_logps",
    "grpo_loss_reference",
    "token_entropy_rows",
]

Tensor = torch.Tensor
LOSS_TYPES = ("GRPO", "DR_GRPO", "DAPO")


def group_advantages(rewards: Tensor, *, scale: bool, eps: float = 1e-4) -> Tensor:
    """[P, G] rewards → [P, G] advantages: ``r − mean_group`` (Dr. GRPO), divided by ``std_group + eps`` when
    ``scale`` (GRPO, DAPO; the unbiased std and the 1e-4 TRL's GRPOTrainer uses)."""
    adv = rewards - rewards.mean(dim=1, keepdim=True)
    if scale:
        adv = adv / (rewards.std(dim=1, keepdim=True) + eps)
    return adv


GrpoStats = (
    dict  # "clipped" (tokens whose term took the clipped side), "kl" (Σ k_t), "tis" (Σ w_t): fp32 sums
)


def grpo_loss_from_logps(
    lp: Tensor, inputs: Mapping[str, Tensor], cfg: Mapping[str, float | str | bool]
) -> tuple[Tensor, GrpoStats]:
    """The loss of the module docstring from per-token log-probs ``lp`` [M].

    ``inputs`` ([M] each): ``old_logps`` (absent: ``lp`` detached, the first update of a batch), ``sampler_logps``,
    ``advantages`` (the sequence's, per token), ``seq_index`` (int64, in [0, n) for this call's n sequences),
    ``ref_logps`` (when ``kl_coef`` > 0), ``trainer_logps`` (what TIS compares with the sampler's; absent: ``old``,
    which is right when both are log-probs of one distribution; the loop passes the raw ones when it trains the
    tempered policy). ``cfg``:
    ``loss_type``, ``clip_eps_low``, ``clip_eps_high``, ``kl_coef``, ``tis_cap`` (< 0: off), ``sequence_ratio``,
    ``num_seqs`` and ``num_tokens`` (the step's S and T), ``max_new_tokens``.
    """
    seq = inputs["seq_index"]
    n = int(seq.max()) + 1 if seq.numel() else 0
    lengths = torch.zeros(n, dtype=lp.dtype, device=lp.device).index_add_(0, seq, torch.ones_like(lp))
    old = inputs["old_logps"] if "old_logps" in inputs else lp.detach()
    log_ratio = lp - old
    if cfg["sequence_ratio"]:
        per_seq = torch.zeros(n, dtype=lp.dtype, device=lp.device).index_add(0, seq, log_ratio) / lengths
        log_ratio = per_seq[seq]
    ratio = torch.exp(log_ratio)
    adv = inputs["advantages"]
    lo, hi = 1.0 - float(cfg["clip_eps_low"]), 1.0 + float(cfg["clip_eps_high"])
    unclipped, clipped = ratio * adv, ratio.clamp(lo, hi) * adv
    surrogate = torch.minimum(unclipped, clipped)
    term = -surrogate
    cap = float(cfg["tis_cap"])
    tis = (
        torch.exp(inputs.get("trainer_logps", old) - inputs["sampler_logps"]).clamp(max=cap)
        if cap >= 0
        else torch.ones_like(lp)
    )
    term = term * tis
    kl = torch.zeros_like(lp)
    if float(cfg["kl_coef"]) > 0:
        d = inputs["ref_logps"] - lp
        kl = torch.exp(d) - d - 1.0
        term = term + float(cfg["kl_coef"]) * kl
    kind = cfg["loss_type"]
    if kind == "GRPO":
        loss = (term / lengths[seq]).sum() / float(cfg["num_seqs"])
    elif kind == "DR_GRPO":
        loss = term.sum() / (float(cfg["num_seqs"]) * float(cfg["max_new_tokens"]))
    elif kind == "DAPO":
        loss = term.sum() / float(cfg["num_tokens"])
    else:
        raise ValueError(f"loss_type must be one of {LOSS_TYPES}, got {kind!r}")
    stats = {
        "clipped": (clipped < unclipped).sum().float().detach(),
        "kl": kl.detach().sum(),
        "tis": tis.detach().sum(),
    }
    return loss, stats


def grpo_loss(
    rows: Tensor,
    weight: Tensor,
    targets: Tensor,
    inputs: Mapping[str, Tensor],
    cfg: Mapping[str, float | str | bool],
    *,
    bias: Tensor | None = None,
    chunk_size: int | None = None,
    softcap: float | None = None,
    logps: Callable[[Tensor, Tensor], Tensor] | None = None,
) -> tuple[Tensor, Tensor, GrpoStats]:
    """GRPO's loss over hidden rows [M, H] (one per completion token), chunked: (loss, lp [M], stats).

    ``logps`` replaces the frozen-head engine (``token_logps_trainable_head`` for a LoRA on the head)."""
    if logps is None:
        lp = token_logps_rows(rows, weight, targets, bias, chunk_size=chunk_size, softcap=softcap)
    else:
        lp = logps(rows, targets)
    loss, stats = grpo_loss_from_logps(lp, inputs, cfg)
    return loss, lp, stats


def grpo_loss_reference(
    rows: Tensor,
    weight: Tensor,
    targets: Tensor,
    inputs: Mapping[str, Tensor],
    cfg: Mapping[str, float | str | bool],
    *,
    bias: Tensor | None = None,
    softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    """:func:`grpo_loss` from the full logits in plain torch, sequence by sequence as the papers write it."""
    lp = token_logps_reference(rows, weight, targets, bias, softcap=softcap)
    seq = inputs["seq_index"].tolist()
    n = max(seq) + 1
    terms = []
    for i in range(n):
        idx = torch.tensor([m for m, s in enumerate(seq) if s == i], dtype=torch.long)
        lp_i, old_i = lp[idx], inputs["old_logps"][idx]
        if cfg["sequence_ratio"]:
            r = torch.exp((lp_i - old_i).mean()).expand_as(lp_i)
        else:
            r = torch.exp(lp_i - old_i)
        a = inputs["advantages"][idx]
        lo, hi = 1 - cfg["clip_eps_low"], 1 + cfg["clip_eps_high"]
        surr = torch.where(a >= 0, torch.where(r > hi, hi * a, r * a), torch.where(r < lo, lo * a, r * a))
        w = torch.ones_like(lp_i)
        if cfg["tis_cap"] >= 0:
            w = torch.minimum(torch.exp(old_i - inputs["sampler_logps"][idx]), torch.tensor(cfg["tis_cap"]))
        t = -w * surr
        if cfg["kl_coef"] > 0:
            ref_i = inputs["ref_logps"][idx]
            t = t + cfg["kl_coef"] * (torch.exp(ref_i - lp_i) - (ref_i - lp_i) - 1)
        terms.append(t)
    if cfg["loss_type"] == "GRPO":
        loss = sum(t.mean() for t in terms) / cfg["num_seqs"]
    elif cfg["loss_type"] == "DR_GRPO":
        loss = sum(t.sum() for t in terms) / (cfg["num_seqs"] * cfg["max_new_tokens"])
    else:
        loss = sum(t.sum() for t in terms) / cfg["num_tokens"]
    return loss, lp


@torch.no_grad()
def token_entropy_rows(
    rows: Tensor,
    weight: Tensor,
    bias: Tensor | None = None,
    *,
    chunk_rows: int = 256,
    softcap: float | None = None,
) -> Tensor:
    """Each row's next-token entropy ``−Σ_v p_v log p_v`` [M] (fp32, no gradient), ``chunk_rows`` rows at a time so
    only one chunk's ``[C, V]`` logits exist (a metric: the policy's entropy over the sampled tokens)."""
    out = []
    for start in range(0, rows.shape[0], chunk_rows):
        z = F.linear(rows[start : start + chunk_rows].to(weight.dtype), weight, bias).float()
        if softcap is not None:
            z = softcap * torch.tanh(z / softcap)
        logp = z.log_softmax(-1)
        out.append(-(logp.exp() * logp).sum(-1))
    return torch.cat(out) if out else rows.new_zeros(0, dtype=torch.float32)
