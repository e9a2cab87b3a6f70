"""The services' state database: one interface over SQLite (embedded, the default) and PostgreSQL (replicas).

A service opens its state with :func:`open_database`: an empty URL (or ``sqlite:///path``) is the SQLite file
in the state directory; ``postgresql://…`` is a shared PostgreSQL database, for a service that runs as several
pods (SQLite over a network filesystem is unsafe, and per-pod files would give each pod its own job list).

The stores write one SQL dialect, the subset both engines run: ``?`` placeholders (the PostgreSQL backend
turns them into psycopg's ``%s``), ``TEXT`` / ``BIGINT`` / ``DOUBLE PRECISION`` columns (never ``REAL``, which
PostgreSQL stores in 4 bytes: a Unix time would lose its seconds), ``INSERT … ON CONFLICT … DO UPDATE`` and
``RETURNING``. Rows come back as dicts on both backends.

Several processes share one PostgreSQL database, so every unfinished job or export records the
``instance_id`` of the process that runs it (``--instance-id``, default the host name: a pod's name), and
:class:`Liveness` keeps a heartbeat per instance in the ``instances`` table. A process recovers (marks
INTERRUPTED) only the work of instances that are not alive: its own previous incarnation when it starts, and
any instance whose heartbeat stopped (a pod that died and came back under another name, as a Deployment's
pods do). Another live pod's jobs are never touched.
"""

from __future__ import annotations

import logging
import os
import socket
import sqlite3
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

log = logging.getLogger("strop.db")

Row = dict[str, Any]

# The heartbeat: written every HEARTBEAT_SECONDS; an instance silent for STALE_AFTER_SECONDS is dead and its
# unfinished work is recovered by whichever live instance sweeps first. Six missed beats, so a pod whose
# database connection hiccups (or whose node's clock is a few seconds off) is not declared dead.
HEARTBEAT_SECONDS = 10.0
STALE_AFTER_SECONDS = 60.0

INSTANCES_SCHEMA = """
CREATE TABLE IF NOT EXISTS instances (
    service TEXT NOT NULL,
    instance_id TEXT NOT NULL,
    started_at DOUBLE PRECISION NOT NULL,
    heartbeat_at DOUBLE PRECISION NOT NULL,
    PRIMARY KEY (service, instance_id)
);
"""


def default_instance_id() -> str:
    """This process's name among the service's instances: ``STROP_INSTANCE_ID``, else the host name (in
    Kubernetes the pod's name, stable across restarts for a StatefulSet's pods)."""
    return os.environ.get("STROP_INSTANCE_ID") or socket.gethostname()


