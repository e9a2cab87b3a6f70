"""Chunked ORPO, CPO/SimPO and KTO: loss, metrics and d(hidden) against TRL 1.16's own formulas on full logits;
strop's trainer classes against TRL's own trainers; the fallback to TRL.

Formulas: the full-logits reference is TRL's code itself where it is callable (``ORPOTrainer.get_batch_logps``
and ``odds_ratio_loss``, ``CPOTrainer.get_batch_logps`` and ``cpo_loss``, ``nn.CrossEntropyLoss`` for the NLL
terms) and, for KTO (inline in ``_compute_loss``), its lines written out. Odd shapes (6 sequences × 23
positions, hidden 37, vocab 301), prompts masked, right padding; the Triton kernel under TRITON_INTERPRET=1 and
the torch fallback. fp32 agreement to 1e-5 relative of each tensor's scale: both sides sum the same fp32
log-softmax terms in a different order (online softmax over vocab blocks, per-group index_add), ≈1e-7 relative
per term over ≤ 100 terms.

Trainer parity: a tiny PEFT Llama trained 3 steps by TRL's ORPOTrainer / CPOTrainer(simpo) / KTOTrainer and by
the same trainer with strop's mixin, same seed, data, fp32, SGD (rounding differences carry forward linearly,
see tests/kernels/losses/test_dpo.py): per-step losses to 1e-5 relative, logged metrics to 1e-5 of their
scale, final adapter to 1e-5 of each tensor's scale.
"""

from __future__ import annotations

import math
import os
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from tests.deps import locked

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import strop.kernels.losses.logps as logps_engine
from strop.kernels.losses.cpo import cpo_loss_from_logps, cpo_loss_reference, strop_cpo_loss
from strop.kernels.losses.kto import kto_loss_from_logps, strop_kto_loss
from strop.kernels.losses.orpo import orpo_loss_from_logps, orpo_loss_reference, strop_orpo_loss
from strop.kernels.losses.preference import grouped_logps, grouped_logps_reference, mean_logits
from tests.kernels._chunked_losses import (
    cuda_loss_grad_and_extra_bytes,
    preference_pairs,
    tiny_tokenizer,
    train_recording_losses,
)
from tests.kernels._tolerances import assert_bf16_within_torch_bound, needs_cuda

trl = locked("trl")
peft = locked("peft")
transformers = locked("transformers")
from trl.experimental.cpo import CPOConfig, CPOTrainer  # noqa: E402
from trl.experimental.orpo import ORPOConfig, ORPOTrainer  # noqa: E402

from strop.kernels.trainers import (  # noqa: E402
    strop_cpo_trainer_class,
    strop_kto_trainer_class,
    strop_orpo_trainer_class,
)

S, T, H, V = 6, 23, 37, 301
B = S // 2
PROMPT = 7


