"""The official ``openai`` SDK (3.60.0, pinned) against the real OpenAI gateway and a real trainer on 127.0.0.1 (a tiny
fp32 Llama): files, fine-tuning jobs (SFT with a validation file, DPO), their events and checkpoints, cancel, pause and
resume, models, tenants, a full queue, and a gateway restart. Every response is parsed by the SDK's own types."""

from __future__ import annotations

import json

import pytest

from tests.deps import locked

openai = locked("openai")

from strop.client.export import ExportClient  # noqa: E402
from tests.gateways.openai_stack import (  # noqa: E402
    KEY_A,
    KEY_B,
    chat_rows,
    jsonl,
    preference_rows,
    running_stack,
    wait_status,
)

DONE = ("succeeded", "failed", "cancelled")


@pytest.fixture(scope="module")
def stack(model_root, tmp_path_factory):
    yield from running_stack(model_root, tmp_path_factory)


@pytest.fixture(scope="module")
def files(stack):
    c = stack.client()
    train = c.files.create(file=("train.jsonl", jsonl(chat_rows(8))), purpose="fine-tune")
    valid = c.files.create(file=("valid.jsonl", jsonl(chat_rows(4, offset=20))), purpose="fine-tune")
    prefs = c.files.create(file=("prefs.jsonl", jsonl(preference_rows(4))), purpose="fine-tune")
    return train, valid, prefs


@pytest.fixture(scope="module")
def sft_job(stack, files):
    """One SFT job with a validation file, run to its end: 8 rows, batch 4, 2 epochs = 4 steps."""
    c = stack.client()
    train, valid, _ = files
    job = c.fine_tuning.jobs.create(
        model="tiny-llama",
        training_file=train.id,
        validation_file=valid.id,
        suffix="adder",
        seed=7,
        metadata={"team": "a", "strop_export": "peft"},
        method={
            "type": "supervised",
            "supervised": {
                "hyperparameters": {"n_epochs": 2, "batch_size": 4, "learning_rate_multiplier": 5.0}
            },
        },
    )
    return job, wait_status(c, job.id, DONE)


def test_the_pinned_sdk():
    assert openai.__version__ == "3.60.0"


def test_files_round_trip(stack, files):
    c = stack.client()
    train = files[0]
    assert train.object == "file" and train.purpose == "fine-tune" and train.status == "processed"
    assert train.bytes == len(jsonl(chat_rows(8))) and train.filename == "train.jsonl"
    assert c.files.retrieve(train.id).id == train.id
    assert c.files.content(train.id).content == jsonl(chat_rows(8))  # the bytes as uploaded
    listed = [f.id for f in c.files.list(purpose="fine-tune")]
    assert set(listed) >= {f.id for f in files}
    page = c.files.list(limit=1, order="asc")
    assert [f.id for f in page.data] == [train.id] and page.has_more
    assert [f.id for f in page.get_next_page().data] == [files[1].id]  # the SDK's cursor (after=) pages on