class Database(ABC):
    """A thread-safe handle on one state database; the stores talk to it in the shared dialect."""

    dialect: str  # "sqlite" or "postgresql"
    url: str  # for logs and errors, without a password

    @abstractmethod
    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        """Run one statement (committed at once); returns the number of rows it changed."""

    @abstractmethod
    def query(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        """Every row of a query (or of a statement with ``RETURNING``), as dicts."""

    def query_one(self, sql: str, params: Sequence[Any] = ()) -> Row | None:
        rows = self.query(sql, params)
        return rows[0] if rows else None

    @abstractmethod
    def transaction(self, statements: Iterable[tuple[str, Sequence[Any]]]) -> None:
        """Run ``statements`` in one transaction: all of them or, on any error, none."""

    @abstractmethod
    def columns(self, table: str) -> set[str]:
        """The column names of ``table`` (empty if it does not exist)."""

    @abstractmethod
    def publish(self, channel: str) -> None:
        """Tell the other processes on this database that something changed (PostgreSQL ``NOTIFY``), so their
        watchers of a job look again at once; SQLite has one process, whose own waiters the store wakes."""

    @abstractmethod
    def listen(self, channel: str, callback: Callable[[], None]) -> None:
        """Call ``callback`` (from a daemon thread) whenever a process publishes on ``channel``."""

    def ensure_column(self, table: str, column: str, ddl: str) -> None:
        """Add ``column`` (``ddl``: its type and default) to a table an older version created without it."""
        if column not in self.columns(table):
            self.execute(f"ALTER TABLE {table} ADD COLUMN {column} {ddl}")

    @abstractmethod
    def close(self) -> None: ...


class SqliteDatabase(Database):
    """One connection guarded by a lock; WAL journal so readers never see a half-written transaction.

    SQLite serialises writers anyway; one connection with a lock keeps the code simple and is far
    from the bottleneck here (a few writes per training step).
    """

    dialect = "sqlite"

    def __init__(self, path: str | Path, schema: str):
        self.path = Path(path)
        self.url = f"sqlite:///{self.path}"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.RLock()
        self._conn = sqlite3.connect(str(self.path), check_same_thread=False, isolation_level=None)
        self._conn.row_factory = sqlite3.Row
        with self._lock:
            self._conn.execute("PRAGMA journal_mode=WAL")
            self._conn.execute("PRAGMA synchronous=FULL")
            self._conn.execute("PRAGMA foreign_keys=ON")
            self._conn.executescript(INSTANCES_SCHEMA + schema)

    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        with self._lock:
            return self._conn.execute(sql, params).rowcount

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        with self._lock:
            return [dict(r) for r in self._conn.execute(sql, params).fetchall()]

    def transaction(self, statements: Iterable[tuple[str, Sequence[Any]]]) -> None:
        with self._lock:
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                for sql, params in statements:
                    self._conn.execute(sql, params)
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            self._conn.execute("COMMIT")

    def columns(self, table: str) -> set[str]:
        return {r["name"] for r in self.query(f"PRAGMA table_info({table})")}

    def publish(self, channel: str) -> None:
        pass  # one process per file: the store has woken its own waiters

    def listen(self, channel: str, callback: Callable[[], None]) -> None:
        pass

    def close(self) -> None:
        with self._lock:
            self._conn.close()


def _pg_sql(sql: str) -> str:
    """The shared dialect's ``?`` placeholders as psycopg's ``%s`` (a literal ``%`` doubled first)."""
    return sql.replace("%", "%%").replace("?", "%s")


class PostgresDatabase(Database):
    """One psycopg 3 connection per process, guarded by a lock like the SQLite one, in autocommit mode (each
    statement commits; :meth:`transaction` groups several). A broken connection (the server restarted, a
    network blip) is replaced before the next statement; the statement that met the break fails, and the
    caller's error handling decides, as for any other error.

    Creating the schema takes an advisory lock, so pods starting together do not race on ``CREATE TABLE``.
    """

    dialect = "postgresql"
    _SCHEMA_LOCK = 0x5354524F50  # "STROP": the advisory lock key every strop process uses for its DDL

    def __init__(self, url: str, schema: str, *, connect_timeout: float = 10.0):
        import psycopg  # only a PostgreSQL-backed service needs it

        self._psycopg = psycopg
        parts = urlsplit(url)
        netloc = parts.netloc.rsplit("@", 1)[-1]
        user = parts.username
        self.url = f"{parts.scheme}://{user + '@' if user else ''}{netloc}{parts.path}"
        self._dsn = url
        self._connect_timeout = connect_timeout
        self._lock = threading.RLock()
        self._closed = threading.Event()
        self._listeners: list[threading.Thread] = []
        self._conn = self._connect()
        with self._lock, self._conn.transaction():
            self._conn.execute("SELECT pg_advisory_xact_lock(%s)", (self._SCHEMA_LOCK,))
            self._conn.execute(INSTANCES_SCHEMA + schema)

    def _connect(self):
        from psycopg.rows import dict_row

        return self._psycopg.connect(
            self._dsn,
            autocommit=True,
            row_factory=dict_row,
            connect_timeout=max(1, int(self._connect_timeout)),
            application_name="strop",
        )

    def _live(self):
        if self._conn.closed or self._conn.broken:
            log.warning("state database connection lost; reconnecting to %s", self.url)
            self._conn = self._connect()
        return self._conn

    def execute(self, sql: str, params: Sequence[Any] = ()) -> int:
        with self._lock:
            return self._live().execute(_pg_sql(sql), params).rowcount

    def query(self, sql: str, params: Sequence[Any] = ()) -> list[Row]:
        with self._lock:
            return list(self._live().execute(_pg_sql(sql), params).fetchall())

    def transaction(self, statements: Iterable[tuple[str, Sequence[Any]]]) -> None:
        with self._lock:
            conn = self._live()
            with conn.transaction():
                for sql, params in statements:
                    conn.execute(_pg_sql(sql), params)

    def publish(self, channel: str) -> None:
        self.execute("SELECT pg_notify(?, '')", (channel,))

    def listen(self, channel: str, callback: Callable[[], None]) -> None:
        from psycopg import sql

        def run() -> None:
            while not self._closed.is_set():
                try:
                    with self._connect() as conn:
                        conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(channel)))
                        callback()  # what changed while no one listened (first start, a reconnect)
                        while not self._closed.is_set():
                            for _ in conn.notifies(timeout=1.0):
                                callback()
                except Exception as exc:  # the server went away: listen again once it is back
                    if not self._closed.is_set():
                        log.warning("listening on %s failed (%s); retrying", self.url, exc)
                        self._closed.wait(2.0)

        t = threading.Thread(target=run, name=f"strop-listen-{channel}", daemon=True)
        t.start()
        self._listeners.append(t)

    def ensure_column(self, table: str, column: str, ddl: str) -> None:
        self.execute(
            f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {column} {ddl}"
        )  # pods may start together

    def columns(self, table: str) -> set[str]:
        rows = self.query(
            "SELECT column_name FROM information_schema.columns "
            "WHERE table_schema = current_schema() AND table_name = ?",
            (table,),
        )
        return {r["column_name"] for r in rows}

    def close(self) -> None:
        self._closed.set()
        for t in self._listeners:
            t.join(5)
        with self._lock:
            self._conn.close()


