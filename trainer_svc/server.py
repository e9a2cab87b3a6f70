"""``python -m strop.trainer_svc`` / ``strop serve trainer``: run the trainer service."""

from __future__ import annotations

import argparse
from pathlib import Path

from strop.common.grpc_server import ConnectionAge, Drain, Security, Service, ServiceBinding, build_server
from strop.common.metrics import serve_metrics
from strop.common.paths import private_paths
from strop.common.server_cli import run_main, server_options, service_parser
from strop.trainer_svc.core.datasets import Limits
from strop.trainer_svc.core.trainer_core import TrainerConfig, TrainerCore
from strop.trainer_svc.service import SERVICE_NAME, TrainerServicer, add_to_server

DEFAULT_PORT = 50051


def start(
    config: TrainerConfig,
    *,
    address: str = "127.0.0.1:0",
    rpc_threads: int = 32,
    reflection: bool = True,
    security: Security | None = None,
    metrics: str | None = None,
    health: str | None = None,
    connection_age: ConnectionAge | None = None,
) -> Service:
    """Build the core and start a server (used by ``main`` and by the tests, with port 0); ``health``: ``host:port``
    of the plaintext health-only listener (None: off); ``metrics``:
    ``host:port`` for Prometheus ``/metrics`` (port 0 binds a free one: ``Service.metrics_port``), None: off."""
    core = TrainerCore(config)
    drain = Drain()
    servicer = TrainerServicer(core, drain)
    running = build_server(
        [ServiceBinding(add_to_server, servicer, SERVICE_NAME)],
        address=address,
        max_workers=rpc_threads,
        drain=drain,
        reflection_on=reflection,
        security=security,
        health_address=health,
        connection_age=connection_age,
        private_paths=private_paths(
            models=config.model_root,
            artifacts=config.artifact_root,
            state=config.state_dir,
            data=config.data_root,
        ),
    )
    endpoint = serve_metrics(core.metrics.registry, metrics) if metrics else None
    return Service(running, core, drain_work=core.drain, close=core.close, metrics=endpoint)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    import os

    env = os.environ.get
    p = service_parser(
        "strop serve trainer", "strop trainer service (gRPC)", name="trainer", port=DEFAULT_PORT
    )
    p.add_argument(
        "--data-root", default=env("STROP_DATA_ROOT"), help="datasets given by path (env STROP_DATA_ROOT)"
    )
    p.add_argument(
        "--device", default=env("STROP_DEVICE", "auto"), help="auto, cpu, cuda:0, ... (env STROP_DEVICE)"
    )
    p.add_argument("--max-sessions", type=int, default=int(env("STROP_MAX_SESSIONS", "8")))
    p.add_argument("--max-queued-jobs", type=int, default=int(env("STROP_MAX_QUEUED_JOBS", "64")))
    p.add_argument("--max-dataset-bytes", type=int, default=Limits.max_bytes)
    p.add_argument(
        "--step-hole-seconds",
        type=float,
        default=float(env("STROP_STEP_HOLE_SECONDS", "60")),
        help="step API: how long a run's missing seq id blocks the seqs behind it before it is skipped "
        "(env STROP_STEP_HOLE_SECONDS)",
    )
    a = p.parse_args(argv)
    if not (a.step_hole_seconds > 0 and a.step_hole_seconds != float("inf")):
        p.error(f"--step-hole-seconds must be a positive number of seconds, got {a.step_hole_seconds}")
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    config = TrainerConfig(
        model_root=Path(a.model_root),
        artifact_root=Path(a.artifact_root),
        state_dir=Path(a.state_dir),
        data_root=Path(a.data_root) if a.data_root else None,
        device=a.device,
        max_sessions=a.max_sessions,
        max_queued_jobs=a.max_queued_jobs,
        dataset_limits=Limits(max_bytes=a.max_dataset_bytes),
        database_url=a.database_url,
        instance_id=a.instance_id,
        step_hole_seconds=a.step_hole_seconds,
    )
    options = server_options(a)
    run_main(a, lambda: start(config, **options))
