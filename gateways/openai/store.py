"""The gateway's own state, durable across restarts, in the services' state database (``common/db.py``: SQLite by
default, PostgreSQL by URL): files, fine-tuning jobs (with the chain of strop jobs each one ran as), their events and
checkpoints. Each record is a JSON document keyed by its OpenAI id, owned by the sha256 of the API key that made it;
lists are ordered by ``t`` (the creation time to the microsecond: OpenAI's ``created_at`` is whole seconds).

Events and checkpoints are numbered per job (``n``, 1, 2, …): OpenAI lists them newest first and pages on the id of
the last one a page held (``after``), which is its number here.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from strop.common.db import Database, open_database

SCHEMA = """
CREATE TABLE IF NOT EXISTS oai_files (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    data TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS oai_jobs (
    id TEXT PRIMARY KEY,
    owner TEXT NOT NULL,
    created_at DOUBLE PRECISION NOT NULL,
    data TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS oai_events (
    job_id TEXT NOT NULL,
    n BIGINT NOT NULL,
    id TEXT NOT NULL,
    src TEXT,
    data TEXT NOT NULL,
    PRIMARY KEY (job_id, n)
);
CREATE TABLE IF NOT EXISTS oai_checkpoints (
    job_id TEXT NOT NULL,
    n BIGINT NOT NULL,
    id TEXT NOT NULL,
    src TEXT,
    data TEXT NOT NULL,
    PRIMARY KEY (job_id, n)
);
"""


class GatewayStore:
    def __init__(self, url: str, state_dir: Path):
        self.db: Database = open_database(
            url, sqlite_path=Path(state_dir) / "openai-gateway.db", schema=SCHEMA
        )
        self._lock = threading.RLock()  # read-modify-write of one document at a time

    def close(self) -> None:
        self.db.close()

    # ---- documents (files, jobs) --------------------------------------------------------------------------

    def put(self, table: str, doc: dict) -> None:
        self.db.execute(
            f"INSERT INTO {table} (id, owner, created_at, data) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (id) DO UPDATE SET data = excluded.data",
            (doc["id"], doc["owner"], float(doc.get("t", doc["created_at"])), json.dumps(doc)),
        )

    def get(self, table: str, ident: str) -> dict | None:
        row = self.db.query_one(f"SELECT data FROM {table} WHERE id = ?", (ident,))
        return json.loads(row["data"]) if row else None

    def update(self, table: str, ident: str, **changes: Any) -> dict:
        with self._lock:
            doc = self.get(table, ident)
            if doc is None:
                raise KeyError(ident)
            doc.update(changes)
            self.put(table, doc)
            return doc

    def update_if(self, table: str, ident: str, key: str, expected: Any, **changes: Any) -> dict | None:
        """:meth:`update` only while ``doc[key] == expected`` (a follower never undoes a pause asked meanwhile)."""
        with self._lock:
            doc = self.get(table, ident)
            if doc is None or doc.get(key) != expected:
                return None
            return self.update(table, ident, **changes)

    def delete(self, table: str, ident: str) -> None:
        self.db.execute(f"DELETE FROM {table} WHERE id = ?", (ident,))

    def list(self, table: str, owner: str | None) -> list[dict]:
        """Every document of ``owner`` (all with None), newest first."""
        if owner is None:
            rows = self.db.query(f"SELECT data FROM {table} ORDER BY created_at DESC, id DESC")
        else:
            rows = self.db.query(
                f"SELECT data FROM {table} WHERE owner = ? ORDER BY created_at DESC, id DESC", (owner,)
            )
        return [json.loads(r["data"]) for r in rows]

    # ---- numbered records of a job (events, checkpoints) --------------------------------------------------

    def append(self, table: str, job_id: str, prefix: str, doc: dict, src: str | None = None) -> dict | None:
        """Number and store ``doc``; ``src`` (the trainer event it comes from, ``<strop job>:<seq>``) stores it once
        only (None when stored already), so a follower that reads an event again after a restart adds nothing."""
        with self._lock:
            if src is not None and self.db.query_one(
                f"SELECT n FROM {table} WHERE job_id = ? AND src = ?", (job_id, src)
            ):
                return None
            row = self.db.query_one(f"SELECT MAX(n) AS n FROM {table} WHERE job_id = ?", (job_id,))
            n = int(row["n"] or 0) + 1 if row else 1
            doc = {**doc, "id": f"{prefix}-{job_id.split('-', 1)[-1]}-{n}"}
            self.db.execute(
                f"INSERT INTO {table} (job_id, n, id, src, data) VALUES (?, ?, ?, ?, ?)",
                (job_id, n, doc["id"], src, json.dumps(doc)),
            )
            return doc

    def page(self, table: str, job_id: str, after: str | None, limit: int) -> tuple[list[dict], bool]:
        """Up to ``limit`` records newest first, older than the one whose id is ``after``; and whether more follow."""
        below = None
        if after:
            row = self.db.query_one(f"SELECT n FROM {table} WHERE job_id = ? AND id = ?", (job_id, after))
            below = int(row["n"]) if row else 0  # an unknown cursor: nothing older than it
        sql, params = f"SELECT data FROM {table} WHERE job_id = ?", [job_id]
        if below is not None:
            sql += " AND n < ?"
            params.append(below)
        rows = self.db.query(sql + " ORDER BY n DESC LIMIT ?", (*params, limit + 1))
        docs = [json.loads(r["data"]) for r in rows]
        return docs[:limit], len(docs) > limit

    def records(self, table: str, job_id: str) -> list[dict]:
        rows = self.db.query(f"SELECT data FROM {table} WHERE job_id = ? ORDER BY n", (job_id,))
        return [json.loads(r["data"]) for r in rows]