def open_database(url: str, *, sqlite_path: str | Path, schema: str) -> Database:
    """The state database ``url`` names, with ``schema`` created if absent.

    Args:
        url: ``""`` (the default: the SQLite file ``sqlite_path``), ``sqlite:///path/to/file`` or
            ``postgresql://user:password@host:5432/db`` (also ``postgres://``; any libpq parameters, e.g.
            ``?sslmode=require``).
        sqlite_path: the embedded database's file when ``url`` is empty.
        schema: ``CREATE TABLE IF NOT EXISTS …`` statements in the shared dialect.
    """
    scheme = url.split(":", 1)[0].lower() if url else ""
    if not url:
        return SqliteDatabase(sqlite_path, schema)
    if scheme == "sqlite":  # sqlite:///relative/path, sqlite:////absolute/path (SQLAlchemy's form)
        rest = url.split(":", 1)[1]
        if not rest.startswith("///") or len(rest) == 3:
            raise ValueError(
                f"database URL {url!r}: expected sqlite:///relative/path or sqlite:////absolute/path"
            )
        return SqliteDatabase(rest[3:], schema)
    if scheme in ("postgresql", "postgres"):
        return PostgresDatabase(url, schema)
    raise ValueError(f"database URL {url!r}: expected sqlite:///… or postgresql://…")


class Liveness:
    """This instance's heartbeat in the ``instances`` table, and who else is alive.

    ``start(sweep)`` beats every ``interval`` seconds on a daemon thread and then calls ``sweep(live)`` with
    the instances alive now (this one included), so the service can recover the work of dead ones.
    """

    def __init__(
        self,
        db: Database,
        service: str,
        instance_id: str,
        *,
        interval: float = HEARTBEAT_SECONDS,
        stale_after: float = STALE_AFTER_SECONDS,
    ):
        if not instance_id:
            raise ValueError("instance_id must not be empty")
        self.db, self.service, self.instance_id = db, service, instance_id
        self.interval, self.stale_after = interval, stale_after
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def others_alive(self) -> set[str]:
        """Instances other than this one whose heartbeat is fresh (what a starting process must not touch)."""
        rows = self.db.query(
            "SELECT instance_id FROM instances WHERE service = ? AND instance_id <> ? AND heartbeat_at >= ?",
            (self.service, self.instance_id, time.time() - self.stale_after),
        )
        return {r["instance_id"] for r in rows}

    def beat(self) -> None:
        now = time.time()
        self.db.execute(
            "INSERT INTO instances (service, instance_id, started_at, heartbeat_at) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (service, instance_id) DO UPDATE SET heartbeat_at = excluded.heartbeat_at",
            (self.service, self.instance_id, now, now),
        )

    def start(self, sweep: Callable[[set[str]], Any]) -> None:
        self.beat()

        def loop() -> None:
            while not self._stop.wait(self.interval):
                try:
                    self.beat()
                    sweep(self.others_alive() | {self.instance_id})
                except Exception:  # a database outage must not end the heartbeat; the next beat retries
                    log.exception("heartbeat of %s/%s failed", self.service, self.instance_id)

        self._thread = threading.Thread(target=loop, name=f"strop-{self.service}-heartbeat", daemon=True)
        self._thread.start()

    def stop(self, *, retire: bool) -> None:
        """Stop beating; ``retire`` (a clean stop: nothing of ours is left running) also removes our row."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(self.interval + 5)
        if retire:
            self.db.execute(
                "DELETE FROM instances WHERE service = ? AND instance_id = ?",
                (self.service, self.instance_id),
            )
