"""The trainer's state database: sessions, datasets, jobs and their events, in SQLite under the state dir.

Objects are stored as JSON of the core dataclasses (``strop.common.serde``), with the columns that
queries need kept beside them. Events are append-only, numbered 1, 2, 3, ... per job with no gaps; the
job row's ``last_seq`` is updated in the same transaction as the insert.
"""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

from strop.common.db import Database
from strop.common.errors import NotFound
from strop.common.serde import from_dict, to_dict
from strop.common.signals import ChangeSignal
from strop.common.trainer_types import (
    JOB_TRANSITIONS,
    DatasetInfo,
    JobEvent,
    JobInfo,
    JobState,
    SessionInfo,
    SessionState,
    StateChange,
)

SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY, state TEXT NOT NULL, created_at REAL NOT NULL, body TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS datasets (
    dataset_id TEXT PRIMARY KEY, path TEXT NOT NULL, created_at REAL NOT NULL, body TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, state TEXT NOT NULL, created_at REAL NOT NULL,
    last_seq INTEGER NOT NULL DEFAULT 0, body TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS events (
    job_id TEXT NOT NULL, seq INTEGER NOT NULL, time REAL NOT NULL, body TEXT NOT NULL,
    PRIMARY KEY (job_id, seq));
"""


class TrainerStore:
    def __init__(self, state_dir: str | Path):
        self.db = Database(Path(state_dir) / "trainer.sqlite3", SCHEMA)
        # Wakes event watchers (threads and asyncio streams) when any job appends an event or changes state.
        self.changed = ChangeSignal()
        self._job_lock = threading.RLock()

    # sessions
    def put_session(self, s: SessionInfo) -> None:
        self.db.execute(
            "INSERT OR REPLACE INTO sessions VALUES (?, ?, ?, ?)",
            (s.session_id, s.state.value, s.created_at, json.dumps(to_dict(s))),
        )

    def get_session(self, session_id: str) -> SessionInfo:
        row = self.db.query_one("SELECT body FROM sessions WHERE session_id = ?", (session_id,))
        if row is None:
            raise NotFound(f"session {session_id!r} not found")
        return from_dict(SessionInfo, json.loads(row["body"]))

    def list_sessions(self) -> list[SessionInfo]:
        rows = self.db.query("SELECT body FROM sessions ORDER BY created_at")
        return [from_dict(SessionInfo, json.loads(r["body"])) for r in rows]

    # datasets
    def put_dataset(self, d: DatasetInfo, path: str) -> None:
        self.db.execute(
            "INSERT INTO datasets VALUES (?, ?, ?, ?)",
            (d.dataset_id, path, d.created_at, json.dumps(to_dict(d))),
        )

    def get_dataset(self, dataset_id: str) -> tuple[DatasetInfo, str]:
        row = self.db.query_one("SELECT body, path FROM datasets WHERE dataset_id = ?", (dataset_id,))
        if row is None:
            raise NotFound(f"dataset {dataset_id!r} not found")
        return from_dict(DatasetInfo, json.loads(row["body"])), row["path"]

    def list_datasets(self) -> list[DatasetInfo]:
        rows = self.db.query("SELECT body FROM datasets ORDER BY created_at")
        return [from_dict(DatasetInfo, json.loads(r["body"])) for r in rows]

    # jobs
    def insert_job(self, job: JobInfo) -> None:
        self.db.execute(
            "INSERT INTO jobs VALUES (?, ?, ?, ?, ?, ?)",
            (job.job_id, job.session_id, job.state.value, job.created_at, 0, json.dumps(to_dict(job))),
        )

    def get_job(self, job_id: str) -> JobInfo:
        row = self.db.query_one("SELECT body, last_seq FROM jobs WHERE job_id = ?", (job_id,))
        if row is None:
            raise NotFound(f"job {job_id!r} not found")
        job = from_dict(JobInfo, json.loads(row["body"]))
        job.last_seq = row["last_seq"]
        return job

    def list_jobs(self, session_id: str = "", states: list[JobState] | None = None) -> list[JobInfo]:
        rows = self.db.query("SELECT job_id FROM jobs ORDER BY created_at, job_id")
        jobs = [self.get_job(r["job_id"]) for r in rows]
        return [
            j
            for j in jobs
            if (not session_id or j.session_id == session_id) and (not states or j.state in states)
        ]

    def update_job(self, job_id: str, **changes) -> JobInfo:
        """Read-modify-write a job row (fields by name). State changes go through :meth:`transition`."""
        with self._job_lock:
            job = self.get_job(job_id)
            for k, v in changes.items():
                setattr(job, k, v)
            self.db.execute(
                "UPDATE jobs SET state = ?, body = ? WHERE job_id = ?",
                (job.state.value, json.dumps(to_dict(job)), job_id),
            )
        self._notify()
        return job

    def transition(self, job_id: str, new: JobState, message: str = "", **changes) -> JobInfo:
        """Move a job to ``new`` (guarded) and append the matching state event, atomically."""
        with self._job_lock:
            job = self.get_job(job_id)
            if new not in JOB_TRANSITIONS.get(job.state, frozenset()):
                raise RuntimeError(f"job {job_id}: illegal transition {job.state} -> {new}")
            job.state = new
            now = time.time()
            if new is JobState.RUNNING:
                job.started_at = now
            if new.terminal:
                job.finished_at = now
                if message and new is JobState.FAILED:
                    job.error = message
            for k, v in changes.items():
                setattr(job, k, v)
            event = JobEvent(job_id=job_id, seq=job.last_seq + 1, time=now, state=StateChange(new, message))
            job.last_seq = event.seq
            self.db.transaction(
                [
                    (
                        "INSERT INTO events VALUES (?, ?, ?, ?)",
                        (job_id, event.seq, now, json.dumps(to_dict(event))),
                    ),
                    (
                        "UPDATE jobs SET state = ?, last_seq = ?, body = ? WHERE job_id = ?",
                        (new.value, event.seq, json.dumps(to_dict(job)), job_id),
                    ),
                ]
            )
        self._notify()
        return job

    # events
    def append_event(self, event: JobEvent, **job_changes) -> JobEvent:
        """Number ``event`` (next seq of its job), store it, and apply ``job_changes`` in one transaction."""
        with self._job_lock:
            job = self.get_job(event.job_id)
            event.seq = job.last_seq + 1
            event.time = event.time or time.time()
            job.last_seq = event.seq
            for k, v in job_changes.items():
                setattr(job, k, v)
            self.db.transaction(
                [
                    (
                        "INSERT INTO events VALUES (?, ?, ?, ?)",
                        (event.job_id, event.seq, event.time, json.dumps(to_dict(event))),
                    ),
                    (
                        "UPDATE jobs SET last_seq = ?, body = ? WHERE job_id = ?",
                        (event.seq, json.dumps(to_dict(job)), event.job_id),
                    ),
                ]
            )
        self._notify()
        return event

    def events_after(self, job_id: str, after_seq: int, limit: int = 1000) -> list[JobEvent]:
        rows = self.db.query(
            "SELECT body FROM events WHERE job_id = ? AND seq > ? ORDER BY seq LIMIT ?",
            (job_id, after_seq, limit),
        )
        return [from_dict(JobEvent, json.loads(r["body"])) for r in rows]

    def _notify(self) -> None:
        self.changed.notify()

    def recover_after_restart(self) -> list[str]:
        """Mark what the previous process left open: sessions LOST, unfinished jobs INTERRUPTED."""
        for s in self.list_sessions():
            if s.state in (SessionState.LOADED, SessionState.READY):
                s.state = SessionState.LOST
                s.busy_job_id = ""
                self.put_session(s)
        interrupted = []
        for j in self.list_jobs(states=[JobState.QUEUED, JobState.RUNNING]):
            self.transition(j.job_id, JobState.INTERRUPTED, "the service stopped while the job was running")
            interrupted.append(j.job_id)
        return interrupted
