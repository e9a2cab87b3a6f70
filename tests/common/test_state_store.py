"""The state stores on both backends: the embedded SQLite file and a real PostgreSQL (``database_url`` runs each
test on both). Several instances ("pods") share one database: every pod lists every job, and a pod's restart
recovery touches only its own work and that of pods whose heartbeat stopped."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

from strop.common.artifacts import ArtifactStore
from strop.common.db import Liveness, SqliteDatabase, open_database
from strop.common.export_types import ExportRequest, ExportState, ExportTarget
from strop.common.serde import to_dict
from strop.common.trainer_types import (
    DatasetFormat,
    DatasetInfo,
    JobEvent,
    JobInfo,
    JobState,
    LogMessage,
    SessionInfo,
    SessionState,
    StepMetrics,
)
from strop.export_svc.core.jobs import SCHEMA as EXPORT_SCHEMA
from strop.export_svc.core.jobs import ExportManager
from strop.trainer_svc.core.store import SERVICE, TrainerStore

# A Unix time with microseconds: PostgreSQL's REAL (4 bytes) would keep ~7 digits of it, DOUBLE PRECISION all.
T0 = 1764590000.123456


def _store(tmp_path: Path, url: str, instance: str) -> TrainerStore:
    # every "pod" of one test shares the state dir, so with SQLite they share the file as pods share PostgreSQL
    return TrainerStore(tmp_path / "state", database_url=url, instance_id=instance)


def _job(job_id: str, session_id: str, created_at: float) -> JobInfo:
    return JobInfo(job_id=job_id, session_id=session_id, state=JobState.QUEUED, created_at=created_at)


def test_trainer_records_round_trip_exactly(tmp_path, database_url):
    store = _store(tmp_path, database_url, "pod-a")
    s = SessionInfo(session_id="sess-1", name="n", state=SessionState.LOADED, created_at=T0, tenant="t")
    store.put_session(s)
    s.state = SessionState.READY
    store.put_session(s)  # an update, not a second row
    assert store.list_sessions() == [store.get_session("sess-1")]
    got = store.get_session("sess-1")
    assert got.state is SessionState.READY and got.instance_id == "pod-a", "the store stamps its instance"
    assert got.created_at == T0, "timestamps keep their microseconds on both backends"

    d = DatasetInfo(dataset_id="ds-1", name="d", format=DatasetFormat.TEXT, num_rows=3, created_at=T0)
    store.put_dataset(d, "/data/ds-1.jsonl")
    assert store.get_dataset("ds-1") == (d, "/data/ds-1.jsonl")
    assert store.list_datasets() == [d]

    store.insert_job(_job("job-2", "sess-1", T0 + 1))
    store.insert_job(_job("job-1", "sess-other", T0))
    store.transition("job-2", JobState.RUNNING)
    for i in range(1, 4):
        store.append_event(
            JobEvent(job_id="job-2", step=StepMetrics(step=i, loss=1.0 / i)), step=i, last_loss=1.0 / i
        )
    store.append_event(
        JobEvent(job_id="job-2", log=LogMessage("info", "50% done"))
    )  # a literal %: no placeholder
    job = store.get_job("job-2")
    assert (job.state, job.step, job.last_seq, job.instance_id) == (JobState.RUNNING, 3, 5, "pod-a")
    events = store.events_after("job-2", 0)
    assert [e.seq for e in events] == [1, 2, 3, 4, 5], "state event, three steps, a log: numbered 1..5"
    assert [e.step.loss for e in events if e.step] == [1.0, 0.5, 1.0 / 3]
    assert events[-1].log.message == "50% done"
    assert [e.seq for e in store.events_after("job-2", 3, limit=1)] == [4]

    assert [j.job_id for j in store.list_jobs()] == ["job-1", "job-2"], "oldest first"
    assert [j.job_id for j in store.list_jobs(session_id="sess-1")] == ["job-2"]
    assert [j.job_id for j in store.list_jobs(states=[JobState.QUEUED])] == ["job-1"]
    assert store.list_jobs(session_id="sess-1", states=[JobState.QUEUED]) == []
    assert store.job_counts("pod-a") == {JobState.QUEUED: 1, JobState.RUNNING: 1}
    with pytest.raises(RuntimeError, match="illegal transition"):
        store.transition("job-2", JobState.QUEUED)
    store.db.close()


def test_every_pod_lists_every_job_and_a_restart_recovers_only_its_own(tmp_path, database_url):
    a, b = _store(tmp_path, database_url, "pod-a"), _store(tmp_path, database_url, "pod-b")
    Liveness(b.db, SERVICE, "pod-b").beat()  # pod-b is alive
    for store, n in ((a, "a"), (b, "b")):
        store.put_session(SessionInfo(session_id=f"sess-{n}", state=SessionState.READY, created_at=T0))
        store.insert_job(_job(f"job-{n}", f"sess-{n}", T0))
        store.transition(f"job-{n}", JobState.RUNNING)
    assert [j.job_id for j in a.list_jobs()] == [j.job_id for j in b.list_jobs()] == ["job-a", "job-b"]

    a.db.close()  # pod-a dies; it comes back under the same name (a StatefulSet's pod)
    a = _store(tmp_path, database_url, "pod-a")
    live = Liveness(a.db, SERVICE, "pod-a").others_alive()
    assert live == {"pod-b"}
    assert a.recover(live) == ["job-a"], "only pod-a's own unfinished job"
    assert a.get_job("job-a").state is JobState.INTERRUPTED
    assert a.get_session("sess-a").state is SessionState.LOST
    assert b.get_job("job-b").state is JobState.RUNNING, "a live pod's job is left alone"
    assert b.get_session("sess-b").state is SessionState.READY
    assert a.events_after("job-a", 0)[-1].state.message == "the service stopped while the job was running"
    a.db.close()
    b.db.close()


def test_the_work_of_a_pod_whose_heartbeat_stopped_is_recovered_once(tmp_path, database_url):
    a, b, c = (_store(tmp_path, database_url, p) for p in ("pod-a", "pod-b", "pod-c"))
    b.insert_job(_job("job-b", "sess-b", T0))
    b.transition("job-b", JobState.RUNNING)
    beat_b = Liveness(b.db, SERVICE, "pod-b", stale_after=0.5)
    beat_b.beat()
    watch_a = Liveness(a.db, SERVICE, "pod-a", stale_after=0.5)
    assert watch_a.others_alive() == {"pod-b"}
    assert a.recover(watch_a.others_alive() | {"pod-a"}) == [], "pod-b beats: its job is not touched"

    time.sleep(0.7)  # pod-b stops beating (it died; a Deployment replaces it under another name)
    live = watch_a.others_alive() | {"pod-a"}
    assert "pod-b" not in live
    assert a.recover(live) == ["job-b"]
    assert c.recover(live | {"pod-c"}) == [], "a second sweeper finds nothing left to do"
    states = [e.state.state for e in a.events_after("job-b", 0) if e.state]
    assert states == [JobState.RUNNING, JobState.INTERRUPTED], "one INTERRUPTED event, not two"
    assert a.events_after("job-b", 0)[-1].state.message == "instance pod-b stopped while the job was running"
    for s in (a, b, c):
        s.db.close()


def test_an_old_state_db_gains_the_instance_columns(tmp_path):
    old = SqliteDatabase(
        tmp_path / "state" / "trainer.sqlite3",
        "CREATE TABLE jobs (job_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, state TEXT NOT NULL, "
        "created_at REAL NOT NULL, last_seq INTEGER NOT NULL DEFAULT 0, body TEXT NOT NULL);"
        "CREATE TABLE sessions (session_id TEXT PRIMARY KEY, state TEXT NOT NULL, created_at REAL NOT NULL, "
        "body TEXT NOT NULL);",
    )
    old.execute(
        "INSERT INTO jobs VALUES (?, ?, ?, ?, ?, ?)",
        (
            "job-old",
            "s",
            "RUNNING",
            T0,
            0,
            json.dumps(to_dict(_job("job-old", "s", T0)) | {"state": "RUNNING"}),
        ),
    )
    old.close()
    store = _store(tmp_path, "", "pod-a")
    assert {"instance_id"} <= store.db.columns("jobs") and {"instance_id"} <= store.db.columns("sessions")
    assert store.recover(set()) == ["job-old"], "a row from before instances belongs to no live instance"
    store.db.close()


def test_database_urls_pick_the_backend(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for url, path in (
        ("", tmp_path / "default.db"),
        ("sqlite:///relative.db", tmp_path / "relative.db"),
        (f"sqlite:///{tmp_path}/absolute.db", tmp_path / "absolute.db"),  # four slashes: an absolute path
    ):
        db = open_database(url, sqlite_path=tmp_path / "default.db", schema="")
        assert db.dialect == "sqlite" and path.is_file(), url
        db.close()
    for bad in ("mysql://x/y", "sqlite:/x.db", "sqlite:///"):
        with pytest.raises(ValueError):
            open_database(bad, sqlite_path=tmp_path / "unused.db", schema="")


def test_postgres_urls_hide_the_password_in_logs(postgres):
    url = postgres.new_database()
    db = open_database(url.replace("strop@", "strop:secret@"), sqlite_path="unused", schema="")
    assert db.dialect == "postgresql" and "secret" not in db.url and db.url.startswith("postgresql://strop@")
    db.close()


# -- exports -----------------------------------------------------------------------------------------------


def _insert_export(db, export_id: str, state: ExportState, instance: str, created_at: float) -> None:
    req = ExportRequest(adapter_artifact_id="a", targets=[ExportTarget.merged()], name=export_id)
    db.execute(
        "INSERT INTO exports (export_id, name, state, request, created_at, started_at, instance_id) "
        "VALUES (?, ?, ?, ?, ?, ?, ?)",
        (export_id, export_id, state.value, json.dumps(to_dict(req)), created_at, created_at, instance),
    )


def test_export_pods_share_the_list_and_recover_only_their_own(tmp_path, database_url):
    state = tmp_path / "state"
    db = open_database(database_url, sqlite_path=state / "export.db", schema=EXPORT_SCHEMA)
    _insert_export(db, "exp-a", ExportState.RUNNING, "pod-a", T0)
    _insert_export(db, "exp-b", ExportState.RUNNING, "pod-b", T0 + 1)
    _insert_export(db, "exp-b2", ExportState.QUEUED, "pod-b", T0 + 2)
    Liveness(db, "export", "pod-b").beat()
    db.close()

    store = ArtifactStore(tmp_path / "artifacts")
    a = ExportManager(state, tmp_path, store, database_url=database_url, instance_id="pod-a")
    try:
        assert [e.export_id for e in a.list()] == ["exp-b2", "exp-b", "exp-a"], "newest first, every pod's"
        assert a.get("exp-a").state is ExportState.INTERRUPTED, "pod-a's own export, left by its last run"
        assert a.get("exp-b").state is ExportState.RUNNING, "pod-b is alive: its running export stays"
        assert a.get("exp-b").created_at == T0 + 1, "timestamps keep their microseconds"

        a.cancel("exp-b")  # pod-b runs it: the request waits in the database for pod-b's heartbeat
        assert a.db.query_one("SELECT cancel_requested FROM exports WHERE export_id = ?", ("exp-b",)) == {
            "cancel_requested": 1
        }
        assert a.get("exp-b").state is ExportState.RUNNING, "only pod-b can stop its worker"
        assert a._counts() == {"INTERRUPTED": 1}, "pod-a's metrics count pod-a's exports"
    finally:
        a.shutdown()
    db = open_database(database_url, sqlite_path=state / "export.db", schema=EXPORT_SCHEMA)
    rows = db.query("SELECT export_id, state FROM exports ORDER BY export_id")
    assert rows == [
        {"export_id": "exp-a", "state": "INTERRUPTED"},
        {"export_id": "exp-b", "state": "RUNNING"},
        {"export_id": "exp-b2", "state": "QUEUED"},
    ], "pod-a's drain leaves pod-b's queue alone"
    db.close()


def test_an_event_one_pod_writes_wakes_the_watchers_of_another(tmp_path, postgres):
    """PostgreSQL NOTIFY: a stream on pod b following a job that pod a runs sees each event at once, instead of
    at its next heartbeat poll."""
    url = postgres.new_database()
    a, b = _store(tmp_path, url, "pod-a"), _store(tmp_path, url, "pod-b")
    try:
        a.insert_job(_job("job-1", "s", T0))
        deadline = time.monotonic() + 10
        while b.changed.generation == 0 and time.monotonic() < deadline:  # b's listener connects and wakes b
            time.sleep(0.05)  # once, for what it may have missed
        generation = b.changed.generation
        assert generation == 1
        a.transition("job-1", JobState.RUNNING)
        deadline = time.monotonic() + 10
        while b.changed.generation == generation and time.monotonic() < deadline:
            b.changed.wait(generation, 0.5)
        assert b.changed.generation > generation, "pod b's watchers were woken by pod a's event"
    finally:
        a.db.close()
        b.db.close()
