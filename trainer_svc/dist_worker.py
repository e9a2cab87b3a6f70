"""One trainer job on several processes through torch.distributed: the entry point each rank runs.

``python -m strop.trainer_svc.dist_worker --spec job.json`` under torchrun (``python -m torch.distributed.run
--nproc-per-node N -m strop.trainer_svc.dist_worker ...``) or in a Kubernetes training operator's pod, with the
environment they inject: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``. A pod given
only torchrun's ``PET_*`` variables (Kubeflow Trainer's torch runtime: ``PET_NNODES``, ``PET_NPROC_PER_NODE``,
``PET_NODE_RANK``, ``PET_MASTER_ADDR``, ``PET_MASTER_PORT``) is re-run through torchrun, which reads them. With
none of these it trains as one process.

Every rank loads the base the way a session does (``models.load_model``), attaches the same LoRA (seeded, so
every rank starts from the same adapter), validates the dataset, and trains with the single-process path's
trainer (``training.run_training``: TRL's trainer, strop's callback, the gradient guard). DDP is TRL's and
transformers' own, through accelerate: each rank takes every ``WORLD_SIZE``-th batch of the one shuffled order,
and the gradients are averaged. Only the adapters are synchronised: the frozen base and the buffers are listed
in ``_ddp_params_and_buffers_to_ignore``, so DDP neither broadcasts them at the start nor all-reduces anything
but the LoRA tensors (each rank read the same base from the same files). Rank 0 alone writes the adapter and
the checkpoints into the artifact store (``sessions.publish_adapter``, ``jobs.publish_checkpoint``: the
single-process path's metadata) and writes the job's events, one JSON ``JobEvent`` a line.

Stopping: SIGTERM (what torchrun and Kubernetes send) stops the job INTERRUPTED, SIGINT CANCELLED, at a step
boundary, with a checkpoint; so does a ``--stop-file`` appearing with ``cancel`` or ``interrupt`` in it (how the
trainer service, ``core/dist_launch.py``, stops the job it launched). Every rank must stop after the same step (a rank that stops alone leaves the
others waiting in an all-reduce), so at each step end the ranks agree on the stop flag with one all-reduce.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from strop.common import serde
from strop.common.artifacts import ArtifactStore
from strop.common.paths import confine
from strop.common.trainer_types import JobEvent, JobState, LogMessage, StateChange, StepMetrics
from strop.trainer_svc.core.dist_launch import DistributedJob

log = logging.getLogger("strop.trainer.dist")

LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
STOP_CODES = {None: 0, "cancel": 1, "interrupt": 2}  # all-reduced with MAX: an interrupt outranks a cancel
STOP_REASONS = {v: k for k, v in STOP_CODES.items()}


@dataclass
class Rank:
    rank: int
    world_size: int
    local_rank: int

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def rank_from_env(env: dict[str, str] | None = None) -> Rank:
    env = os.environ if env is None else env
    return Rank(int(env.get("RANK", "0")), int(env.get("WORLD_SIZE", "1")), int(env.get("LOCAL_RANK", "0")))


class EventWriter:
    """Rank 0's job events, numbered, one JSON line each (a file the launcher follows, or stdout)."""

    def __init__(self, job_id: str, path: str) -> None:
        self.job_id, self.seq = job_id, 0
        self._file = sys.stdout if path in ("", "-") else open(path, "a", buffering=1)

    def emit(self, **payload) -> None:
        self.seq += 1
        event = JobEvent(job_id=self.job_id, seq=self.seq, time=time.time(), **payload)
        self._file.write(json.dumps(serde.to_dict(event)) + "\n")
        self._file.flush()


