"""GRPO jobs with a ``score_model`` grader answered by another session on the same trainer
(``trainer_svc/core/grader_sessions.py``), over real gRPC on the tiny fp32 Llama.

The reference for a grade is the grader session's model asked directly: the request's messages rendered with its
chat template, HF ``generate`` greedy (one prompt at a time, no padding: an implementation independent of the
step API's batched sampler that the grader uses), the reply read by ``read_score`` and clipped to the range. The
grader session's adapter is first taught by a short SFT job to reply with a score (a random fixture never replies
with a number), so the replies and the scores read from them are both pinned down.
"""

from __future__ import annotations

import json

import pytest
import torch

from strop.client import (
    GrpoConfig,
    InvalidArgumentError,
    JobState,
    LoraConfig,
    Retention,
    TrainConfig,
    TrainMethod,
)
from strop.common.errors import FailedPrecondition
from strop.common.trainer_types import Quantization
from strop.graders import Sample
from strop.graders.model import read_score
from strop.trainer_svc.core import chat_sampling, grader_sessions, grpo
from strop.trainer_svc.core.sampler import SampleRequest, SamplingParams, sample

NEW_TOKENS = 4
JUDGE = {
    "type": "score_model",
    "name": "judge",
    "model": "judge",  # the grader session's name
    "input": [
        {"role": "system", "content": "You grade answers to: {{item.question}}"},
        {"role": "user", "content": "Answer: {{sample.output_text}}"},
    ],
    "range": [0, 10],
    "pass_threshold": 5,
    "sampling_params": {"max_completions_tokens": NEW_TOKENS},
}
HAS_LETTER = {
    "type": "string_check",
    "name": "has_letter",
    "input": "{{sample.output_text}}",
    "reference": "{{item.letter}}",
    "operation": "like",
}
ROWS = [
    {"messages": [{"role": "user", "content": f"Say word {i}."}], "letter": "t", "question": f"word {i}"}
    for i in range(4)
]
HELD_OUT = [
    {"messages": [{"role": "user", "content": f"Name thing {i}."}], "letter": "t", "question": f"thing {i}"}
    for i in range(4)
]


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)  # tests/trainer_svc/test_grpo.py says why
    yield
    torch.set_num_threads(before)


@pytest.fixture
def torch_engine(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "0")  # read per call by kernels/losses/logps.py (_use_triton)


@pytest.fixture(scope="module")
def sessions(trainer):
    """The job's session (LoRA attached) and the grader's (``judge``, no adapter), both the tiny fp32 Llama."""
    from strop.client import TrainerClient

    with TrainerClient(f"127.0.0.1:{trainer[0].port}") as c:
        policy = c.load_model("tiny-llama", quantization=Quantization.NONE, dtype="float32")
        c.attach_lora(policy.session_id, LoraConfig(r=8, alpha=16, seed=0))
        judge = c.load_model("tiny-llama", quantization=Quantization.NONE, dtype="float32", name="judge")
        c.attach_lora(judge.session_id, LoraConfig(r=8, alpha=16, seed=1))
        _teach_the_judge(c, judge.session_id)
        train = c.upload_dataset(ROWS, name="prompts.jsonl")
        held = c.upload_dataset(HELD_OUT, name="held_out.jsonl")
        yield policy.session_id, judge.session_id, train.dataset_id, held.dataset_id
        c.close_session(policy.session_id)
        c.close_session(judge.session_id)


JUDGE_WORDS = ["tree", "cat", "stone", "water", "fire", "sky", "road", "tent", "boat", "tiger", "sun", "moon"]


