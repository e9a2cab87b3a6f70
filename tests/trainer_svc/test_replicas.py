"""Two trainer pods on one PostgreSQL state database (a real server): each lists and watches every job, a job's
record names the pod that runs it, and one pod's restart leaves the other's running job alone."""

from __future__ import annotations

import pytest

from strop.client import FailedPreconditionError, JobState, SessionState, TrainerClient
from strop.demo.data import sft_rows
from strop.trainer_svc.core.trainer_core import TrainerConfig
from strop.trainer_svc.server import start
from tests.trainer_svc.conftest import FAST_LORA, sft_config


def _pod(model_root, tmp_path, url: str, name: str):
    config = TrainerConfig(
        model_root=model_root,
        artifact_root=tmp_path / "artifacts",  # the shared artifact store (a ReadWriteMany volume)
        state_dir=tmp_path / name,  # each pod's own work files
        database_url=url,
        instance_id=name,
    )
    return start(config)


def test_pods_share_the_job_list_and_a_restart_leaves_the_other_pods_job_running(
    model_root, tmp_path, postgres
):
    url = postgres.new_database()
    pod0, pod1 = _pod(model_root, tmp_path, url, "trainer-0"), _pod(model_root, tmp_path, url, "trainer-1")
    try:
        with TrainerClient(f"127.0.0.1:{pod0.port}") as t0, TrainerClient(f"127.0.0.1:{pod1.port}") as t1:
            s = t0.load_model("tiny-llama-4bit")
            t0.attach_lora(s.session_id, FAST_LORA)
            ds = t0.upload_dataset(sft_rows())
            done = list(t0.train(s.session_id, ds.dataset_id, sft_config(3)))
            finished = done[0].job_id

            seen = {j.job_id: j for j in t1.list_jobs()}
            assert set(seen) == {finished}, "trainer-1 lists trainer-0's job"
            assert seen[finished].instance_id == "trainer-0" and seen[finished].state is JobState.SUCCEEDED
            replay = list(t1.watch_job(finished))
            assert [e.seq for e in replay] == [e.seq for e in done], (
                "every event, replayed through the other pod"
            )
            (sess,) = t1.list_sessions()
            assert (sess.session_id, sess.instance_id, sess.state) == (
                s.session_id,
                "trainer-0",
                SessionState.READY,
            )

            events = t0.train(s.session_id, ds.dataset_id, sft_config(5000))
            running = next(e for e in events if e.step is not None).job_id
            events.close()
            with pytest.raises(FailedPreconditionError, match="runs on trainer instance trainer-0"):
                t1.cancel_job(running)

        assert pod1.stop(grace=5.0)
        pod1 = _pod(
            model_root, tmp_path, url, "trainer-1"
        )  # trainer-1 restarts: it recovers its own work only
        with TrainerClient(f"127.0.0.1:{pod0.port}") as t0, TrainerClient(f"127.0.0.1:{pod1.port}") as t1:
            assert t1.get_job(running).state is JobState.RUNNING, "trainer-0's job runs on"
            assert t1.get_session(s.session_id).state is SessionState.READY, "and its session is not LOST"
            t0.cancel_job(running)
            end = list(t1.watch_job(running))[-1]
            assert end.state.state is JobState.CANCELLED
    finally:
        pod0.stop(grace=10.0)
        pod1.stop(grace=5.0)