def _stop_agreement(control, device: str, world_size: int, stop_file: Path | None):
    """A callback that, at every step end, reads the launcher's stop file (``cancel`` or ``interrupt``, written by
    the trainer service) and all-reduces (MAX) each rank's stop flag, so all ranks stop after the same step."""
    import torch
    import torch.distributed as dist
    from transformers import TrainerCallback

    class StopAgreement(TrainerCallback):
        def on_step_end(self, args, state, control_, **kw):
            if stop_file is not None and stop_file.is_file():
                asked = stop_file.read_text().strip()
                control.request_stop(asked if asked in ("cancel", "interrupt") else "interrupt")
            if launcher_gone():  # the service that launched the job died (SIGKILL): checkpoint and stop
                control.request_stop("interrupt")
            code = STOP_CODES[control.stop.reason if control.stop else None]
            if world_size > 1:
                flag = torch.tensor([code], device=device)
                dist.all_reduce(flag, op=dist.ReduceOp.MAX)
                code = int(flag.item())
            reason = STOP_REASONS[code]
            if reason is not None:
                control.request_stop(reason)  # a no-op on the rank that asked
                control_.should_training_stop = True
                control_.should_save = True
            return control_

    return StopAgreement()


def launcher_gone(env: dict[str, str] | None = None) -> bool:
    """Whether the trainer service that launched this job (``STROP_LAUNCHER_PID``, set by ``core/dist_launch.py``)
    has died: a service killed hard cannot write the stop file, and ranks left training would hold its devices."""
    pid = (os.environ if env is None else env).get("STROP_LAUNCHER_PID", "")
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:  # alive, another user's
        return False
    return False


def frozen_names(model) -> list[str]:
    """Every parameter that does not train and every buffer: what DDP is told to leave alone."""
    return [n for n, p in model.named_parameters() if not p.requires_grad] + [
        n for n, _ in model.named_buffers()
    ]


def _init_distributed(rank: Rank) -> str:
    """Join the process group (nccl on CUDA, gloo on the CPU); returns this rank's device."""
    import torch
    import torch.distributed as dist

    if torch.cuda.is_available():
        device = f"cuda:{rank.local_rank}"
        torch.cuda.set_device(device)
        backend = "nccl"
    else:
        device, backend = "cpu", "gloo"
    if rank.world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend=backend)
    return device