def _teach_the_judge(c, session_id: str) -> None:
    """SFT the grader session's adapter to reply with a score (9 when the answer holds a "t", else 2) to the
    prompts ``JUDGE`` renders: the random fixture never replies with a number, a grader model must."""
    leaf = grpo.parse_grader(json.dumps(JUDGE)).leaves["judge"]
    rows = []
    for i, w in enumerate(JUDGE_WORDS):
        req = leaf.request(Sample.of(w), {"question": f"word {i}"})
        rows.append({"messages": [*req.messages, {"role": "assistant", "content": "9" if "t" in w else "2"}]})
    data = c.upload_dataset(rows, name="judge.jsonl")
    cfg = TrainConfig(
        method=TrainMethod.SFT,
        max_steps=JUDGE_STEPS,
        learning_rate=2e-2,
        batch_size=4,
        seed=0,
        lr_scheduler="constant",
        retention=Retention.NONE,  # taught to reply with a score: the rows alone, not the chat recipe
    )
    events = list(c.train(session_id, data.dataset_id, cfg))
    assert events[-1].state.state is JobState.SUCCEEDED, events[-1]


JUDGE_STEPS = 12


def generate_replies(loaded, requests, max_new_tokens: int) -> list[str]:
    """The reference: each request's messages through the chat template, HF greedy generate, the new text."""
    tok, model = loaded.tokenizer, loaded.model
    eos = list(chat_sampling.eos_ids(loaded))
    out = []
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for r in requests:
                ids = tok.apply_chat_template(
                    list(r.messages), add_generation_prompt=True, tokenize=True, return_dict=True
                )["input_ids"]
                x = torch.tensor([ids])
                gen = model.generate(
                    x,
                    attention_mask=torch.ones_like(x),
                    do_sample=False,
                    max_new_tokens=max_new_tokens,
                    eos_token_id=eos,
                    pad_token_id=tok.pad_token_id,
                )
                out.append(tok.decode(gen[0, len(ids) :], skip_special_tokens=True))
    finally:
        model.train(was_training)
    return out


def test_score_model_asks_the_grader_session_once_per_batch_as_greedy_generate_answers(trainer, sessions):
    core = trainer[1]
    policy_id, judge_id, _, _ = sessions
    table = grader_sessions.resolve(
        grpo.parse_grader(json.dumps(JUDGE)), core.sessions, core.sessions.open(policy_id)
    )
    assert table["judge"].session.info.session_id == judge_id and table["judge"].adapter
    asked, replies = [], []
    answer = grader_sessions.GraderSessions(table)

    def model_fn(requests):
        asked.append(list(requests))
        replies.extend(answer(requests))
        return replies[-len(requests) :]

    grader = grpo.parse_grader(json.dumps(JUDGE), model_fn)
    outputs = ["tree", "a cat", "", "42", "stone wall", "tent", "x" * 300, '{"result": 10}']
    items = [{"question": f"word {i}"} for i in range(len(outputs))]
    results = grader.grade_many([Sample.of(o) for o in outputs], items)
    assert len(asked) == 1 and len(asked[0]) == len(outputs)  # the whole batch in one call
    first = asked[0][0].messages
    assert first[0]["role"] == "system" and first[0]["content"].startswith("You grade answers to: word 0")
    assert first[1] == {"role": "user", "content": "Answer: tree"}
    want = generate_replies(core.sessions.open(judge_id).loaded, asked[0], NEW_TOKENS)
    assert replies == want  # the batched sampler's greedy replies are generate's, one by one
    for got, text in zip(results, want, strict=True):
        ref = read_score(text, 0.0, 10.0)
        assert got.score == ref.value and got.per_grader["judge"] == ref.value
        assert got.passed["judge"] is (ref.value >= 5)
        assert ("judge" in got.invalid) is (ref.invalid is not None)


def test_label_model_reads_the_grader_sessions_label(trainer, sessions):
    core = trainer[1]
    spec = {**JUDGE, "type": "label_model", "labels": ["9", "2"], "passing_labels": ["9"]}
    for key in ("range", "pass_threshold"):
        spec.pop(key)
    table = grader_sessions.resolve(
        grpo.parse_grader(json.dumps(spec)), core.sessions, core.sessions.open(sessions[0])
    )
    asked = []
    answer = grader_sessions.GraderSessions(table)
    grader = grpo.parse_grader(json.dumps(spec), lambda reqs: asked.extend(reqs) or answer(reqs))
    outputs = ["tree", "moon", "boat"]
    results = grader.grade_many([Sample.of(o) for o in outputs], [{"question": "q"}] * 3)
    want = generate_replies(core.sessions.open(sessions[1]).loaded, asked, NEW_TOKENS)
    leaf = grader.leaves["judge"]
    assert [r.score for r in results] == [leaf.read(w).value for w in want]
    assert any(r.score == 1.0 for r in results)  # the taught judge says 9 (a passing label) to these prompts


