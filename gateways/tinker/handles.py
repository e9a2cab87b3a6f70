"""The ids the SDK holds and sends back: Tinker sessions, models, sampling sessions and futures.

The gateway keeps no table of them. Each id carries what the gateway needs to answer it, and the rest is read
from the trainer. So a restarted gateway, or another replica, answers every id an SDK holds:

- a session id is ``tks-<tag>-<random>``; a model id is ``<session id>:train:<n>``, the form the SDK builds
  itself. The model's training run on the trainer is named after it (``run_name``), so the run is found by
  listing the caller's runs;
- a sampling session id and a future's ``request_id`` are ``<prefix>-<tag>-<payload>``. The payload is
  base64url JSON: for a sampler, the snapshot or run it samples and the base; for a future, the trainer's future
  id and how to answer it, or for work the gateway does itself (create_model, load_weights), what that work is
  (the work is idempotent, so a restarted gateway does it again or finds it done).

``<tag>`` is the first 12 hex digits of the API key's sha256. An id with another key's tag is "not found" to the
caller, as before. The payloads are not secret and need no signature: every trainer call carries the caller's
own key, and the trainer answers NOT_FOUND for any run, future or snapshot that is not the caller's.
"""

from __future__ import annotations

import base64
import binascii
import json
import re
import uuid
from typing import Any

from strop.gateways.tinker.wire import WireError

TAG_LEN = 12
SESSION = "tks"
SAMPLER = "tksm"
FUTURE = "tkf"
_SESSION_RE = re.compile(r"^tks-([0-9a-f]{12})-[0-9a-f]{16}$")
_MODEL_RE = re.compile(r"^(tks-[0-9a-f]{12}-[0-9a-f]{16}):train:(\d{1,9})$")


def tag(owner: str) -> str:
    """``owner`` is the API key's sha256 (hex)."""
    return owner[:TAG_LEN]


def new_session_id(owner: str) -> str:
    return f"{SESSION}-{tag(owner)}-{uuid.uuid4().hex[:16]}"


def check_session(session_id: str | None, owner: str) -> str:
    m = _SESSION_RE.match(session_id or "")
    if m is None or m.group(1) != tag(owner):
        raise WireError(f"session {session_id!r} not found", 404)
    return session_id


def model_id(session_id: str, model_seq_id: int) -> str:
    return f"{session_id}:train:{int(model_seq_id)}"  # the SDK assumes exactly this form


def check_model(model_id_: str | None, owner: str) -> str:
    m = _MODEL_RE.match(model_id_ or "")
    if m is None:
        raise WireError(f"model {model_id_!r} not found", 404)
    check_session(m.group(1), owner)
    return model_id_


def owns(model_id_: str, owner: str) -> bool:
    m = _MODEL_RE.match(model_id_)
    return m is not None and m.group(1).split("-")[1] == tag(owner)


def run_name(model_id_: str, user_metadata: dict[str, str] | None) -> str:
    """The trainer-side name of a model's run: the model id, then its user metadata as JSON (if any)."""
    return model_id_ + (" " + json.dumps(user_metadata, sort_keys=True) if user_metadata else "")


def parse_run_name(name: str) -> tuple[str, dict[str, str] | None] | None:
    """(model id, user metadata) of a run the gateway named, or None for any other run."""
    mid, _, meta = name.partition(" ")
    if _MODEL_RE.match(mid) is None:
        return None
    try:
        parsed = json.loads(meta) if meta else None
    except ValueError:
        parsed = None
    return mid, parsed if isinstance(parsed, dict) else None


def encode(prefix: str, owner: str, payload: dict[str, Any]) -> str:
    raw = json.dumps(payload, separators=(",", ":"), sort_keys=True).encode()
    return f"{prefix}-{tag(owner)}-" + base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode(prefix: str, owner: str, handle: str | None, what: str) -> dict[str, Any]:
    head = f"{prefix}-{tag(owner)}-"
    if not isinstance(handle, str) or not handle.startswith(head):
        raise WireError(f"{what} {handle!r} not found", 404)
    body = handle[len(head) :]
    try:
        payload = json.loads(base64.urlsafe_b64decode(body + "=" * (-len(body) % 4)))
    except (ValueError, binascii.Error):
        payload = None
    if not isinstance(payload, dict):
        raise WireError(f"{what} {handle!r} not found", 404)
    return payload


def runs_of(ks: list[int]) -> list[list[int]]:
    """Run-length form of the per-datum candidate counts (mostly all 1) a forward_backward answer needs."""
    out: list[list[int]] = []
    for k in ks:
        if out and out[-1][0] == k:
            out[-1][1] += 1
        else:
            out.append([k, 1])
    return out


def from_runs(runs: list[list[int]], limit: int = 1 << 20) -> list[int]:
    # a payload is the caller's to edit: bounded before it is expanded
    if sum(int(n) for _, n in runs) > limit:
        raise ValueError("too many datums")
    return [int(k) for k, n in runs for _ in range(int(n))]
