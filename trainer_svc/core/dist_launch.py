"""A session's job on several devices of this node: torchrun launches ``strop.trainer_svc.dist_worker`` ranks.

The job's ``num_devices`` > 1 makes ``Jobs`` run it here instead of in the session's process. The ranks load
the session's base and adapter configuration themselves (each its own copy, on its own device), train with
DDP, and rank 0 publishes the checkpoints and the adapter; this side follows rank 0's event file (one JSON
``JobEvent`` a line) into the job's events, stops every rank between steps by writing the stop file
(``cancel`` or ``interrupt``), and when the job is over loads the trained adapter into the session, so the
session's Generate and SaveAdapter see what the ranks trained.

How a job on ranks ends when a rank does not finish. A rank whose training raises (bad data only it sees, its
device out of memory) records the failure (``RankFailure``: its message and gRPC code, as ``jobs.failure_of``
gives them) in the job's ``failures`` directory before it exits; its peers' collectives then fail, which they
take for a lost peer, not a failure of their own (``dist_worker.lost_peer``). The job ends FAILED with the first
recorded failure (``RankFailed``). A rank that dies without a record (SIGKILL: the OOM killer, a lost node)
makes torchrun stop the others (SIGTERM, SIGKILL 30 s later) and exit non-zero: the job ends INTERRUPTED
(``RanksLost``) with the last checkpoint rank 0 published, which it resumes from; never SUCCEEDED, even when
rank 0 reached the last step, since its peers' share of the steps is not accounted for.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from strop.common import serde
from strop.common.artifacts import ArtifactStore, key_for
from strop.common.errors import FailedPrecondition
from strop.common.trainer_types import (
    Artifact,
    Checkpoint,
    DatasetFormat,
    JobEvent,
    JobState,
    KernelMode,
    LoadModelRequest,
    LoraConfig,
    Quantization,
    TrainConfig,
)

if TYPE_CHECKING:
    from strop.trainer_svc.core.model_loading import LoadedModel
    from strop.trainer_svc.core.sessions import Session
    from strop.trainer_svc.core.training import JobControl

POLL_SECONDS = 0.2
STOP_GRACE_SECONDS = 120.0  # a stop waits for the step in flight; past this the ranks are killed


@dataclass
class RankFailure:
    """What a rank that failed records (``failures/rank-<N>.json`` in the job's work dir): how the job fails."""

    rank: int = 0
    message: str = ""
    code: str = "INTERNAL"  # the gRPC status code the job's error carries
    time: float = 0.0


class RankFailed(Exception):
    """A rank's training failed; the job fails with that rank's message and code."""

    def __init__(self, failure: RankFailure) -> None:
        super().__init__(f"rank {failure.rank}: {failure.message}")
        self.grpc_code = failure.code


class RanksLost(Exception):
    """A rank died without a failure of its own (killed); the job is INTERRUPTED at its last checkpoint."""

    def __init__(
        self, message: str, step: int, checkpoint: Checkpoint | None, launcher_tail: str = ""
    ) -> None:
        super().__init__(message)
        # the launcher log's last lines: the job's work directory, the log with it, is removed when the job ends
        self.step, self.checkpoint, self.launcher_tail = step, checkpoint, launcher_tail


FAILURES_DIR = "failures"


def record_failure(job_work_dir: Path, failure: RankFailure) -> None:
    """A rank's failure, written atomically (the launcher may read the directory while ranks exit)."""
    out = job_work_dir / FAILURES_DIR
    out.mkdir(parents=True, exist_ok=True)
    tmp = out / f".rank-{failure.rank}.json.tmp"
    tmp.write_text(json.dumps(serde.to_dict(failure)))
    tmp.replace(out / f"rank-{failure.rank}.json")


def read_failures(job_work_dir: Path) -> list[RankFailure]:
    """The recorded rank failures, first to fail first."""
    found = [
        serde.from_dict(RankFailure, json.loads(f.read_text()))
        for f in sorted((job_work_dir / FAILURES_DIR).glob("rank-*.json"))
    ]
    return sorted(found, key=lambda f: f.time)


# How a rank exits when it stopped because a peer was lost (EX_TEMPFAIL: the job resumes from its checkpoint);
# this side tells such a consequence from the rank that was lost by it.
EXIT_LOST_PEER = 75
_SIGTERM = -15  # how torchrun stops the ranks still running once one has died

# torchrun's summary of a failed run: a block for each rank that failed, "rank : 1 (local_rank: 1)" then
# "exitcode : -9 (pid: 123)  (SIGKILL)", under "Failures:" and "Root Cause (first observed failure):"
_FAILURE = re.compile(
    r"rank\s*:\s*(\d+) \(local_rank[^\n]*\n\s*exitcode\s*:\s*(-?\d+)[^\n(]*(?:\(pid: \d+\))?[ \t]*(\(\w+\))?"
)


def lost_rank_summary(launcher_log: str) -> str:
    """Which rank was lost, and how ("rank 1 exited with SIGKILL"), from torchrun's failure summary.

    torchrun's root cause is the failure with the earliest timestamp, in whole seconds, the lower rank on a tie.
    When rank 0 notices the lost peer in a collective and exits ``EXIT_LOST_PEER`` before torchrun's next poll, both
    exits are seen together and rank 0 is named; so a rank that exited as a consequence (``EXIT_LOST_PEER``, or the
    SIGTERM torchrun sends the survivors) is named only when no rank failed otherwise."""
    summary = launcher_log[launcher_log.rfind("Failures:") :] if "Failures:" in launcher_log else ""
    root = summary.find("Root Cause")
    blocks = [m for m in _FAILURE.finditer(summary) if m.start() > root] + [
        m for m in _FAILURE.finditer(summary) if m.start() < root
    ]  # the root cause first, then the others in torchrun's order
    if not blocks:
        return "a rank exited without a failure of its own"
    consequences = (EXIT_LOST_PEER, _SIGTERM)
    rank, code, sig = next((m for m in blocks if int(m.group(2)) not in consequences), blocks[0]).groups()
    return f"rank {rank} exited with " + (sig.strip("()") if sig else f"status {code}")


@dataclass
class DistributedJob:
    """What a distributed job trains: the same request types as the service's LoadModel, AttachLora and Train
    (read from JSON with ``common.serde``). ``dataset_path`` is under the data root; ``resume_from`` is a
    checkpoint artifact's store key (``common.artifacts.key_of``)."""

    job_id: str = ""
    model: LoadModelRequest = field(default_factory=LoadModelRequest)
    lora: LoraConfig = field(default_factory=LoraConfig)
    config: TrainConfig = field(default_factory=TrainConfig)
    dataset_path: str = ""
    dataset_format: DatasetFormat = DatasetFormat.UNSPECIFIED
    resume_from: str = ""
    tenant: str = ""


_QUANTIZATION = {  # a session's facts.quantization → the LoadModel request that reloads it the same way
    "none": Quantization.NONE,
    "bnb-nf4-on-load": Quantization.NF4,
    "bnb-nf4-prequantized": Quantization.UNSPECIFIED,
}


def check_devices(num_devices: int, device: str) -> None:
    """Refuse a job asking for more devices than this node has: CUDA devices, or CPU cores for gloo ranks."""
    if num_devices <= 1:
        return
    if device.startswith("cuda"):
        import torch

        have, what = torch.cuda.device_count(), "CUDA devices"
    else:
        have, what = os.cpu_count() or 1, "CPU cores (one gloo rank each)"
    if num_devices > have:
        raise FailedPrecondition(f"num_devices {num_devices}: this trainer has {have} {what}")


def spec_for(
    sess: Session, job_id: str, cfg: TrainConfig, fmt: DatasetFormat, resume_from: str
) -> DistributedJob:
    loaded = sess.loaded
    facts = loaded.facts
    return DistributedJob(
        job_id=job_id,
        model=LoadModelRequest(
            model_path=loaded.model_rel,
            quantization=_QUANTIZATION[facts.quantization],
            dtype=facts.compute_dtype,
            max_seq_length=facts.max_seq_length,
            kernels=(loaded.fp8_kernels or KernelMode.ON) if facts.kernels_enabled else KernelMode.OFF,
        ),
        lora=loaded.lora,
        config=cfg,
        dataset_path="rows.jsonl",
        dataset_format=fmt,
        resume_from=resume_from,
        tenant=sess.info.tenant,
    )


def run_distributed(
    sess: Session,
    job_id: str,
    cfg: TrainConfig,
    fmt: DatasetFormat,
    rows: list[dict],
    control: JobControl,
    resume_dir: Path | None,
    *,
    work_dir: Path,
    artifacts: ArtifactStore,
    model_root: Path,
    on_event: Callable[[JobEvent], None],
) -> tuple[int, Artifact]:
    """Launch ``cfg.num_devices`` ranks with torchrun and follow rank 0's events until they exit.

    Returns:
        The step reached and the adapter rank 0 published.

    Raises:
        RankFailed: a rank's training failed (the first to fail: its message and code).
        RanksLost: a rank died without a failure of its own (killed); the session then holds the adapter of the
            last checkpoint, the one the job resumes from.
        RuntimeError: the ranks failed before any could record why (the launcher's exit status and log tail).
    """
    work_dir.mkdir(parents=True, exist_ok=True)
    (work_dir / "data").mkdir(exist_ok=True)
    with open(work_dir / "data" / "rows.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")
    spec = spec_for(sess, job_id, cfg, fmt, artifacts.key_at(resume_dir) if resume_dir else "")
    (work_dir / "spec.json").write_text(json.dumps(serde.to_dict(spec)))
    events, stop_file, log_path = work_dir / "events.jsonl", work_dir / "stop", work_dir / "ranks.log"
    events.touch()
    argv = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={cfg.num_devices}",
        "-m",
        "strop.trainer_svc.dist_worker",
        "--spec",
        str(work_dir / "spec.json"),
        "--model-root",
        str(model_root),
        "--artifact-root",
        str(artifacts.root),
        "--data-root",
        str(work_dir / "data"),
        "--work-dir",
        str(work_dir / "ranks"),
        "--events",
        str(events),
        "--stop-file",
        str(stop_file),
    ]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env["STROP_LAUNCHER_PID"] = str(os.getpid())  # the ranks stop (checkpointed) if this service dies
    with open(log_path, "w") as log_file:
        proc = subprocess.Popen(
            argv, env=env, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True
        )
    step, adapter, final, stop_asked_at, pending, checkpoint = 0, None, None, None, "", None
    with open(events) as follow:
        while True:
            exited = proc.poll() is not None
            *lines, pending = (pending + follow.read()).split("\n")  # whole lines only
            for line in lines:
                event = serde.from_dict(JobEvent, json.loads(line))
                event.job_id, event.seq = job_id, 0  # the job's store numbers its events
                if event.step is not None:
                    step = event.step.step
                if event.checkpoint is not None:
                    step, checkpoint = max(step, event.checkpoint.step), event.checkpoint
                if event.adapter is not None:
                    adapter = event.adapter
                if event.state is not None:
                    final = event.state
                    continue  # the job's own state changes are Jobs' to make
                on_event(event)
            if exited:
                break
            if control.stop is not None and stop_asked_at is None:
                stop_file.write_text(control.stop.reason)
                stop_asked_at = time.monotonic()
            if stop_asked_at is not None and time.monotonic() - stop_asked_at > STOP_GRACE_SECONDS:
                proc.kill()
            time.sleep(POLL_SECONDS)
    failures = read_failures(work_dir / "ranks" / job_id)
    if failures:
        raise RankFailed(failures[0])
    if proc.returncode != 0 or adapter is None:
        if final is not None and final.state is JobState.FAILED:
            raise RuntimeError(f"rank 0: {final.message}")
        if proc.returncode == 0 or final is None:
            # rank 0 never started (torchrun failed), or ended well without an adapter: not a resumable stop
            tail = log_path.read_text()[-2000:]
            raise RuntimeError(f"the distributed ranks exited with status {proc.returncode}: {tail}")
        launcher_log = log_path.read_text()[-20_000:]
        lost = lost_rank_summary(launcher_log)
        if checkpoint is not None:
            load_adapter_into_session(sess.loaded, artifacts.path_of(key_for(checkpoint.artifact)))
            resume = f"resume from the checkpoint at step {checkpoint.step}"
        else:
            resume = "no checkpoint to resume from"
        tail = "\n".join(launcher_log.splitlines()[-40:])
        raise RanksLost(f"{lost} at step {step}; {resume}", step, checkpoint, tail)
    load_adapter_into_session(sess.loaded, artifacts.path_of(key_for(adapter)))
    return step, adapter


def load_adapter_into_session(loaded: LoadedModel, adapter_dir: Path) -> None:
    """The ranks' trained adapter weights into the session's PEFT model (same LoRA configuration)."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    state = load_file(str(adapter_dir / "adapter_model.safetensors"), device=loaded.device)
    result = set_peft_model_state_dict(loaded.model, state)
    unexpected = list(getattr(result, "unexpected_keys", []) or [])
    if unexpected:
        raise RuntimeError(f"the ranks' adapter has tensors the session's does not: {unexpected[:4]}")
