"""The official ``openai`` SDK's reinforcement job with a ``score_model`` grader, through the OpenAI gateway to a real
trainer (a tiny fp32 Llama): the grader's ``model`` resolves in the trainer (``trainer_svc/core/grader_sessions.py``)
for the gateway's tenant, so naming the job's own base model grades with that base on the job's session."""

from __future__ import annotations

import pytest

from tests.deps import locked

openai = locked("openai")

from tests.gateways.openai_stack import jsonl, running_stack, wait_status  # noqa: E402

DONE = ("succeeded", "failed", "cancelled")
JUDGE = {
    "type": "score_model",
    "name": "judge",
    "model": "tiny-llama",  # the job's own base: its session answers, adapters off
    "input": [
        {"role": "system", "content": "Grade the sum of {{ item.question }} and itself."},
        {"role": "user", "content": "{{ sample.output_text }}"},
    ],
    "sampling_params": {"max_completions_tokens": 4},
}
ROWS = [
    {"messages": [{"role": "user", "content": f"What is {i} plus {i}?"}], "question": str(i)}
    for i in range(2)
]


@pytest.fixture(scope="module")
def stack(model_root, tmp_path_factory):
    yield from running_stack(model_root, tmp_path_factory)


def _create(c, grader: dict):
    f = c.files.create(file=("rft.jsonl", jsonl(ROWS)), purpose="fine-tune")
    return c.fine_tuning.jobs.create(
        model="tiny-llama",
        training_file=f.id,
        method={
            "type": "reinforcement",
            "reinforcement": {
                "grader": grader,
                "hyperparameters": {"n_epochs": 1, "batch_size": 2, "compute_multiplier": 0.25},
            },
        },
    )


def test_a_reinforcement_job_grades_with_a_score_model_on_its_own_base(stack):
    c = stack.client()
    job = _create(c, JUDGE)
    done = wait_status(c, job.id, DONE)
    assert done.status == "succeeded", done.error
    assert done.method.reinforcement.grader.type == "score_model"
    (step,) = [e.data for e in c.fine_tuning.jobs.list_events(job.id) if e.type == "metrics"]
    assert 0.0 <= step["train_reward_mean"] <= 1.0  # clipped to the default range [0, 1]


@pytest.mark.parametrize(
    ("grader", "field"),
    [
        ({**JUDGE, "model": "gpt-4o"}, "method.reinforcement.grader.model"),
        (
            {
                "type": "multi",
                "name": "total",
                "graders": {"judge": {**JUDGE, "model": "gpt-4o"}},
                "calculate_output": "judge",
            },
            "method.reinforcement.grader.graders.judge.model",
        ),
    ],
)
def test_a_score_model_no_session_answers_is_a_bad_request_naming_the_grader_field(stack, grader, field):
    """The trainer refuses the model; the SDK's error names the request's field (OpenAI's ``param``), not the
    trainer's ``config.grpo`` path nor the training file."""
    c = stack.client()
    with pytest.raises(openai.BadRequestError) as err:
        _create(c, grader)
    assert err.value.param == field
    assert err.value.code == "invalid_argument"
    assert err.value.body["message"].startswith(f"{field}: 'gpt-4o' names no open session"), err.value.body
