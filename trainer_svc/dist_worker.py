"""One trainer job on several processes through torch.distributed: the entry point each rank runs.

``python -m strop.trainer_svc.dist_worker --spec job.json`` under torchrun (``python -m torch.distributed.run
--nproc-per-node N -m strop.trainer_svc.dist_worker ...``) or in a Kubernetes training operator's pod, with the
environment they inject: ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``. A pod given
only torchrun's ``PET_*`` variables (Kubeflow Trainer's torch runtime: ``PET_NNODES``, ``PET_NPROC_PER_NODE``,
``PET_NODE_RANK``, ``PET_MASTER_ADDR``, ``PET_MASTER_PORT``) is re-run through torchrun, which reads them. With
none of these it trains as one process.

Every rank loads the base the way a session does (``models.load_model``; into host memory for a sharded job on
GPUs, which FSDP2 moves to the device as it shards it, ``core/fsdp.py``), attaches the same LoRA (seeded, so
every rank starts from the same adapter), validates the dataset, and trains with the single-process path's
trainer (``training.run_training``: TRL's trainer, strop's callback, the gradient guard). DDP is TRL's and
transformers' own, through accelerate: each rank takes every ``WORLD_SIZE``-th batch of the one shuffled order,
and the gradients are averaged. Only the adapters are synchronised: the frozen base and the buffers are listed
in ``_ddp_params_and_buffers_to_ignore``, so DDP neither broadcasts them at the start nor all-reduces anything
but the LoRA tensors (each rank read the same base from the same files). A job with ``parallelism`` FSDP is
sharded with FSDP2 instead (``core/fsdp.py``): the base and the adapters over the ranks. Rank 0 alone writes
the adapter and the checkpoints into the artifact store (``sessions.publish_adapter``, ``jobs.publish_checkpoint``: the
single-process path's metadata) and writes the job's events, one JSON ``JobEvent`` a line.

Stopping: SIGTERM (what torchrun and Kubernetes send) stops the job INTERRUPTED, SIGINT CANCELLED, at a step
boundary, with a checkpoint; so does a ``--stop-file`` appearing with ``cancel`` or ``interrupt`` in it (how the
trainer service, ``core/dist_launch.py``, stops the job it launched). Every rank must stop after the same step (a rank that stops alone leaves the
others waiting in an all-reduce), so at each step end the ranks agree on the stop flag with one all-reduce.

A rank that does not finish. One whose training raises records its failure (message and code) in the job's
work dir for the launcher and in torch.distributed's store for rank 0, and exits 1. Its peers' next collective
then fails (gloo: "Connection reset by peer" once its sockets close), or torchrun, seeing it exit, SIGTERMs
them: a peer takes that for a lost peer (``lost_peer``), not a failure of its own, and rank 0 reports the job
FAILED with the failed rank's message if one was recorded, INTERRUPTED otherwise (a rank SIGKILLed: the OOM
killer, a lost node), and exits ``EXIT_LOST_PEER``. A collective waits at most ``COLLECTIVE_TIMEOUT_S`` for a
peer that vanished without closing its sockets (a node lost), instead of gloo's default 30 minutes.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

from strop.common import serde
from strop.common.artifacts import ArtifactStore
from strop.common.errors import InvalidArgument
from strop.common.paths import confine
from strop.common.trainer_types import (
    FP8_KERNEL_MODES,
    JobEvent,
    JobState,
    LogMessage,
    StateChange,
    StepMetrics,
)
from strop.trainer_svc.core.dist_launch import EXIT_LOST_PEER, DistributedJob, RankFailure, record_failure

log = logging.getLogger("strop.trainer.dist")

LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
STOP_CODES = {None: 0, "cancel": 1, "interrupt": 2}  # all-reduced with MAX: an interrupt outranks a cancel
STOP_REASONS = {v: k for k, v in STOP_CODES.items()}
# the longest a collective waits for a peer; a step's all-reduces take well under a second, but the first one
# also waits for the slowest rank to finish loading its copy of the base
COLLECTIVE_TIMEOUT_S = 600
_FAILURE_KEY = "strop/failure/{rank}"  # a failed rank's RankFailure in torch.distributed's store


class PeerLost(Exception):
    """This rank stopped because a peer rank is gone (``lost_peer``); the job resumes from its checkpoint."""


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
        dist.init_process_group(backend=backend, timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S))
    return device


def lost_peer(exc: BaseException) -> bool:
    """Whether ``exc`` is a collective failing because a peer rank is gone, not this rank's own failure:
    torch.distributed's ``DistError`` (timeouts, NCCL's aborts), or a transport error, which gloo raises as a
    plain RuntimeError (seen here when a peer was SIGKILLed: "[.../gloo/transport/tcp/pair.cc:537] Read error
    [127.0.0.1]:21897: Connection reset by peer", from accelerate's all_gather of the step's token count)."""
    import torch.distributed as dist

    while exc is not None:
        if isinstance(exc, dist.DistError):
            return True
        text = str(exc)
        if isinstance(exc, RuntimeError) and ("gloo/transport" in text or "NCCL" in text):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def _share_failure(failure: RankFailure) -> None:
    """This rank's failure into the job's store, where rank 0 reads it (``_peer_failure``) on another node."""
    import torch.distributed as dist

    try:
        store = dist.distributed_c10d._get_default_store()  # the rendezvous store torchrun's agent holds
        store.set(_FAILURE_KEY.format(rank=failure.rank), json.dumps(serde.to_dict(failure)))
    except Exception as exc:  # no store (one process, or torchrun gone): the work dir's record still tells
        log.warning("could not share rank %d's failure: %s", failure.rank, exc)


def _peer_failure(world_size: int) -> RankFailure | None:
    """The first recorded failure of another rank, if one failed (rather than being killed)."""
    import torch.distributed as dist

    try:
        store = dist.distributed_c10d._get_default_store()
        keys = [_FAILURE_KEY.format(rank=r) for r in range(world_size)]
        found = [serde.from_dict(RankFailure, json.loads(store.get(k))) for k in keys if store.check([k])]
    except Exception:
        return None
    return min(found, key=lambda f: f.time) if found else None


def run(
    spec: DistributedJob,
    *,
    model_root: Path,
    artifact_root: Path,
    data_root: Path,
    work_dir: Path,
    events_path: str = "",
    stop_file: Path | None = None,
) -> JobState:
    """Train ``spec`` as this rank; returns how the job ended (every rank returns the same state)."""
    import torch

    from strop.trainer_svc.core import fsdp, job_config, model_loading, training
    from strop.trainer_svc.core.datasets import Limits, validate_jsonl
    from strop.trainer_svc.core.jobs import failure_of, publish_checkpoint
    from strop.trainer_svc.core.sessions import publish_adapter

    rank = rank_from_env()
    events = EventWriter(spec.job_id, events_path) if rank.is_main else None

    def emit(**payload) -> None:
        if events is not None:
            events.emit(**payload)

    control = training.JobControl()
    # torchrun SIGTERMs the ranks left when one exits, as Kubernetes does a pod's
    terminated = threading.Event()

    def on_sigterm(*_) -> None:
        terminated.set()
        control.request_stop("interrupt")

    signal.signal(signal.SIGTERM, on_sigterm)
    signal.signal(signal.SIGINT, lambda *_: control.request_stop("cancel"))
    artifacts = ArtifactStore(artifact_root)
    loaded, reached = None, 0
    try:
        device = _init_distributed(rank)
        declared = spec.config.ranks()
        if (spec.config.num_devices or spec.config.num_nodes) and declared != rank.world_size:
            # the global batch is batch_size x the world: a job must not silently train another one
            raise InvalidArgument(
                f"the job declares {declared} processes (num_nodes {max(spec.config.num_nodes, 1)} x num_devices "
                f"{max(spec.config.num_devices, 1)}) but {rank.world_size} joined: launch it with as many"
            )
        # before the base is loaded: it reads only the job's world and kernels
        fsdp.check_supported(spec.config, fp8=spec.model.kernels in FP8_KERNEL_MODES)
        emit(
            state=StateChange(
                JobState.RUNNING, f"{rank.world_size} process" + ("es" if rank.world_size > 1 else "")
            )
        )
        dataset = confine(data_root, spec.dataset_path, what="dataset path")
        with open(dataset, "rb") as f:
            ds = validate_jsonl(iter(lambda: f.read(1 << 20), b""), spec.dataset_format, Limits())
        # a sharded job on accelerators loads into host memory: FSDP2 moves each layer to the device as it shards
        load_device = fsdp.staging_device(spec.config, device, rank.world_size)
        # a 4-bit MoE's experts go NF4 on every rank as in one process (FSDP2 shards them: shard_nf4_experts)
        loaded = model_loading.load_model(
            spec.model, model_root=model_root, device=device, load_device=load_device
        )
        model_loading.attach_lora(loaded, spec.lora)  # seeded: the same adapter on every rank
        if load_device != device:
            loaded.pending_device_bytes = fsdp.device_bytes_after_sharding(loaded.model, rank.world_size)
        cfg = job_config.with_defaults(spec.config, session_max_len=loaded.facts.max_seq_length)
        job_config.check_dataset_fits(cfg, ds.format, ds.rows, loaded.facts.vocab_size)
        job_config.check_tools_rendered(ds.rows, loaded.tokenizer)
        sharded = fsdp.is_fsdp(cfg) and rank.world_size > 1
        if sharded:
            fsdp.prepare(device)
            model_loading.loaded_base_quant(
                loaded
            )  # the adapter's metadata, read from the base before it is sharded
            fsdp.shard_4bit_as_compute_dtype(loaded.model, getattr(torch, loaded.facts.compute_dtype))
            fsdp.shard_nf4_experts(loaded.model)
        resume_dir = None
        if spec.resume_from:
            artifacts.verify(spec.resume_from)
            resume_dir = artifacts.path_of(spec.resume_from)
        ignored = frozen_names(loaded.model)
        loaded.model._ddp_params_and_buffers_to_ignore = ignored
        synced = [n for n, p in loaded.model.named_parameters() if p.requires_grad]
        if sharded:
            text = (
                f"FSDP2 over {rank.world_size} processes shards the frozen base and {len(synced)} adapter tensors; "
                "rank 0 writes the adapter whole"
            )
        elif rank.world_size > 1:
            text = (
                f"DDP over {rank.world_size} processes synchronises {len(synced)} adapter tensors; "
                f"{len(ignored)} frozen tensors and buffers are left alone"
            )
        else:
            text = f"one process: {len(synced)} adapter tensors train"
        emit(log=LogMessage("info", text))
        tenant = spec.tenant

        def on_step(m: StepMetrics) -> None:
            nonlocal reached
            reached = m.step
            emit(step=m)

        def on_checkpoint(step: int, path: Path) -> None:
            if rank.is_main:
                ckpt = publish_checkpoint(
                    artifacts, loaded, tenant=tenant, job_id=spec.job_id, step=step, path=path
                )
                emit(checkpoint=ckpt)

        def on_start(total: int) -> None:
            if sharded:  # the engine has sharded the model by now
                held, whole = fsdp.base_bytes_held(loaded.model)
                emit(
                    log=LogMessage(
                        "info", f"FSDP2: this rank holds {held:,} of the frozen base's {whole:,} bytes"
                    )
                )
                held, whole = fsdp.nf4_expert_bytes_held(loaded.model)
                if whole:
                    emit(
                        log=LogMessage(
                            "info", f"FSDP2: this rank holds {held:,} of the NF4 experts' {whole:,} bytes"
                        )
                    )

        sinks = training.Sinks(on_step=on_step, on_checkpoint=on_checkpoint, on_start=on_start)
        callbacks = [_stop_agreement(control, device, rank.world_size, stop_file)]
        # one scratch directory a rank: a rank that finishes first removes its own, never one rank 0 still reads
        scratch = work_dir / f"rank-{rank.rank}"
        step = training.run_training(
            loaded, ds.rows, ds.format, cfg, scratch, control, sinks, resume_dir, callbacks
        )
        if sharded:
            fsdp.unshard_adapter(loaded.model)  # every rank: a collective
        if rank.is_main:
            adapter = publish_adapter(
                artifacts,
                loaded,
                tenant=tenant,
                artifact_id=None,
                metadata={"job_id": spec.job_id, "step": str(step), "world_size": str(rank.world_size)},
            )
            emit(adapter=adapter)
        if control.stop is None:
            state, message = JobState.SUCCEEDED, f"finished at step {step}"
        elif control.stop.reason == "cancel":
            state, message = JobState.CANCELLED, f"cancelled at step {step}"
        else:
            state, message = JobState.INTERRUPTED, f"stopped at step {step}"
        emit(state=StateChange(state, message))
        return state
    except Exception as exc:
        if rank.world_size > 1 and (lost_peer(exc) or terminated.is_set()):
            # a peer is gone (or torchrun is stopping this rank because one is): its failure, if it recorded
            # one, is the job's; this rank's own exception is only the consequence
            peer = _peer_failure(rank.world_size)
            if peer is not None:
                emit(state=StateChange(JobState.FAILED, f"rank {peer.rank}: {peer.message}"))
                return JobState.FAILED
            log.warning("rank %d: a peer rank is gone: %s", rank.rank, _first_line(exc))
            emit(state=StateChange(JobState.INTERRUPTED, f"a peer rank was lost after step {reached}"))
            raise PeerLost(str(exc)) from exc
        message, code = failure_of(exc)
        failure = RankFailure(rank=rank.rank, message=message, code=code, time=time.time())
        record_failure(work_dir, failure)
        if rank.world_size > 1:
            _share_failure(failure)
        emit(state=StateChange(JobState.FAILED, message))
        raise
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _first_line(exc: BaseException) -> str:
    return (str(exc).splitlines() or [type(exc).__name__])[0]


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
    try:
        state = run(
            spec,
            model_root=Path(a.model_root),
            artifact_root=Path(a.artifact_root),
            data_root=Path(a.data_root),
            work_dir=Path(a.work_dir) / (spec.job_id or "job"),
            events_path=a.events,
            stop_file=Path(a.stop_file) if a.stop_file else None,
        )
    except PeerLost as exc:
        log.warning("stopped: a peer rank was lost (%s)", _first_line(exc))
        sys.exit(EXIT_LOST_PEER)
    sys.exit(0 if state is not JobState.FAILED else 1)


if __name__ == "__main__":
    main()