def test_sampled_grader_replies_are_seeded_by_their_prompt(trainer, sessions):
    """Without a seed, a grader sampling at temperature > 0 draws each reply from its own prompt's seed: the same
    prompt gets the same reply in any batch (a resumed job grades as one never stopped)."""
    core = trainer[1]
    spec = {**JUDGE, "sampling_params": {"temperature": 1.0, "max_completions_tokens": 6}}
    table = grader_sessions.resolve(
        grpo.parse_grader(json.dumps(spec)), core.sessions, core.sessions.open(sessions[0])
    )
    answer = grader_sessions.GraderSessions(table)
    leaf = grpo.parse_grader(json.dumps(spec)).leaves["judge"]
    reqs = [leaf.request(Sample.of(o), {"question": "q"}) for o in ("tree", "moon", "boat", "tent")]
    together = answer(reqs)
    alone = [answer([r])[0] for r in reversed(reqs)][::-1]
    assert together == alone
    greedy = generate_replies(core.sessions.open(sessions[1]).loaded, reqs, 6)
    assert together != greedy  # temperature 1 over the taught judge's distribution: not the greedy replies


def test_grader_models_resolve_by_session_id_name_or_base(trainer, sessions):
    core = trainer[1]
    policy_id, judge_id, _, _ = sessions
    own = core.sessions.open(policy_id)

    def resolved(model: str):
        g = grpo.parse_grader(json.dumps({**JUDGE, "model": model}))
        return grader_sessions.resolve(g, core.sessions, own)[model]

    by_id = resolved(judge_id)
    assert by_id.session.info.session_id == judge_id and by_id.adapter  # its job adapter, the one taught
    mine = resolved(policy_id)
    assert mine.session is own and mine.adapter  # a session named by id serves its job adapter
    base = resolved("tiny-llama")  # two sessions loaded it: the job's own serves its base, adapters off
    assert base.session is own and not base.adapter


def _config(grader: dict, steps: int) -> TrainConfig:
    return TrainConfig(
        method=TrainMethod.GRPO,
        learning_rate=2e-2,
        lr_scheduler="constant",
        max_steps=steps,
        batch_size=2,
        seed=0,
        grpo=GrpoConfig(grader=json.dumps(grader), group_size=4, max_new_tokens=2, temperature=0.3),
    )


def _train(client, sessions, grader: dict, steps: int = 1, **extra):
    policy_id, _, train, _ = sessions
    return list(client.train(policy_id, train, _config(grader, steps), **extra))


def _multi(judge: dict) -> dict:
    return {
        "type": "multi",
        "name": "total",
        "graders": {"has_letter": HAS_LETTER, "judge": judge},
        "calculate_output": "has_letter + judge / 10",
    }


@pytest.mark.parametrize(
    "grader,field",
    [
        (
            {**JUDGE, "model": "no-such-model"},
            "config.grpo.grader.model: 'no-such-model' names no open session",
        ),
        (_multi({**JUDGE, "model": "sess-000000000000"}), "config.grpo.grader.graders.judge.model"),
        ({**JUDGE, "range": [10, 0]}, "config.grpo.grader.range"),
        ({**JUDGE, "range": [0, float("inf")]}, "config.grpo.grader.range.1"),
        (
            {**JUDGE, "input": [{"role": "user", "content": "{{item.answer}}: {{sample.output_text}}"}]},
            "config.grpo.grader.input.0.content: {{ item.answer }} reads a field",
        ),
        ({**JUDGE, "sampling_params": {"top_p": 0}}, "config.grpo.grader.sampling_params.top_p"),
        (
            {**JUDGE, "sampling_params": {"reasoning_effort": "low"}},
            "config.grpo.grader.sampling_params.reasoning",
        ),
    ],
)
def test_bad_model_graders_are_refused_naming_the_field_before_any_sampling(client, sessions, grader, field):
    before = len(client.list_jobs(sessions[0]))
    with pytest.raises(InvalidArgumentError, match=field.replace(".", r"\.").replace("{", r"\{")):
        _train(client, sessions, grader)
    assert len(client.list_jobs(sessions[0])) == before  # refused when submitted: no job, nothing sampled


