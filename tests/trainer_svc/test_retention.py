"""Retention: replay of the base's own answers mixed into SFT on chat data, and the forgetting metric as an event.

What they achieve on a real model (facts learned, general answers kept) is measured by ``bench/recipe_facts.py``
(bench/RESULTS.md); here: which jobs replay, how many rows join, that the metric is computed against the base and
reported as a numbered event through the service.
"""

from __future__ import annotations

import pytest

from strop.common.errors import InvalidArgument
from strop.common.trainer_types import (
    CHAT_RECIPE_ADAPTER_SCALE,
    CHAT_RECIPE_KL,
    CHAT_RECIPE_NEIGHBOURS,
    KL_RETENTION_WEIGHT,
    DatasetFormat,
    LoadModelRequest,
    LoraConfig,
    Retention,
    TrainConfig,
    TrainMethod,
)
from strop.trainer_svc.core import job_config, model_loading, retention, training
from tests.trainer_svc.conftest import sft_config


def test_replay_and_held_out_prompts_are_disjoint_and_the_row_limit_is_the_replay_set():
    # the metric must measure prompts never trained on
    assert not set(retention.REPLAY_PROMPTS) & set(retention.HELD_OUT_PROMPTS)
    assert (
        len(set(retention.REPLAY_PROMPTS)) == len(retention.REPLAY_PROMPTS) == job_config.MAX_RETENTION_ROWS
    )


class _Tok:
    chat_template = "{{ messages }}"


def _sft(**kw) -> TrainConfig:
    return TrainConfig(method=TrainMethod.SFT, **kw)


def test_sft_on_chat_data_retains_by_default_and_other_data_only_when_asked():
    assert job_config.retention_of(_sft(), DatasetFormat.MESSAGES, _Tok()) is Retention.KL  # the chat recipe
    assert job_config.retention_of(_sft(num_devices=2), DatasetFormat.MESSAGES, _Tok()) is Retention.NONE
    assert (
        job_config.retention_of(_sft(retention=Retention.REPLAY), DatasetFormat.MESSAGES, _Tok())
        is Retention.REPLAY
    )
    assert job_config.retention_of(_sft(), DatasetFormat.TEXT, _Tok()) is Retention.NONE
    assert job_config.retention_of(_sft(), DatasetFormat.MESSAGES, object()) is Retention.NONE  # no template
    assert (
        job_config.retention_of(_sft(retention=Retention.NONE), DatasetFormat.MESSAGES, _Tok())
        is Retention.NONE
    )
    with pytest.raises(InvalidArgument, match="REPLAY needs messages data"):
        job_config.retention_of(_sft(retention=Retention.REPLAY), DatasetFormat.PROMPT_COMPLETION, _Tok())
    with pytest.raises(InvalidArgument, match="REPLAY needs messages data"):
        job_config.check_dataset_fits(_sft(retention=Retention.REPLAY), DatasetFormat.TEXT, [], 100)


