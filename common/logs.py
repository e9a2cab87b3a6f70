"""The services' log format: text for a terminal, or one JSON object per line for a log pipeline.

A JSON line holds ``ts`` (UTC, ISO 8601 with milliseconds), ``level``, ``logger``, ``message`` and, where the
record concerns one, ``job_id`` / ``export_id`` / ``session_id``: from the record's ``extra`` or from the
context that :func:`bind` sets (a job's thread binds its job id, so every line it logs, TRL's included,
carries it). A traceback goes in ``exc``.
"""

from __future__ import annotations

import contextvars
import datetime
import json
import logging
from enum import StrEnum

CONTEXT_KEYS = ("job_id", "export_id", "session_id")
_context: contextvars.ContextVar[dict[str, str] | None] = contextvars.ContextVar(
    "strop_log_context", default=None
)


class LogFormat(StrEnum):
    TEXT = "text"
    JSON = "json"


TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def bind(**ids: str) -> contextvars.Token:
    """Attach ids (``job_id=…``) to every record logged from this context on; undo with :func:`unbind`."""
    return _context.set({**(_context.get() or {}), **{k: v for k, v in ids.items() if v}})


def unbind(token: contextvars.Token) -> None:
    _context.reset(token)


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out: dict[str, object] = {
            "ts": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(
                timespec="milliseconds"
            ),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        ids = _context.get() or {}
        for key in CONTEXT_KEYS:
            value = getattr(record, key, None) or ids.get(key)
            if value:
                out[key] = str(value)
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        elif record.stack_info:
            out["exc"] = self.formatStack(record.stack_info)
        return json.dumps(out, ensure_ascii=False, default=str)


def configure(level: str = "INFO", fmt: LogFormat | str = LogFormat.TEXT) -> None:
    """Set up the root logger of a service process (replaces any handler installed before)."""
    handler = logging.StreamHandler()
    handler.setFormatter(
        JsonFormatter() if LogFormat(fmt) is LogFormat.JSON else logging.Formatter(TEXT_FORMAT)
    )
    logging.basicConfig(level=level.upper(), handlers=[handler], force=True)
