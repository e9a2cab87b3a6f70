"""``strop serve tinker``: the Tinker REST gateway as its own process, a gRPC client of the trainer.

Flags (each with an environment variable): ``--listen`` (STROP_TINKER_LISTEN, default 127.0.0.1:8000),
``--trainer`` (STROP_TRAINER, host:port), ``--model-root`` (STROP_MODEL_ROOT: the trainer's model root, read-only;
base models and tokenizers), ``--quantization``/``--dtype``/``--max-seq-length`` (how base sessions are loaded),
``--poll-ms``, ``--tls-cert``/``--tls-key`` (HTTPS), ``--trainer-tls-ca`` (STROP_TLS_CA), ``--admin-token-file``
(STROP_TINKER_ADMIN_TOKEN_FILE: a trainer admin token, with which the gateway loads each base once as a shared
session; without it, bases must be loaded shared by an admin), ``--health-port`` (STROP_HEALTH_PORT: plaintext
``/healthz`` and ``/readyz`` for probes; 0: off).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from strop.common.trainer_types import Quantization
from strop.gateways.common import add_server_flags
from strop.gateways.tinker.gateway import Gateway, GatewayConfig


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="strop serve tinker", description=__doc__.split("\n\n")[0])
    add_server_flags(p, "TINKER", 8000, "base sessions")
    p.add_argument(
        "--poll-ms",
        type=int,
        default=int(env("STROP_TINKER_POLL_MS", "10000")),
        help="how long retrieve_future holds a pending future before try_again (< the SDK's 45 s)",
    )
    p.add_argument(
        "--admin-token-file",
        default=env("STROP_TINKER_ADMIN_TOKEN_FILE"),
        help="a file holding a trainer admin token: the gateway loads shared bases with it",
    )
    p.add_argument(
        "--health-port",
        type=int,
        default=int(env("STROP_HEALTH_PORT", "0")),
        help="plaintext HTTP port for /healthz and /readyz (0: none)",
    )
    return p


def _admin_token(path: str | None) -> str | None:
    if not path:
        return None
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise SystemExit(f"strop: --admin-token-file: {exc}") from None
    if not token:
        raise SystemExit(f"strop: --admin-token-file {path} is empty")
    return token


def config_from_args(args) -> GatewayConfig:
    if not 100 <= args.poll_ms <= 30_000:
        raise SystemExit("strop: --poll-ms must be within 100..30000")
    return GatewayConfig(
        trainer=args.trainer,
        model_root=Path(args.model_root),
        quantization=Quantization(args.quantization),
        dtype=args.dtype,
        max_seq_length=args.max_seq_length,
        poll_ms=args.poll_ms,
        tls_ca=args.trainer_tls_ca,
        admin_token=_admin_token(args.admin_token_file),
    )


def main(argv: list[str] | None = None) -> int:
    from strop.gateways.common import serve
    from strop.gateways.health import HealthServer, trainer_reachable
    from strop.gateways.tinker.app import create_app

    args = build_parser().parse_args(argv)
    if not 0 <= args.health_port < 65536:
        raise SystemExit("strop: --health-port must be within 0..65535")
    gw = Gateway(config_from_args(args))
    host = args.listen.rpartition(":")[0] or "127.0.0.1"
    health = None
    if args.health_port:
        from strop.client import TrainerClient

        probe = TrainerClient(gw.config.trainer, tls_ca=gw.config.tls_ca)  # its channel only: no call is made
        health = HealthServer(host, args.health_port, lambda: trainer_reachable(probe)).start()
    try:
        serve(create_app(gw), args.listen, tls_cert=args.tls_cert, tls_key=args.tls_key)
    finally:
        if health is not None:
            health.draining()
            health.stop()
        gw.close()
    return 0
