"""Jobs: one SFT or DPO run on a session, in its own thread, outliving any stream.

Every event is stored before it is shown, so a watcher that re-attaches with ``after_seq`` misses nothing. One
job at a time runs on a session (it holds the session's lock); ``drain`` stops them at a step boundary.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import json
import logging
import shutil
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path

from strop.common import auth, logs
from strop.common.artifacts import ArtifactStore, key_for
from strop.common.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from strop.common.metrics import TrainerMetrics
from strop.common.paths import private_paths, scrub_paths
from strop.common.signals import follow_blocking
from strop.common.trainer_types import (
    RESUMABLE_STATES,
    Checkpoint,
    DatasetFormat,
    JobEvent,
    JobInfo,
    JobState,
    LogMessage,
    Retention,
    SessionState,
    StepMetrics,
    TrainConfig,
    TrainMethod,
)
from strop.trainer_svc.core import (
    adapter_state,
    dist_launch,
    fsdp,
    job_config,
    loss_curve,
    model_loading,
    training,
    validation,
)
from strop.trainer_svc.core.datasets import Datasets
from strop.trainer_svc.core.guard import BrokenTraining
from strop.trainer_svc.core.sessions import Session, Sessions
from strop.trainer_svc.core.store import TrainerStore

log = logging.getLogger("strop.trainer")


def publish_checkpoint(
    artifacts: ArtifactStore,
    loaded: model_loading.LoadedModel,
    *,
    tenant: str,
    job_id: str,
    step: int,
    path: Path,
) -> Checkpoint:
    """Copy the checkpoint directory HF wrote at ``step`` into the store (a job's, or a distributed job's rank
    0's, ``dist_worker``), with the base's tokenizer files and metadata."""
    adapter_state.check_finite(loaded, f"the checkpoint at step {step}")
    meta = {**model_loading.adapter_metadata(loaded), "job_id": job_id, "step": str(step)}
    with artifacts.create("checkpoint", owner=tenant, metadata=meta) as pending:
        for src in path.rglob("*"):
            if src.is_file():
                dst = pending.dir / src.relative_to(path)
                dst.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dst)
        model_loading.copy_tokenizer_files(loaded.model_dir, pending.dir)
        if loaded.facts.quantization == "bnb-nf4-on-load":  # exports from a checkpoint are exact too
            model_loading.write_nf4_stats(loaded.model, pending.dir / model_loading.NF4_STATS_FILE)
        model_loading.write_base_record(
            pending.dir, meta
        )  # the directory alone says what base it was trained on
    return Checkpoint(step=step, artifact=artifacts.get(pending.key))


def failure_of(exc: BaseException) -> tuple[str, str]:
    """How a job whose training raised ``exc`` ends FAILED: its message and gRPC code (a job on ranks: the
    first failed rank's, ``dist_launch.RankFailed``; each rank describes its own failure with this too)."""
    import torch

    if isinstance(exc, torch.OutOfMemoryError):
        return f"out of device memory: {str(exc).splitlines()[0]}", "RESOURCE_EXHAUSTED"
    if isinstance(exc, BrokenTraining):
        return f"BrokenTraining: {exc}", exc.code
    if isinstance(exc, dist_launch.RankFailed):
        return str(exc), exc.grpc_code
    return f"{type(exc).__name__}: {exc}", getattr(exc, "grpc_code", "INTERNAL")


@dataclass
class _RunningJob:
    job_id: str
    control: training.JobControl
    thread: threading.Thread


class Jobs:
    """The device's job scheduler: jobs start in the order they were accepted, one at a time; up to
    ``max_queued`` wait QUEUED, beyond that a Train is RESOURCE_EXHAUSTED. A queued job can be cancelled (it
    ends CANCELLED without running) and shows its place in the queue (``JobInfo.queue_position``).

    One at a time is a correctness requirement, not a tuning choice: accelerate's ``AcceleratorState`` is
    process-wide, and a second TRL trainer built while a first one trains resets it under the first (seen here:
    ``AttributeError: 'AcceleratorState' object has no attribute 'distributed_type'`` in the running job). More
    jobs at once means more trainer processes (pods), each with its own device.
    """

    def __init__(
        self,
        store: TrainerStore,
        artifacts: ArtifactStore,
        sessions: Sessions,
        datasets: Datasets,
        *,
        state_dir: Path,
        max_queued: int = 64,
        metrics: TrainerMetrics | None = None,
    ) -> None:
        if max_queued < 0:
            raise ValueError(f"max_queued must be >= 0, got {max_queued}")
        self.store, self.artifacts, self.sessions, self.datasets = store, artifacts, sessions, datasets
        self.state_dir = Path(state_dir)
        self.max_queued = max_queued
        self.metrics = metrics
        self._jobs: dict[str, _RunningJob] = {}
        self._queue: collections.deque[str] = collections.deque()  # QUEUED jobs, in the order accepted
        self._running = 0
        self._lock = threading.RLock()
        self._turn = threading.Condition(self._lock)
        # full pages of events, shared by the streams that replay the same job (``poll``)
        self._pages: collections.OrderedDict[tuple[str, int, int], list[JobEvent]] = collections.OrderedDict()

    def start(
        self,
        session_id: str,
        dataset_id: str,
        config: TrainConfig | None,
        *,
        resume_from_job_id: str = "",
        name: str = "",
        fail_if_busy: bool = False,
        validation_dataset_id: str = "",
    ) -> JobInfo:
        """Validate everything, create the job and start its thread; errors leave nothing behind.

        A job on a session busy with another one waits QUEUED behind it (in the device's queue, its position in
        ``queue_position``), unless ``fail_if_busy``: then FAILED_PRECONDITION.
        """
        resume_dir = None
        if resume_from_job_id:
            prev = self._visible_job(resume_from_job_id)
            if prev.state not in RESUMABLE_STATES:
                raise FailedPrecondition(
                    f"job {resume_from_job_id} is {prev.state.value}; only a finished job "
                    "(cancelled, interrupted, failed or succeeded) can be resumed"
                )
            if prev.last_checkpoint is None or prev.last_checkpoint.artifact is None:
                raise FailedPrecondition(f"job {resume_from_job_id} has no checkpoint to resume from")
            ckpt_key = key_for(prev.last_checkpoint.artifact)
            self.artifacts.verify(ckpt_key)
            resume_dir = self.artifacts.path_of(ckpt_key)
            dataset_id = dataset_id or prev.dataset_id
            validation_dataset_id = validation_dataset_id or prev.validation_dataset_id
            if config is None or config.method is TrainMethod.UNSPECIFIED:
                config = prev.config
                # stored before retention was resolved: that job ran none, and its resumption goes on the same way
                if config.retention is Retention.UNSPECIFIED:
                    config = replace(config, retention=Retention.NONE)
        if config is None:
            raise InvalidArgument("config is required (its method: SFT, DPO, ORPO, KTO, SIMPO or GRPO)")
        if not dataset_id:
            raise InvalidArgument("dataset_id is required")
        sess = self.sessions.open(session_id)  # busy is checked last, under the lock
        if sess.loaded.lora is None:
            raise FailedPrecondition(f"session {session_id} has no adapter; call AttachLora first")
        ds_info, rows = self.datasets.rows(dataset_id)
        cfg = job_config.with_defaults(
            config, session_max_len=sess.info.facts.max_seq_length, num_rows=len(rows)
        )
        cfg = job_config.with_retention(cfg, ds_info.format, sess.loaded.tokenizer)  # stored as it runs
        job_config.check_dataset_fits(cfg, ds_info.format, rows, sess.info.facts.vocab_size)
        held_out = validation.load(
            self.datasets, validation_dataset_id, cfg, ds_info.format, sess.info.facts.vocab_size
        )
        job_config.check_tools_rendered(rows, sess.loaded.tokenizer)
        if held_out is not None:
            job_config.check_tools_rendered(
                held_out.rows, sess.loaded.tokenizer, f"validation_dataset_id {held_out.dataset_id}: "
            )
        # GRPO: the grader, its templates against every row and the prompt lengths, all before any sampling
        if cfg.method is TrainMethod.GRPO:
            from strop.trainer_svc.core import grpo

            cfg = grpo.check_job(cfg, ds_info.format, rows, sess.loaded.tokenizer, validation=held_out)
            graders = grpo.grader_models(cfg, self.sessions, sess)  # resolved for the caller, here
        else:
            graders = {}
        if cfg.num_nodes > 1:
            raise FailedPrecondition(
                f"num_nodes {cfg.num_nodes}: the trainer service trains on its own node; run a job over several "
                "nodes as a training operator's job (strop.trainer_svc.dist_worker, deploy/k8s/training-operators)"
            )
        dist_launch.check_devices(cfg.num_devices, sess.loaded.device)
        fsdp.check_supported(cfg, fp8=sess.loaded.fp8_kernels is not None)
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
            tenant=sess.info.tenant,
            validation_dataset_id=validation_dataset_id,
        )
        with self._lock:
            if sess.broken:
                raise FailedPrecondition(f"session {session_id}: {sess.broken}")
            if sess.info.state is SessionState.CLOSED:
                raise FailedPrecondition(f"session {session_id} is closed")
            if sess.info.busy_job_id and fail_if_busy:
                raise FailedPrecondition(f"session {session_id} is busy with job {sess.info.busy_job_id}")
            if len(self._queue) >= self.max_queued:
                raise ResourceExhausted(
                    f"{len(self._queue)} jobs are queued for this device (limit {self.max_queued}); retry later"
                )
            sess.jobs.append(job.job_id)
            sess.info.busy_job_id = sess.jobs[0]
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
            control = training.JobControl()
            thread = threading.Thread(
                target=self._run,
                name=f"strop-{job.job_id}",
                args=(sess, job.job_id, cfg, ds_info.format, rows, control, resume_dir, held_out, graders),
                daemon=True,
            )
            self._jobs[job.job_id] = _RunningJob(job.job_id, control, thread)
            self._queue.append(job.job_id)
            thread.start()
        return self.get(job.job_id)

    def queue_length(self) -> int:
        """Jobs waiting QUEUED for this device."""
        with self._lock:
            return len(self._queue)

    def _wait_turn(self, job_id: str, control: training.JobControl) -> bool:
        """Block until the job heads the queue and a slot is free; False if it was stopped while queued."""
        with self._turn:
            while control.stop is None and not (self._queue[0] == job_id and self._running == 0):
                self._turn.wait()
            self._queue.remove(job_id)
            if control.stop is not None:
                self._turn.notify_all()
                return False
            self._running += 1
            return True

    def _release_turn(self) -> None:
        with self._turn:
            self._running -= 1
            self._turn.notify_all()

    @contextlib.contextmanager
    def device_turn(self) -> Iterator[None]:
        """The device for one step-API primitive (``core/runs.py``): it waits while a job runs or is queued
        (a queued job goes first, so a stream of short primitives never starves jobs), and a job waits for it."""
        with self._turn:
            while self._running or self._queue:
                self._turn.wait()
            self._running += 1
        try:
            yield
        finally:
            self._release_turn()

    def _check_resume_compatible(self, sess: Session, ckpt_dir: Path) -> None:
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

    def _run(
        self,
        sess: Session,
        job_id: str,
        cfg: TrainConfig,
        fmt: DatasetFormat,
        rows: list[dict],
        control: training.JobControl,
        resume_dir: Path | None,
        held_out: validation.ValidationSet | None = None,
        graders: dict | None = None,
    ) -> None:
        import torch

        logs.bind(job_id=job_id)  # this thread is the job's: every line it logs carries the id
        work_dir = self.state_dir / "work" / job_id
        sinks = training.Sinks(
            on_step=lambda m: self._on_step(job_id, m),
            on_checkpoint=lambda step, path: self._on_checkpoint(sess, job_id, step, path),
            on_start=lambda total: self.store.update_job(job_id, total_steps=total),
            on_retention=lambda m: self.store.append_event(JobEvent(job_id=job_id, retention=m)),
            on_eval=lambda m: self.store.append_event(JobEvent(job_id=job_id, eval=m), last_eval=m),
        )
        if not self._wait_turn(job_id, control):
            self._free_session(sess, job_id)
            if control.stop.reason == "cancel":
                state, message = JobState.CANCELLED, "cancelled while queued"
            else:
                state, message = JobState.INTERRUPTED, "service shutting down; the job had not started"
            if self.metrics is not None:
                self.metrics.on_finished(state.value)
            self.store.transition(job_id, state, message)
            return
        outcome, before = None, None
        try:
            with sess.lock:
                self.store.transition(job_id, JobState.RUNNING)
                before = adapter_state.snapshot(sess.loaded)  # what a FAILED job leaves the session with
                if cfg.num_devices > 1:  # torchrun's ranks train; rank 0 publishes (``dist_launch``)
                    step, adapter = dist_launch.run_distributed(
                        sess,
                        job_id,
                        cfg,
                        fmt,
                        rows,
                        control,
                        resume_dir,
                        work_dir=work_dir,
                        artifacts=self.artifacts,
                        model_root=self.sessions.model_root,
                        on_event=lambda e: self._on_rank_event(job_id, e),
                    )
                elif cfg.method is TrainMethod.GRPO:  # strop's own loop on the step API's sampler
                    from strop.trainer_svc.core import grpo

                    step = grpo.run_grpo(
                        sess.loaded,
                        rows,
                        cfg,
                        work_dir,
                        control,
                        sinks,
                        resume_dir,
                        validation=held_out,
                        graders=graders,
                    )
                    if control.complete():  # from here a cancel is too late: the job ends as it completed
                        training.scale_adapter(sess.loaded, cfg.adapter_scale)
                    adapter = self.sessions.publish_adapter(
                        sess, artifact_id=None, metadata={"job_id": job_id, "step": str(step)}
                    )
                else:
                    step = training.run_training(
                        sess.loaded, rows, fmt, cfg, work_dir, control, sinks, resume_dir, validation=held_out
                    )
                    if cfg.keep_best_checkpoint and control.stop is None:  # the adapter published is the best
                        validation.keep_best(self.store, self.artifacts, sess.loaded, job_id, step)
                    adapter = self.sessions.publish_adapter(
                        sess, artifact_id=None, metadata={"job_id": job_id, "step": str(step)}
                    )
            self.store.append_event(JobEvent(job_id=job_id, adapter=adapter), adapter=adapter)
            if cfg.method is TrainMethod.DPO:
                self._note_a_flat_margin(job_id, cfg)
            if control.stop is None:
                outcome = JobState.SUCCEEDED, f"finished at step {step}", ""
            elif control.stop.reason == "cancel":
                outcome = JobState.CANCELLED, f"cancelled at step {step}", ""
            else:
                outcome = JobState.INTERRUPTED, f"service shutting down; stopped at step {step}", ""
        except dist_launch.RanksLost as exc:  # a rank was killed: resumable from the last checkpoint
            log.warning("job %s: %s; the launcher's last lines:\n%s", job_id, exc, exc.launcher_tail)
            lost = (
                JobState.CANCELLED
                if control.stop and control.stop.reason == "cancel"
                else JobState.INTERRUPTED
            )
            outcome = lost, str(exc), ""
        except (torch.OutOfMemoryError, BrokenTraining, dist_launch.RankFailed) as exc:
            log.warning("job %s: %s", job_id, exc)
            message, code = failure_of(exc)
            outcome = JobState.FAILED, self._scrub(message), code
        except Exception as exc:
            log.exception("job %s failed", job_id)
            message, code = failure_of(exc)
            outcome = JobState.FAILED, self._scrub(message), code
        finally:
            shutil.rmtree(work_dir, ignore_errors=True)
            if before is not None and (outcome is None or outcome[0] is JobState.FAILED):
                self._restore_adapter(sess, job_id, before)
            if sess.loaded.device.startswith("cuda"):
                torch.cuda.empty_cache()
            # drawn before the device is released: the job ends (finished_at) before the next one starts
            curve = loss_curve.publish_loss_curve(self.store, self.artifacts, job_id)
            csv = validation.publish_metrics_csv(self.store, self.artifacts, job_id)
            self._release_turn()
            self._free_session(sess, job_id)
        state, message, code = outcome
        if self.metrics is not None:  # before the event: a client that saw the end finds it in the metrics
            self.metrics.on_finished(state.value)
        self.store.transition(job_id, state, message, error_code=code, loss_curve=curve, metrics_csv=csv)
        log.info("job %s: %s (%s)", job_id, state.value, message)

    def _restore_adapter(self, sess: Session, job_id: str, before: adapter_state.Snapshot) -> None:
        """A failed job's adapter goes: the session gets back the one it had before the job (before the device
        turn is released, so a job queued behind it starts from that one)."""
        try:
            with sess.lock:
                adapter_state.restore(sess.loaded, before)
        except Exception:  # the session cannot be trusted any more: it refuses work until closed
            log.exception("job %s: the session's adapter could not be restored", job_id)
            sess.broken = f"job {job_id} failed and its adapter could not be restored; close the session"
            return
        self.store.append_event(
            JobEvent(
                job_id=job_id,
                log=LogMessage("info", "the session's adapter is back to its state before this job"),
            )
        )

    FLAT_MARGIN = 0.05  # reward-margin change (nats) below which a DPO run is said to have shown no effect

    def _note_a_flat_margin(self, job_id: str, cfg: TrainConfig) -> None:
        """A DPO job whose reward margin barely moved says so in its events, with the way out: DPO's default
        learning rate (TRL's 5e-6) moves a LoRA adapter slowly, and a short run then looks like no training."""
        margins, seq = [], 0
        while page := self.store.events_after(job_id, seq):
            margins += [e.step.dpo.reward_margin for e in page if e.step and e.step.dpo]
            seq = page[-1].seq
        if len(margins) < 2 or abs(margins[-1] - margins[0]) >= self.FLAT_MARGIN:
            return
        self.store.append_event(
            JobEvent(
                job_id=job_id,
                log=LogMessage(
                    "warning",
                    f"the DPO reward margin moved {margins[-1] - margins[0]:+.4f} over {len(margins)} steps at "
                    f"learning_rate {cfg.learning_rate:g}: no visible effect yet; raise learning_rate (e.g. "
                    "5e-5 to 5e-4 for LoRA) or train more steps",
                ),
            )
        )

    def _scrub(self, message: str) -> str:
        """No absolute server paths in what clients see: the roots and the interpreter's prefix, named instead."""
        return scrub_paths(
            message,
            private_paths(
                state=self.state_dir, models=self.sessions.model_root, artifacts=self.artifacts.root
            ),
        )

    def _free_session(self, sess: Session, job_id: str) -> None:
        # The session is free before the terminal event, so a client that saw the job end can reuse it.
        with self._lock:
            if job_id in sess.jobs:
                sess.jobs.remove(job_id)
            sess.info.busy_job_id = sess.jobs[0] if sess.jobs else ""
            if sess.info.state is not SessionState.CLOSED:
                self.store.put_session(sess.info)
            self._jobs.pop(job_id, None)

    def _on_step(self, job_id: str, m: StepMetrics) -> None:
        if self.metrics is not None:  # before the event: a client that saw the step finds it in the metrics
            self.metrics.on_step(
                job_id,
                step=m.step,
                loss=m.loss,
                tokens_per_second=m.tokens_per_second,
                seconds=m.step_seconds,
                peak_bytes=m.peak_memory_bytes,
            )
        self.store.append_event(
            JobEvent(job_id=job_id, step=m), step=m.step, total_steps=m.total_steps, last_loss=m.loss
        )

    def _on_rank_event(self, job_id: str, event: JobEvent) -> None:
        """An event of a distributed job's rank 0, into the job's events (as the single-process path stores it)."""
        if event.step is not None:
            self._on_step(job_id, event.step)
        elif event.checkpoint is not None:
            self.store.append_event(event, last_checkpoint=event.checkpoint)
        elif event.adapter is None:  # the adapter event is stored once the job's outcome is known, as below
            self.store.append_event(event)

    def _on_checkpoint(self, sess: Session, job_id: str, step: int, path: Path) -> None:
        ckpt = publish_checkpoint(
            self.artifacts, sess.loaded, tenant=sess.info.tenant, job_id=job_id, step=step, path=path
        )
        ckpt = validation.with_losses(ckpt, self.store.get_job(job_id))
        self.store.append_event(JobEvent(job_id=job_id, checkpoint=ckpt), last_checkpoint=ckpt)

    def poll(self, job_id: str, after_seq: int, limit: int = 1000) -> tuple[list[JobEvent], bool]:
        """Events with seq > ``after_seq`` (a page of at most ``limit``), and whether the stream is complete
        after them."""
        if after_seq < 0:
            raise InvalidArgument(f"after_seq must be >= 0, got {after_seq}")
        job = self._visible_job(job_id)  # NotFound
        key = (job_id, after_seq, limit)
        with self._lock:
            events = self._pages.get(key)
            if events is not None:
                self._pages.move_to_end(key)
                return list(events), False
        events = self.store.events_after(job_id, after_seq, limit)
        if len(events) == limit:  # a full page never changes (events are only appended): replays share it
            with self._lock:
                self._pages[key] = events
                while len(self._pages) > self.CACHED_PAGES:
                    self._pages.popitem(last=False)
            return list(events), False
        if events:
            return events, False
        return [], job.state.terminal and job.last_seq <= after_seq

    CACHED_PAGES = 256  # 25,600 events at the gRPC layer's page of 100

    def _visible_job(self, job_id: str) -> JobInfo:
        job = self.store.get_job(job_id)
        auth.check_visible(job.tenant, f"job {job_id!r}")
        return job

    def watch(self, job_id: str, after_seq: int = 0, *, poll_seconds: float = 1.0) -> Iterator[JobEvent]:
        """Every event with seq > after_seq, in order, then new ones as they come, until the job ends
        (blocking; the gRPC layer follows :meth:`poll` on the event loop instead)."""
        return follow_blocking(
            functools.partial(self.poll, job_id), self.store.changed, after_seq, poll_seconds
        )

    def get(self, job_id: str) -> JobInfo:
        return self._with_position(self._visible_job(job_id))

    def _with_position(self, job: JobInfo) -> JobInfo:
        with self._lock:
            if job.state is JobState.QUEUED and job.job_id in self._queue:
                job.queue_position = self._queue.index(job.job_id) + 1
        return job

    def list(self, session_id: str = "", states: list[JobState] | None = None) -> list[JobInfo]:
        me = auth.current()
        return [
            self._with_position(j) for j in self.store.list_jobs(session_id, states) if me.can_see(j.tenant)
        ]

    def cancel(self, job_id: str) -> JobInfo:
        job = self._visible_job(job_id)
        if job.state.terminal:
            raise FailedPrecondition(f"job {job_id} already ended ({job.state.value})")
        with self._lock:
            running = self._jobs.get(job_id)
        if running is None and job.instance_id and job.instance_id != self.store.instance_id:
            raise FailedPrecondition(
                f"job {job_id} runs on trainer instance {job.instance_id}; cancel it there"
            )
        if running is not None:
            running.control.request_stop("cancel")
            with self._turn:
                self._turn.notify_all()  # a queued job wakes and ends CANCELLED without running
        return self.get(job_id)

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
        with self._turn:
            self._turn.notify_all()
        deadline = time.monotonic() + grace_seconds
        for r in running:
            r.thread.join(max(0.0, deadline - time.monotonic()))
        stuck = [r.job_id for r in running if r.thread.is_alive()]
        if stuck:
            log.error(
                "drain: jobs %s did not reach a step boundary within %.0fs", ", ".join(stuck), grace_seconds
            )
        return not stuck