def test_sft_job_trains_and_reports(stack, sft_job):
    c = stack.client()
    created, job = sft_job
    assert created.status in ("queued", "running") and created.seed == 7
    assert job.status == "succeeded", job.error
    # "auto" resolved as documented: learning_rate_multiplier given, the others too
    assert (job.hyperparameters.n_epochs, job.hyperparameters.batch_size) == (2, 4)
    assert (
        job.method.type == "supervised"
        and job.method.supervised.hyperparameters.learning_rate_multiplier == 5.0
    )
    assert job.fine_tuned_model == f"ft:tiny-llama:a:adder:{job.id.split('-', 1)[1]}"
    assert job.metadata == {"team": "a", "strop_export": "peft"}
    assert job.finished_at >= job.created_at and job.trained_tokens > 0
    events = list(c.fine_tuning.jobs.list_events(job.id, limit=3))  # three a page: the SDK pages with after=
    assert events[0].message == "The job has successfully completed"
    steps = [e.data for e in reversed(events) if e.type == "metrics" and "train_loss" in e.data]
    assert [s["step"] for s in steps] == [1, 2, 3, 4] and all(s["total_steps"] == 4 for s in steps)
    assert steps[-1]["train_loss"] < steps[0]["train_loss"]  # lr 5e-3 on 8 rows, twice: the loss falls
    # the validation file is evaluated at each epoch's end (steps 2 and 4), the whole set at the end
    evals = {e.data["step"]: e.data for e in events if e.type == "metrics" and "valid_loss" in e.data}
    assert sorted(evals) == [2, 4] and all(e["valid_loss"] > 0 for e in evals.values())
    assert evals[4]["full_valid_loss"] == pytest.approx(
        evals[4]["valid_loss"], rel=1e-12
    )  # eval_rows 0: all rows
    ckpts = list(c.fine_tuning.jobs.checkpoints.list(job.id))
    # one checkpoint an epoch (2 steps each), newest first; each carries its step's training loss
    assert [k.step_number for k in ckpts] == [4, 2]
    by_step = {s["step"]: s["train_loss"] for s in steps}
    for k in ckpts:
        assert k.metrics.train_loss == pytest.approx(by_step[k.step_number], rel=1e-9)
        assert k.fine_tuned_model_checkpoint == f"{job.fine_tuned_model}:ckpt-step-{k.step_number}"
        assert k.metrics.valid_loss == pytest.approx(evals[k.step_number]["valid_loss"], rel=1e-12)
    assert ckpts[0].metrics.full_valid_loss == pytest.approx(evals[4]["full_valid_loss"], rel=1e-12)
    # the result file: the trainer's metrics CSV, one row a step
    (result,) = job.result_files
    assert c.files.retrieve(result).purpose == "fine-tune-results"
    csv = c.files.content(result).text.splitlines()
    assert csv[0].startswith("step,train_loss") and len(csv) == 1 + 4
    # metadata.strop_export: the export service wrote the fine-tuned model as a PEFT adapter directory
    (export,) = job.model_extra["strop_exports"]
    with ExportClient(stack.exporter_address, token=KEY_A) as ec:
        done = ec.wait_export(export["export_id"], timeout=120)
    assert done.state.value == "SUCCEEDED", done.error
    assert [r.artifact.kind for r in done.results] == ["peft_adapter"]
    assert [r.artifact.artifact_id for r in done.results] == export["artifacts"]


def test_models_list_retrieve_delete(stack, sft_job):
    c = stack.client()
    name = sft_job[1].fine_tuned_model
    ids = [m.id for m in c.models.list()]
    assert {"tiny-llama", "tiny-llama-4bit", name} <= set(ids)
    assert c.models.retrieve(name).owned_by == "org-a"
    assert c.models.retrieve("tiny-llama").owned_by == "strop"
    with pytest.raises(openai.NotFoundError):
        stack.client(KEY_B).models.retrieve(name)  # another tenant's model does not exist for it
    with pytest.raises(openai.PermissionDeniedError):
        c.models.delete("tiny-llama")
    assert c.models.delete(name).deleted
    with pytest.raises(openai.NotFoundError):
        c.models.retrieve(name)