def test_a_grpo_job_grades_with_a_score_model_on_another_session(trainer, client, sessions, torch_engine):
    core = trainer[1]
    policy_id, judge_id, _, held = sessions
    grader = _multi({**JUDGE, "model": judge_id})
    judge_model = core.sessions.open(judge_id).loaded.model
    taught = {k: p.detach().clone() for k, p in judge_model.named_parameters() if "lora_" in k}
    events = _train(client, sessions, grader, steps=2, validation_dataset_id=held)
    assert events[-1].state.state is JobState.SUCCEEDED, events[-1]
    steps = [e.step for e in events if e.step is not None]
    assert len(steps) == 2
    for s in steps:
        names = {g.name: g for g in s.rl.graders}
        assert set(names) == {"has_letter", "judge", "total"}
        assert 0.0 <= names["judge"].mean_score <= 10.0
    # the last step's evaluation, recomputed: the held-out prompts sampled as the job samples them (one call, one
    # sample each, the job's eval seeds) with the adapter the job ended with, each graded by the reference
    policy = core.sessions.open(policy_id).loaded
    tok, eos = policy.tokenizer, chat_sampling.eos_ids(policy)
    reqs = [
        SampleRequest(
            chat_sampling.prompt_ids(tok, r["messages"]),
            1,
            SamplingParams(max_tokens=2, temperature=0.3, top_p=1.0, seed=grpo.eval_seed(0, i)),
        )
        for i, r in enumerate(HELD_OUT)
    ]
    texts = [
        chat_sampling.reply_text(tok, res.sequences[0], eos)
        for res in sample(policy.model, reqs, eos_token_ids=eos)
    ]
    judge_leaf = grpo.parse_grader(json.dumps(grader)).leaves["judge"]
    asks = [judge_leaf.request(Sample.of(t), row) for t, row in zip(texts, HELD_OUT, strict=True)]
    judged = generate_replies(core.sessions.open(judge_id).loaded, asks, NEW_TOKENS)
    want = [float("t" in t) + read_score(j, 0.0, 10.0).value / 10 for t, j in zip(texts, judged, strict=True)]
    assert steps[-1].rl.eval_reward_mean == pytest.approx(sum(want) / len(want), rel=1e-6)  # float32 rewards
    assert taught and all(
        torch.equal(p, taught[k]) for k, p in judge_model.named_parameters() if "lora_" in k
    )
    assert not client.get_session(judge_id).busy_job_id  # the grader session was asked, never trained or held


