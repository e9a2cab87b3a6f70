"""``strop serve export`` / ``python -m strop.export_svc``: the export service's process.

Builds the artifact store, the job manager (SQLite state under ``--state-dir``) and the gRPC server
(error mapping, health, reflection, message limits); on SIGTERM it stops accepting exports, lets
running ones finish within ``--grace`` seconds, marks the rest INTERRUPTED and stops.
"""

from __future__ import annotations

import argparse
import logging
import os
from dataclasses import dataclass
from pathlib import Path

from strop.common.artifacts import ArtifactStore
from strop.common.grpc_server import Drain, RunningServer, ServiceBinding, build_server, serve_forever
from strop.export_svc.core.jobs import ExportManager
from strop.export_svc.service import ExportServicer
from strop.v1 import export_pb2, export_pb2_grpc

SERVICE_NAME = export_pb2.DESCRIPTOR.services_by_name["ExportService"].full_name


@dataclass
class ExportServer:
    """A running export service (what tests and ``main`` hold)."""

    running: RunningServer
    manager: ExportManager
    store: ArtifactStore

    @property
    def port(self) -> int:
        return self.running.port

    def stop(self, grace: float = 5.0) -> None:
        self.running.stop(grace, on_drain=lambda: self.manager.shutdown(grace))


def start_server(
    *,
    address: str = "127.0.0.1:0",
    model_root: str | Path,
    artifact_root: str | Path,
    state_dir: str | Path,
    workers: int = 1,
    rpc_threads: int = 16,
) -> ExportServer:
    """Start the service (port 0 binds a free port; read it from ``.port``)."""
    store = ArtifactStore(artifact_root)
    manager = ExportManager(state_dir, model_root, store, workers=workers)
    drain = Drain()
    servicer = ExportServicer(manager, store, drain)
    binding = ServiceBinding(export_pb2_grpc.add_ExportServiceServicer_to_server, servicer, SERVICE_NAME)
    running = build_server([binding], address=address, max_workers=rpc_threads, drain=drain)
    return ExportServer(running, manager, store)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="strop serve export", description="Run the strop export service.")
    p.add_argument(
        "--address", default="0.0.0.0:50052", help="host:port to listen on (port 0: any free port)"
    )
    p.add_argument("--model-root", required=True, help="base models and adapters given by path live under it")
    p.add_argument("--artifact-root", required=True, help="the artifact store shared with the trainer")
    p.add_argument("--state-dir", required=True, help="where export.db keeps export history and events")
    p.add_argument("--workers", type=int, default=1, help="exports running at once")
    p.add_argument("--grace", type=float, default=30.0, help="seconds running exports get on SIGTERM")
    p.add_argument("--port-file", default="", help="write the bound port here once serving (for port 0)")
    p.add_argument("--log-level", default="INFO")
    return p


def main(argv: list[str] | None = None) -> None:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # strop never downloads at run time (models come from disk)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    server = start_server(
        address=args.address,
        model_root=args.model_root,
        artifact_root=args.artifact_root,
        state_dir=args.state_dir,
        workers=args.workers,
    )
    logging.getLogger("strop.export").info("export service on port %d", server.port)
    if args.port_file:
        tmp = Path(args.port_file + ".tmp")
        tmp.write_text(str(server.port))
        os.replace(tmp, args.port_file)  # readers never see a half-written port
    serve_forever(server.running, grace=args.grace, on_drain=lambda: server.manager.shutdown(args.grace))


if __name__ == "__main__":
    main()