def test_another_tenants_job_and_files_are_not_found(stack, sft_job, files):
    b = stack.client(KEY_B)
    job_id = sft_job[1].id
    for call in (
        lambda: b.fine_tuning.jobs.retrieve(job_id),
        lambda: b.fine_tuning.jobs.cancel(job_id),
        lambda: b.fine_tuning.jobs.list_events(job_id),
        lambda: b.files.retrieve(files[0].id),
        lambda: b.files.content(files[0].id),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert job_id not in [j.id for j in b.fine_tuning.jobs.list()]
    with pytest.raises(
        openai.BadRequestError
    ) as e:  # a job on another tenant's file: that file does not exist
        b.fine_tuning.jobs.create(model="tiny-llama", training_file=files[0].id)
    assert e.value.param == "training_file"


def test_cancel_stops_a_running_job(stack, files):
    c = stack.client()
    job = c.fine_tuning.jobs.create(
        model="tiny-llama", training_file=files[0].id, hyperparameters={"n_epochs": 50, "batch_size": 1}
    )
    wait_status(c, job.id, ("running",))
    assert c.fine_tuning.jobs.cancel(job.id).status == "cancelled"
    with pytest.raises(openai.ConflictError) as e:
        c.fine_tuning.jobs.cancel(job.id)
    assert e.value.response.headers["x-should-retry"] == "false"  # final: the SDK must not retry it
    _wait_followed(stack, job.id)
    job = c.fine_tuning.jobs.retrieve(job.id)
    assert job.status == "cancelled" and job.fine_tuned_model is None
    assert any(e.message == "Fine-tuning job cancelled" for e in c.fine_tuning.jobs.list_events(job.id))


def _wait_followed(stack, job_id: str, timeout: float = 60.0) -> None:
    """Until the gateway has settled the job's strop job (its session closed)."""
    import time

    deadline = time.monotonic() + timeout
    while stack.gateway.gw.store.get("oai_jobs", job_id).get("following"):
        assert time.monotonic() < deadline, "the gateway did not settle the job"
        time.sleep(0.05)


def _steps(c, job_id: str) -> list[int]:
    return [
        e.data["step"]
        for e in reversed(list(c.fine_tuning.jobs.list_events(job_id, limit=100)))
        if e.type == "metrics" and "train_loss" in e.data
    ]


def test_pause_and_resume_keep_the_job(stack, files):
    c = stack.client()
    job = c.fine_tuning.jobs.create(
        model="tiny-llama", training_file=files[0].id, hyperparameters={"n_epochs": 2, "batch_size": 1}
    )  # 16 steps, a checkpoint at 8 each
    deadline_steps = 2
    import time

    while len(_steps(c, job.id)) < deadline_steps:
        time.sleep(0.05)
    assert c.fine_tuning.jobs.pause(job.id).status == "paused"
    _wait_followed(stack, job.id)
    paused_at = _steps(c, job.id)[-1]
    assert c.fine_tuning.jobs.retrieve(job.id).status == "paused"
    with pytest.raises(openai.ConflictError):
        c.fine_tuning.jobs.pause(job.id)
    resumed = c.fine_tuning.jobs.resume(job.id)
    assert resumed.id == job.id and resumed.status in ("queued", "running")
    done = wait_status(c, job.id, DONE)
    assert done.status == "succeeded", done.error
    steps = _steps(c, job.id)
    # the resumed strop job continues from the pause's checkpoint: after the paused step, the steps go on to 16
    # with none repeated past the pause (HF resumes at the checkpoint's global step)
    after = steps[steps.index(paused_at) + 1 :]
    assert after == list(range(paused_at + 1, 17)), steps
    chain = stack.gateway.gw.store.get("oai_jobs", job.id)["chain"]
    assert len(chain) == 2  # two strop jobs, one OpenAI job


def test_dpo_job_on_a_preference_file(stack, files):
    c = stack.client()
    job = c.fine_tuning.jobs.create(
        model="tiny-llama",
        training_file=files[2].id,
        method={
            "type": "dpo",
            "dpo": {
                "hyperparameters": {
                    "beta": 0.2,
                    "n_epochs": 1,
                    "batch_size": 2,
                    "learning_rate_multiplier": 100,
                }
            },
        },
    )
    done = wait_status(c, job.id, DONE)
    assert done.status == "succeeded", done.error
    assert done.method.type == "dpo" and done.method.dpo.hyperparameters.beta == 0.2
    metrics = [e.data for e in c.fine_tuning.jobs.list_events(job.id) if e.type == "metrics"]
    assert len(metrics) == 2 and all("reward_margin" in m for m in metrics)  # 4 pairs, batch 2
    with pytest.raises(openai.BadRequestError) as e:  # a chat file cannot train DPO
        c.fine_tuning.jobs.create(model="tiny-llama", training_file=files[0].id, method={"type": "dpo"})
    assert e.value.param == "training_file"


def test_a_full_queue_is_a_rate_limit(stack, files):
    c = stack.client()
    slow = {"n_epochs": 50, "batch_size": 1}
    running = c.fine_tuning.jobs.create(model="tiny-llama", training_file=files[0].id, hyperparameters=slow)
    wait_status(c, running.id, ("running",))
    queued = c.fine_tuning.jobs.create(model="tiny-llama", training_file=files[0].id, hyperparameters=slow)
    assert c.fine_tuning.jobs.retrieve(queued.id).status == "queued"
    with pytest.raises(openai.RateLimitError) as e:  # the trainer's queue holds one (MAX_QUEUED)
        c.fine_tuning.jobs.create(model="tiny-llama", training_file=files[0].id, hyperparameters=slow)
    assert e.value.code == "rate_limit_exceeded" and e.value.response.headers["retry-after"] == "10"
    for j in (queued, running):
        c.fine_tuning.jobs.cancel(j.id)
    for j in (queued, running):
        _wait_followed(stack, j.id)
    # the refused job left nothing: two new jobs, both cancelled
    assert [j.id for j in c.fine_tuning.jobs.list(limit=2).data] == [queued.id, running.id]
    assert [c.fine_tuning.jobs.retrieve(j.id).status for j in (queued, running)] == ["cancelled", "cancelled"]


def test_a_restarted_gateway_keeps_its_state(stack, files, sft_job):
    c = stack.client()
    job = c.fine_tuning.jobs.create(
        model="tiny-llama", training_file=files[0].id, hyperparameters={"n_epochs": 3, "batch_size": 1}
    )
    wait_status(c, job.id, ("running",))
    before = [e.id for e in c.fine_tuning.jobs.list_events(sft_job[1].id, limit=100)]
    stack.restart_gateway()
    c = stack.client()
    assert c.files.content(files[0].id).content == jsonl(chat_rows(8))
    assert [e.id for e in c.fine_tuning.jobs.list_events(sft_job[1].id, limit=100)] == before
    assert c.fine_tuning.jobs.retrieve(sft_job[1].id).fine_tuned_model == sft_job[1].fine_tuned_model
    # the job that ran across the restart is followed again (at its owner's first request) and finishes
    done = wait_status(c, job.id, DONE)
    assert done.status == "succeeded", done.error
    assert _steps(c, job.id) == list(range(1, 25))  # every step's event once: none lost or doubled


def test_a_job_the_trainer_fails_reports_its_error(stack, files):
    from strop.client import TrainerClient

    c = stack.client()
    # a learning rate of 1e9 breaks training at once: the trainer fails its job, and the gateway reports the
    # trainer's message in OpenAI's error object, its code by who is at fault (the trainer's error_code)
    job = c.fine_tuning.jobs.create(
        model="tiny-llama",
        training_file=files[0].id,
        hyperparameters={"n_epochs": 1, "learning_rate_multiplier": 1e12},
    )
    done = wait_status(c, job.id, DONE)
    assert done.status == "failed" and done.fine_tuned_model is None
    (strop_job,) = stack.gateway.gw.store.get("oai_jobs", job.id)["chain"]
    with TrainerClient(stack.trainer_address, token=KEY_A) as t:
        failed = t.get_job(strop_job)
    assert failed.state.value == "FAILED" and done.error.message == failed.error
    assert done.error.code == (
        "invalid_training_file" if failed.error_code == "INVALID_ARGUMENT" else "server_error"
    )
    assert next(iter(c.fine_tuning.jobs.list_events(job.id))).level == "error"


GRADER = {
    "type": "string_check",
    "name": "has_answer",
    "input": "{{ sample.output_text }}",
    "reference": "{{ item.answer }}",
    "operation": "like",
}


def test_reinforcement_job_runs_grpo_with_the_grader(stack):
    c = stack.client()
    rows = [
        {"messages": [{"role": "user", "content": f"What is {i} plus {i}?"}], "answer": str(2 * i)}
        for i in range(2)
    ]
    f = c.files.create(file=("rft.jsonl", jsonl(rows)), purpose="fine-tune")
    job = c.fine_tuning.jobs.create(
        model="tiny-llama",
        training_file=f.id,
        method={
            "type": "reinforcement",
            "reinforcement": {
                "grader": GRADER,
                "hyperparameters": {"n_epochs": 1, "batch_size": 2, "compute_multiplier": 0.25},
            },
        },
    )
    done = wait_status(c, job.id, DONE)
    assert done.status == "succeeded", done.error
    assert done.method.type == "reinforcement" and done.method.reinforcement.grader.name == "has_answer"
    assert done.method.reinforcement.hyperparameters.compute_multiplier == 0.25
    (step,) = [
        e.data for e in c.fine_tuning.jobs.list_events(job.id) if e.type == "metrics"
    ]  # 2 prompts, batch 2
    # a string_check scores 0 or 1: the step's mean over its 2 x 2 samples (group 8 x 0.25) is a multiple of 1/4
    assert step["train_reward_mean"] * 4 == pytest.approx(round(step["train_reward_mean"] * 4), abs=1e-9)
    config = stack.gateway.gw.store.get("oai_jobs", job.id)["config"]["grpo"]
    assert config["group_size"] == 2 and json.loads(config["grader"]) == GRADER


def test_a_trainer_restart_continues_the_job(stack, files):
    import time

    c = stack.client()
    job = c.fine_tuning.jobs.create(
        model="tiny-llama", training_file=files[0].id, hyperparameters={"n_epochs": 2, "batch_size": 1}
    )  # 16 steps
    while len(_steps(c, job.id)) < 2:
        time.sleep(0.05)
    stack.restart_trainer()  # the job stops INTERRUPTED at a step boundary, with a checkpoint there
    done = wait_status(c, job.id, DONE, timeout=180)
    assert done.status == "succeeded", done.error
    events = [e.message for e in reversed(list(c.fine_tuning.jobs.list_events(job.id, limit=100)))]
    (note,) = [m for m in events if m.startswith("The trainer stopped at step")]
    stopped = int(note.split()[5].rstrip(";"))
    steps = _steps(c, job.id)
    # the continuation starts after the interrupted step: none repeated, none missing, to the 16th
    assert steps[steps.index(stopped) + 1 :] == list(range(stopped + 1, 17)), steps
    assert len(stack.gateway.gw.store.get("oai_jobs", job.id)["chain"]) == 2