def test_the_chat_recipe_fills_the_fields_a_request_left_unset_and_a_resolved_config_stays_as_it_is():
    chat = job_config.with_retention(_sft(), DatasetFormat.MESSAGES, _Tok())
    assert (chat.retention, chat.retention_kl, chat.retention_neighbours, chat.adapter_scale) == (
        Retention.KL,
        CHAT_RECIPE_KL,
        CHAT_RECIPE_NEIGHBOURS,
        CHAT_RECIPE_ADAPTER_SCALE,
    )
    assert job_config.with_retention(chat, DatasetFormat.MESSAGES, _Tok()) == chat, (
        "resolving twice: no change"
    )
    own = job_config.with_retention(
        _sft(retention_kl=6.0, adapter_scale=1.0, retention_neighbours=2), DatasetFormat.MESSAGES, _Tok()
    )
    assert (own.retention_kl, own.retention_neighbours, own.adapter_scale) == (6.0, 2, 1.0), "what was asked"
    best = job_config.with_retention(_sft(keep_best_checkpoint=True), DatasetFormat.MESSAGES, _Tok())
    assert best.retention is Retention.KL and best.adapter_scale == 0.0, (
        "a kept checkpoint is published as is"
    )
    # asked explicitly, KL keeps its plain defaults: its weight, no neighbours, no scale (the recipe is the unset
    # default)
    asked = job_config.with_retention(_sft(retention=Retention.KL), DatasetFormat.MESSAGES, _Tok())
    assert (asked.retention_kl, asked.retention_neighbours, asked.adapter_scale) == (
        KL_RETENTION_WEIGHT,
        0,
        0.0,
    )
    assert job_config.with_retention(asked, DatasetFormat.MESSAGES, _Tok()) == asked
    for fmt, tok in ((DatasetFormat.TEXT, _Tok()), (DatasetFormat.MESSAGES, object())):
        plain = job_config.with_retention(_sft(), fmt, tok)
        assert plain.retention is Retention.NONE and plain.adapter_scale == 0.0 and not plain.retention_kl
        with pytest.raises(InvalidArgument, match="retention_neighbours adds questions to the KL term"):
            job_config.with_retention(_sft(retention_neighbours=4), fmt, tok)
    dpo = job_config.with_retention(TrainConfig(method=TrainMethod.DPO), DatasetFormat.PREFERENCE, _Tok())
    assert dpo.retention is Retention.NONE
    # several processes (asked, or the world a rank was launched into): each would generate on its own, so none
    for cfg, ranks in ((_sft(num_devices=2), 0), (_sft(), 2)):
        several = job_config.with_retention(cfg, DatasetFormat.MESSAGES, _Tok(), ranks)
        assert several.retention is Retention.NONE and several.adapter_scale == 0.0
    with pytest.raises(InvalidArgument, match="retention_kl weighs a KL term"):
        job_config.with_retention(_sft(retention_kl=3.0), DatasetFormat.TEXT, _Tok())


def test_retention_settings_are_validated():
    assert job_config.with_defaults(_sft(), session_max_len=64).retention_rows == 110
    with pytest.raises(InvalidArgument, match=r"retention_rows must be in 1\.\.110"):
        job_config.with_defaults(_sft(retention_rows=111), session_max_len=64)
    with pytest.raises(InvalidArgument, match="REPLAY applies to SFT only"):
        job_config.with_defaults(
            TrainConfig(method=TrainMethod.DPO, retention=Retention.REPLAY), session_max_len=64
        )


def test_replay_keeps_the_bases_finished_answers_whole_and_leaves_unfinished_ones_out():
    base = retention.BaseAnswers(
        ["Q1?", "Q2?", "Q3?", "Q4?", "Q5?"],
        ["Whole. And more", "Cut here. And not", "no end at all", " ", "Last."],
        [True, False, False, True, True],
        0.0,
    )
    rows = retention.replay_rows(base, 10)
    # Q2 and Q3 ran into the token cap (replaying them, even cut at a sentence end, kept fewer general answers);
    # Q4's answer is empty; the finished ones are replayed word for word after their prompt
    assert [r["messages"] for r in rows] == [
        [{"role": "user", "content": "Q1?"}, {"role": "assistant", "content": "Whole. And more"}],
        [{"role": "user", "content": "Q5?"}, {"role": "assistant", "content": "Last."}],
    ]
    assert [r["messages"][0]["content"] for r in retention.replay_rows(base, 1)] == ["Q1?"]


ROWS = [
    {
        "messages": [
            {"role": "user", "content": f"Question {i}?"},
            {"role": "assistant", "content": f"Answer {i}."},
        ]
    }
    for i in range(4)
]


def _run(model_root, tmp_path, monkeypatch, **cfg):
    """One SFT job on the tiny 4-bit model, the base's answers fixed (a random model rarely ends a turn):
    every replay prompt answered "Yes." and finished."""

    def answers(loaded, prompts, *, max_new_tokens, disable_adapter):
        assert disable_adapter, "replay and the metric use the base's answers (adapter disabled)"
        return ["Yes."] * len(prompts), [True] * len(prompts)

    monkeypatch.setattr(model_loading, "generate_chat_batch", answers)
    loaded = model_loading.load_model(
        LoadModelRequest(model_path="tiny-llama-4bit"), model_root=model_root, device="cpu"
    )
    model_loading.attach_lora(loaded, LoraConfig(r=4, alpha=8, seed=0))
    steps, events = [], []
    sinks = training.Sinks(steps.append, lambda s, p: None, lambda n: None, on_retention=events.append)
    config = job_config.with_defaults(
        _sft(learning_rate=1e-3, batch_size=2, num_epochs=1, **cfg), session_max_len=64
    )
    training.run_training(
        loaded, ROWS, DatasetFormat.MESSAGES, config, tmp_path / "w", training.JobControl(), sinks
    )
    return steps, events


