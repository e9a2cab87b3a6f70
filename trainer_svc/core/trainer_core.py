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
from strop.common.db import Liveness, default_instance_id
from strop.common.metrics import MemoryReading, TrainerMetrics, host_memory
from strop.common.trainer_types import JobState
from strop.trainer_svc.core import loss_curve, model_loading
from strop.trainer_svc.core.datasets import Datasets, Limits
from strop.trainer_svc.core.jobs import Jobs
from strop.trainer_svc.core.runs import TrainingRuns
from strop.trainer_svc.core.sessions import Sessions
from strop.trainer_svc.core.store import SERVICE, TrainerStore

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
    database_url: str = ""  # "": SQLite in state_dir; postgresql://… shared by every trainer pod
    instance_id: str = ""  # "": STROP_INSTANCE_ID or the host name
    # the step API: how long a run's missing seq id blocks the seqs behind it before it is skipped
    step_hole_seconds: float = 60.0


class TrainerCore:
    def __init__(self, config: TrainerConfig):
        self.config = config
        for p in (config.model_root, config.artifact_root, config.state_dir):
            Path(p).mkdir(parents=True, exist_ok=True)
        self.instance_id = config.instance_id or default_instance_id()
        self.store = TrainerStore(
            config.state_dir, database_url=config.database_url, instance_id=self.instance_id
        )
        self.artifacts = ArtifactStore(config.artifact_root)
        self.device = model_loading.pick_device(config.device)
        self.sessions = Sessions(
            self.store,
            self.artifacts,
            model_root=Path(config.model_root),
            device=self.device,
            max_sessions=config.max_sessions,
        )
        self.datasets = Datasets(
            self.store, Path(config.state_dir), data_root=config.data_root, limits=config.dataset_limits
        )
        self.metrics = TrainerMetrics(
            job_counts=lambda: {s.value: n for s, n in self.store.job_counts(self.instance_id).items()},
            queue_length=lambda: self.jobs.queue_length(),
            memory=self._memory,
            states=[s.value for s in JobState],
        )
        self.jobs = Jobs(
            self.store,
            self.artifacts,
            self.sessions,
            self.datasets,
            state_dir=Path(config.state_dir),
            max_queued=config.max_queued_jobs,
            metrics=self.metrics,
        )
        # the step API: training runs on loaded sessions, their primitives sharing the device with jobs
        self.runs = TrainingRuns(
            self.sessions,
            self.artifacts,
            self.jobs.device_turn,
            metrics=self.metrics,
            hole_seconds=config.step_hole_seconds,
        )
        self.liveness = Liveness(self.store.db, SERVICE, self.instance_id)
        # Our previous incarnation is dead by definition; other live pods' sessions and jobs are theirs.
        interrupted = self._recover(self.liveness.others_alive())
        if interrupted:
            log.warning("marked %d job(s) INTERRUPTED after restart: %s", len(interrupted), interrupted)
        self.liveness.start(self._sweep)

    def _recover(self, live: set[str]) -> list[str]:
        """Interrupt the unfinished jobs of instances not in ``live``, and draw the loss curves they did not."""
        interrupted = self.store.recover(live)
        for job_id in interrupted:
            curve = loss_curve.publish_loss_curve(self.store, self.artifacts, job_id)
            if curve is not None:
                self.store.update_job(job_id, loss_curve=curve)
        return interrupted

    def _sweep(self, live: set[str]) -> None:
        """The heartbeat's sweep: the work of instances whose heartbeat stopped becomes INTERRUPTED."""
        interrupted = self._recover(live)
        if interrupted:
            log.warning(
                "marked %d job(s) of stopped instances INTERRUPTED: %s", len(interrupted), interrupted
            )

    def _memory(self) -> MemoryReading:
        if not self.device.startswith("cuda"):
            return host_memory()
        import torch

        return [
            reading
            for i in range(torch.cuda.device_count())
            for reading in (
                (f"cuda:{i}", "allocated", float(torch.cuda.memory_allocated(i))),
                (f"cuda:{i}", "reserved", float(torch.cuda.memory_reserved(i))),
            )
        ]

    def drain(self, grace_seconds: float) -> bool:
        """Stop running jobs at their next step boundary (see :meth:`Jobs.drain`)."""
        return self.jobs.drain(grace_seconds)

    def close(self) -> None:
        self.runs.stop()
        self.liveness.stop(retire=True)  # called after a clean drain: nothing of ours is left running
        self.store.db.close()
