"""Chunked DPO loss: per-sequence log-probs, loss, metrics and d(hidden) against the full-logits reference for
every loss type; the formulas against hand-computed values; the TRL glue against TRL's own DPOTrainer.

CPU tier: the fused-CE Triton kernel under TRITON_INTERPRET=1 and the torch fallback, odd shapes (6
sequences × 23 positions, hidden 37, vocab 301), prompts masked, right padding, one sequence with no
completion token. fp32 agreement to ≈1e-5 relative: the chunked path sums the same fp32 log-softmax terms
in a different order (online softmax over vocab blocks, per-sequence index_add).

Trainer parity: a tiny PEFT Llama trained 3 steps by TRL 1.16's DPOTrainer and by the same trainer with
``StropDPOMixin`` (each pair's prompt run once, or as TRL lays the rows out), same seed, data and fp32 (bf16=False): per-step losses, logged reward metrics and the
final adapter must agree to 1e-5 relative (observed ≈4e-7 under AVX512, AVX2 and scalar ATen). The optimizer
is plain SGD, so rounding differences carry forward linearly rather than through AdamW's m/√v (which turns
the rounding of nearly cancelling gradients into whole-step differences); 3 steps of ≈2e-7 per-step rounding
stay near 1e-6, and the test runs under two ``ATEN_CPU_CAPABILITY`` values (marker ``parity``).

GPU tier: Llama-3-8B head (vocab 128,256, hidden 4096), 4 pairs of 1,024 tokens (512 completion), bf16:
the chunked loss must need under 1 GiB beyond its inputs where full logits need over 8 GiB, and stay
within 2× torch's own bf16 error of the fp32 truth.
"""

from __future__ import annotations

import math
import os

import pytest
import torch
import torch.nn.functional as F

from tests.deps import locked

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

import strop.kernels.losses.logps as logps_engine
from strop.kernels.losses.dpo import chunked_dpo_loss_reference, dpo_loss_from_logps, strop_dpo_loss
from strop.kernels.losses.logps import sequence_logps, sequence_logps_reference, sequence_logps_rows
from strop.kernels.trainers import add_hidden_states_head, remove_hidden_states_head, strop_dpo_trainer_class
from tests.kernels._chunked_losses import (
    cuda_loss_grad_and_extra_bytes,
    preference_pairs,
    tiny_peft_llama,
    tiny_tokenizer,
    train_recording_losses,
)
from tests.kernels._loop_reads import LoopBoolReads

S, T, H, V = 6, 23, 37, 301
PROMPT = 7


def _inputs(dtype=torch.float32, device="cpu", seed=0):
    gen = torch.Generator().manual_seed(seed)
    hidden = torch.randn(S, T, H, generator=gen)
    ref_hidden = hidden + 0.3 * torch.randn(S, T, H, generator=gen)
    weight = torch.randn(V, H, generator=gen) / H**0.5
    labels = torch.randint(0, V, (S, T), generator=gen)
    labels[:, :PROMPT] = -100  # prompt
    labels[1, 15:] = -100  # right padding
    labels[4, 12:] = -100
    labels[5, PROMPT:] = -100  # a rejected sequence with no completion token at all
    cast = lambda t: t.to(device=device, dtype=dtype)  # noqa: E731
    return cast(hidden), cast(ref_hidden), cast(weight), labels.to(device)


def _assert_fp32_close(actual, expected, what):
    scale = expected.abs().max().item() if expected.numel() else 0.0
    torch.testing.assert_close(
        actual,
        expected,
        rtol=1e-5,
        atol=1e-5 * max(scale, 1e-30),
        msg=lambda m: f"{what} differs beyond fp32 rounding: {m}",
    )


@pytest.fixture(params=["triton", "torch"])
def backend(request, monkeypatch):
    if request.param == "torch":
        monkeypatch.setattr(logps_engine, "_use_triton", lambda device: False)
    return request.param


# ---- per-sequence log-probs ------------------------------------------------------------------------------


