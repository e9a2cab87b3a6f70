"""A trainer service killed mid-run keeps its history; the interrupted job resumes from its checkpoint."""

from __future__ import annotations

import time

from strop.client import JobState, SessionState, TrainerClient
from strop.demo.data import sft_rows
from strop.demo.services import start_service
from tests.trainer_svc.conftest import FAST_LORA, sft_config


def test_killed_service_restarts_with_history_and_resumes_the_interrupted_job(model_root, tmp_path):
    args = [
        "--model-root",
        str(model_root),
        "--artifact-root",
        str(tmp_path / "artifacts"),
        "--state-dir",
        str(tmp_path / "state"),
    ]
    svc = start_service("trainer", args, tmp_path / "logs")
    try:
        with TrainerClient(svc.target) as tc:
            s = tc.load_model("tiny-llama-4bit")
            tc.attach_lora(s.session_id, FAST_LORA)
            ds = tc.upload_dataset(sft_rows())
            done = list(tc.train(s.session_id, ds.dataset_id, sft_config(3)))
            finished_id = done[0].job_id
            events = tc.train(s.session_id, ds.dataset_id, sft_config(5000, checkpoint_every_steps=5))
            job_id, ckpt_step = "", 0
            for e in events:
                job_id = e.job_id
                if e.checkpoint is not None and e.checkpoint.step >= 10:
                    ckpt_step = e.checkpoint.step
                    break
            events.close()
    finally:
        svc.kill()  # SIGKILL mid-run: no drain, no cleanup

    svc = start_service("trainer", args, tmp_path / "logs")
    try:
        with TrainerClient(svc.target) as tc:
            jobs = {j.job_id: j for j in tc.list_jobs()}
            assert set(jobs) == {finished_id, job_id}, "every job survives the restart"
            assert jobs[finished_id].state is JobState.SUCCEEDED
            interrupted = jobs[job_id]
            assert interrupted.state is JobState.INTERRUPTED
            assert interrupted.last_checkpoint.step >= ckpt_step
            assert interrupted.loss_curve is not None, (
                "the restart draws the curve the killed process could not"
            )
            assert int(interrupted.loss_curve.metadata["steps"]) >= ckpt_step
            assert tc.get_session(s.session_id).state is SessionState.LOST
            replay = list(tc.watch_job(job_id))
            assert replay[-1].state.state is JobState.INTERRUPTED, "watchers see the job's end"
            steps = [e.step.step for e in replay if e.step]
            assert steps == list(range(1, len(steps) + 1))

            s2 = tc.load_model("tiny-llama-4bit")
            tc.attach_lora(s2.session_id, FAST_LORA)
            start = interrupted.last_checkpoint.step
            t0 = time.monotonic()
            resumed = list(
                tc.train(
                    s2.session_id,
                    resume_from_job_id=job_id,
                    config=sft_config(start + 3, checkpoint_every_steps=5),
                )
            )
            assert time.monotonic() - t0 < 120
            assert [e.step.step for e in resumed if e.step] == [start + 1, start + 2, start + 3]
            assert resumed[-1].state.state is JobState.SUCCEEDED

            # SIGTERM while a job runs: the drain checkpoints it at the step reached and marks it INTERRUPTED.
            events = tc.train(s2.session_id, ds.dataset_id, sft_config(5000, checkpoint_every_steps=1000))
            drained_id = next(e for e in events if e.step is not None and e.step.step >= 3).job_id
            events.close()
    finally:
        rc = svc.stop()
        assert rc == 0, f"SIGTERM drains and exits cleanly (exit {rc}); service log:\n{svc.log_tail()}"

    svc = start_service("trainer", args, tmp_path / "logs")
    try:
        with TrainerClient(svc.target) as tc:
            drained = tc.get_job(drained_id)
            assert drained.state is JobState.INTERRUPTED
            assert drained.last_checkpoint is not None and drained.last_checkpoint.step == drained.step >= 3
            assert (
                "shutting down"
                in tc.watch_job(drained_id, after_seq=drained.last_seq - 1).__next__().state.message
            )
    finally:
        svc.stop()
