"""``strop serve tinker``: the Tinker REST gateway as its own process, a gRPC client of the trainer.

Flags (each with an environment variable): ``--listen`` (STROP_TINKER_LISTEN, default 127.0.0.1:8000),
``--trainer`` (STROP_TRAINER, host:port), ``--model-root`` (STROP_MODEL_ROOT: the trainer's model root, read-only;
base models and tokenizers), ``--quantization``/``--dtype``/``--max-seq-length`` (how base sessions are loaded),
``--poll-ms``, ``--tls-cert``/``--tls-key`` (HTTPS), ``--trainer-tls-ca`` (STROP_TLS_CA).
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from strop.common.trainer_types import Quantization
from strop.gateways.tinker.gateway import Gateway, GatewayConfig


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="strop serve tinker", description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--listen", default=env("STROP_TINKER_LISTEN", "127.0.0.1:8000"), help="host:port to serve HTTP on"
    )
    p.add_argument(
        "--trainer", default=env("STROP_TRAINER", "127.0.0.1:50051"), help="the trainer's gRPC address"
    )
    p.add_argument(
        "--model-root", default=env("STROP_MODEL_ROOT", "models"), help="the trainer's model root (read-only)"
    )
    p.add_argument("--quantization", default=env("STROP_TINKER_QUANTIZATION", "UNSPECIFIED"),
                   choices=[q.value for q in Quantization], help="how base sessions are loaded")  # fmt: skip
    p.add_argument(
        "--dtype", default=env("STROP_TINKER_DTYPE", ""), help="base sessions' dtype ('' = trainer's)"
    )
    p.add_argument("--max-seq-length", type=int, default=int(env("STROP_TINKER_MAX_SEQ_LENGTH", "0")))
    p.add_argument("--poll-ms", type=int, default=int(env("STROP_TINKER_POLL_MS", "10000")),
                   help="how long retrieve_future holds a pending future before try_again (< the SDK's 45 s)")  # fmt: skip
    p.add_argument("--tls-cert", default=env("STROP_TINKER_TLS_CERT"), help="HTTPS certificate (PEM)")
    p.add_argument("--tls-key", default=env("STROP_TINKER_TLS_KEY"), help="HTTPS private key (PEM)")
    p.add_argument(
        "--trainer-tls-ca", default=env("STROP_TLS_CA"), help="CA of the trainer's TLS certificate"
    )
    return p


def config_from_args(args) -> GatewayConfig:
    if not 100 <= args.poll_ms <= 30_000:
        raise SystemExit("strop: --poll-ms must be within 100..30000")
    return GatewayConfig(
        trainer=args.trainer, model_root=Path(args.model_root), quantization=Quantization(args.quantization),
        dtype=args.dtype, max_seq_length=args.max_seq_length, poll_ms=args.poll_ms, tls_ca=args.trainer_tls_ca,
    )  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from strop.gateways.tinker.app import create_app

    args = build_parser().parse_args(argv)
    gw = Gateway(config_from_args(args))
    host, _, port = args.listen.rpartition(":")
    try:
        uvicorn.run(
            create_app(gw), host=host or "127.0.0.1", port=int(port), ssl_certfile=args.tls_cert,
            ssl_keyfile=args.tls_key, log_level="info", timeout_graceful_shutdown=10,
        )  # fmt: skip
    finally:
        gw.close()
    return 0