@pytest.mark.parametrize("chunk_size", [3, None])
def test_sequence_logps_and_gradient_equal_full_logits(backend, chunk_size):
    hidden, _, weight, labels = _inputs()
    h1, h2 = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    got = sequence_logps(h1, weight, labels, chunk_size=chunk_size)
    expected = sequence_logps_reference(h2, weight, labels)
    _assert_fp32_close(got, expected, "per-sequence log-probs")
    assert got[5].item() == 0.0, "a sequence without completion tokens has log-prob 0"
    upstream = torch.linspace(-1.0, 2.0, S)  # a different factor per sequence
    (g1,) = torch.autograd.grad(got, h1, upstream)
    (g2,) = torch.autograd.grad(expected, h2, upstream)
    _assert_fp32_close(g1, g2, "d(hidden)")
    assert g1[:, : PROMPT - 1].abs().max().item() == 0.0, "prompt rows predict masked labels: no gradient"


def test_scored_rows_found_in_host_labels_give_the_same_log_probs_and_gradient_bit_for_bit():
    """``host_labels`` (the labels as the caller holds them in host memory): the same rows, targets and sequence
    of each row, in the same order, as the device path's boolean selection, so log-probs and d(hidden) are the
    same bits; labels of another shape are refused."""
    hidden, _, weight, labels = _inputs()
    h1, h2 = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    device_labels = labels.clone()
    host = labels.clone()
    got = sequence_logps(h1, weight, device_labels.masked_fill(device_labels >= 0, 7), host_labels=host)
    expected = sequence_logps(h2, weight, labels)
    assert torch.equal(got, expected)  # the device labels' values are not read: the host's are the labels
    upstream = torch.linspace(-1.0, 2.0, S)
    (g1,) = torch.autograd.grad(got, h1, upstream)
    (g2,) = torch.autograd.grad(expected, h2, upstream)
    assert torch.equal(g1, g2)
    with pytest.raises(ValueError, match="host_labels"):
        sequence_logps(hidden, weight, labels, host_labels=labels[:, 1:])


def test_rows_api_with_unordered_sequence_index():
    gen = torch.Generator().manual_seed(5)
    rows = torch.randn(19, H, generator=gen, requires_grad=True)
    weight = torch.randn(V, H, generator=gen) / H**0.5
    targets = torch.randint(0, V, (19,), generator=gen)
    seq_index = torch.randint(0, 4, (19,), generator=gen)
    got = sequence_logps_rows(rows, weight, targets, seq_index, 5, chunk_size=4)
    per_row = F.linear(rows, weight).float().log_softmax(-1).gather(1, targets[:, None]).squeeze(1)
    expected = torch.zeros(5).index_add(0, seq_index, per_row)
    _assert_fp32_close(got, expected, "row-wise log-probs")
    assert got[4].item() == 0.0
    (g1,) = torch.autograd.grad(got.sum(), rows)
    (g2,) = torch.autograd.grad(expected.sum(), rows)
    _assert_fp32_close(g1, g2, "d(rows)")


def test_head_bias_is_supported():
    hidden, _, weight, labels = _inputs()
    bias = 0.1 * torch.randn(V, generator=torch.Generator().manual_seed(9))
    _assert_fp32_close(
        sequence_logps(hidden, weight, labels, bias, chunk_size=4),
        sequence_logps_reference(hidden, weight, labels, bias),
        "log-probs with head bias",
    )


# ---- loss, metrics, gradients ----------------------------------------------------------------------------


@pytest.mark.parametrize("loss_type", ["sigmoid", "hinge", "ipo", "robust"])
@pytest.mark.parametrize("ref_mode", ["ref_hidden", "precomputed"])
def test_loss_metrics_and_dhidden_equal_full_logits_reference(backend, loss_type, ref_mode):
    hidden, ref_hidden, weight, labels = _inputs()
    options = dict(beta=0.3, loss_type=loss_type, label_smoothing=0.2 if loss_type == "robust" else 0.0)
    if ref_mode == "ref_hidden":
        ref = dict(ref_hidden=ref_hidden)
    else:
        rc, rr = sequence_logps_reference(ref_hidden, weight, labels).chunk(2)
        ref = dict(ref_chosen_logps=rc, ref_rejected_logps=rr)
    h1, h2 = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    got = strop_dpo_loss(h1, weight, labels, chunk_size=7, **ref, **options)
    expected = chunked_dpo_loss_reference(h2, weight, labels, **ref, **options)
    _assert_fp32_close(got.loss, expected.loss, f"{loss_type} loss")
    # Rewards are β·(differences of ~100-nat sums): their fp32 error scales with the sums, not with the result.
    logps_scale = torch.cat([expected.chosen_logps, expected.rejected_logps]).abs().max().item()
    for key, value in expected.metrics().items():
        scale = options["beta"] * logps_scale if key.startswith("rewards/") else value.abs().item()
        torch.testing.assert_close(got.metrics()[key], value, rtol=1e-5, atol=1e-5 * scale, msg=key)
    (g1,) = torch.autograd.grad(got.loss, h1)
    (g2,) = torch.autograd.grad(expected.loss, h2)
    assert g2.abs().max().item() > 0, "the reference gradient must not vanish (test would be vacuous)"
    _assert_fp32_close(g1, g2, f"{loss_type} d(hidden)")


