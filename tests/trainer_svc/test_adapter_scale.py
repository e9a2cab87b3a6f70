"""``adapter_scale``: the adapter a job ends with, interpolated toward the base (every LoRA B factor times the
scale once training completes, so the adapted layer is W + scale · ΔW); validated before a job starts."""

from __future__ import annotations

import math

import pytest
import torch

from strop.common.errors import InvalidArgument
from strop.common.trainer_types import (
    ADAPTER_SCALE_AUTO,
    AUTO_ADAPTER_SCALES,
    AUTO_SCALE_REFINE,
    DatasetFormat,
    LoadModelRequest,
    LoraConfig,
    Retention,
    TrainConfig,
    TrainMethod,
)
from strop.trainer_svc.core import job_config, model_loading, retention, training

ROWS = [
    {"text": f"The {word} sleeps on mat number {i}."} for i, word in enumerate(("cat", "dog", "fox", "owl"))
]


def _factors_after_a_job(
    model_root, work, scale: float, control: training.JobControl | None = None
) -> dict[str, torch.Tensor]:
    loaded = model_loading.load_model(
        LoadModelRequest(model_path="tiny-llama"), model_root=model_root, device="cpu"
    )
    model_loading.attach_lora(loaded, LoraConfig(r=4, alpha=8, seed=0))
    cfg = job_config.with_defaults(
        TrainConfig(
            method=TrainMethod.SFT, learning_rate=1e-2, batch_size=2, max_steps=3, seed=0, adapter_scale=scale
        ),
        session_max_len=64,
    )
    sinks = training.Sinks(lambda m: None, lambda step, path: None, lambda total: None)
    training.run_training(
        loaded, ROWS, DatasetFormat.TEXT, cfg, work, control or training.JobControl(), sinks
    )
    factors = {n: p.detach().clone() for n, p in loaded.model.named_parameters() if ".lora_" in n}
    model_loading.release(loaded)
    return factors


def test_a_scaled_job_ends_with_every_b_factor_times_the_scale_and_the_a_factors_as_trained(
    model_root, tmp_path
):
    trained = _factors_after_a_job(model_root, tmp_path / "as-trained", 0.0)
    scaled = _factors_after_a_job(model_root, tmp_path / "scaled", 0.3)
    b_names = [n for n in trained if ".lora_B." in n]
    assert b_names and len(b_names) == sum(".lora_A." in n for n in trained), "one B factor per A factor"
    assert all(bool(trained[n].abs().max() > 0) for n in b_names), "three steps at lr 1e-2 move every B"
    for name, value in trained.items():
        # the same job on the same CPU: bitwise the same run; the scale is one multiplication of each B at its end
        want = value * 0.3 if ".lora_B." in name else value
        assert torch.equal(scaled[name], want), name


def test_a_cancel_that_lands_while_the_adapter_is_scaled_is_too_late_to_change_how_the_job_ends(
    model_root, tmp_path, monkeypatch
):
    """The job's outcome is read after the scale: a stop asked between the two must not make a CANCELLED job whose
    published adapter is the scaled one (only a completed run's adapter is scaled)."""
    control = training.JobControl()
    real = training.scale_adapter

    def racing(loaded, scale):
        control.request_stop("cancel")  # the Cancel RPC lands after the last step, before the job's outcome
        return real(loaded, scale)

    monkeypatch.setattr(training, "scale_adapter", racing)
    _factors_after_a_job(model_root, tmp_path, 0.3, control)
    assert control.completed and control.stop is None, "the run completed: the job ends SUCCEEDED, scaled"


def test_a_stop_asked_before_the_run_completes_is_kept_and_the_run_is_not_completed():
    control = training.JobControl()
    control.request_stop("cancel")
    control.request_stop("interrupt")
    assert not control.complete() and not control.completed
    assert control.stop is not None and control.stop.reason == "cancel", "the first stop asked is the job's"


@pytest.mark.parametrize("scale", [-0.1, 1.5, math.nan, math.inf])
def test_an_adapter_scale_outside_0_to_1_is_refused_naming_it(scale):
    with pytest.raises(InvalidArgument, match="adapter_scale must be"):
        job_config.with_defaults(TrainConfig(method=TrainMethod.SFT, adapter_scale=scale), session_max_len=64)


def test_an_adapter_scale_with_keep_best_checkpoint_is_refused():
    cfg = TrainConfig(
        method=TrainMethod.SFT, adapter_scale=0.5, keep_best_checkpoint=True, eval_every_steps=2
    )
    with pytest.raises(InvalidArgument, match="adapter_scale interpolates"):
        job_config.with_defaults(cfg, session_max_len=64)
    kept = TrainConfig(
        method=TrainMethod.SFT, adapter_scale=1.0, keep_best_checkpoint=True, eval_every_steps=2
    )
    assert job_config.with_defaults(kept, session_max_len=64).adapter_scale == 1.0, (
        "1 is the adapter as trained"
    )
    for scale in (0.0, 0.5, 1.0):
        assert (
            job_config.with_defaults(
                TrainConfig(method=TrainMethod.SFT, adapter_scale=scale), session_max_len=64
            ).adapter_scale
            == scale
        )