def _inputs(seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(S, T, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) / H**0.5
    bias = 0.1 * torch.randn(V, generator=gen)
    ids = torch.randint(0, V, (S, T), generator=gen)
    attention = torch.ones(S, T, dtype=torch.long)
    attention[1, 15:] = 0  # right padding
    attention[4, 12:] = 0
    labels = ids.masked_fill(attention == 0, -100)
    labels[:, :PROMPT] = -100
    return hidden, weight, bias, ids, attention, labels


def _close(actual, expected, what, scale=None):
    scale = expected.abs().max().item() if scale is None else scale
    torch.testing.assert_close(
        actual.float(),
        expected.float(),
        rtol=1e-5,
        atol=1e-5 * max(scale, 1e-30),
        msg=lambda m: f"{what} differs beyond fp32 rounding: {m}",
    )


def _grad(loss, h):
    (g,) = torch.autograd.grad(loss, h)
    assert g.abs().max().item() > 0, "the gradient must not vanish (the comparison would be vacuous)"
    return g


@pytest.fixture(params=["triton", "torch"])
def backend(request, monkeypatch):
    if request.param == "torch":
        monkeypatch.setattr(logps_engine, "_use_triton", lambda device: False)
    return request.param


_ACC = SimpleNamespace(device=torch.device("cpu"))


# ---- grouped log-probs and mean logits --------------------------------------------------------------------


def test_grouped_logps_and_gradient_equal_full_logits(backend):
    hidden, weight, bias, ids, _, _ = _inputs()
    gen = torch.Generator().manual_seed(3)
    groups = torch.randint(-1, 4, (S, T), generator=gen)  # unordered groups spanning sequences, −1 unscored
    h1, h2 = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    got = grouped_logps(h1, weight, ids, groups, 5, bias, chunk_size=7)
    expected = grouped_logps_reference(h2, weight, ids, groups, 5, bias)
    _close(got, expected, "grouped log-probs")
    assert got[4].item() == 0.0, "a group without positions sums to 0"
    up = torch.linspace(-1.0, 2.0, 5)
    _close(torch.autograd.grad(got, h1, up)[0], torch.autograd.grad(expected, h2, up)[0], "d(hidden)")


def test_mean_logits_equal_the_mean_of_the_full_logits():
    hidden, weight, bias, *_ = _inputs()
    logits = F.linear(hidden, weight, bias)
    # h·mean(W) + mean(b) is the vocabulary mean exactly; fp32 rounding is relative to the logits' magnitude
    _close(mean_logits(hidden, weight, bias), logits.mean(-1), "mean logits", logits.abs().mean().item())


# ---- ORPO against TRL's own functions -------------------------------------------------------------------


def _trl_orpo(hidden, weight, bias, ids, attention, labels, beta):
    logits = F.linear(hidden, weight, bias)
    nll_labels = torch.where(attention == 1, ids, -100)  # TRL: input_ids where attended, prompt included
    nll = torch.nn.CrossEntropyLoss()(logits[:B, :-1].reshape(-1, V), nll_labels[:B, 1:].reshape(-1))
    logps = ORPOTrainer.get_batch_logps(logits, labels, average_log_prob=True)
    trl_self = SimpleNamespace(beta=beta, accelerator=_ACC)
    losses, cr, rr, ratio, log_odds = ORPOTrainer.odds_ratio_loss(trl_self, logps[:B], logps[B:])
    metrics = {
        "rewards/chosen": cr.mean(),
        "rewards/rejected": rr.mean(),
        "rewards/margins": (cr - rr).mean(),
        "rewards/accuracies": (cr > rr).float().mean(),
        "logps/chosen": logps[:B].mean(),
        "logps/rejected": logps[B:].mean(),
        "logits/chosen": logits[:B, :-1].mean(),
        "logits/rejected": logits[B:, :-1].mean(),
        "nll_loss": nll,
        "log_odds_ratio": ratio,
        "log_odds_chosen": log_odds,
    }
    return nll - losses.mean(), metrics, logits.abs().mean().item()


def test_orpo_loss_metrics_and_dhidden_equal_trl_on_full_logits(backend):
    hidden, weight, bias, ids, attention, labels = _inputs()
    h1, h2 = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    got = strop_orpo_loss(h1, weight, ids, attention, labels, bias, beta=0.25, chunk_size=7)
    loss, metrics, logit_scale = _trl_orpo(h2, weight, bias, ids, attention, labels, 0.25)
    _close(got.loss, loss, "ORPO loss")
    for key, value in got.metrics().items():
        # a logits/* mean carries the rounding of the logits it averages, not of the (smaller) mean
        _close(value, metrics[key].detach(), key, logit_scale if key.startswith("logits/") else None)
    assert set(got.metrics()) == set(metrics), "the keys TRL's ORPOTrainer logs"
    _close(_grad(got.loss, h1), _grad(loss, h2), "ORPO d(hidden)")


# ---- CPO / SimPO against TRL's own functions -----------------------------------------------------------


def _trl_cpo(hidden, weight, bias, labels, softcap=None, **cfg):
    logits = F.linear(hidden, weight, bias)
    if softcap is not None:  # HF's Gemma forward, before TRL sees the logits
        logits = softcap * torch.tanh(logits / softcap)
    avg = cfg["loss_type"] in ("ipo", "simpo")
    logps = CPOTrainer.get_batch_logps(logits, labels, average_log_prob=avg)
    trl_self = SimpleNamespace(alpha=0.0, accelerator=_ACC, **cfg)
    losses, cr, rr = CPOTrainer.cpo_loss(trl_self, logps[:B], logps[B:])
    nll = torch.nn.CrossEntropyLoss()(logits[:B, :-1].reshape(-1, V), labels[:B, 1:].reshape(-1))
    if cfg["cpo_alpha"] == 0:
        nll = torch.tensor(0.0)
    metrics = {
        "rewards/chosen": cr.mean(),
        "rewards/rejected": rr.mean(),
        "rewards/margins": (cr - rr).mean(),
        "rewards/accuracies": (cr > rr).float().mean(),
        "logps/chosen": logps[:B].mean(),
        "logps/rejected": logps[B:].mean(),
        "logits/chosen": logits[:B].mean(),
        "logits/rejected": logits[B:].mean(),
        "nll_loss": nll,
    }
    if softcap is not None:  # not computed under a soft-cap (its mean is not linear in h)
        del metrics["logits/chosen"], metrics["logits/rejected"]
    return losses.mean() + cfg["cpo_alpha"] * nll, metrics, logits.abs().mean().item()


@pytest.mark.parametrize(
    "cfg",
    [
        dict(loss_type="simpo", beta=2.5, simpo_gamma=0.4, label_smoothing=0.0, cpo_alpha=0.0),  # SimPO
        dict(loss_type="simpo", beta=2.0, simpo_gamma=0.5, label_smoothing=0.1, cpo_alpha=0.0),
        dict(loss_type="sigmoid", beta=0.1, simpo_gamma=0.5, label_smoothing=0.0, cpo_alpha=1.0),  # CPO
        dict(loss_type="hinge", beta=0.1, simpo_gamma=0.5, label_smoothing=0.0, cpo_alpha=0.5),
        dict(loss_type="ipo", beta=0.3, simpo_gamma=0.5, label_smoothing=0.0, cpo_alpha=0.0),
        # Gemma's final-logit soft-cap, small enough to bend these logits (|z| up to ≈4)
        dict(loss_type="simpo", beta=2.5, simpo_gamma=0.4, label_smoothing=0.0, cpo_alpha=1.0, softcap=3.0),
    ],
    ids=lambda c: f"{c['loss_type']}-eps{c['label_smoothing']}-alpha{c['cpo_alpha']}-cap{c.get('softcap')}",
)
def test_cpo_loss_metrics_and_dhidden_equal_trl_on_full_logits(backend, cfg):
    hidden, weight, bias, _, _, labels = _inputs()
    h1, h2 = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    got = strop_cpo_loss(h1, weight, labels, bias, chunk_size=7, **cfg)
    loss, metrics, logit_scale = _trl_cpo(h2, weight, bias, labels, **cfg)
    _close(got.loss, loss, "CPO loss")
    # rewards β·logps of ~100-nat sums (sigmoid/hinge): their rounding scales with the sums, not the result
    logps_scale = cfg["beta"] * max(
        metrics["logps/chosen"].abs().item(), metrics["logps/rejected"].abs().item()
    )
    for key, value in got.metrics().items():
        scale = (
            logit_scale if key.startswith("logits/") else logps_scale if key.startswith("rewards/") else None
        )
        _close(value, metrics[key].detach(), key, scale)
    assert set(got.metrics()) == set(metrics), "the keys TRL's CPOTrainer logs"
    _close(_grad(got.loss, h1), _grad(loss, h2), "CPO d(hidden)")


# ---- KTO against TRL's lines --------------------------------------------------------------------------


def _trl_kto(hidden, weight, bias, labels, desirable, ref_logps, kl, beta, wd, wu, loss_type):
    """TRL 1.16 KTOTrainer._compute_loss after its forward passes, on full logits."""
    logits = F.linear(hidden, weight, bias)
    logps = CPOTrainer.get_batch_logps(logits, labels)  # Σ over completion tokens (what the fused head sums)
    ci, ri = desirable.nonzero().view(-1), (~desirable).nonzero().view(-1)
    cr = logps.index_select(0, ci) - ref_logps.index_select(0, ci)
    rr = logps.index_select(0, ri) - ref_logps.index_select(0, ri)
    if loss_type == "kto":
        cl, rl = 1 - F.sigmoid(beta * (cr - kl)), 1 - F.sigmoid(beta * (kl - rr))
    else:
        cl, rl = 1 - F.sigmoid(beta * cr), F.sigmoid(beta * rr)
    loss = torch.cat((wd * cl, wu * rl), 0).nanmean()
    mask = labels[:, 1:] != -100
    ml = logits[:, :-1].mean(-1)
    metrics = {
        "kl": kl,
        "rewards/chosen": (beta * cr).sum() / len(ci),
        "rewards/rejected": (beta * rr).sum() / len(ri),
        "logps/chosen": logps[ci].sum() / len(ci),
        "logps/rejected": logps[ri].sum() / len(ri),
        "logits/chosen": ml[ci][mask[ci]].sum() / mask[ci].sum(),
        "logits/rejected": ml[ri][mask[ri]].sum() / mask[ri].sum(),
    }
    metrics["rewards/margins"] = metrics["rewards/chosen"] - metrics["rewards/rejected"]
    return loss, metrics, logits.abs().mean().item(), logps


@pytest.mark.parametrize("loss_type", ["kto", "apo_zero_unpaired"])
def test_kto_loss_metrics_and_dhidden_equal_trl_on_full_logits(backend, loss_type):
    hidden, weight, bias, _, _, labels = _inputs()
    labels[5, PROMPT:] = -100  # a row without completion tokens: log-prob 0, as TRL's masked sum gives
    desirable = torch.tensor([True, False, True, True, False, False])
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():
        ref_logps = logps_engine.sequence_logps_reference(
            hidden + 0.3 * torch.randn(S, T, H, generator=gen), weight, labels, bias
        )
    kl = torch.tensor(0.7) if loss_type == "kto" else None
    cfg = dict(beta=0.2, desirable_weight=1.5, undesirable_weight=0.75, loss_type=loss_type)
    h1, h2 = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    got = strop_kto_loss(
        h1, weight, labels, desirable, ref_logps=ref_logps, kl=kl, bias=bias, chunk_size=7, **cfg
    )
    loss, metrics, logit_scale, logps = _trl_kto(
        h2,
        weight,
        bias,
        labels,
        desirable,
        ref_logps,
        kl if kl is not None else torch.tensor(0.0),
        0.2,
        1.5,
        0.75,
        loss_type,
    )
    _close(got.loss, loss, "KTO loss")
    logps_scale = logps.abs().max().item()
    for key, value in got.metrics().items():
        scale = (
            logit_scale
            if key.startswith("logits/")
            else 0.2 * logps_scale
            if key.startswith("rewards/")
            else None
        )
        _close(
            torch.tensor(value),
            metrics[key].detach(),
            key,
            logps_scale if key.startswith("logps/") else scale,
        )
    assert set(got.metrics()) == set(metrics), "TRL's KTO keys (its entropy is not computed)"
    _close(_grad(got.loss, h1), _grad(loss, h2), "KTO d(hidden)")


def test_formulas_match_hand_computed_values():
    # ORPO, one pair: avg_c = ln 0.5, avg_r = ln 0.25 ⇒ odds 1 and 1/3, log odds ratio ln 3
    out = orpo_loss_from_logps(
        torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)]), torch.tensor(2.0), beta=0.5
    )
    assert math.isclose(out.log_odds.item(), math.log(3), rel_tol=1e-6)
    assert math.isclose(out.loss.item(), 2.0 + 0.5 * math.log1p(1 / 3), rel_tol=1e-6)  # nll − λ logσ(ln 3)
    # SimPO: −logσ(β(avg_c − avg_r) − γ) = −logσ(2·(−1 + 2) − 0.5) = log(1 + e^−1.5)
    out = cpo_loss_from_logps(
        torch.tensor([-1.0]),
        torch.tensor([-2.0]),
        torch.tensor(0.0),
        beta=2.0,
        loss_type="simpo",
        simpo_gamma=0.5,
        cpo_alpha=0.0,
    )
    assert math.isclose(out.loss.item(), math.log1p(math.exp(-1.5)), rel_tol=1e-6)
    # KTO: r = [1, −1], z0 = 0.5, β = 1: desirable 1.5·(1 − σ(0.5)), undesirable 0.75·(1 − σ(1.5)), mean of two
    out = kto_loss_from_logps(
        torch.tensor([0.0, -3.0]),
        torch.tensor([-1.0, -2.0]),
        torch.tensor([True, False]),
        torch.tensor(0.5),
        beta=1.0,
        desirable_weight=1.5,
        undesirable_weight=0.75,
    )
    sig = lambda z: 1 / (1 + math.exp(-z))  # noqa: E731
    assert math.isclose(out.loss.item(), (1.5 * (1 - sig(0.5)) + 0.75 * (1 - sig(1.5))) / 2, rel_tol=1e-6)
    m = out.metrics()
    assert (m["rewards/chosen"], m["rewards/rejected"], m["rewards/margins"], m["kl"]) == (
        1.0,
        -1.0,
        2.0,
        0.5,
    )