def test_formulas_match_hand_computed_values():
    # TRL 1.16 _compute_loss, reverse KL, written out in scalar math for two pairs.
    beta, eps = 0.5, 0.2
    pc, pr = torch.tensor([-10.0, -20.0]), torch.tensor([-12.0, -15.0])
    rc, rr = torch.tensor([-11.0, -19.0]), torch.tensor([-11.0, -16.0])
    nc, nr = torch.tensor([4, 5]), torch.tensor([3, 6])
    cr, rj = [1.0, -1.0], [-1.0, 1.0]  # chosen / rejected log-ratios
    deltas = [c - r for c, r in zip(cr, rj, strict=True)]  # [2, −2]
    logsig = lambda z: -math.log1p(math.exp(-z))  # noqa: E731
    expected = {
        "sigmoid": sum(-logsig(beta * d) for d in deltas) / 2,
        "hinge": sum(max(0.0, 1 - beta * d) for d in deltas) / 2,  # (0 + 2) / 2
        "ipo": sum(
            (c / n_c - r / n_r - 1 / (2 * beta)) ** 2
            for c, r, n_c, n_r in zip(cr, rj, [4, 5], [3, 6], strict=True)
        )
        / 2,
        "robust": sum(
            (-(1 - eps) * logsig(beta * d) + eps * logsig(-beta * d)) / (1 - 2 * eps) for d in deltas
        )
        / 2,
    }
    for loss_type, value in expected.items():
        out = dpo_loss_from_logps(
            pc,
            pr,
            rc,
            rr,
            beta=beta,
            loss_type=loss_type,
            label_smoothing=eps,
            chosen_tokens=nc,
            rejected_tokens=nr,
        )
        assert math.isclose(out.loss.item(), value, rel_tol=1e-6), (loss_type, out.loss.item(), value)
    m = out.metrics()
    # rewards β·ratio: chosen [0.5, −0.5], rejected [−0.5, 0.5]; only the first pair ranks chosen above rejected
    assert [m[k].item() for k in ("rewards/chosen", "rewards/rejected", "rewards/margins")] == [0.0, 0.0, 0.0]
    assert m["rewards/accuracies"].item() == 0.5
    assert (m["logps/chosen"].item(), m["logps/rejected"].item()) == (-15.0, -13.5)


def test_list_of_loss_types_sums_weighted_means():
    pc, pr, rc, rr = (torch.tensor(v) for v in ([-3.0, -4.0], [-5.0, -2.0], [-3.5, -4.0], [-4.0, -2.5]))
    one = lambda t: dpo_loss_from_logps(pc, pr, rc, rr, beta=0.2, loss_type=t).loss  # noqa: E731
    both = dpo_loss_from_logps(
        pc, pr, rc, rr, beta=0.2, loss_type=["sigmoid", "hinge"], loss_weights=[0.7, 0.3]
    )
    assert math.isclose(
        both.loss.item(), 0.7 * one("sigmoid").item() + 0.3 * one("hinge").item(), rel_tol=1e-6
    )