def test_a_fully_trained_module_copy_moves_the_same_fraction_toward_the_base():
    """A module PEFT trains whole (``modules_to_save``: an MoE's router with ``train_router``) is interpolated as the
    LoRA pairs are: base + scale · (trained − base)."""
    from types import SimpleNamespace

    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    model = get_peft_model(
        net, PeftLoraConfig(r=2, lora_alpha=4, target_modules=["0"], modules_to_save=["1"])
    )
    with torch.no_grad():
        for p in model.parameters():
            if p.requires_grad:  # as if trained: B away from its zero init, the copy away from the base
                p.add_(torch.randn_like(p))
    wrapper = model.base_model.model[1]
    base = {n: p.detach().clone() for n, p in wrapper.original_module.named_parameters()}
    trained = {n: p.detach().clone() for n, p in wrapper.modules_to_save["default"].named_parameters()}
    b = model.base_model.model[0].lora_B["default"].weight.detach().clone()
    assert training.scale_adapter(SimpleNamespace(model=model), 0.25) == 3, (
        "lora_B, the copy's weight and bias"
    )
    torch.testing.assert_close(model.base_model.model[0].lora_B["default"].weight, b * 0.25, rtol=0, atol=0)
    for n, p in wrapper.modules_to_save["default"].named_parameters():
        torch.testing.assert_close(p, base[n] + 0.25 * (trained[n] - base[n]), rtol=1e-6, atol=1e-6)


def _peft_toy():
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    torch.manual_seed(0)
    model = get_peft_model(
        torch.nn.Sequential(torch.nn.Linear(6, 5)), PeftLoraConfig(r=2, target_modules=["0"])
    )
    b = model.base_model.model[0].lora_B["default"].weight
    with torch.no_grad():
        b.add_(torch.randn_like(b))  # as if trained
    return model, b


@pytest.mark.parametrize(
    ("messages", "tokens", "chosen", "tried"),
    [
        # messages reproduced fall below the trained adapter's under 0.65: the walk stops at 0.6, then halves
        # 0.7..0.6 twice: 0.65 fits, 0.625 does not
        (lambda r: 10 if r > 0.64 else 9, lambda r: 400, 0.65, [0.9, 0.8, 0.7, 0.6, 0.65, 0.625]),
        # 1% fewer top-1 tokens is within the slack, more is not: 0.9 keeps 397 of 400, below it 395
        (
            lambda r: 10,
            lambda r: {1.0: 400, 0.9: 397}.get(round(r, 6), 395),
            0.9,
            [0.9, 0.8, 0.85, 0.875],
        ),
        # the first scale already fits worse: the interval is 1..0.9
        (lambda r: 10 if r > 0.96 else 9, lambda r: 400, 0.975, [0.9, 0.95, 0.975]),
        # every scale fits: the walk ends at the last, 0.5, with nothing to halve
        (lambda r: 10, lambda r: 400, 0.5, [0.9, 0.8, 0.7, 0.6, 0.5]),
        # a scale that reproduces more than the adapter as trained passes (a swap of near ties is no loss)
        (lambda r: 11 if r < 1 else 10, lambda r: 400, 0.5, [0.9, 0.8, 0.7, 0.6, 0.5]),
    ],
)
def test_auto_scale_ends_at_the_smallest_scale_before_the_first_that_fits_the_taught_rows_worse(
    monkeypatch, messages, tokens, chosen, tried
):
    """The walk of ``choose_adapter_scale`` over AUTO_ADAPTER_SCALES and the halvings after it, with the fit measured as a function of the
    adapter's current scale (read off its B factor), and the adapter it leaves: the trained B times the chosen
    scale, bitwise (as a fixed adapter_scale of that value would leave it)."""
    from types import SimpleNamespace

    model, b = _peft_toy()
    trained = b.detach().clone()

    def fit(loaded, rows, **kw):
        r = float(b.detach().norm() / trained.norm())
        m, t = messages(r), tokens(r)
        return [
            ((t, 400, 0.0), [True] * m + [False] * (12 - m))
        ]  # one "conversation" of 12 assistant messages

    monkeypatch.setattr(retention, "conversation_hits", fit)
    cfg = TrainConfig(method=TrainMethod.SFT, adapter_scale=ADAPTER_SCALE_AUTO)
    choice = training.choose_adapter_scale(SimpleNamespace(model=model), [{"messages": []}], cfg)
    assert choice.scale == chosen
    assert [s for s, _, _ in choice.tried] == [1.0, *tried]
    assert (choice.messages, choice.tokens) == (12, 400)
    assert torch.equal(b, trained * chosen), "the trained B times the chosen scale"


