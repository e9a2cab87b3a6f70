"""Tenancy: with bearer tokens, a tenant sees and touches only its own sessions, datasets, jobs, exports and
artifacts; another tenant's ids are NOT_FOUND (the same answer as for ids that do not exist); an admin sees all.
Each tenant has its own artifact id space; published artifacts are immutable (only their owner deletes one)."""

from __future__ import annotations

import json

import pytest

from strop.client import AlreadyExistsError, InvalidArgumentError, LoraConfig, NotFoundError, TrainerClient
from strop.client.export import ExportClient, ExportTarget, VerifyOptions
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
    tokens.write_text(
        json.dumps(
            {
                "tokens": [
                    {"tenant": "team-a", "token": "ta"},
                    {"tenant": "team-b", "token": "tb"},
                    {"tenant": "ops", "token": "admin", "role": "admin"},
                ]
            }
        )
    )
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


def test_published_artifacts_are_immutable_whatever_overwrite_says(services, team_a_work, tmp_path):
    _, export_target = services
    (tmp_path / "up").mkdir()
    (tmp_path / "up" / "adapter_config.json").write_text("{}")
    adapter = team_a_work["adapter"]
    with ExportClient(export_target, token="ta") as ea:
        before = ea.get_artifact(adapter)
        for overwrite in (False, True):  # before: an upload with overwrite replaced an upload in place
            with pytest.raises(AlreadyExistsError, match="immutable"):
                ea.upload_artifact(tmp_path / "up", artifact_id=adapter, overwrite=overwrite)
        assert ea.get_artifact(adapter).sha256 == before.sha256
        ea.upload_artifact(tmp_path / "up", artifact_id="team-a-upload")
        with pytest.raises(AlreadyExistsError, match="immutable"):
            ea.upload_artifact(tmp_path / "up", artifact_id="team-a-upload", overwrite=True)
        ea.delete_artifact("team-a-upload")  # the owner frees its id
        with pytest.raises(NotFoundError):
            ea.get_artifact("team-a-upload")
        assert ea.upload_artifact(tmp_path / "up", artifact_id="team-a-upload").metadata["tenant"] == "team-a"


def test_an_export_cannot_replace_another_tenants_artifact(services, team_a_work):
    # finding 1: B's export naming A's adapter id as its target, overwrite=True and verification skipped,
    # SUCCEEDED and replaced A's adapter (A's GetArtifact then said NOT_FOUND: the manifest said team-b)
    target, export_target = services
    adapter = team_a_work["adapter"]
    with TrainerClient(target, token="ta") as a:
        before = a.get_artifact(adapter)
    with TrainerClient(target, token="tb") as b:
        s = b.load_model("tiny-llama-4bit")
        b.attach_lora(s.session_id, LoraConfig(r=4, alpha=8))
        mine = b.save_adapter(s.session_id)
        b.close_session(s.session_id)
    with ExportClient(export_target, token="tb") as eb:
        done = eb.wait_export(
            eb.create_export(
                [ExportTarget.peft(artifact_id=adapter)],
                adapter_artifact_id=mine.artifact_id,
                overwrite=True,
                verify=VerifyOptions(skip=True),
            ).export_id
        )
        assert done.state.value == "SUCCEEDED", done.error  # in team-b's own id space
        assert eb.get_artifact(adapter).metadata["tenant"] == "team-b"
    for token in ("ta", "admin"):
        with TrainerClient(target, token=token) as c:
            got = c.get_artifact(f"team-a/{adapter}" if token == "admin" else adapter)
            assert (got.sha256, got.metadata["tenant"]) == (before.sha256, "team-a"), (
                "A's adapter is untouched"
            )
    with ExportClient(export_target, token="admin") as admin:  # two tenants hold that id: the admin names one
        with pytest.raises(InvalidArgumentError, match=r"team-a/.*team-b/"):
            admin.get_artifact(adapter)
        assert admin.get_artifact(f"team-b/{adapter}").metadata["tenant"] == "team-b"


def test_another_tenants_ids_look_free_and_cannot_be_squatted(services, team_a_work, tmp_path):
    # finding 3: B's upload with A's id said ALREADY_EXISTS while GetArtifact said NOT_FOUND (existence leaked),
    # and an id B uploaded first made A's later export to that id fail with ALREADY_EXISTS
    target, export_target = services
    with TrainerClient(target, token="ta") as a:
        a_adapter = a.get_artifact(team_a_work["adapter"])
    (tmp_path / "up").mkdir()
    (tmp_path / "up" / "adapter_config.json").write_text("{}")
    with ExportClient(export_target, token="ta") as ea:
        ea.upload_artifact(tmp_path / "up", artifact_id="a-private")
        a_second = ea.upload_artifact(tmp_path / "up", artifact_id="a-second")
    with ExportClient(export_target, token="tb") as eb:
        with pytest.raises(NotFoundError):
            eb.get_artifact("a-private")
        with pytest.raises(NotFoundError):
            eb.delete_artifact("a-private")
        with pytest.raises(NotFoundError):  # a qualified id names nothing B may see, exactly as a free id
            eb.get_artifact("team-a/a-private")
        # the same answer as for any free id: B takes it, in its own id space
        assert eb.upload_artifact(tmp_path / "up", artifact_id="a-private").metadata["tenant"] == "team-b"
        eb.upload_artifact(tmp_path / "up", artifact_id="squatted")
    with TrainerClient(target, token="tb") as b:  # the trainer's write path: SaveAdapter under an id of A's
        s = b.load_model("tiny-llama-4bit")
        b.attach_lora(s.session_id, LoraConfig(r=4, alpha=8))
        assert b.save_adapter(s.session_id, "a-second").metadata["tenant"] == "team-b"
        b.close_session(s.session_id)
    with ExportClient(export_target, token="ta") as ea:
        assert ea.get_artifact("a-private").metadata["tenant"] == "team-a"
        done = ea.wait_export(
            ea.create_export(
                [ExportTarget.peft(artifact_id="squatted")],
                adapter_artifact_id=team_a_work["adapter"],
                verify=VerifyOptions(skip=True),
            ).export_id
        )
        assert done.state.value == "SUCCEEDED", done.error
        assert ea.get_artifact("squatted").metadata["tenant"] == "team-a"
        for mine in (a_adapter, a_second):
            kept = ea.get_artifact(mine.artifact_id)
            assert (kept.sha256, kept.metadata["tenant"]) == (mine.sha256, "team-a"), (
                "no write path touched it"
            )
