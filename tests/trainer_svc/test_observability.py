"""Observability of the trainer: /metrics scraped over HTTP from a running service shows the job it just ran; the
job's loss curve, stored as it ends and fetched by ``strop jobs plot``, plots exactly the job's recorded losses.

The service keeps its state in the embedded SQLite file: the one query the metrics add (``job_counts``) runs on
both backends in ``tests/common/test_state_store.py``, and PostgreSQL-backed services in ``test_replicas.py``."""

from __future__ import annotations

import io
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from strop.cli.main import main as cli_main
from strop.client import JobState, TrainerClient
from strop.demo.data import sft_rows
from strop.trainer_svc.core import loss_curve
from strop.trainer_svc.core.trainer_core import TrainerConfig
from strop.trainer_svc.server import start
from tests.trainer_svc.conftest import FAST_LORA, sft_config


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Every sample of ``/metrics``, by (name, sorted labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
        assert resp.status == 200
        body = resp.read().decode()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(body)
        for s in family.samples
    }


@pytest.fixture
def service(model_root, tmp_path):
    config = TrainerConfig(
        model_root=model_root,
        artifact_root=tmp_path / "artifacts",
        state_dir=tmp_path / "state",
        instance_id="trainer-0",
    )
    svc = start(config, metrics="127.0.0.1:0")
    yield svc
    svc.stop(grace=10.0)


def test_metrics_show_the_job_just_run_and_its_loss_curve_plots_its_recorded_losses(service, tmp_path):
    assert service.metrics_port > 0
    with TrainerClient(f"127.0.0.1:{service.port}") as tc:
        s = tc.load_model("tiny-llama-4bit")
        tc.attach_lora(s.session_id, FAST_LORA)
        ds = tc.upload_dataset(sft_rows())
        events = list(tc.train(s.session_id, ds.dataset_id, sft_config(3)))
        job_id = events[0].job_id
        steps = [e.step for e in events if e.step is not None]
        job = tc.get_job(job_id)
        assert job.state is JobState.SUCCEEDED and job.instance_id == "trainer-0"
        assert tc.get_session(s.session_id).instance_id == "trainer-0"

        m = scrape(service.metrics_port)
        by_state = {dict(k[1])["state"]: v for k, v in m.items() if k[0] == "strop_trainer_jobs"}
        assert by_state == {st.value: (1.0 if st is JobState.SUCCEEDED else 0.0) for st in JobState}, (
            "one job, and it succeeded"
        )
        job_label = (("job_id", job_id),)
        assert m[("strop_trainer_job_loss", job_label)] == steps[-1].loss, "the job's last recorded loss"
        assert m[("strop_trainer_job_step", job_label)] == 3
        assert m[("strop_trainer_job_tokens_per_second", job_label)] == steps[-1].tokens_per_second > 0
        assert m[("strop_trainer_steps_total", ())] == 3
        assert m[("strop_trainer_step_seconds_count", ())] == 3
        assert m[("strop_trainer_step_seconds_sum", ())] == pytest.approx(sum(x.step_seconds for x in steps))
        assert m[("strop_trainer_jobs_finished_total", (("state", "SUCCEEDED"),))] == 1
        assert m[("strop_trainer_queue_length", ())] == 0
        assert m[("strop_device_memory_bytes", (("device", "cpu"), ("kind", "process_rss")))] > 100e6, (
            "a process holding torch and a model has a resident set well above 100 MB"
        )

        # the loss curve: the figure's one line holds exactly the recorded (step, loss) points
        store = service.core.store
        recorded_steps, recorded_losses = loss_curve.loss_points(store, job_id)
        assert recorded_steps == [x.step for x in steps] == [1, 2, 3]
        assert recorded_losses == [x.loss for x in steps]
        fig = loss_curve.loss_curve_figure(store.get_job(job_id), recorded_steps, recorded_losses)
        (line,) = fig.axes[0].get_lines()
        assert list(line.get_xdata()) == recorded_steps and list(line.get_ydata()) == recorded_losses

        # ... and `strop jobs plot` writes the PNG the trainer stored, which is that figure
        out = tmp_path / "curve.png"
        assert (
            cli_main(["jobs", "--target", f"127.0.0.1:{service.port}", "plot", job_id, "-o", str(out)]) == 0
        )
        from PIL import Image

        png = out.read_bytes()
        with Image.open(io.BytesIO(png)) as img:
            img.verify()
        with Image.open(io.BytesIO(png)) as img:
            assert (img.format, img.size) == ("PNG", (800, 450)), "8 × 4.5 inches at 100 dpi"
        assert png == loss_curve.figure_png(fig), "the stored curve is the figure of the recorded losses"
        assert job.loss_curve is not None and job.loss_curve.metadata["steps"] == "3"


def test_plotting_a_job_without_a_curve_says_why(service, tmp_path, capsys):
    store = service.core.store
    from strop.common.trainer_types import JobInfo

    store.insert_job(JobInfo(job_id="job-empty", session_id="s", state=JobState.QUEUED, created_at=1.0))
    target = f"127.0.0.1:{service.port}"
    assert cli_main(["jobs", "--target", target, "plot", "job-empty", "-o", str(tmp_path / "x.png")]) == 1
    assert "its loss curve is stored when it ends" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()