def test_turn_spans_end_each_assistant_message_at_its_end_of_turn():
    """What greedy decoding reproduces of each assistant message: up to and including its end of turn (7); the
    template's text after it (its newline, 5) is not generated."""
    mask = [0, 1, 1, 1, 1, 0, 0, 1, 1, 1, 0, 1, 1]
    target = [3, 4, 4, 7, 5, 2, 2, 4, 7, 5, 2, 4, 4]
    assert retention._turn_spans(mask, target, 7) == [(1, 4), (7, 9), (11, 13)]


CHAT = [
    {
        "messages": [
            {"role": "user", "content": f"Where does item {i} go?"},
            {"role": "assistant", "content": f"Item {i} goes on shelf {i * 3 % 7}."},
        ]
    }
    for i in range(6)
]


def _chat_job(model_root, work, scale: float, events: list):
    loaded = model_loading.load_model(
        LoadModelRequest(model_path="tiny-llama"), model_root=model_root, device="cpu"
    )
    model_loading.attach_lora(loaded, LoraConfig(r=4, alpha=8, seed=0))
    cfg = job_config.with_defaults(
        TrainConfig(
            method=TrainMethod.SFT,
            learning_rate=1e-2,
            batch_size=3,
            max_steps=40,
            seed=0,
            adapter_scale=scale,
            retention=Retention.NONE,
        ),
        session_max_len=64,
    )
    sinks = training.Sinks(lambda m: None, lambda step, path: None, lambda total: None)
    sinks.on_retention = events.append
    training.run_training(loaded, CHAT, DatasetFormat.MESSAGES, cfg, work, training.JobControl(), sinks)
    return loaded


def test_an_auto_scaled_job_ends_at_the_scale_its_own_rows_choose_and_reports_it(model_root, tmp_path):
    """Through the trainer: the adapter an auto job ends with is the same run's trained adapter times the scale
    the fit on its rows picks (recomputed here from the trained adapter), and the job's retention event says
    which."""
    plain: list = []
    loaded = _chat_job(model_root, tmp_path / "as-trained", 1.0, plain)
    trained = {n: p.detach().clone() for n, p in loaded.model.named_parameters() if ".lora_" in n}

    def fit(scale):
        training.scale_adapter(loaded, scale)
        res = retention.conversation_hits(loaded, CHAT)
        with torch.no_grad():
            for n, p in loaded.model.named_parameters():
                if n in trained:
                    p.copy_(trained[n])
        return sum(sum(w) for _, w in res), sum(h[0] for h, _ in res)

    as_trained = fit(1.0)
    assert as_trained[1] >= 60, "forty steps at lr 1e-2 teach the tiny model most of the answers' ~100 tokens"

    def fits(scale):
        m, t = fit(scale)
        return m >= as_trained[0] and t >= 0.99 * as_trained[1]

    want, worse = 1.0, None
    for scale in AUTO_ADAPTER_SCALES:
        if not fits(scale):
            worse = scale
            break
        want = scale
    for _ in range(AUTO_SCALE_REFINE if worse is not None else 0):
        mid = round((want + worse) / 2, 6)
        want, worse = (mid, worse) if fits(mid) else (want, mid)
    model_loading.release(loaded)

    events: list = []
    loaded = _chat_job(model_root, tmp_path / "auto", ADAPTER_SCALE_AUTO, events)
    for name, value in loaded.model.named_parameters():
        if name in trained:
            # the same job on the same CPU: bitwise the same run, then one multiplication of each B
            assert torch.equal(value, trained[name] * want if ".lora_B." in name else trained[name]), name
    model_loading.release(loaded)
    assert [e.adapter_scale for e in events] == [want] and plain == [], "the chosen scale is reported"


@pytest.mark.parametrize(
    ("cfg", "fmt"),
    [
        (TrainConfig(method=TrainMethod.SFT, adapter_scale=ADAPTER_SCALE_AUTO), DatasetFormat.TEXT),
        (TrainConfig(method=TrainMethod.DPO, adapter_scale=ADAPTER_SCALE_AUTO), DatasetFormat.PREFERENCE),
        (
            TrainConfig(method=TrainMethod.SFT, adapter_scale=ADAPTER_SCALE_AUTO, num_devices=2),
            DatasetFormat.MESSAGES,
        ),
    ],
)
def test_auto_scale_is_refused_where_there_are_no_chat_conversations_to_measure_in_one_process(cfg, fmt):
    tok = type("Tok", (), {"chat_template": "{{ messages }}"})()
    with pytest.raises(InvalidArgument, match=r"adapter_scale -1 \(auto\)"):
        job_config.with_retention(cfg, fmt, tok)