def test_bf16_within_twice_torch_bf16_error():
    hidden, ref_hidden, weight, labels = _inputs()
    rc, rr = sequence_logps_reference(ref_hidden, weight, labels).chunk(2)
    ref = dict(ref_chosen_logps=rc, ref_rejected_logps=rr, beta=0.3)

    def run(fn, h, w):
        h = h.clone().requires_grad_()
        out = fn(h, w, labels, **ref)
        return out.loss.detach(), torch.autograd.grad(out.loss, h)[0]

    truth = run(chunked_dpo_loss_reference, hidden, weight)
    torch_bf16 = run(chunked_dpo_loss_reference, hidden.bfloat16(), weight.bfloat16())
    ours = run(lambda *a, **k: strop_dpo_loss(*a, chunk_size=5, **k), hidden.bfloat16(), weight.bfloat16())
    for what, o, t, e in zip(("loss", "d(hidden)"), ours, torch_bf16, truth, strict=True):
        err_ours = (o.float() - e).abs().max().item()
        err_torch = (t.float() - e).abs().max().item()
        assert err_ours <= 2 * err_torch + 1e-6 * e.abs().max().item(), (what, err_ours, err_torch)


def test_bad_inputs_raise():
    hidden, ref_hidden, weight, labels = _inputs()
    with pytest.raises(ValueError, match="LM-head gradient"):
        strop_dpo_loss(hidden, weight.clone().requires_grad_(), labels, ref_hidden=ref_hidden)
    with pytest.raises(ValueError, match="unshifted"):
        strop_dpo_loss(hidden, weight, labels[:, 1:], ref_hidden=ref_hidden)
    with pytest.raises(ValueError, match="loss_type"):
        strop_dpo_loss(hidden, weight, labels, ref_hidden=ref_hidden, loss_type="exo_pair")
    with pytest.raises(ValueError, match="reference log-probs"):
        strop_dpo_loss(hidden, weight, labels)
    with pytest.raises(ValueError, match="pairs"):
        strop_dpo_loss(hidden[:5], weight, labels[:5], ref_hidden=ref_hidden[:5])
    with pytest.raises(ValueError, match="label_smoothing"):
        strop_dpo_loss(hidden, weight, labels, ref_hidden=ref_hidden, loss_type="robust", label_smoothing=0.5)


# ---- TRL glue --------------------------------------------------------------------------------------------

trl = locked("trl")
peft = locked("peft")
transformers = locked("transformers")


@pytest.fixture(scope="module")
def tokenizer():
    return tiny_tokenizer()


