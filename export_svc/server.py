"""``strop serve export`` / ``python -m strop.export_svc``: the export service's process.

Builds the artifact store, the export queue (state in SQLite under ``--state-dir``, or ``--database-url``) and the gRPC server (error
mapping, health, reflection, message limits); on SIGTERM it stops accepting exports, lets running ones finish
within ``--grace`` seconds, marks the rest INTERRUPTED and stops. Flags and defaults follow the convention both
services share (``strop.common.server_cli.service_parser``).
"""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from pathlib import Path

from strop.common.artifacts import ArtifactStore
from strop.common.grpc_server import ConnectionAge, Drain, Security, Service, ServiceBinding, build_server
from strop.common.metrics import serve_metrics
from strop.common.paths import private_paths
from strop.common.server_cli import run_main, server_options, service_parser
from strop.export_svc.core.jobs import ExportManager
from strop.export_svc.service import ExportServicer
from strop.v1 import export_pb2, export_pb2_grpc

SERVICE_NAME = export_pb2.DESCRIPTOR.services_by_name["ExportService"].full_name
DEFAULT_PORT = 50052


@dataclass
class ExportConfig:
    model_root: Path
    artifact_root: Path
    state_dir: Path
    concurrent_exports: int = 1  # each uses every CPU core while it quantizes
    database_url: str = ""  # "": SQLite in state_dir; postgresql://… shared by every export pod
    instance_id: str = ""  # "": STROP_INSTANCE_ID or the host name


def start(
    config: ExportConfig,
    *,
    address: str = "127.0.0.1:0",
    rpc_threads: int = 16,
    reflection: bool = True,
    security: Security | None = None,
    metrics: str | None = None,
    health: str | None = None,
    connection_age: ConnectionAge | None = None,
) -> Service:
    """Start the service (port 0 binds a free port; read it from ``.port``); ``.core`` is the ExportManager.
    ``metrics``: ``host:port`` for Prometheus ``/metrics`` (port 0: a free one, ``Service.metrics_port``)."""
    store = ArtifactStore(config.artifact_root)
    manager = ExportManager(
        config.state_dir,
        config.model_root,
        store,
        workers=config.concurrent_exports,
        database_url=config.database_url,
        instance_id=config.instance_id,
    )
    drain = Drain()
    servicer = ExportServicer(manager, store, drain)
    binding = ServiceBinding(export_pb2_grpc.add_ExportServiceServicer_to_server, servicer, SERVICE_NAME)
    running = build_server(
        [binding],
        address=address,
        max_workers=rpc_threads,
        drain=drain,
        reflection_on=reflection,
        security=security,
        health_address=health,
        connection_age=connection_age,
        private_paths=private_paths(
            models=config.model_root, artifacts=config.artifact_root, state=config.state_dir
        ),
    )
    # the manager closes its database as the drain ends, so there is nothing left to close afterwards
    endpoint = serve_metrics(manager.metrics.registry, metrics) if metrics else None
    return Service(running, manager, drain_work=manager.shutdown, close=lambda: None, metrics=endpoint)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = service_parser(
        "strop serve export", "Run the strop export service.", name="export", port=DEFAULT_PORT
    )
    p.add_argument(
        "--concurrent-exports",
        type=int,
        default=int(os.environ.get("STROP_CONCURRENT_EXPORTS", "1")),
        help="exports running at once (each uses every CPU core while it quantizes)",
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    config = ExportConfig(
        Path(a.model_root),
        Path(a.artifact_root),
        Path(a.state_dir),
        concurrent_exports=a.concurrent_exports,
        database_url=a.database_url,
        instance_id=a.instance_id,
    )
    options = server_options(a)
    run_main(a, lambda: start(config, **options))


if __name__ == "__main__":
    main()