def run(spec: DistributedJob, *, model_root: Path, artifact_root: Path, data_root: Path, work_dir: Path,
        events_path: str = "", stop_file: Path | None = None) -> JobState:  # fmt: skip
    """Train ``spec`` as this rank; returns how the job ended (every rank returns the same state)."""
    from strop.trainer_svc.core import job_config, models, training
    from strop.trainer_svc.core.datasets import Limits, validate_jsonl
    from strop.trainer_svc.core.guard import BrokenTraining
    from strop.trainer_svc.core.jobs import publish_checkpoint
    from strop.trainer_svc.core.sessions import publish_adapter

    rank = rank_from_env()
    device = _init_distributed(rank)
    events = EventWriter(spec.job_id, events_path) if rank.is_main else None

    def emit(**payload) -> None:
        if events is not None:
            events.emit(**payload)

    control = training.JobControl()
    signal.signal(signal.SIGTERM, lambda *_: control.request_stop("interrupt"))
    signal.signal(signal.SIGINT, lambda *_: control.request_stop("cancel"))
    artifacts = ArtifactStore(artifact_root)
    loaded = None
    try:
        emit(
            state=StateChange(
                JobState.RUNNING, f"{rank.world_size} process" + ("es" if rank.world_size > 1 else "")
            )
        )
        dataset = confine(data_root, spec.dataset_path, what="dataset path")
        with open(dataset, "rb") as f:
            ds = validate_jsonl(iter(lambda: f.read(1 << 20), b""), spec.dataset_format, Limits())
        loaded = models.load_model(spec.model, model_root=model_root, device=device)
        models.attach_lora(loaded, spec.lora)  # seeded: the same adapter on every rank
        cfg = job_config.with_defaults(spec.config, session_max_len=loaded.facts.max_seq_length)
        job_config.check_dataset_fits(cfg, ds.format, ds.rows, loaded.facts.vocab_size)
        resume_dir = None
        if spec.resume_from:
            artifacts.verify(spec.resume_from)
            resume_dir = artifacts.path_of(spec.resume_from)
        ignored = frozen_names(loaded.model)
        loaded.model._ddp_params_and_buffers_to_ignore = ignored
        synced = [n for n, p in loaded.model.named_parameters() if p.requires_grad]
        if rank.world_size > 1:
            text = (
                f"DDP over {rank.world_size} processes synchronises {len(synced)} adapter tensors; "
                f"{len(ignored)} frozen tensors and buffers are left alone"
            )
        else:
            text = f"one process: {len(synced)} adapter tensors train"
        emit(log=LogMessage("info", text))
        tenant = spec.tenant

        def on_step(m: StepMetrics) -> None:
            emit(step=m)

        def on_checkpoint(step: int, path: Path) -> None:
            if rank.is_main:
                ckpt = publish_checkpoint(
                    artifacts, loaded, tenant=tenant, job_id=spec.job_id, step=step, path=path
                )
                emit(checkpoint=ckpt)

        sinks = training.Sinks(on_step=on_step, on_checkpoint=on_checkpoint, on_start=lambda total: None)
        callbacks = [_stop_agreement(control, device, rank.world_size, stop_file)]
        # one scratch directory a rank: a rank that finishes first removes its own, never one rank 0 still reads
        scratch = work_dir / f"rank-{rank.rank}"
        step = training.run_training(
            loaded, ds.rows, ds.format, cfg, scratch, control, sinks, resume_dir, callbacks
        )
        if rank.is_main:
            adapter = publish_adapter(
                artifacts, loaded, tenant=tenant, artifact_id=None,
                metadata={"job_id": spec.job_id, "step": str(step), "world_size": str(rank.world_size)},
            )  # fmt: skip
            emit(adapter=adapter)
        if control.stop is None:
            state, message = JobState.SUCCEEDED, f"finished at step {step}"
        elif control.stop.reason == "cancel":
            state, message = JobState.CANCELLED, f"cancelled at step {step}"
        else:
            state, message = JobState.INTERRUPTED, f"stopped at step {step}"
        emit(state=StateChange(state, message))
        return state
    except BrokenTraining as exc:
        emit(state=StateChange(JobState.FAILED, f"BrokenTraining: {exc}"))
        raise
    except Exception as exc:
        emit(state=StateChange(JobState.FAILED, f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _relaunch_with_torchrun() -> None:
    """A pod with torchrun's PET_* variables but no RANK: run this module under torchrun, which reads them."""
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "-m",
        "strop.trainer_svc.dist_worker",
        *sys.argv[1:],
    ]
    os.execv(sys.executable, argv)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    env = os.environ.get
    p = argparse.ArgumentParser("python -m strop.trainer_svc.dist_worker", description=__doc__.split("\n")[0])
    p.add_argument("--spec", required=True, help="the job: a DistributedJob as JSON")
    p.add_argument("--model-root", default=env("STROP_MODEL_ROOT", "./models"), help="env STROP_MODEL_ROOT")
    p.add_argument(
        "--artifact-root", default=env("STROP_ARTIFACT_ROOT", "./artifacts"), help="env STROP_ARTIFACT_ROOT"
    )
    p.add_argument("--data-root", default=env("STROP_DATA_ROOT", "./data"), help="env STROP_DATA_ROOT")
    p.add_argument(
        "--work-dir", default=env("STROP_WORK_DIR", "./work"), help="this node's scratch (env STROP_WORK_DIR)"
    )
    p.add_argument("--events", default="", help="rank 0's events, one JSON line each (default: stdout)")
    p.add_argument(
        "--stop-file", default="", help="a file whose appearance (cancel or interrupt) stops the job"
    )
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    if "RANK" not in os.environ and any(k.startswith("PET_") for k in os.environ):
        _relaunch_with_torchrun()
    a = parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    spec = serde.from_dict(DistributedJob, json.loads(Path(a.spec).read_text()))
    state = run(
        spec, model_root=Path(a.model_root), artifact_root=Path(a.artifact_root), data_root=Path(a.data_root),
        work_dir=Path(a.work_dir) / (spec.job_id or "job"), events_path=a.events,
        stop_file=Path(a.stop_file) if a.stop_file else None,
    )  # fmt: skip
    sys.exit(0 if state is not JobState.FAILED else 1)


if __name__ == "__main__":
    main()