def test_a_cancelled_job_resumed_grades_as_one_never_stopped(client, sessions, torch_engine):
    """The grader model samples at temperature 0.5 (each reply seeded by its prompt) and is resolved again when the
    job resumes: the resumed steps' rewards and the judge's own mean score equal a job never stopped."""
    _, judge_id, train, _ = sessions
    judge = {**JUDGE, "model": judge_id, "sampling_params": {"temperature": 0.5, "max_completions_tokens": 4}}
    steps = 6  # room for the cancel, sent after the first step's event, to land before the last step
    cfg = _config(_multi(judge), steps)

    def fresh():
        s = client.load_model("tiny-llama", quantization=Quantization.NONE, dtype="float32")
        client.attach_lora(s.session_id, LoraConfig(r=8, alpha=16, seed=0))
        return s.session_id

    a = fresh()
    reference = [e.step for e in client.train(a, train, cfg) if e.step is not None]
    client.close_session(a)
    # the sampled judge's replies vary (some state a score, some do not), so equal means below say something
    assert len({g.mean_score for m in reference for g in m.rl.graders if g.name == "judge"}) > 1
    b = fresh()
    job_id, cancelled = "", False
    for event in client.train(b, train, cfg):
        job_id = event.job_id
        if event.step is not None and not cancelled:
            client.cancel_job(job_id)  # lands between steps: the job checkpoints the step it reached
            cancelled = True
    job = client.get_job(job_id)
    assert job.state is JobState.CANCELLED and job.last_checkpoint is not None, job
    stopped = job.last_checkpoint.step
    assert 1 <= stopped < steps
    resumed = [e.step for e in client.train(b, resume_from_job_id=job_id) if e.step is not None]
    assert [s.step for s in resumed] == list(range(stopped + 1, steps + 1))
    for got, want in zip(resumed, reference[stopped:], strict=True):
        assert got.rl.reward_mean == want.rl.reward_mean
        assert {g.name: g.mean_score for g in got.rl.graders} == {
            g.name: g.mean_score for g in want.rl.graders
        }
    client.close_session(b)


def test_a_closed_grader_session_fails_the_grade(trainer, client, sessions):
    core = trainer[1]
    gone = client.load_model("tiny-llama", quantization=Quantization.NONE, dtype="float32")
    grader = grpo.parse_grader(json.dumps({**JUDGE, "model": gone.session_id}))
    table = grader_sessions.resolve(grader, core.sessions, core.sessions.open(sessions[0]))
    leaf = grader.leaves["judge"]
    client.close_session(gone.session_id)
    with pytest.raises(FailedPrecondition, match=f"grader session {gone.session_id} .* was closed"):
        grader_sessions.GraderSessions(table)([leaf.request(Sample.of("x"), {"question": "q"})])


def test_a_multi_asks_each_grader_model_once_and_drops_prompts_too_long(trainer, sessions):
    """Two model graders on two sessions: the judge (its adapter on) and the job's own base (named by its model
    path: the policy session with its adapter off), each asked once for the batch; a prompt longer than the grader
    session's max_seq_length gets the empty reply, scored 0 and invalid."""
    core = trainer[1]
    policy_id, judge_id, _, _ = sessions
    spec = _multi({**JUDGE, "model": judge_id})
    spec["graders"] = {
        "judge": spec["graders"]["judge"],
        "base": {**JUDGE, "name": "base", "model": "tiny-llama"},
    }
    spec["calculate_output"] = "judge + base"
    own = core.sessions.open(policy_id)
    table = grader_sessions.resolve(grpo.parse_grader(json.dumps(spec)), core.sessions, own)
    assert table["tiny-llama"].session is own and not table["tiny-llama"].adapter
    asked = []
    answer = grader_sessions.GraderSessions(table)

    def model_fn(requests):
        asked.append(list(requests))
        return answer(requests)

    grader = grpo.parse_grader(json.dumps(spec), model_fn)
    too_long = "word " * own.loaded.facts.max_seq_length
    outputs = ["tree", too_long, "moon"]
    results = grader.grade_many([Sample.of(o) for o in outputs], [{"question": "q"}] * 3)
    assert [len(a) for a in asked] == [3, 3] and {a[0].model for a in asked} == {judge_id, "tiny-llama"}
    judge = core.sessions.open(judge_id).loaded
    by_model = {a[0].model: a for a in asked}
    want_judge = generate_replies(judge, [by_model[judge_id][i] for i in (0, 2)], NEW_TOKENS)
    with own.loaded.model.disable_adapter():
        want_base = generate_replies(own.loaded, [by_model["tiny-llama"][i] for i in (0, 2)], NEW_TOKENS)
    for k, i in enumerate((0, 2)):
        assert results[i].per_grader["judge"] == read_score(want_judge[k], 0, 10).value
        assert results[i].per_grader["base"] == read_score(want_base[k], 0, 10).value
    assert results[1].per_grader == {"judge": 0.0, "base": 0.0, "total": 0.0}
    assert set(results[1].invalid) >= {"judge", "base"}  # "states no score: ''"
