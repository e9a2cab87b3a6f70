"""``strop serve openai``: OpenAI's fine-tuning API as its own process, a gRPC client of the trainer.

Flags (each with an environment variable): ``--listen`` (STROP_OPENAI_LISTEN, default 127.0.0.1:8001; the SDK's
``base_url`` is ``http://<listen>/v1``), ``--trainer`` (STROP_TRAINER, host:port), ``--model-root`` (STROP_MODEL_ROOT:
the trainer's model root, read-only: the base models served), ``--state-dir`` (STROP_OPENAI_STATE_DIR: the SQLite file
and the uploaded files), ``--database-url`` (STROP_OPENAI_DATABASE_URL: PostgreSQL instead of SQLite),
``--quantization``/``--dtype``/``--max-seq-length`` (how jobs' bases are loaded), ``--tls-cert``/``--tls-key``
(HTTPS), ``--trainer-tls-ca`` (STROP_TLS_CA), ``--exporter`` (STROP_EXPORTER: the export service, for jobs whose
metadata asks for exports). ``GET /healthz`` is the probe.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from strop.common.trainer_types import Quantization
from strop.gateways.common import add_server_flags
from strop.gateways.openai.gateway import Gateway, GatewayConfig


def build_parser() -> argparse.ArgumentParser:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="strop serve openai", description=__doc__.split("\n\n")[0])
    add_server_flags(p, "OPENAI", 8001, "jobs' bases")
    p.add_argument(
        "--state-dir",
        default=env("STROP_OPENAI_STATE_DIR", "state/openai"),
        help="the gateway's SQLite state and uploaded files",
    )
    p.add_argument(
        "--database-url",
        default=env("STROP_OPENAI_DATABASE_URL", ""),
        help="'' (SQLite in --state-dir) or postgresql://…",
    )
    p.add_argument(
        "--max-file-mb",
        type=int,
        default=int(env("STROP_OPENAI_MAX_FILE_MB", "512")),
        help="the largest file /v1/files takes (OpenAI's: 512 MB)",
    )
    p.add_argument(
        "--exporter",
        default=env("STROP_EXPORTER", ""),
        help="the export service's gRPC address: jobs whose metadata asks (strop_export) are exported "
        "on success ('' = none)",
    )
    return p


def config_from_args(args) -> GatewayConfig:
    if args.max_file_mb < 1:
        raise SystemExit("strop: --max-file-mb must be >= 1")
    return GatewayConfig(
        trainer=args.trainer,
        model_root=Path(args.model_root),
        state_dir=Path(args.state_dir),
        database_url=args.database_url,
        quantization=Quantization(args.quantization),
        dtype=args.dtype,
        max_seq_length=args.max_seq_length,
        max_file_bytes=args.max_file_mb << 20,
        tls_ca=args.trainer_tls_ca,
        exporter=args.exporter,
    )


def main(argv: list[str] | None = None) -> int:
    from strop.gateways.common import serve
    from strop.gateways.openai.app import create_app

    args = build_parser().parse_args(argv)
    gw = Gateway(config_from_args(args))
    try:
        serve(create_app(gw), args.listen, tls_cert=args.tls_cert, tls_key=args.tls_key)
    finally:
        gw.close()
    return 0