def test_replay_mixes_the_bases_answers_into_the_rows_and_the_metric_is_reported_once(
    model_root, tmp_path, monkeypatch
):
    steps, events = _run(model_root, tmp_path, monkeypatch, retention=Retention.REPLAY, retention_rows=6)
    assert len(steps) == (4 + 6) // 2, "4 rows and 6 replayed conversations, 2 a step, one epoch"
    (event,) = events
    assert event.replay_rows == 6 and event.step == len(steps)
    # the held-out answers the base itself reproduces are the denominator; "Yes." is no random model's answer
    assert 0 <= event.kept <= event.held_out <= len(retention.HELD_OUT_PROMPTS)


def test_without_replay_only_the_rows_train_and_nothing_is_generated(model_root, tmp_path, monkeypatch):
    def no_generation(*a, **kw):
        raise AssertionError("a job without retention generates nothing")

    monkeypatch.setattr(retention, "base_answers", no_generation)
    steps, events = _run(model_root, tmp_path / "none", monkeypatch, retention=Retention.NONE)
    assert len(steps) == 2 and events == []


def test_the_forgetting_metric_counts_answers_the_model_still_gives_word_for_word(model_root):
    # The base's own greedy answers are, by definition, kept by the base: the metric on an untrained adapter
    # (B = 0: the same function) keeps every answer the base reproduces, with token agreement 1.
    loaded = model_loading.load_model(
        LoadModelRequest(model_path="tiny-llama-4bit"), model_root=model_root, device="cpu"
    )
    model_loading.attach_lora(loaded, LoraConfig(r=4, alpha=8, seed=0))
    base = retention.base_answers(loaded, retention.HELD_OUT_PROMPTS[:4], max_new_tokens=6)
    # a random model rarely ends its turn: count its answers as finished to have something to check
    base = retention.BaseAnswers(base.prompts, base.answers, [True] * 4, base.seconds)
    held = retention.reproducible(base, retention.answer_hits(loaded, base, disable_adapter=True))
    f = retention.forgetting(loaded, held)
    assert f.kept == f.held_out == len(held.prompts)
    assert f.token_agreement == (1.0 if f.held_out else 0.0)


def test_the_forgetting_metric_reaches_the_client_as_a_numbered_event_before_the_adapter(
    client, ready_session, sft_dataset
):
    events = list(
        client.train(
            ready_session, sft_dataset.dataset_id, sft_config(2, retention=Retention.REPLAY, retention_rows=4)
        )
    )
    kinds = [e.kind for e in events]
    assert kinds.count("retention") == 1, kinds
    assert kinds.index("retention") < kinds.index("adapter"), (
        "measured on the trained adapter, then published"
    )
    r = events[kinds.index("retention")].retention
    assert r.step == 2 and 0 <= r.kept <= r.held_out <= len(retention.HELD_OUT_PROMPTS)
    assert 0 <= r.replay_rows <= 4


def test_sfts_default_epochs_give_a_small_dataset_about_300_rows_of_training_and_a_large_one_a_pass():
    # 30 facts need ~10 passes to be answered word for word (issue 31); a dataset of thousands of rows, one.
    epochs = {
        n: job_config.with_defaults(_sft(), session_max_len=64, num_rows=n).num_epochs
        for n in (30, 100, 3000)
    }
    assert epochs == {30: 10.0, 100: 3.0, 3000: 1.0}
    assert job_config.with_defaults(_sft(num_epochs=2), session_max_len=64, num_rows=30).num_epochs == 2.0
    dpo = job_config.with_defaults(TrainConfig(method=TrainMethod.DPO), session_max_len=64, num_rows=30)
    assert (dpo.num_epochs, dpo.batch_size) == (1.0, 1), "the preference methods keep one pass of single rows"
