"""A job that fails leaves its session as it found it, adapters with inf or NaN are never published, and a Train
on a busy session waits its turn (over gRPC, through the SDK)."""

from __future__ import annotations

import time

import pytest
import torch

from strop.client import FailedPreconditionError, JobState
from tests.trainer_svc.conftest import sft_config


def _weights(core, artifact) -> bytes:
    return (core.artifacts.path_of(artifact.artifact_id) / "adapter_model.safetensors").read_bytes()


def _end(client, job_id: str, timeout: float = 240.0):
    deadline = time.monotonic() + timeout
    while not (job := client.get_job(job_id)).state.terminal:
        assert time.monotonic() < deadline, f"job {job_id} still {job.state.value}"
        time.sleep(0.1)
    return job


@pytest.mark.parametrize("broken", [{"learning_rate": 1e308}, {"weight_decay": 1e308}])
def test_a_failed_job_leaves_the_session_adapter_as_it_was(
    client, trainer, ready_session, sft_dataset, broken
):
    # before: the FAILED job's non-finite adapter stayed in the session; SaveAdapter published it (32,768 of
    # 32,768 values non-finite), an export from it SUCCEEDED, and the next sound Train failed on it
    _, core, _ = trainer
    before = client.save_adapter(ready_session)
    events = list(client.train(ready_session, sft_dataset.dataset_id, sft_config(3, **broken)))
    job = client.get_job(events[-1].job_id)
    assert job.state is JobState.FAILED, job.message
    assert any(e.log and "back to its state before this job" in e.log.message for e in events)
    after = client.save_adapter(ready_session)
    assert _weights(core, after) == _weights(core, before), (
        "the adapter is bit for bit the one before the job"
    )
    sound = list(client.train(ready_session, sft_dataset.dataset_id, sft_config(2)))
    assert client.get_job(sound[-1].job_id).state is JobState.SUCCEEDED


def test_an_adapter_with_non_finite_values_is_never_saved(client, trainer, ready_session):
    _, core, _ = trainer
    sess = core.sessions.open(ready_session)
    lora_b = next(p for n, p in sess.loaded.model.named_parameters() if "lora_B" in n)
    with torch.no_grad():
        kept = lora_b.clone()
        lora_b[0, 0] = float("nan")
    try:
        with pytest.raises(FailedPreconditionError, match=r"1 non-finite values of \d+ .*not published"):
            client.save_adapter(ready_session, "nan-adapter")
        assert not core.artifacts.exists("nan-adapter")
    finally:
        with torch.no_grad():
            lora_b.copy_(kept)


def test_a_train_on_a_busy_session_waits_its_turn_unless_asked_to_fail(client, ready_session, sft_dataset):
    # before: the second Train was refused with FAILED_PRECONDITION ("is busy with job …")
    first = next(iter(client.train(ready_session, sft_dataset.dataset_id, sft_config(400)))).job_id
    second = next(iter(client.train(ready_session, sft_dataset.dataset_id, sft_config(2)))).job_id
    waiting = client.get_job(second)
    assert waiting.state is JobState.QUEUED and waiting.queue_position == 1
    with pytest.raises(FailedPreconditionError, match=f"is busy with job {first}"):
        next(iter(client.train(ready_session, sft_dataset.dataset_id, sft_config(2), fail_if_busy=True)))
    assert client.get_session(ready_session).busy_job_id == first
    client.cancel_job(first)
    assert _end(client, first).state is JobState.CANCELLED
    done = _end(client, second)
    assert done.state is JobState.SUCCEEDED and done.step == 2, done.message
    assert client.get_session(ready_session).busy_job_id == ""