# ---- TRL glue: strop's trainer classes against TRL's own -------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def _dataset(method):
    from datasets import Dataset

    pairs = preference_pairs()
    if method == "orpo":
        # rows of one token length (no padding), so its pairs run each prompt once: TRL's logits/* metrics average
        # padding positions too, which a shared batch does not compute (SimPO's padded pairs run unshared)
        pairs = [{**p, "chosen": f" Yes {i}.", "rejected": f" Yes {i}!"} for i, p in enumerate(pairs)]
        return Dataset.from_list(pairs)
    if method != "kto":
        return Dataset.from_list(pairs)
    rows = []
    for p in pairs:
        rows.append({"prompt": p["prompt"], "completion": p["chosen"], "label": True})
        rows.append({"prompt": p["prompt"], "completion": p["rejected"], "label": False})
    return Dataset.from_list(rows)


METHODS = {
    "orpo": (ORPOConfig, ORPOTrainer, strop_orpo_trainer_class, dict(beta=0.25)),
    "simpo": (
        CPOConfig,
        CPOTrainer,
        strop_cpo_trainer_class,
        dict(loss_type="simpo", cpo_alpha=0.0, beta=2.5, simpo_gamma=0.4),
    ),
    "kto": (
        trl.KTOConfig,
        trl.KTOTrainer,
        strop_kto_trainer_class,
        dict(beta=0.2, desirable_weight=1.5, undesirable_weight=0.75),
    ),
}