def _train(trainer_cls, tokenizer, tmp_path, steps=3, evaluate=False, **config):
    from datasets import Dataset

    settings = dict(
        output_dir=str(tmp_path),
        per_device_train_batch_size=2,
        max_steps=steps,
        learning_rate=0.5,
        optim="sgd",
        logging_steps=1,
        report_to=[],
        save_strategy="no",
        seed=0,
        use_cpu=True,
        bf16=False,
        max_length=64,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    args = trl.DPOConfig(**{**settings, **config})
    pairs = Dataset.from_list(preference_pairs())
    return train_recording_losses(
        trainer_cls, args, tokenizer, pairs, pairs.select(range(2)) if evaluate else None
    )


@pytest.mark.parity
@pytest.mark.parametrize(
    ("loss_type", "share", "buckets"),
    [("sigmoid", True, False), ("ipo", False, False), ("sigmoid", False, True)],
)
def test_trl_dpo_trainer_and_strop_glue_train_identically(
    tokenizer, tmp_path, monkeypatch, loss_type, share, buckets
):
    """With ``share``, strop runs each pair's prompt once (``shared_prompt.py``); TRL runs it in both rows. With
    ``buckets`` (``shared_prompt.WIDTH_BUCKETS``), the unshared rows reach the model padded to a bucket's width: the
    added columns are masked padding (completion mask 0), so the same losses, logs and adapters."""
    from strop.kernels.trainers import dpo, shared_prompt

    widths = []  # (TRL's width, the model's) of each batch bucketed_width saw
    bucketed = shared_prompt.bucketed_width

    def recorded(batch, *args):
        out = bucketed(batch, *args)
        widths.append((batch["input_ids"].shape[1], out["input_ids"].shape[1]))
        return out

    monkeypatch.setattr(dpo, "bucketed_width", recorded)
    monkeypatch.setattr(shared_prompt, "WIDTH_BUCKETS", buckets)
    trl_trainer, trl_losses = _train(trl.DPOTrainer, tokenizer, tmp_path / "trl", loss_type=[loss_type])
    cls = type("Trainer", (strop_dpo_trainer_class(),), {"strop_share_prompts": share})
    ours, our_losses = _train(cls, tokenizer, tmp_path / "strop", loss_type=[loss_type])
    assert ours._strop_dpo_reason is None, ours._strop_dpo_reason
    assert ours.strop_shared_batches == (3 if share else 0), ours._strop_sharing.reasons
    if buckets:
        assert len(widths) == 3 and all(w == shared_prompt.bucket(t) for t, w in widths), widths
        assert any(w > t for t, w in widths), f"no batch was widened, so the test proves nothing: {widths}"
    else:
        assert not widths, "bucketing is opt-in"
    assert len(our_losses) == len(trl_losses) == 3
    for step, (a, b) in enumerate(zip(our_losses, trl_losses, strict=True)):
        assert math.isclose(a, b, rel_tol=1e-5), f"step {step}: strop {a} vs TRL {b}"
    assert our_losses[-1] < our_losses[0], "training must move the loss (else equal losses prove little)"
    logged = lambda tr: [h for h in tr.state.log_history if "loss" in h]  # noqa: E731
    for ours_log, trl_log in zip(logged(ours), logged(trl_trainer), strict=True):
        for key in ("logps/chosen", "logps/rejected", "rewards/accuracies", "num_tokens"):
            assert math.isclose(ours_log[key], trl_log[key], rel_tol=1e-5, abs_tol=1e-6), key
        for key in ("rewards/chosen", "rewards/rejected", "rewards/margins"):
            # β · (policy − reference) of ~60-nat sums: fp32 rounding of the sums is ~1e-5 · β · 60
            assert math.isclose(ours_log[key], trl_log[key], abs_tol=1e-5 * 0.1 * 130), key
    trl_params = dict(trl_trainer.model.named_parameters())
    for name, p in ours.model.named_parameters():
        if p.requires_grad:
            ref = trl_params[name].detach()
            torch.testing.assert_close(p.detach(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_metrics_held_on_the_device_log_what_trl_logs_across_accumulation_and_evaluation(tokenizer, tmp_path):
    # the step metrics are read at the log (DeviceMetrics): with two micro-batches a logged step, a log every other
    # step and an evaluation between logs, every logged value (the token counts included) is TRL's
    config = dict(
        steps=3,
        gradient_accumulation_steps=2,
        logging_steps=2,
        eval_strategy="steps",
        eval_steps=1,
        evaluate=True,
        per_device_eval_batch_size=2,
    )
    trl_trainer, _ = _train(trl.DPOTrainer, tokenizer, tmp_path / "trl", **config)
    ours, _ = _train(strop_dpo_trainer_class(), tokenizer, tmp_path / "strop", **config)
    history, trl_history = ours.state.log_history, trl_trainer.state.log_history
    assert len(history) == len(trl_history), history
    assert sum("eval_num_tokens" in h for h in history) == 3 and sum("num_tokens" in h for h in history) == 1
    for log, trl_log in zip(history, trl_history, strict=True):
        # TRL's entropy and logits/* need a pass over the vocabulary that the chunked loss does not make
        assert log.keys() <= trl_log.keys(), (log.keys(), trl_log.keys())
        for key, value in ((k, trl_log[k]) for k in log):
            assert not isinstance(log[key], torch.Tensor), key
            if "num_tokens" in key or key in ("step", "epoch"):
                assert log[key] == value, (key, log[key], value)
            elif key.startswith(("logps/", "eval_logps/", "rewards/accuracies", "eval_rewards/accuracies")):
                assert math.isclose(log[key], value, rel_tol=1e-5, abs_tol=1e-6), key


def test_glue_leaves_unsupported_configs_to_trl(tokenizer, tmp_path):
    trainer, losses = _train(strop_dpo_trainer_class(), tokenizer, tmp_path, steps=1, loss_type=["bco_pair"])
    assert "bco_pair" in trainer._strop_dpo_reason
    assert len(losses) == 1 and math.isfinite(losses[0])
    forward = trainer.model.get_base_model().__dict__.get("forward")
    assert not getattr(forward, "_strop_hidden_head", False), "no hidden-states head when TRL's loss runs"


def test_nan_filter_runs_on_the_device_and_logs_what_hfs_filter_logs(tokenizer, tmp_path, monkeypatch):
    """With HF's logging_nan_inf_filter on (its default), strop's DPO trainer reads no loss back after the
    backward (HF's filter reads it before the optimizer's Python runs), and logs the losses HF's filter logs."""
    hf_filter = type(
        "HfFilter",
        (strop_dpo_trainer_class(),),
        {"train": trl.DPOTrainer.train, "training_step": trl.DPOTrainer.training_step},
    )
    reads = LoopBoolReads(monkeypatch)
    logs = {}
    for current, cls in (("HfFilter", hf_filter), ("Ours", strop_dpo_trainer_class())):
        reads.current = current
        trainer, _ = _train(cls, tokenizer, tmp_path / current, steps=3)
        assert trainer.args.logging_nan_inf_filter, (
            "HF's default, and the user's setting restored after train()"
        )
        logs[current] = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    assert len(logs["Ours"]) == 3 and logs["Ours"] == logs["HfFilter"], logs
    assert reads.counts.get("HfFilter", 0) >= 3, (
        "HF's loop reads the loss after every backward (the test sees it)"
    )
    assert "Ours" not in reads.counts, f"the loop read the loss back {reads.counts.get('Ours')} times"


def test_hidden_states_head_returns_backbone_output_and_passes_other_calls(tokenizer):
    model = tiny_peft_llama(tokenizer).eval()
    hf = model.get_base_model()
    ids = torch.randint(0, len(tokenizer), (2, 9), generator=torch.Generator().manual_seed(0))
    logits = model(input_ids=ids).logits
    add_hidden_states_head(hf)
    add_hidden_states_head(hf)  # idempotent
    hidden = model(input_ids=ids, strop_hidden_states=True).last_hidden_state
    torch.testing.assert_close(hidden, hf.model(input_ids=ids).last_hidden_state, rtol=0, atol=0)
    torch.testing.assert_close(model(input_ids=ids).logits, logits, rtol=0, atol=0)
    remove_hidden_states_head(hf)
    assert "forward" not in hf.__dict__


# ---- GPU tier --------------------------------------------------------------------------------------------


@pytest.mark.gpu
def test_gpu_chunked_dpo_memory_and_accuracy_at_8b_vocab():
    pairs, seq, prompt, hid, vocab = 4, 1024, 512, 4096, 128256
    gen = torch.Generator("cuda").manual_seed(0)
    hidden = torch.randn(2 * pairs, seq, hid, device="cuda", generator=gen)
    weight = torch.randn(vocab, hid, device="cuda", generator=gen) / hid**0.5
    labels = torch.randint(0, vocab, (2 * pairs, seq), device="cuda", generator=gen)
    labels[:, :prompt] = -100
    ref_lp = sequence_logps_reference(hidden + 0.1, weight, labels).chunk(2)
    ref = dict(ref_chosen_logps=ref_lp[0], ref_rejected_logps=ref_lp[1], beta=0.1)

    def run(fn, h, w):
        return cuda_loss_grad_and_extra_bytes(fn, h, w, labels, **ref)

    truth_loss, truth_g, _ = run(chunked_dpo_loss_reference, hidden, weight)
    hb, wb = hidden.bfloat16(), weight.bfloat16()
    torch_loss, torch_g, full_extra = run(chunked_dpo_loss_reference, hb, wb)
    our_loss, our_g, chunked_extra = run(strop_dpo_loss, hb, wb)
    assert full_extra > 8 * 2**30, f"full logits should need > 8 GiB, measured {full_extra / 2**30:.2f}"
    assert chunked_extra < 2**30, f"chunked DPO needs {chunked_extra / 2**30:.2f} GiB beyond its inputs"
    for what, o, t, e in (("loss", our_loss, torch_loss, truth_loss), ("d(hidden)", our_g, torch_g, truth_g)):
        err_ours = (o.float() - e).abs().max().item()
        err_torch = (t.float() - e).abs().max().item()
        assert err_ours <= 2 * err_torch + 1e-6 * e.abs().max().item(), (what, err_ours, err_torch)
