"""Tenancy: with bearer tokens, a tenant sees and touches only its own sessions, datasets, jobs, exports and
artifacts; another tenant's ids are NOT_FOUND (the same answer as for ids that do not exist); an admin sees all.
Published artifacts are immutable: an upload can replace only an upload of its own tenant."""

from __future__ import annotations

import json

import pytest

from strop.client import FailedPreconditionError, LoraConfig, NotFoundError, TrainerClient
from strop.client.export import ExportClient, ExportTarget
from strop.common.auth import TokenTable
from strop.common.grpc_server import Security
from strop.demo.data import sft_rows
from strop.export_svc.server import ExportConfig
from strop.export_svc.server import start as start_export
from strop.trainer_svc.core.trainer_core import TrainerConfig
from strop.trainer_svc.server import start as start_trainer
from tests.trainer_svc.conftest import sft_config


@pytest.fixture(scope="module")
def services(model_root, tmp_path_factory):
    work = tmp_path_factory.mktemp("tenancy")
    tokens = work / "tokens.json"
    tokens.write_text(json.dumps({"tokens": [
        {"tenant": "team-a", "token": "ta"}, {"tenant": "team-b", "token": "tb"},
        {"tenant": "ops", "token": "admin", "role": "admin"},
    ]}))  # fmt: skip
    security = Security(tokens=TokenTable.load(tokens))
    trainer = start_trainer(
        TrainerConfig(model_root=model_root, artifact_root=work / "artifacts", state_dir=work / "trainer"),
        security=security,
    )
    exporter = start_export(ExportConfig(model_root, work / "artifacts", work / "export"), security=security)
    yield f"127.0.0.1:{trainer.port}", f"127.0.0.1:{exporter.port}"
    exporter.stop(grace=5.0)
    trainer.stop(grace=10.0)


@pytest.fixture(scope="module")
def team_a_work(services):
    target, _ = services
    with TrainerClient(target, token="ta") as a:
        s = a.load_model("tiny-llama-4bit")
        a.attach_lora(s.session_id, LoraConfig(r=4, alpha=8))
        ds = a.upload_dataset(sft_rows())
        events = list(a.train(s.session_id, ds.dataset_id, sft_config(2)))
        job = a.get_job(events[-1].job_id)
        assert job.state.value == "SUCCEEDED" and job.tenant == "team-a"
        return {
            "session": s.session_id,
            "dataset": ds.dataset_id,
            "job": job.job_id,
            "adapter": job.adapter.artifact_id,
        }


def test_another_tenant_gets_not_found_for_every_id_and_empty_lists(services, team_a_work):
    target, export_target = services
    w = team_a_work
    with TrainerClient(target, token="tb") as b:
        assert b.list_sessions() == [] and b.list_datasets() == [] and b.list_jobs() == []
        assert all(a.artifact_id != w["adapter"] for a in b.list_artifacts())
        for call in (
            lambda: b.get_session(w["session"]),
            lambda: b.close_session(w["session"]),
            lambda: b.generate(w["session"], "hi"),
            lambda: b.get_dataset(w["dataset"]),
            lambda: b.get_job(w["job"]),
            lambda: b.cancel_job(w["job"]),
            lambda: list(b.watch_job(w["job"])),
            lambda: b.get_artifact(w["adapter"]),
            lambda: next(iter(b.train(w["session"], w["dataset"], sft_config(1)))),
        ):
            with pytest.raises(NotFoundError, match="not found"):
                call()
    with ExportClient(export_target, token="tb") as eb:
        with pytest.raises(NotFoundError, match="not found"):
            eb.create_export([ExportTarget.peft()], adapter_artifact_id=w["adapter"])
        with pytest.raises(NotFoundError, match="not found"):
            eb.download_artifact(w["adapter"], "/tmp/strop-tenancy-should-not-exist")


def test_the_owner_and_an_admin_see_it_all(services, team_a_work):
    target, export_target = services
    w = team_a_work
    for token in ("ta", "admin"):
        with TrainerClient(target, token=token) as c:
            assert c.get_job(w["job"]).tenant == "team-a"
            assert any(s.session_id == w["session"] for s in c.list_sessions())
            assert c.get_artifact(w["adapter"]).metadata["tenant"] == "team-a"
    with ExportClient(export_target, token="ta") as ea:
        done = ea.wait_export(
            ea.create_export([ExportTarget.peft()], adapter_artifact_id=w["adapter"]).export_id
        )
        assert done.state.value == "SUCCEEDED" and done.tenant == "team-a"
        assert done.results[0].artifact.metadata["tenant"] == "team-a"
    with ExportClient(export_target, token="tb") as eb:
        assert all(e.export_id != done.export_id for e in eb.list_exports())
        with pytest.raises(NotFoundError):
            eb.get_export(done.export_id)


def test_published_artifacts_are_immutable_and_uploads_belong_to_their_tenant(
    services, team_a_work, tmp_path
):
    _, export_target = services
    (tmp_path / "up").mkdir()
    (tmp_path / "up" / "adapter_config.json").write_text("{}")
    with ExportClient(export_target, token="ta") as ea:
        # today: an upload with overwrite replaced the trainer's adapter in place, with a recomputed sha256
        with pytest.raises(FailedPreconditionError, match="immutable"):
            ea.upload_artifact(tmp_path / "up", artifact_id=team_a_work["adapter"], overwrite=True)
        mine = ea.upload_artifact(tmp_path / "up", artifact_id="team-a-upload")
        assert mine.metadata["tenant"] == "team-a"
        ea.upload_artifact(tmp_path / "up", artifact_id="team-a-upload", overwrite=True)  # its own upload
    with ExportClient(export_target, token="tb") as eb, pytest.raises(NotFoundError):
        eb.upload_artifact(tmp_path / "up", artifact_id="team-a-upload", overwrite=True)