def test_auto_scale_with_keep_best_checkpoint_is_refused():
    cfg = TrainConfig(
        method=TrainMethod.SFT,
        adapter_scale=ADAPTER_SCALE_AUTO,
        keep_best_checkpoint=True,
        eval_every_steps=2,
    )
    with pytest.raises(InvalidArgument, match="adapter_scale interpolates"):
        job_config.with_defaults(cfg, session_max_len=64)


@pytest.mark.parametrize("failure", ["unmaskable", "no tokens"])
def test_auto_scale_keeps_the_adapter_as_trained_where_the_fit_cannot_be_measured(monkeypatch, failure):
    """A completed run is not failed by its measurement: rows its template masks only with loss_on_all_tokens
    (``assistant_masked`` raises), or rows with no assistant tokens to measure, leave the adapter as trained."""
    from types import SimpleNamespace

    model, b = _peft_toy()
    trained = b.detach().clone()

    def fit(loaded, rows, **kw):
        if failure == "unmaskable":
            raise InvalidArgument("the chat template renders a conversation's first 2 messages differently")
        return [((0, 0, 0.0), [])]

    monkeypatch.setattr(retention, "conversation_hits", fit)
    cfg = TrainConfig(method=TrainMethod.SFT, adapter_scale=ADAPTER_SCALE_AUTO)
    choice = training.choose_adapter_scale(SimpleNamespace(model=model), [{"messages": []}], cfg)
    assert choice.scale == 1.0 and torch.equal(b, trained)


def test_auto_scale_ends_at_the_last_scale_shown_to_fit_when_a_later_try_runs_out_of_memory(monkeypatch):
    """A try after the first that cannot be measured (out of memory at 0.7) ends the walk at the last scale shown
    to fit, with B restored before it is scaled: the trained B times 0.8, bitwise."""
    from types import SimpleNamespace

    model, b = _peft_toy()
    trained = b.detach().clone()

    def fit(loaded, rows, **kw):
        r = float(b.detach().norm() / trained.norm())
        if abs(r - 0.7) < 1e-3:
            raise torch.OutOfMemoryError("CUDA out of memory")
        return [((400, 400, 0.0), [True] * 12)]

    monkeypatch.setattr(retention, "conversation_hits", fit)
    cfg = TrainConfig(method=TrainMethod.SFT, adapter_scale=ADAPTER_SCALE_AUTO)
    choice = training.choose_adapter_scale(SimpleNamespace(model=model), [{"messages": []}], cfg)
    assert choice.scale == 0.8 and [s for s, _, _ in choice.tried] == [1.0, 0.9, 0.8]
    assert torch.equal(b, trained * 0.8)


def test_conversation_hits_match_full_logits_on_every_assistant_message_and_cut_at_max_length(model_root):
    """The measured positions' logits (``logits_to_keep``) against the full logits of the same forward, on a
    two-turn conversation: the same top-1 hits, token count and NLL; each message judged whole on its own tokens;
    a max_length cut measures only what lies before it."""
    loaded = model_loading.load_model(
        LoadModelRequest(model_path="tiny-llama"), model_root=model_root, device="cpu"
    )
    model_loading.attach_lora(loaded, LoraConfig(r=4, alpha=8, seed=0))
    tok = loaded.tokenizer
    conv = {
        "messages": [
            {"role": "user", "content": "Name a shelf."},
            {"role": "assistant", "content": "Shelf three."},
            {"role": "user", "content": "And another?"},
            {"role": "assistant", "content": "Shelf five, by the door."},
        ]
    }
    ((hits, tokens, nll), whole) = retention.conversation_hits(loaded, [conv])[0]
    row = job_config.assistant_masked(conv["messages"], tok)
    target = row["input_ids"][1:]
    spans = retention._turn_spans(row["completion_mask"][1:], target, tok.eos_token_id)
    assert len(spans) == 2 and len(whole) == 2, "one span per assistant message"
    ids = torch.tensor([row["input_ids"]])
    with torch.no_grad():
        logits = loaded.model(input_ids=ids).logits[0, :-1].float()
    at = torch.tensor([i for a, b in spans for i in range(a, b)])
    right = logits.argmax(-1) == ids[0, 1:]
    assert (hits, tokens) == (int(right[at].sum()), len(at))
    want = float(torch.nn.functional.cross_entropy(logits[at], ids[0, 1:][at], reduction="sum"))
    assert nll == pytest.approx(want, rel=1e-5)
    assert whole == [bool(right[a:b].all()) for a, b in spans]
    cut = spans[1][0] + 2  # two tokens into the second message's span
    ((_, short, _), whole_cut) = retention.conversation_hits(loaded, [conv], max_length=cut + 1)[0]
    assert short == (spans[0][1] - spans[0][0]) + 2 and len(whole_cut) == 2
    model_loading.release(loaded)
