"""GRPO's loss over the chunked log-prob engine against its full-logits reference (written sequence by sequence, as
the papers do), for each aggregation, GSPO's sequence ratio, the KL term and truncated IS; a step split into
micro-batches sums to the whole; the advantages against their formula."""

from __future__ import annotations

import itertools

import pytest
import torch

from strop.kernels.losses.grpo import (
    group_advantages,
    grpo_loss,
    grpo_loss_reference,
    token_entropy_rows,
)

V, H = 97, 24
LENGTHS = [3, 5, 1, 4, 6, 2]  # six sequences of odd lengths (two groups of three)


def _case(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    m = sum(LENGTHS)
    rows = torch.randn(m, H, generator=g)
    weight = torch.randn(V, H, generator=g) * 0.5
    targets = torch.randint(0, V, (m,), generator=g)
    seq = torch.repeat_interleave(torch.arange(len(LENGTHS)), torch.tensor(LENGTHS))
    lp = torch.log_softmax(rows @ weight.T, -1).gather(1, targets[:, None])[:, 0]
    adv = torch.randn(len(LENGTHS), generator=g)[seq]
    inputs = {
        # old and sampler log-probs off the learner's by up to ±0.4 nats a token plus ±0.5 a sequence, so token and
        # sequence ratios leave [0.8, 1.28] and clip
        "old_logps": lp
        + (torch.rand(m, generator=g) - 0.5) * 0.8
        + (torch.rand(len(LENGTHS), generator=g) - 0.5)[seq],
        "sampler_logps": lp + (torch.rand(m, generator=g) - 0.5) * 1.6,
        "ref_logps": lp + (torch.rand(m, generator=g) - 0.5),
        "advantages": adv,
        "seq_index": seq,
    }
    return rows, weight, targets, inputs


def _cfg(loss_type, seq_ratio, kl, tis):
    return {
        "loss_type": loss_type,
        "clip_eps_low": 0.2,
        "clip_eps_high": 0.28,
        "kl_coef": kl,
        "tis_cap": tis,
        "sequence_ratio": seq_ratio,
        "num_seqs": len(LENGTHS),
        "num_tokens": sum(LENGTHS),
        "max_new_tokens": 8,
    }


@pytest.mark.parametrize(
    "loss_type,seq_ratio,kl,tis",
    [
        (lt, sr, kl, tis)
        for lt, sr, (kl, tis) in itertools.product(
            ("GRPO", "DR_GRPO", "DAPO"), (False, True), ((0.0, -1.0), (0.04, 2.0))
        )
    ],
)
def test_grpo_loss_and_gradient_equal_the_full_logits_reference(loss_type, seq_ratio, kl, tis):
    rows, weight, targets, inputs = _case()
    cfg = _cfg(loss_type, seq_ratio, kl, tis)
    x = rows.clone().requires_grad_()
    loss, lp, stats = grpo_loss(x, weight, targets, inputs, cfg, chunk_size=7)
    loss.backward()
    y = rows.clone().requires_grad_()
    ref, ref_lp = grpo_loss_reference(y, weight, targets, inputs, cfg)
    ref.backward()
    # fp32 throughout: the chunked and full log-softmax differ by rounding (~1e-6 relative)
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, ref, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(x.grad, y.grad, rtol=1e-4, atol=1e-6)
    assert (
        float(stats["clipped"]) > 0
    )  # the case is built so that some ratios clip: the clip branch is tested
    assert float(x.grad.abs().sum()) > 0


def test_a_step_split_into_micro_batches_sums_to_the_whole():
    rows, weight, targets, inputs = _case(1)
    cfg = _cfg("GRPO", False, 0.04, 2.0)
    x = rows.clone().requires_grad_()
    whole, _, _ = grpo_loss(x, weight, targets, inputs, cfg)
    whole.backward()
    y = rows.clone().requires_grad_()
    cut = sum(LENGTHS[:3])  # the first group, then the second
    parts = []
    for sl, base in ((slice(0, cut), 0), (slice(cut, None), 3)):
        part = {k: v[sl] for k, v in inputs.items()}
        part["seq_index"] = part["seq_index"] - base
        loss, _, _ = grpo_loss(y[sl], weight, targets[sl], part, cfg)
        loss.backward()
        parts.append(loss.detach())
    torch.testing.assert_close(sum(parts), whole.detach(), rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(y.grad, x.grad, rtol=1e-6, atol=1e-8)


def test_on_policy_ratio_is_one_and_the_gradient_is_the_policy_gradient():
    # old = lp (the first update of a batch), TIS off, no KL, GRPO: loss = −(1/S) Σ_i A_i mean_t ρ_t with ρ = 1, and
    # ∂/∂lp_t = −A_i / (|i| S): the REINFORCE gradient with the group baseline
    rows, weight, targets, inputs = _case(2)
    lp = torch.log_softmax(rows @ weight.T, -1).gather(1, targets[:, None])[:, 0]
    inputs["old_logps"] = lp
    cfg = _cfg("GRPO", False, 0.0, -1.0)
    lp_var = lp.clone().requires_grad_()
    from strop.kernels.losses.grpo import grpo_loss_from_logps

    loss, stats = grpo_loss_from_logps(lp_var, inputs, cfg)
    loss.backward()
    seq = inputs["seq_index"]
    n_i = torch.tensor(LENGTHS, dtype=torch.float32)[seq]
    torch.testing.assert_close(lp_var.grad, -inputs["advantages"] / (n_i * len(LENGTHS)))
    assert float(stats["clipped"]) == 0.0


def test_group_advantages_subtract_the_group_mean_and_grpo_divides_by_its_std():
    r = torch.tensor([[1.0, 0.0, 0.0, 1.0], [0.0, 0.0, 0.0, 0.0], [3.0, 1.0, 2.0, 2.0]])
    dr = group_advantages(r, scale=False)
    torch.testing.assert_close(dr[0], torch.tensor([0.5, -0.5, -0.5, 0.5]))
    assert float(dr[1].abs().sum()) == 0.0  # a group of equal rewards carries no signal
    grpo = group_advantages(r, scale=True)
    std0 = (4 * 0.25 / 3) ** 0.5  # unbiased std of [1, 0, 0, 1]
    torch.testing.assert_close(grpo[0], torch.tensor([0.5, -0.5, -0.5, 0.5]) / (std0 + 1e-4))


def test_chunked_entropy_equals_the_full_logits_entropy():
    rows, weight, _, _ = _case(3)
    p = torch.softmax(rows @ weight.T, -1)
    want = -(p * p.log()).sum(-1)
    torch.testing.assert_close(token_entropy_rows(rows, weight, chunk_rows=5), want, rtol=1e-5, atol=1e-6)
