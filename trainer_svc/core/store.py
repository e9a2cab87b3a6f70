"""The trainer's state database: sessions, datasets, jobs and their events, in SQLite under the state dir or in a
PostgreSQL database every trainer pod shares (``--database-url``).

Objects are stored as JSON of the core dataclasses (``strop.common.serde``), with the columns that
queries need kept beside them. Events are append-only, numbered 1, 2, 3, ... per job with no gaps; the
job row's ``last_seq`` is updated in the same transaction as the insert.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from pathlib import Path

from strop.common.db import default_instance_id, open_database
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

log = logging.getLogger("strop.trainer")

SCHEMA = """
CREATE TABLE IF NOT EXISTS sessions (
    session_id TEXT PRIMARY KEY, state TEXT NOT NULL, created_at DOUBLE PRECISION NOT NULL, body TEXT NOT NULL,
    instance_id TEXT NOT NULL DEFAULT '');
CREATE TABLE IF NOT EXISTS datasets (
    dataset_id TEXT PRIMARY KEY, path TEXT NOT NULL, created_at DOUBLE PRECISION NOT NULL, body TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS jobs (
    job_id TEXT PRIMARY KEY, session_id TEXT NOT NULL, state TEXT NOT NULL, created_at DOUBLE PRECISION NOT NULL,
    last_seq BIGINT NOT NULL DEFAULT 0, body TEXT NOT NULL, instance_id TEXT NOT NULL DEFAULT '');
CREATE TABLE IF NOT EXISTS events (
    job_id TEXT NOT NULL, seq BIGINT NOT NULL, time DOUBLE PRECISION NOT NULL, body TEXT NOT NULL,
    PRIMARY KEY (job_id, seq));
"""
SERVICE = "trainer"  # this service's name in the shared ``instances`` table
CHANNEL = "strop_trainer_changed"  # published on every event, so other pods' watchers look again at once


class TrainerStore:
    """The trainer's records in its state database (see :func:`strop.common.db.open_database`).

    Args:
        state_dir: holds the embedded SQLite file when ``database_url`` is empty.
        database_url: ``""`` (SQLite in ``state_dir``) or ``postgresql://…``, shared by every trainer pod.
        instance_id: this process among the pods sharing the database; sessions and jobs it creates carry it,
            and :meth:`recover` leaves the records of live instances alone.
    """

    def __init__(self, state_dir: str | Path, *, database_url: str = "", instance_id: str = ""):
        self.db = open_database(database_url, sqlite_path=Path(state_dir) / "trainer.sqlite3", schema=SCHEMA)
        for table in ("sessions", "jobs"):  # state databases written before instances existed
            self.db.ensure_column(table, "instance_id", "TEXT NOT NULL DEFAULT ''")
        self.instance_id = instance_id or default_instance_id()
        # Wakes event watchers (threads and asyncio streams) when any job appends an event or changes state.
        self.changed = ChangeSignal()
        self.db.listen(CHANNEL, self.changed.notify)  # events other pods append (PostgreSQL)
        self._job_lock = threading.RLock()

    # sessions
    def put_session(self, s: SessionInfo) -> None:
        s.instance_id = s.instance_id or self.instance_id
        self.db.execute(
            "INSERT INTO sessions (session_id, state, created_at, body, instance_id) VALUES (?, ?, ?, ?, ?) "
            "ON CONFLICT (session_id) DO UPDATE SET state = excluded.state, body = excluded.body",
            (s.session_id, s.state.value, s.created_at, json.dumps(to_dict(s)), s.instance_id),
        )

    def get_session(self, session_id: str) -> SessionInfo:
        row = self.db.query_one("SELECT body FROM sessions WHERE session_id = ?", (session_id,))
        if row is None:
            raise NotFound(f"session {session_id!r} not found")
        return from_dict(SessionInfo, json.loads(row["body"]))

    def list_sessions(self) -> list[SessionInfo]:
        rows = self.db.query("SELECT body FROM sessions ORDER BY created_at, session_id")
        return [from_dict(SessionInfo, json.loads(r["body"])) for r in rows]

    # datasets
    def put_dataset(self, d: DatasetInfo, path: str) -> None:
        self.db.execute(
            "INSERT INTO datasets (dataset_id, path, created_at, body) VALUES (?, ?, ?, ?)",
            (d.dataset_id, path, d.created_at, json.dumps(to_dict(d))),
        )

    def get_dataset(self, dataset_id: str) -> tuple[DatasetInfo, str]:
        row = self.db.query_one("SELECT body, path FROM datasets WHERE dataset_id = ?", (dataset_id,))
        if row is None:
            raise NotFound(f"dataset {dataset_id!r} not found")
        return from_dict(DatasetInfo, json.loads(row["body"])), row["path"]

    def list_datasets(self) -> list[DatasetInfo]:
        rows = self.db.query("SELECT body FROM datasets ORDER BY created_at, dataset_id")
        return [from_dict(DatasetInfo, json.loads(r["body"])) for r in rows]

    # jobs
    def insert_job(self, job: JobInfo) -> None:
        job.instance_id = job.instance_id or self.instance_id
        self.db.execute(
            "INSERT INTO jobs (job_id, session_id, state, created_at, last_seq, body, instance_id) "
            "VALUES (?, ?, ?, ?, ?, ?, ?)",
            (
                job.job_id,
                job.session_id,
                job.state.value,
                job.created_at,
                0,
                json.dumps(to_dict(job)),
                job.instance_id,
            ),
        )

    @staticmethod
    def _job(row) -> JobInfo:
        job = from_dict(JobInfo, json.loads(row["body"]))
        job.last_seq = row["last_seq"]
        return job

    def get_job(self, job_id: str) -> JobInfo:
        row = self.db.query_one("SELECT body, last_seq FROM jobs WHERE job_id = ?", (job_id,))
        if row is None:
            raise NotFound(f"job {job_id!r} not found")
        return self._job(row)

    def list_jobs(self, session_id: str = "", states: list[JobState] | None = None) -> list[JobInfo]:
        """Every job in the database (all instances'), oldest first, optionally of one session / in ``states``."""
        where, params = [], []
        if session_id:
            where.append("session_id = ?")
            params.append(session_id)
        if states:
            where.append(f"state IN ({', '.join('?' * len(states))})")
            params.extend(s.value for s in states)
        sql = "SELECT body, last_seq FROM jobs"
        if where:
            sql += " WHERE " + " AND ".join(where)
        return [self._job(r) for r in self.db.query(sql + " ORDER BY created_at, job_id", params)]

    def job_counts(self, instance_id: str) -> dict[JobState, int]:
        """How many of ``instance_id``'s jobs are in each state (the metrics' jobs-by-state gauge)."""
        rows = self.db.query(
            "SELECT state, COUNT(*) AS n FROM jobs WHERE instance_id = ? GROUP BY state", (instance_id,)
        )
        return {JobState(r["state"]): int(r["n"]) for r in rows}

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
                        "INSERT INTO events (job_id, seq, time, body) VALUES (?, ?, ?, ?)",
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
                        "INSERT INTO events (job_id, seq, time, body) VALUES (?, ?, ?, ?)",
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
        self.db.publish(CHANNEL)

    def recover(self, live: set[str]) -> list[str]:
        """Close what instances no longer running left open: their sessions LOST, their unfinished jobs
        INTERRUPTED (resumable from their last checkpoint). Records of the instances in ``live`` are left alone.

        A starting process passes the other live instances (its own previous incarnation is dead by definition);
        the heartbeat's sweep passes every live instance, itself included. Two pods sweeping the same dead pod
        cannot both record the end: the second one's state event collides with the first's sequence number.
        """
        for s in self.list_sessions():
            if s.state in (SessionState.LOADED, SessionState.READY) and s.instance_id not in live:
                s.state = SessionState.LOST
                s.busy_job_id = ""
                self.put_session(s)
        interrupted = []
        for j in self.list_jobs(states=[JobState.QUEUED, JobState.RUNNING]):
            if j.instance_id in live:
                continue
            whose = "the service" if j.instance_id == self.instance_id else f"instance {j.instance_id or '?'}"
            try:
                self.transition(j.job_id, JobState.INTERRUPTED, f"{whose} stopped while the job was running")
            except Exception as exc:  # another live instance recovered it first
                log.info("job %s: already recovered elsewhere (%s)", j.job_id, exc)
                continue
            interrupted.append(j.job_id)
        return interrupted
