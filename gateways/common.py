"""What both HTTP gateways need (Tinker's and OpenAI's): the trainer's gRPC status as an HTTP status, the base models
of the model root, one trainer client per API key, and the uvicorn runner their servers share."""

from __future__ import annotations

import argparse
import hashlib
import os
import threading
from pathlib import Path

from strop.client import TrainerClient

# gRPC status of a trainer error → the HTTP status each SDK maps to its exception (BadRequest, NotFound, RateLimit …)
HTTP_STATUS = {
    "INVALID_ARGUMENT": 400,
    "FAILED_PRECONDITION": 400,
    "OUT_OF_RANGE": 400,
    "ALREADY_EXISTS": 409,
    "NOT_FOUND": 404,
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    "RESOURCE_EXHAUSTED": 429,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
}
# the codes that mean the caller's input was wrong (a job failed for them is the user's failure, not the server's)
USER_CODES = {"INVALID_ARGUMENT", "FAILED_PRECONDITION", "OUT_OF_RANGE", "NOT_FOUND", "ALREADY_EXISTS"}


def owner_hash(api_key: str) -> str:
    """Who owns a gateway's objects: the sha256 of the caller's API key (the key itself is never stored)."""
    return hashlib.sha256(api_key.encode()).hexdigest()


def base_models(root: Path | None) -> list[str]:
    """The model root's base models (``<name>/config.json`` or ``<org>/<name>/config.json``), sorted."""
    if root is None or not root.is_dir():
        return []
    found = [p.parent.relative_to(root).as_posix() for p in root.glob("*/config.json")]
    found += [p.parent.relative_to(root).as_posix() for p in root.glob("*/*/config.json")]
    return sorted(found)


class TrainerClients:
    """One client per API key (a :class:`TrainerClient`, or ``cls``), the key as its bearer token: the service
    decides the tenant."""

    def __init__(self, target: str, tls_ca: str | None = None, cls=TrainerClient):
        self.target, self.tls_ca, self.cls = target, tls_ca, cls
        self._lock = threading.Lock()
        self._clients: dict = {}

    def get(self, api_key: str):
        owner = owner_hash(api_key)
        with self._lock:
            c = self._clients.get(owner)
            if c is None:
                c = self._clients[owner] = self.cls(self.target, token=api_key, tls_ca=self.tls_ca)
            return c

    def close(self) -> None:
        with self._lock:
            for c in self._clients.values():
                c.close()
            self._clients.clear()


def add_server_flags(p: argparse.ArgumentParser, prefix: str, port: int, loads: str) -> None:
    """The flags both gateways' servers take, each with its environment variable (``STROP_<PREFIX>_…``): where to
    listen, the trainer and the model root, how bases are loaded (``loads`` says what by), HTTPS and the trainer's CA."""
    from strop.common.trainer_types import Quantization

    env = os.environ.get
    own = f"STROP_{prefix}_"
    p.add_argument(
        "--listen", default=env(own + "LISTEN", f"127.0.0.1:{port}"), help="host:port to serve HTTP on"
    )
    p.add_argument(
        "--trainer", default=env("STROP_TRAINER", "127.0.0.1:50051"), help="the trainer's gRPC address"
    )
    p.add_argument(
        "--model-root", default=env("STROP_MODEL_ROOT", "models"), help="the trainer's model root (read-only)"
    )
    p.add_argument(
        "--quantization",
        default=env(own + "QUANTIZATION", "UNSPECIFIED"),
        choices=[q.value for q in Quantization],
        help=f"how {loads} are loaded",
    )
    p.add_argument("--dtype", default=env(own + "DTYPE", ""), help=f"{loads}' compute dtype ('' = trainer's)")
    p.add_argument("--max-seq-length", type=int, default=int(env(own + "MAX_SEQ_LENGTH", "0")))
    p.add_argument("--tls-cert", default=env(own + "TLS_CERT"), help="HTTPS certificate (PEM)")
    p.add_argument("--tls-key", default=env(own + "TLS_KEY"), help="HTTPS private key (PEM)")
    p.add_argument(
        "--trainer-tls-ca",
        default=env("STROP_TLS_CA"),
        help="CA of the trainer's (and the exporter's) TLS certificate",
    )


def _exit_zero(signum, frame) -> None:
    raise SystemExit(0)


def serve(app, listen: str, *, tls_cert: str | None = None, tls_key: str | None = None) -> None:
    """Run ``app`` under uvicorn on ``host:port`` (HTTPS with a certificate and key) until SIGINT/SIGTERM.

    uvicorn drains on SIGTERM/SIGINT, then re-raises the signal under the handler it found: the one set here makes a
    finished drain end in ``SystemExit(0)`` (the caller's ``finally`` runs; the process exits 0, as the gRPC services
    do on SIGTERM) instead of dying of the signal (exit -15, which a pod's status reports as an error)."""
    import signal

    import uvicorn

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, _exit_zero)
    host, _, port = listen.rpartition(":")
    uvicorn.run(
        app,
        host=host or "127.0.0.1",
        port=int(port),
        ssl_certfile=tls_cert,
        ssl_keyfile=tls_key,
        log_level="info",
        timeout_graceful_shutdown=10,
    )
