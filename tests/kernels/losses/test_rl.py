"""The step API's per-token losses (kernels/losses/rl.py): each loss through the chunked engine against its
plain-torch reference from full logits (value, log-probs and the gradient w.r.t. the hidden rows), each loss
function against central finite differences in float64, and the docs' defaults.

CPU tier: Triton interpreter (TRITON_INTERPRET=1), small odd shapes, several chunks.
"""

from __future__ import annotations

import pytest
import torch

from strop.kernels.losses.logps import token_logps_trainable_head
from strop.kernels.losses.rl import LOSSES, per_token_loss, per_token_loss_reference

M, H, V = 29, 19, 53  # odd rows, hidden and vocab; chunk 8 → four chunks


def _inputs(seed=0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(M, H, generator=g, dtype=torch.float64).to(dtype)
    weight = (torch.randn(V, H, generator=g, dtype=torch.float64) / H**0.5).to(dtype)
    inputs = {
        "target_tokens": torch.randint(0, V, (M,), generator=g),
        "weights": torch.rand(M, generator=g, dtype=torch.float64) * 2 - 0.5,  # real-valued, some negative
        # sampler log-probs near the learner's so ratios fall both inside and outside the clip bounds
        "logprobs": -torch.rand(M, generator=g, dtype=torch.float64) * 6,
        "advantages": torch.randn(M, generator=g, dtype=torch.float64),
    }
    return rows, weight, inputs


def _keep(loss_fn, inputs):
    spec = LOSSES[loss_fn]
    return {k: v for k, v in inputs.items() if k in spec.required + spec.optional}


@pytest.mark.parametrize("loss_fn", sorted(LOSSES))
def test_chunked_loss_equals_the_full_logits_reference(loss_fn):
    rows, weight, inputs = _inputs()
    inputs = _keep(loss_fn, inputs)
    # learner log-probs are ≈ −log V ≈ −4; put q at lp + small offsets so some ratios clip on either side
    with torch.no_grad():
        lp0 = torch.log_softmax(rows.double() @ weight.double().t(), -1)
        lp0 = lp0.gather(1, inputs["target_tokens"].unsqueeze(1)).squeeze(1)
    if "logprobs" in inputs:
        inputs["logprobs"] = (lp0 + torch.linspace(-0.6, 0.6, M, dtype=torch.float64)).float()
    inputs = {k: (v.float() if v.is_floating_point() else v) for k, v in inputs.items()}
    r1 = rows.clone().requires_grad_(True)
    loss, lp = per_token_loss(loss_fn, r1, weight, inputs, chunk_size=8)
    loss.backward()
    r2 = rows.clone().requires_grad_(True)
    ref_loss, ref_lp = per_token_loss_reference(loss_fn, r2, weight, inputs)
    ref_loss.backward()
    # fp32 sums of M ≈ 30 terms of size ≲ 10: agreement to a few ulps of the total, 1e-5 relative
    torch.testing.assert_close(lp, ref_lp, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(r1.grad, r2.grad, rtol=1e-4, atol=1e-6)
    assert r1.grad.abs().sum() > 0, "the loss must reach the hidden rows"


@pytest.mark.parametrize("loss_fn", sorted(LOSSES))
def test_loss_gradient_matches_finite_differences(loss_fn):
    """d loss / d lp by autograd equals central differences (float64: the bound is the FD error, ~h² ≈ 1e-12
    times third derivatives of size ≲ e^2)."""
    _, _, inputs = _inputs(seed=1)
    spec = LOSSES[loss_fn]
    f = {k: v for k, v in _keep(loss_fn, inputs).items() if k != "target_tokens"}
    # keep ratios away from the clip kinks, where the derivative is one-sided
    lp = (
        f.get("logprobs", torch.zeros(M, dtype=torch.float64)) + torch.linspace(-0.5, 0.5, M).double()
    ) * 1.0
    kinks = torch.log(torch.tensor([0.8, 1.2, 4.0], dtype=torch.float64))
    ratio_log = lp - f.get("logprobs", torch.zeros(M, dtype=torch.float64))
    assert (ratio_log.unsqueeze(1) - kinks).abs().min() > 1e-3
    cfg = dict(spec.config)
    x = lp.clone().requires_grad_(True)
    spec.fn(x, f, cfg).backward()
    h = 1e-6
    fd = torch.empty(M, dtype=torch.float64)
    for i in range(M):
        e = torch.zeros(M, dtype=torch.float64)
        e[i] = h
        fd[i] = (spec.fn(lp + e, f, cfg) - spec.fn(lp - e, f, cfg)) / (2 * h)
    if loss_fn == "cispo":
        # the clipped ratio is stop-gradient: the gradient is −sg(clip(r))·A, not the derivative of the value
        ratio = torch.exp(lp - f["logprobs"]).clamp(0.0, 4.0)
        fd = -f["weights"] * ratio * f["advantages"]
    torch.testing.assert_close(x.grad, fd, rtol=1e-6, atol=1e-8)


def test_ppo_clips_to_the_docs_default_bounds_and_datum_thresholds_override():
    lp = torch.zeros(3, dtype=torch.float64)
    q = torch.log(torch.tensor([1 / 2.0, 1 / 1.1, 1 / 0.5], dtype=torch.float64))  # ratios 2.0, 1.1, 0.5
    adv = torch.ones(3, dtype=torch.float64)
    spec = LOSSES["ppo"]
    loss = spec.fn(lp, {"logprobs": q, "advantages": adv}, spec.config)
    # min(r·A, clip(r, 0.8, 1.2)·A) with A = 1: 1.2, 1.1, 0.5
    assert loss.item() == pytest.approx(-(1.2 + 1.1 + 0.5))
    per_token = {"logprobs": q, "advantages": adv, "clip_high_threshold": torch.full((3,), 1.5).double()}
    assert spec.fn(lp, per_token, spec.config).item() == pytest.approx(-(1.5 + 1.1 + 0.5))


def test_trainable_head_chunks_equal_full_logits_and_reach_the_head():
    rows, weight, inputs = _inputs(seed=2)
    head = torch.nn.Linear(H, V, bias=False)
    with torch.no_grad():
        head.weight.copy_(weight.float())
    r = rows.float().requires_grad_(True)
    lp = token_logps_trainable_head(r, head, inputs["target_tokens"], chunk_rows=8)
    lp.sum().backward()
    ref = torch.log_softmax(rows.float() @ weight.float().t(), -1).gather(1, inputs["target_tokens"][:, None])
    torch.testing.assert_close(lp, ref.squeeze(1), rtol=1e-5, atol=1e-5)
    assert head.weight.grad is not None and head.weight.grad.abs().sum() > 0


@pytest.mark.parametrize("loss_fn", ["importance_sampling", "ppo", "cispo", "dro"])
def test_rl_weights_multiply_each_token_and_a_zero_weight_drops_it(loss_fn):
    """``weights`` on an RL loss (the Tinker docs' RL datum sends them; SkyRL multiplies by them): all ones equals
    no weights bit for bit, each token's term is scaled by its weight, and a weight-0 token contributes nothing
    even where its term is not finite (a placeholder q far from lp)."""
    _, _, inputs = _inputs(seed=2)
    spec = LOSSES[loss_fn]
    f = {k: inputs[k] for k in ("logprobs", "advantages")}
    lp = f["logprobs"] + torch.linspace(-0.5, 0.5, M).double()
    cfg = dict(spec.config)
    plain = spec.fn(lp, f, cfg)
    assert torch.equal(spec.fn(lp, {**f, "weights": torch.ones(M, dtype=torch.float64)}, cfg), plain)
    # one token at a time: the weighted sum is Σ w_i · (that token's loss alone)
    w = inputs["weights"]
    per_token = torch.stack(
        [spec.fn(lp[i : i + 1], {k: v[i : i + 1] for k, v in f.items()}, cfg) for i in range(M)]
    )
    torch.testing.assert_close(
        spec.fn(lp, {**f, "weights": w}, cfg), (w * per_token).sum(), rtol=1e-12, atol=1e-12
    )
    # a masked token whose term overflows (ratio e^800) leaves the loss finite and equal to the rest's
    q = f["logprobs"].clone()
    q[0] = -800.0
    mask = torch.ones(M, dtype=torch.float64)
    mask[0] = 0.0
    masked = spec.fn(lp, {"logprobs": q, "advantages": f["advantages"], "weights": mask}, cfg)
    assert torch.isfinite(masked) and masked.item() == pytest.approx(per_token[1:].sum().item(), rel=1e-12)
