"""Export jobs: a persistent queue of validated exports, with states, numbered events and cancellation.

``ExportManager.create`` validates a request once (``resolve.validate``) and queues the result; a
worker thread writes it (``pipeline.write_export``) without checking it again.

State machine (guarded; anything else raises)::

    QUEUED ──▶ RUNNING ──▶ SUCCEEDED | FAILED | CANCELLED | INTERRUPTED
       └──────────────────▶ CANCELLED | INTERRUPTED

INTERRUPTED means the service stopped while the export was queued or running; on the next start the
manager marks such exports INTERRUPTED and removes their partial outputs. Every change, progress
report and result is an event ``(export_id, seq)`` with ``seq`` = 1, 2, 3, … and no gaps, stored in
the state database (SQLite under the state directory, or PostgreSQL shared by every export pod: see
``strop.common.db``), so a client re-attaches with ``after_seq`` and misses nothing, and history survives
restarts. Exports run in worker threads; callers never block on one.

With several pods on one database each export records the ``instance_id`` that runs it: every pod lists and
watches every export, a restart recovers only its own and those of pods whose heartbeat stopped, and cancelling
an export another pod runs sets ``cancel_requested``, which that pod's heartbeat turns into a cancel.

Rows hold the export API's dataclasses as ``serde.to_dict`` writes them.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from strop.common import auth, logs
from strop.common.artifacts import ArtifactStore
from strop.common.db import Liveness, default_instance_id, open_database
from strop.common.export_types import (
    Export,
    ExportEvent,
    ExportProgress,
    ExportRequest,
    ExportResult,
    ExportState,
    ExportStateChange,
)
from strop.common.metrics import ExportMetrics
from strop.common.serde import from_dict, to_dict
from strop.common.signals import ChangeSignal, follow_blocking
from strop.common.trainer_types import JOB_TRANSITIONS
from strop.export_svc.core.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    StropError,
    Unavailable,
)
from strop.export_svc.core.pipeline import CancelToken, write_export
from strop.export_svc.core.resolve import ValidatedExport, validate

log = logging.getLogger("strop.export")


def check_transition(old: ExportState, new: ExportState) -> None:
    """Raise FailedPrecondition unless ``old → new`` is a legal transition."""
    if new not in JOB_TRANSITIONS.get(old, frozenset()):
        raise FailedPrecondition(f"export cannot go from {old.value} to {new.value}")


def _request(data: str) -> ExportRequest:
    return from_dict(ExportRequest, json.loads(data))


def _result(data: dict[str, Any]) -> ExportResult:
    return from_dict(ExportResult, data)


def _event(row) -> ExportEvent:
    """A stored event (``kind`` "state", "progress" or "result"; ``data`` its dataclass as a dict)."""
    ev = ExportEvent(row["export_id"], row["seq"], row["time"])
    kind, data = row["kind"], json.loads(row["data"])
    if kind == "state":
        ev.state = from_dict(ExportStateChange, data)
    elif kind == "progress":
        ev.progress = from_dict(ExportProgress, data)
    elif kind == "result":
        ev.result = _result(data)
    return ev


SCHEMA = """
CREATE TABLE IF NOT EXISTS exports (
    export_id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    state TEXT NOT NULL,
    request TEXT NOT NULL,
    results TEXT NOT NULL DEFAULT '[]',
    artifact_ids TEXT NOT NULL DEFAULT '[]',
    error TEXT NOT NULL DEFAULT '',
    error_code TEXT NOT NULL DEFAULT '',
    created_at DOUBLE PRECISION NOT NULL,
    started_at DOUBLE PRECISION NOT NULL DEFAULT 0,
    finished_at DOUBLE PRECISION NOT NULL DEFAULT 0,
    last_seq BIGINT NOT NULL DEFAULT 0,
    tenant TEXT NOT NULL DEFAULT '',
    instance_id TEXT NOT NULL DEFAULT '',
    cancel_requested BIGINT NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS export_events (
    export_id TEXT NOT NULL REFERENCES exports(export_id),
    seq BIGINT NOT NULL,
    time DOUBLE PRECISION NOT NULL,
    kind TEXT NOT NULL,
    data TEXT NOT NULL,
    PRIMARY KEY (export_id, seq)
);
"""
SERVICE = "export"  # this service's name in the shared ``instances`` table
CHANNEL = "strop_export_changed"  # published on every event, so other pods' watchers look again at once
# Columns later versions added, for state databases an older version created: (name, type and default).
ADDED_COLUMNS = (
    ("tenant", "TEXT NOT NULL DEFAULT ''"),
    ("instance_id", "TEXT NOT NULL DEFAULT ''"),
    ("cancel_requested", "BIGINT NOT NULL DEFAULT 0"),
)

Runner = Callable[..., list[ExportResult]]


class ExportManager:
    """Owns the state database, the worker threads and the cancellation tokens.

    Args:
        state_dir: where ``export.db`` lives (unless ``database_url`` names another database).
        model_root: base models and adapters given by path are confined under it.
        store: the artifact store (shared with the trainer).
        workers: exports running at once (each uses every CPU core while it quantizes).
        runner: what a worker runs on a validated export (``write_export``; tests inject failures
            through it), called as ``runner(job, store=, emit=, cancel=, export_id=)``.
        database_url: ``""`` (SQLite in ``state_dir``) or ``postgresql://…``, shared by every export pod.
        instance_id: this process among the pods sharing the database (default: the host name).
    """

    def __init__(
        self,
        state_dir: str | Path,
        model_root: str | Path,
        store: ArtifactStore,
        *,
        workers: int = 1,
        runner: Runner = write_export,
        database_url: str = "",
        instance_id: str = "",
    ):
        self.model_root = Path(model_root).resolve()
        self.store = store
        self.db = open_database(database_url, sqlite_path=Path(state_dir) / "export.db", schema=SCHEMA)
        for column, ddl in ADDED_COLUMNS:
            self.db.ensure_column("exports", column, ddl)
        self.instance_id = instance_id or default_instance_id()
        self.metrics = ExportMetrics(export_counts=self._counts, states=[s.value for s in ExportState])
        self._runner = runner
        self._pool = ThreadPoolExecutor(max_workers=max(1, workers), thread_name_prefix="strop-export")
        self._tokens: dict[str, CancelToken] = {}
        self.changed = ChangeSignal()  # notified on every event written (streams wait on it)
        self.db.listen(CHANNEL, self.changed.notify)  # events other pods write (PostgreSQL)
        self._lock = threading.RLock()
        self._draining = False
        self._interrupting = False
        self.liveness = Liveness(self.db, SERVICE, self.instance_id)
        # Our previous incarnation is dead by definition; other live pods' exports are theirs.
        self._recover(self.liveness.others_alive())
        self.liveness.start(self._sweep)

    # -- persistence -------------------------------------------------------------------------

    def _append(
        self, export_id: str, kind: str, data: dict[str, Any], *, update: dict[str, Any] | None = None
    ) -> int:
        with self._lock:
            row = self.db.query_one("SELECT last_seq FROM exports WHERE export_id = ?", (export_id,))
            assert row is not None
            seq = int(row["last_seq"]) + 1
            stmts = [
                (
                    "INSERT INTO export_events (export_id, seq, time, kind, data) VALUES (?, ?, ?, ?, ?)",
                    (export_id, seq, time.time(), kind, json.dumps(data)),
                ),
                ("UPDATE exports SET last_seq = ? WHERE export_id = ?", (seq, export_id)),
            ]
            for col, val in (update or {}).items():
                stmts.append((f"UPDATE exports SET {col} = ? WHERE export_id = ?", (val, export_id)))
            self.db.transaction(stmts)
        self.changed.notify()
        self.db.publish(CHANNEL)
        return seq

    def _set_state(self, export_id: str, new: ExportState, message: str = "", **cols: Any) -> None:
        with self._lock:
            row = self._row(export_id)
            old = ExportState(row["state"])
            check_transition(old, new)
            update: dict[str, Any] = {"state": new.value, **cols}
            if new is ExportState.RUNNING:
                update["started_at"] = time.time()
            if new.terminal:
                update["finished_at"] = time.time()
            if new.terminal and old is ExportState.RUNNING and export_id in self._tokens:  # it ran here
                # counted before the event is stored: a client that saw the end finds it in the metrics
                self.metrics.on_finished(new.value, update["finished_at"] - float(row["started_at"]))
            self._append(export_id, "state", to_dict(ExportStateChange(new, message)), update=update)

    def _row(self, export_id: str):
        row = self.db.query_one("SELECT * FROM exports WHERE export_id = ?", (export_id,))
        if row is None:
            raise NotFound(f"export {export_id!r} not found")
        auth.check_visible(row["tenant"], f"export {export_id!r}")  # workers run as the anonymous admin
        return row

    def _record(self, row) -> Export:
        return Export(
            export_id=row["export_id"],
            name=row["name"],
            state=ExportState(row["state"]),
            request=_request(row["request"]),
            results=[_result(r) for r in json.loads(row["results"])],
            error=row["error"],
            error_code=row["error_code"],
            created_at=row["created_at"],
            started_at=row["started_at"],
            finished_at=row["finished_at"],
            last_seq=row["last_seq"],
            tenant=row["tenant"],
        )

    def _counts(self) -> dict[str, int]:
        rows = self.db.query(
            "SELECT state, COUNT(*) AS n FROM exports WHERE instance_id = ? GROUP BY state",
            (self.instance_id,),
        )
        return {r["state"]: int(r["n"]) for r in rows}

    def _recover(self, live: set[str], *, starting: bool = True) -> list[str]:
        """Exports that instances no longer running (not in ``live``) left QUEUED/RUNNING become INTERRUPTED;
        their leftovers go. Returns their ids."""
        rows = self.db.query(
            "SELECT export_id, artifact_ids, instance_id FROM exports WHERE state IN ('QUEUED', 'RUNNING')"
        )
        recovered = []
        for row in rows:
            if row["instance_id"] in live:
                continue
            try:
                self._set_state(
                    row["export_id"],
                    ExportState.INTERRUPTED,
                    "the export service stopped during this export",
                    error="interrupted by a service restart",
                    error_code="ABORTED",
                )
            except Exception as exc:  # another live instance recovered it first
                log.info("export %s: already recovered elsewhere (%s)", row["export_id"], exc)
                continue
            recovered.append(row["export_id"])
            for aid in json.loads(row["artifact_ids"]):
                for p in (self.store.root / ".tmp").glob(f"{aid}.*"):
                    shutil.rmtree(p, ignore_errors=True)
        # scratch-* directories are the export service's and not named by export: they can all go only when no
        # other replica sharing the artifact root is alive (with replicas, a dead one's scratch stays)
        if starting and not live:
            for p in (self.store.root / ".tmp").glob("scratch-*"):
                shutil.rmtree(p, ignore_errors=True)
        return recovered

    def _sweep(self, live: set[str]) -> None:
        """The heartbeat's sweep: recover the exports of stopped instances; honour cancels other pods asked for."""
        recovered = self._recover(live, starting=False)
        if recovered:
            log.warning("marked %d export(s) of stopped instances INTERRUPTED: %s", len(recovered), recovered)
        rows = self.db.query(
            "SELECT export_id FROM exports WHERE instance_id = ? AND cancel_requested = 1 AND state = 'RUNNING'",
            (self.instance_id,),
        )
        for row in rows:
            token = self._tokens.get(row["export_id"])
            if token is not None:
                log.info("export %s: cancelled through another instance", row["export_id"])
                token.cancel()

    # -- API ---------------------------------------------------------------------------------

    def create(self, req: ExportRequest) -> Export:
        """Validate (no weights read) and queue an export; returns at once, QUEUED.

        The one validation of the export: the worker runs what it returns (the request with its
        defaults and artifact ids filled in, the inputs opened, the GGUF vocab loaded).

        Raises:
            StropError: bad input (InvalidArgument, FailedPrecondition, Unimplemented, ...), before
                anything is queued or written.
            Unavailable: the service is draining.
        """
        if self._draining:
            raise Unavailable("the export service is shutting down; retry against another replica or later")
        job = validate(req, self.model_root, self.store)
        export_id = f"exp-{uuid.uuid4().hex[:12]}"
        self.db.execute(
            "INSERT INTO exports (export_id, name, state, request, artifact_ids, created_at, tenant, instance_id) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (
                export_id,
                job.request.name,
                ExportState.QUEUED.value,
                json.dumps(to_dict(job.request)),
                json.dumps([t.artifact_id for t in job.request.targets]),
                time.time(),
                job.tenant,
                self.instance_id,
            ),
        )
        self._append(export_id, "state", to_dict(ExportStateChange(ExportState.QUEUED)))
        token = CancelToken()
        self._tokens[export_id] = token
        self._pool.submit(self._run, export_id, job, token)
        return self.get(export_id)

    def _run(self, export_id: str, job: ValidatedExport, token: CancelToken) -> None:
        bound = logs.bind(export_id=export_id)  # every line this worker logs for the export carries its id
        try:
            if ExportState(self._row(export_id)["state"]) is not ExportState.QUEUED:
                return  # cancelled while queued
            self._set_state(export_id, ExportState.RUNNING)
            log.info("export %s: running %d target(s)", export_id, len(job.request.targets))

            def emit(ev: Any) -> None:
                if isinstance(ev, ExportProgress):
                    self._append(export_id, "progress", to_dict(ev))

            results = self._runner(job, store=self.store, emit=emit, cancel=token, export_id=export_id)
            for r in results:
                self.metrics.on_artifact(r.target.kind.value, r.artifact.size_bytes if r.artifact else 0)
            with self._lock:
                for r in results:
                    self._append(export_id, "result", to_dict(r))
                accepted = [
                    r.target.label for r in results if r.verification and r.verification.accepted_unverified
                ]
                self._set_state(
                    export_id,
                    ExportState.SUCCEEDED,
                    f"{len(results)} artifacts published"
                    + (f"; UNVERIFIED (accepted by the request): {', '.join(accepted)}" if accepted else ""),
                    results=json.dumps([to_dict(r) for r in results]),
                    artifact_ids=json.dumps([r.artifact.artifact_id for r in results]),
                )
            log.info("export %s: SUCCEEDED, %d artifact(s) published", export_id, len(results))
        except StropError as exc:
            code = exc.grpc_code
            if code == "CANCELLED" and self._interrupting:
                self._finish(
                    export_id,
                    ExportState.INTERRUPTED,
                    "the export service stopped during this export",
                    "ABORTED",
                )
            elif code == "CANCELLED":
                self._finish(export_id, ExportState.CANCELLED, str(exc), code)
            elif code == "INTERNAL":
                log.exception("export %s failed", export_id)
                self._finish(export_id, ExportState.FAILED, f"internal error: {exc}", code)
            else:
                self._finish(export_id, ExportState.FAILED, str(exc), code)
        except Exception as exc:
            log.exception("export %s failed", export_id)
            self._finish(
                export_id, ExportState.FAILED, f"internal error: {type(exc).__name__}: {exc}", "INTERNAL"
            )
        finally:
            self._tokens.pop(export_id, None)
            logs.unbind(bound)

    def _finish(self, export_id: str, state: ExportState, message: str, code: str) -> None:
        with contextlib.suppress(FailedPrecondition):  # already terminal (cancelled while queued)
            self._set_state(export_id, state, message, error=message, error_code=code)

    def get(self, export_id: str) -> Export:
        return self._record(self._row(export_id))

    def list(self, states: list[ExportState] | None = None, limit: int = 0) -> list[Export]:
        rows = self.db.query("SELECT * FROM exports ORDER BY created_at DESC, export_id")
        me = auth.current()
        out = [
            self._record(r)
            for r in rows
            if (not states or ExportState(r["state"]) in states) and me.can_see(r["tenant"])
        ]
        return out[:limit] if limit > 0 else out

    def cancel(self, export_id: str) -> Export:
        """Cancel a queued or running export (running ones stop before their next tensor).

        Raises:
            NotFound: unknown id.
            FailedPrecondition: the export already finished.
        """
        with self._lock:
            state = ExportState(self._row(export_id)["state"])
            if state.terminal:
                raise FailedPrecondition(f"export {export_id!r} is already {state.value}")
            if state is ExportState.QUEUED:
                self._set_state(
                    export_id,
                    ExportState.CANCELLED,
                    "cancelled before it started",
                    error="cancelled by a client",
                    error_code="CANCELLED",
                )
            token = self._tokens.get(export_id)
            row = self._row(export_id)
            if token is None and state is ExportState.RUNNING and row["instance_id"] != self.instance_id:
                # another pod runs it: its heartbeat sees the request and cancels it there
                self.db.execute("UPDATE exports SET cancel_requested = 1 WHERE export_id = ?", (export_id,))
        if token is not None:
            token.cancel()
        return self.get(export_id)

    def events(self, export_id: str, after_seq: int = 0) -> list[ExportEvent]:
        self._row(export_id)
        rows = self.db.query(
            "SELECT * FROM export_events WHERE export_id = ? AND seq > ? ORDER BY seq", (export_id, after_seq)
        )
        return [_event(r) for r in rows]

    def poll(self, export_id: str, after_seq: int, limit: int = 0) -> tuple[list[ExportEvent], bool]:
        """Events with seq > ``after_seq`` (the first ``limit``; 0: all), and whether the stream is complete
        after them.

        Raises:
            NotFound: unknown id.
            InvalidArgument: a negative ``after_seq``.
        """
        if after_seq < 0:
            raise InvalidArgument(f"after_seq must be >= 0, got {after_seq}")
        events = self.events(export_id, after_seq)
        if events:
            return events[:limit] if limit else events, False
        row = self._row(export_id)
        return [], ExportState(row["state"]).terminal and int(row["last_seq"]) <= after_seq

    def watch(
        self, export_id: str, after_seq: int = 0, *, poll_seconds: float = 0.5
    ) -> Iterator[ExportEvent]:
        """Every event after ``after_seq``, then new ones as they come, until the export ends (blocking;
        the gRPC layer follows :meth:`poll` on the event loop instead)."""
        return follow_blocking(functools.partial(self.poll, export_id), self.changed, after_seq, poll_seconds)

    def wait(self, export_id: str, timeout: float | None = None) -> Export:
        """Block until the export ends (tests, the offline CLI)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            generation = self.changed.generation
            export = self.get(export_id)
            if export.state.terminal:
                return export
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"export {export_id} still running after {timeout}s")
            self.changed.wait(generation, 0.2)

    def shutdown(self, grace: float = 0.0) -> None:
        """Refuse new exports; let running ones finish within ``grace``; interrupt the rest."""
        self._draining = True
        deadline = time.monotonic() + grace
        while self._tokens and time.monotonic() < deadline:
            time.sleep(0.1)
        self._interrupting = True
        for tok in list(self._tokens.values()):
            tok.cancel()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.liveness.stop(retire=True)
        rows = self.db.query(
            "SELECT export_id FROM exports WHERE state = 'QUEUED' AND instance_id = ?", (self.instance_id,)
        )
        for row in rows:
            self._finish(
                row["export_id"],
                ExportState.INTERRUPTED,
                "the export service stopped before it started",
                "ABORTED",
            )
        self.db.close()
