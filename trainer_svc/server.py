"""``python -m strop.trainer_svc`` / ``strop serve trainer``: run the trainer service."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path

from strop.common.grpc_server import Drain, RunningServer, ServiceBinding, build_server, serve_forever
from strop.trainer_svc.core.datasets import Limits
from strop.trainer_svc.core.trainer_core import TrainerConfig, TrainerCore
from strop.trainer_svc.service import SERVICE_NAME, TrainerServicer, add_to_server


def start(
    config: TrainerConfig, *, address: str = "127.0.0.1:0", max_workers: int = 32
) -> tuple[RunningServer, TrainerCore]:
    """Build the core and start a server (used by ``main`` and by the tests, with port 0)."""
    core = TrainerCore(config)
    drain = Drain()
    servicer = TrainerServicer(core, drain)
    running = build_server(
        [ServiceBinding(add_to_server, servicer, SERVICE_NAME)],
        address=address,
        max_workers=max_workers,
        drain=drain,
    )
    return running, core


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser(prog="strop serve trainer", description="strop trainer service (gRPC)")
    p.add_argument(
        "--address",
        default=env("STROP_TRAINER_ADDRESS", "127.0.0.1:50051"),
        help="host:port to bind (port 0 picks a free one)",
    )
    p.add_argument("--model-root", default=env("STROP_MODEL_ROOT", "./models"))
    p.add_argument("--data-root", default=env("STROP_DATA_ROOT"))
    p.add_argument("--artifact-root", default=env("STROP_ARTIFACT_ROOT", "./artifacts"))
    p.add_argument("--state-dir", default=env("STROP_STATE_DIR", "./state/trainer"))
    p.add_argument("--device", default=env("STROP_DEVICE", "auto"), help="auto, cpu, cuda:0, ...")
    p.add_argument("--max-sessions", type=int, default=8)
    p.add_argument("--max-dataset-bytes", type=int, default=Limits.max_bytes)
    p.add_argument("--workers", type=int, default=32)
    p.add_argument("--grace", type=float, default=30.0, help="seconds to drain on SIGTERM")
    p.add_argument("--port-file", help="write the bound port here once serving (for scripts and tests)")
    p.add_argument("--log-level", default=env("STROP_LOG_LEVEL", "INFO"))
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    a = parse_args(argv)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # strop never downloads at run time (models come from disk)
    logging.basicConfig(level=a.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    config = TrainerConfig(
        model_root=Path(a.model_root),
        artifact_root=Path(a.artifact_root),
        state_dir=Path(a.state_dir),
        data_root=Path(a.data_root) if a.data_root else None,
        device=a.device,
        max_sessions=a.max_sessions,
        dataset_limits=Limits(max_bytes=a.max_dataset_bytes),
    )
    running, core = start(config, address=a.address, max_workers=a.workers)
    if a.port_file:
        tmp = Path(a.port_file + ".tmp")
        tmp.write_text(str(running.port))
        tmp.replace(a.port_file)
    serve_forever(running, grace=a.grace, on_drain=lambda: core.drain(a.grace), on_close=core.close)
