"""The command line both services share: their flags (each with a ``STROP_*`` environment default), what the flags
build (security, connection age, side listeners), and ``run_main``, what each service's ``main`` does after
parsing.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Callable
from typing import Any, NoReturn

from strop.common import log_noise, logs
from strop.common.db import default_instance_id
from strop.common.errors import StropError
from strop.common.grpc_server import ConnectionAge, Security, Service

log = logging.getLogger("strop.grpc")


def service_parser(prog: str, description: str, *, name: str, port: int) -> argparse.ArgumentParser:
    """The flags both services share, each with a ``STROP_*`` environment default (what a pod sets).

    ``--address`` defaults to 127.0.0.1: a service listens on every interface only when asked to.
    """
    env = os.environ.get
    p = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--address",
        default=env(f"STROP_{name.upper()}_ADDRESS", f"127.0.0.1:{port}"),
        help=f"host:port to bind (port 0 picks a free one; env STROP_{name.upper()}_ADDRESS)",
    )
    p.add_argument("--model-root", default=env("STROP_MODEL_ROOT", "./models"), help="env STROP_MODEL_ROOT")
    p.add_argument(
        "--artifact-root", default=env("STROP_ARTIFACT_ROOT", "./artifacts"), help="env STROP_ARTIFACT_ROOT"
    )
    p.add_argument(
        "--state-dir",
        default=env(f"STROP_{name.upper()}_STATE_DIR", f"./state/{name}"),
        help=f"work files, and the SQLite state unless --database-url is set (env STROP_{name.upper()}_STATE_DIR)",
    )
    p.add_argument(
        "--database-url",
        default=env("STROP_DATABASE_URL", ""),
        help="state database: empty for SQLite in --state-dir, or postgresql://user:pass@host:5432/db, shared "
        "by every pod of a replicated service (env STROP_DATABASE_URL)",
    )
    p.add_argument(
        "--instance-id",
        default=default_instance_id(),
        help="this process among the pods sharing --database-url; the jobs it runs carry it, and a restart "
        "recovers only its own (env STROP_INSTANCE_ID; default the host name, i.e. the pod's name)",
    )
    p.add_argument(
        "--rpc-threads", type=int, default=int(env("STROP_RPC_THREADS", "32")), help="gRPC worker threads"
    )
    p.add_argument(
        "--grace",
        type=float,
        default=float(env("STROP_GRACE", "30")),
        help="seconds running work gets on SIGTERM",
    )
    p.add_argument("--port-file", default="", help="write the bound port here once serving (for port 0)")
    p.add_argument("--log-level", default=env("STROP_LOG_LEVEL", "INFO"))
    p.add_argument(
        "--log-format",
        default=env("STROP_LOG_FORMAT", logs.LogFormat.TEXT.value),
        choices=[f.value for f in logs.LogFormat],
        help="text, or json: one object per line with ts, level, logger, message, job/export ids "
        "(env STROP_LOG_FORMAT)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=int(env("STROP_METRICS_PORT", "0")),
        help="serve Prometheus /metrics on this port, on --address's host (0: off; env STROP_METRICS_PORT)",
    )
    p.add_argument("--auth-tokens", default=env("STROP_AUTH_TOKENS", ""), help="bearer-token file (JSON)")
    p.add_argument("--tls-cert", default=env("STROP_TLS_CERT", ""), help="PEM server certificate (TLS)")
    p.add_argument("--tls-key", default=env("STROP_TLS_KEY", ""), help="PEM server key (TLS)")
    p.add_argument(
        "--tls-client-ca",
        default=env("STROP_TLS_CLIENT_CA", ""),
        help="PEM CA for client certificates (mTLS)",
    )
    p.add_argument(
        "--health-port",
        type=int,
        default=int(env("STROP_HEALTH_PORT", "0")),
        help="also serve grpc.health.v1 alone, in plaintext, on --address's host at this port: the probe port "
        "under mTLS, whose client certificates the kubelet cannot present (0: off; env STROP_HEALTH_PORT)",
    )
    p.add_argument(
        "--max-connection-age",
        type=float,
        default=float(env("STROP_MAX_CONNECTION_AGE", "0")),
        help="seconds a client connection lives before the server asks the client to reconnect, so that clients "
        "spread over replicas added later (0: unlimited; env STROP_MAX_CONNECTION_AGE)",
    )
    p.add_argument(
        "--max-connection-age-grace",
        type=float,
        default=float(env("STROP_MAX_CONNECTION_AGE_GRACE", "0")),
        help="seconds calls still open on a connection past --max-connection-age may run (0: until they end; "
        "env STROP_MAX_CONNECTION_AGE_GRACE)",
    )
    p.add_argument(
        "--reflection",
        default=env("STROP_REFLECTION", "on"),
        choices=("on", "off"),
        help="gRPC server reflection (env STROP_REFLECTION)",
    )
    return p


def security_from_args(args: argparse.Namespace) -> Security:
    """The :class:`Security` the shared flags (``--auth-tokens``, ``--tls-*``) ask for; errors exit with status 2."""
    try:
        return Security.from_files(
            tokens=args.auth_tokens,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            tls_client_ca=args.tls_client_ca,
        )
    except (ValueError, OSError, StropError) as exc:
        raise SystemExit(f"strop: {exc}") from None


def connection_age_from_args(args: argparse.Namespace) -> ConnectionAge:
    """The :class:`ConnectionAge` ``--max-connection-age`` and ``--max-connection-age-grace`` ask for."""
    if args.max_connection_age < 0 or args.max_connection_age_grace < 0:
        raise SystemExit("strop: --max-connection-age and --max-connection-age-grace must be >= 0")
    return ConnectionAge(args.max_connection_age, args.max_connection_age_grace)


def metrics_address(args: argparse.Namespace) -> str | None:
    """Where ``--metrics-port`` asks ``/metrics`` to listen: ``--address``'s host on that port; None when off."""
    return _side_address(args, args.metrics_port)


def health_address(args: argparse.Namespace) -> str | None:
    """Where ``--health-port`` asks the plaintext health listener to be: ``--address``'s host; None when off."""
    return _side_address(args, args.health_port)


def _side_address(args: argparse.Namespace, port: int) -> str | None:
    if port <= 0:
        return None
    host = args.address.rpartition(":")[0] or "127.0.0.1"
    return f"{host}:{port}"


def server_options(args: argparse.Namespace) -> dict[str, Any]:
    """The keyword arguments of both services' ``start`` that the shared flags set (security read now, so a bad
    token or certificate file fails before anything starts)."""
    return {
        "address": args.address,
        "rpc_threads": args.rpc_threads,
        "reflection": args.reflection == "on",
        "security": security_from_args(args),
        "metrics": metrics_address(args),
        "health": health_address(args),
        "connection_age": connection_age_from_args(args),
    }


def run_main(args: argparse.Namespace, start: Callable[[], Service]) -> NoReturn:
    """What each service's ``main`` does after parsing: log, stay offline, start, publish the port, serve."""
    logs.configure(args.log_level, args.log_format)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # strop never downloads at run time (models come from disk)
    log_noise.install()
    service = start()
    if args.port_file:
        tmp = args.port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(service.port))
        os.replace(tmp, args.port_file)  # readers never see a half-written port
    service.serve_forever(args.grace)
