"""TrainerCore: sessions, datasets, jobs and artifacts, without any gRPC.

Jobs run in their own threads and outlive any stream; every event is stored before it is shown, so a
watcher that re-attaches with ``after_seq`` misses nothing. One job at a time runs on a session.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from strop.common.artifacts import ArtifactStore
from strop.common.paths import confine
from strop.common.trainer_types import (
    RESUMABLE_STATES,
    Artifact,
    Checkpoint,
    DatasetFormat,
    DatasetInfo,
    JobEvent,
    JobInfo,
    JobState,
    LoadModelRequest,
    LogMessage,
    LoraConfig,
    SessionInfo,
    SessionState,
    StepMetrics,
    TrainConfig,
    TrainMethod,
)
from strop.trainer_svc.core import engine, models
from strop.trainer_svc.core.datasets import Limits, validate_jsonl
from strop.trainer_svc.core.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
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
    dataset_limits: Limits = field(default_factory=Limits)


@dataclass
class _Session:
    info: SessionInfo
    loaded: models.LoadedModel
    lock: threading.RLock = field(default_factory=threading.RLock)


@dataclass
class _RunningJob:
    job_id: str
    control: engine.JobControl
    thread: threading.Thread


class TrainerCore:
    def __init__(self, config: TrainerConfig):
        self.config = config
        for p in (config.model_root, config.artifact_root, config.state_dir):
            Path(p).mkdir(parents=True, exist_ok=True)
        self.store = TrainerStore(config.state_dir)
        self.artifacts = ArtifactStore(config.artifact_root)
        self.device = models.pick_device(config.device)
        self._sessions: dict[str, _Session] = {}
        self._jobs: dict[str, _RunningJob] = {}
        self._lock = threading.RLock()
        self._datasets_dir = Path(config.state_dir) / "datasets"
        self._datasets_dir.mkdir(exist_ok=True)
        interrupted = self.store.recover_after_restart()
        if interrupted:
            log.warning("marked %d job(s) INTERRUPTED after restart: %s", len(interrupted), interrupted)

    # sessions
    def load_model(self, req: LoadModelRequest) -> SessionInfo:
        with self._lock:
            open_sessions = sum(
                1
                for s in self._sessions.values()
                if s.info.state in (SessionState.LOADED, SessionState.READY)
            )
            if open_sessions >= self.config.max_sessions:
                raise ResourceExhausted(
                    f"{open_sessions} sessions are open (limit {self.config.max_sessions}); close one first"
                )
        loaded = models.load_model(req, model_root=Path(self.config.model_root), device=self.device)
        info = SessionInfo(
            session_id=f"sess-{uuid.uuid4().hex[:12]}",
            name=req.name,
            state=SessionState.LOADED,
            facts=loaded.facts,
            created_at=time.time(),
        )
        with self._lock:
            self._sessions[info.session_id] = _Session(info, loaded)
        self.store.put_session(info)
        log.info(
            "session %s: loaded %s (%s, %s)",
            info.session_id,
            loaded.facts.model_path,
            loaded.facts.quantization,
            loaded.facts.kernels_reason,
        )
        return info

    def _open_session(self, session_id: str) -> _Session:
        with self._lock:
            sess = self._sessions.get(session_id)
        if sess is None:
            stored = self.store.get_session(session_id)  # NotFound for unknown ids
            if stored.state is SessionState.LOST:
                raise FailedPrecondition(
                    f"session {session_id} was lost when the service restarted; load the model again"
                )
            raise FailedPrecondition(f"session {session_id} is {stored.state.value.lower()}")
        if sess.info.state is SessionState.CLOSED:
            raise FailedPrecondition(f"session {session_id} is closed")
        return sess

    def _idle_session(self, session_id: str) -> _Session:
        sess = self._open_session(session_id)
        if sess.info.busy_job_id:
            raise FailedPrecondition(f"session {session_id} is busy with job {sess.info.busy_job_id}")
        return sess

    def attach_lora(self, session_id: str, lora: LoraConfig) -> SessionInfo:
        sess = self._idle_session(session_id)
        with sess.lock:
            models.attach_lora(sess.loaded, lora)
            sess.info.lora = sess.loaded.lora
            sess.info.facts = sess.loaded.facts
            sess.info.state = SessionState.READY
            self.store.put_session(sess.info)
        return sess.info

    def get_session(self, session_id: str) -> SessionInfo:
        with self._lock:
            sess = self._sessions.get(session_id)
        return sess.info if sess else self.store.get_session(session_id)

    def list_sessions(self, include_closed: bool = False) -> list[SessionInfo]:
        out = []
        for stored in self.store.list_sessions():
            info = self.get_session(stored.session_id)
            if include_closed or info.state in (SessionState.LOADED, SessionState.READY):
                out.append(info)
        return out

    def close_session(self, session_id: str) -> SessionInfo:
        sess = self._idle_session(session_id)
        with sess.lock:
            models.release(sess.loaded)
            sess.info.state = SessionState.CLOSED
            sess.info.facts.device_memory_bytes = 0
            self.store.put_session(sess.info)
        with self._lock:
            self._sessions.pop(session_id, None)
        return sess.info

    def generate(
        self,
        session_id: str,
        prompts: list[str],
        *,
        max_new_tokens: int = 64,
        disable_adapter: bool = False,
        apply_chat_template: bool = False,
    ) -> list[str]:
        sess = self._idle_session(session_id)
        with sess.lock:
            return models.generate(
                sess.loaded,
                prompts,
                max_new_tokens=max_new_tokens or 64,
                disable_adapter=disable_adapter,
                apply_chat_template=apply_chat_template,
            )

    def save_adapter(self, session_id: str, name: str = "") -> Artifact:
        sess = self._idle_session(session_id)
        if sess.loaded.lora is None:
            raise FailedPrecondition(f"session {session_id} has no adapter; call AttachLora first")
        with sess.lock:
            return self._publish_adapter(sess, artifact_id=name or None, metadata={"session_id": session_id})

    def _publish_adapter(
        self, sess: _Session, *, artifact_id: str | None, metadata: dict[str, str]
    ) -> Artifact:
        meta = {**models.adapter_metadata(sess.loaded), **metadata}
        with self.artifacts.create("adapter", artifact_id=artifact_id, metadata=meta) as pending:
            models.write_adapter(sess.loaded, pending.dir)
        return self.artifacts.get(pending.artifact_id)

    # datasets
    def upload_dataset(self, name: str, fmt: DatasetFormat, chunks: Iterable[bytes]) -> DatasetInfo:
        validated = validate_jsonl(chunks, fmt, self.config.dataset_limits)
        info = DatasetInfo(
            dataset_id=f"ds-{uuid.uuid4().hex[:12]}",
            name=name,
            format=validated.format,
            num_rows=len(validated.rows),
            size_bytes=validated.size_bytes,
            sha256=validated.sha256,
            created_at=time.time(),
        )
        path = self._datasets_dir / f"{info.dataset_id}.jsonl"
        tmp = path.with_suffix(".tmp")
        with open(tmp, "w") as f:
            for row in validated.rows:
                f.write(json.dumps(row, ensure_ascii=False) + "\n")
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        self.store.put_dataset(info, str(path))
        return info

    def register_dataset(self, path: str, name: str, fmt: DatasetFormat) -> DatasetInfo:
        if self.config.data_root is None:
            raise FailedPrecondition("this service has no data root; upload the dataset instead")
        src = confine(self.config.data_root, path, what="dataset path")
        if not src.is_file():
            raise InvalidArgument(f"dataset path {path!r} is not a file")

        def chunks() -> Iterator[bytes]:
            with open(src, "rb") as f:
                while block := f.read(1 << 20):
                    yield block

        return self.upload_dataset(name or src.name, fmt, chunks())

    def get_dataset(self, dataset_id: str) -> DatasetInfo:
        return self.store.get_dataset(dataset_id)[0]

    def list_datasets(self) -> list[DatasetInfo]:
        return self.store.list_datasets()

    def _dataset_rows(self, dataset_id: str) -> tuple[DatasetInfo, list[dict]]:
        info, path = self.store.get_dataset(dataset_id)
        with open(path) as f:
            return info, [json.loads(line) for line in f if line.strip()]

    # jobs
    def start_job(
        self,
        session_id: str,
        dataset_id: str,
        config: TrainConfig | None,
        *,
        resume_from_job_id: str = "",
        name: str = "",
    ) -> JobInfo:
        """Validate everything, create the job and start its thread; errors leave nothing behind."""
        resume_dir = None
        if resume_from_job_id:
            prev = self.store.get_job(resume_from_job_id)
            if prev.state not in RESUMABLE_STATES:
                raise FailedPrecondition(
                    f"job {resume_from_job_id} is {prev.state.value}; only a finished job "
                    "(cancelled, interrupted, failed or succeeded) can be resumed"
                )
            if prev.last_checkpoint is None or prev.last_checkpoint.artifact is None:
                raise FailedPrecondition(f"job {resume_from_job_id} has no checkpoint to resume from")
            ckpt_id = prev.last_checkpoint.artifact.artifact_id
            self.artifacts.verify(ckpt_id)
            resume_dir = self.artifacts.path_of(ckpt_id)
            dataset_id = dataset_id or prev.dataset_id
            if config is None or config.method is TrainMethod.UNSPECIFIED:
                config = prev.config
        if config is None:
            raise InvalidArgument("config is required (method SFT or DPO)")
        if not dataset_id:
            raise InvalidArgument("dataset_id is required")
        sess = self._open_session(session_id)  # busy is checked last, under the lock
        if sess.loaded.lora is None:
            raise FailedPrecondition(f"session {session_id} has no adapter; call AttachLora first")
        ds_info, rows = self._dataset_rows(dataset_id)
        cfg = engine.with_defaults(config, session_max_len=sess.info.facts.max_seq_length)
        engine.check_dataset_fits(cfg.method, ds_info.format, rows, sess.info.facts.vocab_size)
        if resume_from_job_id:
            self._check_resume_compatible(sess, resume_dir)
        job = JobInfo(
            job_id=f"job-{uuid.uuid4().hex[:12]}",
            session_id=session_id,
            dataset_id=dataset_id,
            name=name,
            state=JobState.QUEUED,
            config=cfg,
            resumed_from_job_id=resume_from_job_id,
            created_at=time.time(),
        )
        with self._lock:
            if sess.info.busy_job_id:
                raise FailedPrecondition(f"session {session_id} is busy with job {sess.info.busy_job_id}")
            sess.info.busy_job_id = job.job_id
            self.store.insert_job(job)
            self.store.put_session(sess.info)
            self.store.append_event(
                JobEvent(
                    job_id=job.job_id,
                    log=LogMessage(
                        "info",
                        f"{cfg.method.value} on {ds_info.num_rows} {ds_info.format.value.lower()} rows"
                        + (
                            f", resuming job {resume_from_job_id} from step {prev.last_checkpoint.step}"
                            if resume_from_job_id
                            else ""
                        ),
                    ),
                )
            )
            control = engine.JobControl()
            thread = threading.Thread(
                target=self._run_job,
                name=f"strop-{job.job_id}",
                args=(sess, job.job_id, cfg, ds_info.format, rows, control, resume_dir),
                daemon=True,
            )
            self._jobs[job.job_id] = _RunningJob(job.job_id, control, thread)
            thread.start()
        return self.store.get_job(job.job_id)

    def _check_resume_compatible(self, sess: _Session, ckpt_dir: Path) -> None:
        cfg_path = ckpt_dir / "adapter_config.json"
        if not cfg_path.is_file():
            raise FailedPrecondition("the checkpoint holds no adapter_config.json")
        saved = json.loads(cfg_path.read_text())
        lora = sess.loaded.lora
        if int(saved.get("r", -1)) != lora.r or sorted(saved.get("target_modules") or []) != sorted(
            lora.target_modules
        ):
            raise FailedPrecondition(
                f"the checkpoint's adapter (r={saved.get('r')}, targets={sorted(saved.get('target_modules') or [])}) "
                f"does not match the session's (r={lora.r}, targets={sorted(lora.target_modules)})"
            )

    def _run_job(
        self,
        sess: _Session,
        job_id: str,
        cfg: TrainConfig,
        fmt: DatasetFormat,
        rows: list[dict],
        control: engine.JobControl,
        resume_dir: Path | None,
    ) -> None:
        import torch

        work_dir = Path(self.config.state_dir) / "work" / job_id
        sinks = engine.Sinks(
            on_step=lambda m: self._on_step(job_id, m),
            on_checkpoint=lambda step, path: self._on_checkpoint(sess, job_id, step, path),
            on_start=lambda total: self.store.update_job(job_id, total_steps=total),
        )
        try:
            with sess.lock:
                self.store.transition(job_id, JobState.RUNNING)
                step = engine.run_training(sess.loaded, rows, fmt, cfg, work_dir, control, sinks, resume_dir)
                adapter = self._publish_adapter(
                    sess, artifact_id=None, metadata={"job_id": job_id, "step": str(step)}
                )
            self.store.append_event(JobEvent(job_id=job_id, adapter=adapter), adapter=adapter)
            if control.stop is None:
                outcome = JobState.SUCCEEDED, f"finished at step {step}"
            elif control.stop.reason == "cancel":
                outcome = JobState.CANCELLED, f"cancelled at step {step}"
            else:
                outcome = JobState.INTERRUPTED, f"service shutting down; stopped at step {step}"
        except torch.OutOfMemoryError as exc:
            log.warning("job %s: out of device memory", job_id)
            outcome = JobState.FAILED, f"out of device memory: {str(exc).splitlines()[0]}"
        except Exception as exc:
            log.exception("job %s failed", job_id)
            outcome = JobState.FAILED, f"{type(exc).__name__}: {exc}"
        finally:
            shutil.rmtree(work_dir, ignore_errors=True)
            if sess.loaded.device.startswith("cuda"):
                torch.cuda.empty_cache()
            # The session is free before the terminal event, so a client that saw the job end can reuse it.
            with self._lock:
                sess.info.busy_job_id = ""
                if sess.info.state is not SessionState.CLOSED:
                    self.store.put_session(sess.info)
                self._jobs.pop(job_id, None)
        self.store.transition(job_id, *outcome)

    def _on_step(self, job_id: str, m: StepMetrics) -> None:
        self.store.append_event(
            JobEvent(job_id=job_id, step=m), step=m.step, total_steps=m.total_steps, last_loss=m.loss
        )

    def _on_checkpoint(self, sess: _Session, job_id: str, step: int, path: Path) -> None:
        meta = {**models.adapter_metadata(sess.loaded), "job_id": job_id, "step": str(step)}
        with self.artifacts.create("checkpoint", metadata=meta) as pending:
            for src in path.rglob("*"):
                if src.is_file():
                    dst = pending.dir / src.relative_to(path)
                    dst.parent.mkdir(parents=True, exist_ok=True)
                    shutil.copy2(src, dst)
            models.copy_tokenizer_files(sess.loaded.model_dir, pending.dir)
        ckpt = Checkpoint(step=step, artifact=self.artifacts.get(pending.artifact_id))
        self.store.append_event(JobEvent(job_id=job_id, checkpoint=ckpt), last_checkpoint=ckpt)

    def watch(
        self,
        job_id: str,
        after_seq: int = 0,
        *,
        is_active: Callable[[], bool] = lambda: True,
        poll_seconds: float = 1.0,
    ) -> Iterator[JobEvent]:
        """Every event with seq > after_seq, in order, then new ones as they come, until the job ends."""
        if after_seq < 0:
            raise InvalidArgument(f"after_seq must be >= 0, got {after_seq}")
        self.store.get_job(job_id)  # NotFound
        seq = after_seq
        while True:
            events = self.store.events_after(job_id, seq)
            for e in events:
                yield e
                seq = e.seq
            if events:
                continue
            with self.store.changed:
                job = self.store.get_job(job_id)
                if job.last_seq > seq:
                    continue
                if job.state.terminal or not is_active():
                    return
                self.store.changed.wait(timeout=poll_seconds)

    def get_job(self, job_id: str) -> JobInfo:
        return self.store.get_job(job_id)

    def list_jobs(self, session_id: str = "", states: list[JobState] | None = None) -> list[JobInfo]:
        return self.store.list_jobs(session_id, states)

    def cancel_job(self, job_id: str) -> JobInfo:
        job = self.store.get_job(job_id)
        if job.state.terminal:
            raise FailedPrecondition(f"job {job_id} already ended ({job.state.value})")
        with self._lock:
            running = self._jobs.get(job_id)
        if running is not None:
            running.control.request_stop("cancel")
        return self.store.get_job(job_id)

    def wait_job(self, job_id: str, timeout: float | None = None) -> JobInfo:
        with self._lock:
            running = self._jobs.get(job_id)
        if running is not None:
            running.thread.join(timeout)
        return self.store.get_job(job_id)

    # artifacts
    def get_artifact(self, artifact_id: str) -> Artifact:
        return self.artifacts.get(artifact_id)

    def list_artifacts(self, kind: str = "") -> list[Artifact]:
        return self.artifacts.list(kind or None)

    def artifact_chunks(self, artifact_id: str, chunk_bytes: int = 0):
        return self.artifacts.iter_chunks(artifact_id, chunk_bytes or (1 << 20))

    # lifecycle
    def drain(self, grace_seconds: float) -> bool:
        """Stop running jobs at their next step boundary (checkpointing them as INTERRUPTED).

        Returns:
            True when every job stopped within ``grace_seconds``; False when some are still running (the
            caller must not close the store under them; a restart marks them INTERRUPTED).
        """
        with self._lock:
            running = list(self._jobs.values())
        for r in running:
            r.control.request_stop("interrupt")
        deadline = time.monotonic() + grace_seconds
        for r in running:
            r.thread.join(max(0.0, deadline - time.monotonic()))
        stuck = [r.job_id for r in running if r.thread.is_alive()]
        if stuck:
            log.error(
                "drain: jobs %s did not reach a step boundary within %.0fs", ", ".join(stuck), grace_seconds
            )
        return not stuck

    def close(self) -> None:
        self.store.db.close()