def _train(method, trainer_cls, tokenizer, tmp_path, steps=3, **overrides):
    config_cls, _, _, fields = METHODS[method]
    args = config_cls(
        output_dir=str(tmp_path),
        per_device_train_batch_size=4,
        max_steps=steps,
        learning_rate=0.5,
        optim="sgd",
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=0,
        use_cpu=True,
        bf16=False,
        gradient_checkpointing=False,
        max_length=64,
        dataloader_num_workers=0,
        disable_tqdm=True,
        **{**fields, **overrides},
    )
    return train_recording_losses(trainer_cls, args, tokenizer, _dataset(method))


@pytest.mark.parity
@pytest.mark.parametrize("method", list(METHODS))
def test_trl_trainer_and_strop_glue_train_identically(tokenizer, tmp_path, method):
    _, trl_cls, strop_cls, _ = METHODS[method]
    trl_trainer, trl_losses = _train(method, trl_cls, tokenizer, tmp_path / "trl")
    ours, our_losses = _train(method, strop_cls(), tokenizer, tmp_path / "strop")
    assert ours._strop_reason is None, ours._strop_reason
    # ORPO's unpadded pairs run each prompt once (shared_prompt.py), SimPO's padded ones do not; KTO's are unpaired
    assert ours.strop_shared_batches == (3 if method == "orpo" else 0), ours._strop_sharing.reasons
    if method == "simpo":
        assert ours._strop_sharing.reasons == {"padding positions enter TRL's logits/* means"}
    assert len(our_losses) == len(trl_losses) == 3
    for step, (a, b) in enumerate(zip(our_losses, trl_losses, strict=True)):
        assert math.isclose(a, b, rel_tol=1e-5), f"step {step}: strop {a} vs TRL {b}"
    assert our_losses[-1] < our_losses[0], "training must move the loss (else equal losses prove little)"
    logged = lambda tr: [h for h in tr.state.log_history if "loss" in h]  # noqa: E731
    ours_logs, trl_logs = logged(ours), logged(trl_trainer)
    assert len(ours_logs) == len(trl_logs) == 3
    beta = METHODS[method][3]["beta"]
    for ours_log, trl_log in zip(ours_logs, trl_logs, strict=True):
        named = ("nll_loss", "log_odds_ratio", "log_odds_chosen", "kl", "num_tokens")
        keys = {k for k in trl_log if "/" in k or k in named} - {"entropy"}  # entropy: not computed
        assert not keys - set(ours_log), f"strop does not log {keys - set(ours_log)}"
        # each logged value carries the ≈1e-5-relative fp32 rounding of the log-prob sums (or means) it is made
        # of; rewards are β × such terms and margins (and KTO's kl) differences of two, so their rounding scales
        # with 2·max(β, 1)·|logps|, not with the (possibly near-zero) result
        logps = max(abs(trl_log[k]) for k in ("logps/chosen", "logps/rejected"))
        derived = 1e-5 * 2 * max(beta, 1.0) * logps
        for key in sorted(keys):
            tol = derived if key.startswith("rewards/") or key == "kl" else 1e-5 * abs(trl_log[key])
            assert math.isclose(ours_log[key], trl_log[key], abs_tol=max(tol, 1e-6)), (
                key,
                ours_log[key],
                trl_log[key],
            )
    trl_params = dict(trl_trainer.model.named_parameters())
    moved = 0
    for name, p in ours.model.named_parameters():
        if p.requires_grad:
            ref = trl_params[name].detach()
            torch.testing.assert_close(p.detach(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
            moved += int("lora_B" in name and ref.abs().sum() > 0)
    assert moved, "lora_B starts at zero; training has moved it"


def test_unsupported_configs_fall_back_to_trl_with_a_reason(tokenizer, tmp_path):
    trainer, losses = _train("simpo", strop_cpo_trainer_class(), tokenizer, tmp_path, steps=1, alpha=0.5)
    assert "AlphaPO" in trainer._strop_reason
    assert len(losses) == 1 and math.isfinite(losses[0])
    forward = trainer.model.get_base_model().__dict__.get("forward")
    assert not getattr(forward, "_strop_hidden_head", False), "no hidden-states head when TRL's loss runs"
    assert "_strop_hidden_head" not in trainer.model.get_base_model().__dict__


# ---- GPU tier --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("method", ["orpo", "cpo"])
def test_gpu_chunked_preference_memory_and_accuracy_at_8b_vocab(method):
    # Llama-3-8B head, 4 pairs of 1,024 tokens (512 prompt); ORPO scores the chosen prompts too (its NLL), CPO
    # with cpo_alpha = 1 and simpo's averaged log-probs: the chunked loss must need under 1 GiB beyond its
    # inputs where full logits need over 8 GiB, and stay within 2× torch's own bf16 error of the fp32 truth
    pairs, seq, prompt, hid, vocab = 4, 1024, 512, 4096, 128256
    gen = torch.Generator("cuda").manual_seed(0)
    hidden = torch.randn(2 * pairs, seq, hid, device="cuda", generator=gen)
    weight = torch.randn(vocab, hid, device="cuda", generator=gen) / hid**0.5
    ids = torch.randint(0, vocab, (2 * pairs, seq), device="cuda", generator=gen)
    attention = torch.ones_like(ids)
    labels = ids.masked_fill(torch.arange(seq, device="cuda") < prompt, -100)
    if method == "orpo":
        ours = lambda h, w: strop_orpo_loss(h, w, ids, attention, labels, beta=0.1)  # noqa: E731
        full = lambda h, w: orpo_loss_reference(h, w, ids, attention, labels, beta=0.1)  # noqa: E731
    else:
        cfg = dict(loss_type="simpo", beta=2.0, simpo_gamma=0.5, cpo_alpha=1.0)
        ours = lambda h, w: strop_cpo_loss(h, w, labels, **cfg)  # noqa: E731
        full = lambda h, w: cpo_loss_reference(h, w, labels, **cfg)  # noqa: E731

    def run(fn, h, w):
        return cuda_loss_grad_and_extra_bytes(fn, h, w)

    truth_loss, truth_g, _ = run(full, hidden, weight)
    hb, wb = hidden.bfloat16(), weight.bfloat16()
    torch_loss, torch_g, full_extra = run(full, hb, wb)
    our_loss, our_g, chunked_extra = run(ours, hb, wb)
    assert full_extra > 8 * 2**30, f"full logits should need > 8 GiB, measured {full_extra / 2**30:.2f}"
    assert chunked_extra < 2**30, f"chunked {method} needs {chunked_extra / 2**30:.2f} GiB beyond its inputs"
    assert_bf16_within_torch_bound(our_loss, torch_loss, truth_loss, f"{method} loss")
    assert_bf16_within_torch_bound(our_g, torch_g, truth_g, f"{method} d(hidden)")
