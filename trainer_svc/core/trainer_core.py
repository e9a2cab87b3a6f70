"""TrainerCore: the trainer service's core, without any gRPC — sessions, datasets, jobs and the artifact store.

The gRPC servicer calls the parts directly (``core.sessions``, ``core.datasets``, ``core.jobs``,
``core.artifacts``); this module builds them on one store and owns the lifecycle (restart recovery, drain,
close).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

from strop.common.artifacts import ArtifactStore
from strop.trainer_svc.core import models
from strop.trainer_svc.core.datasets import Datasets, Limits
from strop.trainer_svc.core.jobs import Jobs
from strop.trainer_svc.core.sessions import Sessions
from strop.trainer_svc.core.store import TrainerStore

log = logging.getLogger("strop.trainer")


@dataclass
class TrainerConfig:
    model_root: Path
    artifact_root: Path
    state_dir: Path
    data_root: Path | None = None
    device: str = "auto"
    max_sessions: int = 8
    max_queued_jobs: int = 64
    dataset_limits: Limits = field(default_factory=Limits)


class TrainerCore:
    def __init__(self, config: TrainerConfig):
        self.config = config
        for p in (config.model_root, config.artifact_root, config.state_dir):
            Path(p).mkdir(parents=True, exist_ok=True)
        self.store = TrainerStore(config.state_dir)
        self.artifacts = ArtifactStore(config.artifact_root)
        self.device = models.pick_device(config.device)
        self.sessions = Sessions(
            self.store, self.artifacts, model_root=Path(config.model_root), device=self.device,
            max_sessions=config.max_sessions,
        )  # fmt: skip
        self.datasets = Datasets(
            self.store, Path(config.state_dir), data_root=config.data_root, limits=config.dataset_limits
        )
        self.jobs = Jobs(
            self.store, self.artifacts, self.sessions, self.datasets, state_dir=Path(config.state_dir),
            max_queued=config.max_queued_jobs,
        )  # fmt: skip
        interrupted = self.store.recover_after_restart()
        if interrupted:
            log.warning("marked %d job(s) INTERRUPTED after restart: %s", len(interrupted), interrupted)

    def drain(self, grace_seconds: float) -> bool:
        """Stop running jobs at their next step boundary (see :meth:`Jobs.drain`)."""
        return self.jobs.drain(grace_seconds)

    def close(self) -> None:
        self.store.db.close()
