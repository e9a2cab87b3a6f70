"""Fine-tuning jobs over the trainer's jobs: create, follow, cancel, pause, resume.

One OpenAI job is a chain of strop jobs (``chain``): the first one trains, and each resume after a pause is a new strop
job that continues the last from its checkpoint (``resume_from_job_id``: adapter, optimizer and scheduler state, the
global step), so the OpenAI job id stays one. Pause is the trainer's cancel, which saves a checkpoint at the step
reached; the gateway keeps the chain (no trainer RPC of its own is needed: a paused job holds no device memory).

Sessions: a strop job trains the adapter of its session in place, so every OpenAI job (and every resume) loads its
base in a session of its own (LoadModel, AttachLora with the job's seed) and closes it when the strop job ends. The
trainer's device runs one job at a time and queues the rest (its ``max_queued_jobs``); a job waiting there holds its
loaded base, so the trainer's ``max_sessions`` bounds the jobs a trainer takes at once. Either limit reached is
RESOURCE_EXHAUSTED: 429, the SDK's RateLimitError.

A follower thread per live strop job reads the trainer's events (WatchJob, from the last one stored) into OpenAI's
events and checkpoints in the gateway's store, and settles the job when its strop job ends; a restarted gateway
starts a follower for every job that was live.
"""

from __future__ import annotations

import logging
import re
import tempfile
import threading
import time
import uuid
from pathlib import Path

from strop.client.errors import NotFoundError, StropClientError
from strop.common.trainer_types import Artifact, Checkpoint, JobEvent, JobState, LoraConfig
from strop.gateways.openai import params
from strop.gateways.openai.errors import OpenAIError, from_strop

log = logging.getLogger("strop.gateways.openai")

LIVE = ("validating_files", "queued", "running")
TERMINAL = ("succeeded", "failed", "cancelled")
# trainer errors a follower waits out (a restart, a network blip) before it reads the job's events again
RETRY_MAX_S = 2.0  # the longest wait between tries at a trainer that is away (a failed connect costs nothing)
TRANSIENT = {"UNAVAILABLE", "DEADLINE_EXCEEDED", "CANCELLED", "INTERNAL", "UNKNOWN", "RESOURCE_EXHAUSTED"}


def short_id(job_id: str) -> str:
    return job_id.split("-", 1)[-1]


class JobRunner:
    """The trainer side of the gateway's jobs; ``gw`` is the :class:`~strop.gateways.openai.gateway.Gateway`."""

    def __init__(self, gw):
        self.gw, self.store = gw, gw.store
        self._stop = threading.Event()
        self._threads: dict[str, threading.Thread] = {}
        self._lock = threading.Lock()

    def close(self) -> None:
        self._stop.set()

    # ---- events -------------------------------------------------------------------------------------------

    def event(
        self,
        job_id: str,
        message: str,
        *,
        level: str = "info",
        data: dict | None = None,
        src: str | None = None,
    ) -> None:
        self.store.append(
            "oai_events",
            job_id,
            "ftevent",
            {
                "object": "fine_tuning.job.event",
                "created_at": int(time.time()),
                "level": level,
                "message": message,
                "data": data or {},
                "type": "metrics" if data else "message",
            },
            src,
        )

    # ---- starting a strop job -----------------------------------------------------------------------------

    def start(self, api_key: str, job: dict, *, resume_from: str = "") -> dict:
        """Load the base, attach the job's adapter and queue a strop job on the trainer; the job doc, updated."""
        c = self.gw.clients.get(api_key)
        try:
            sess = c.load_model(
                job["model"],
                quantization=self.gw.config.quantization,
                dtype=self.gw.config.dtype,
                max_seq_length=self.gw.config.max_seq_length,
                name=f"openai-{job['id']}",
            )
        except StropClientError as exc:
            raise from_strop(exc, "model") from None
        try:
            c.attach_lora(sess.session_id, LoraConfig(**job["lora"]))
            cfg = params.config_from_doc(job["config"])
            cfg.eval_every_steps = int(job.get("eval_every_steps") or 0)
            events = c.train(
                sess.session_id,
                job["dataset_id"],
                cfg,
                resume_from_job_id=resume_from,
                name=job["id"],
                validation_dataset_id=job.get("validation_dataset_id") or "",
            )
            try:  # the job exists once its first event is out; closing the stream detaches, the job goes on
                first = next(events)
            finally:
                events.close()
        except StropClientError as exc:
            self._close_session(c, sess.session_id)
            if exc.code != "INVALID_ARGUMENT":
                raise from_strop(exc) from None
            # the trainer names its own field first: the request's field when it is one, else the data's fault
            message, field = params.request_field(exc.details)
            raise from_strop(exc, field or "training_file", message) from None
        except BaseException:
            self._close_session(c, sess.session_id)
            raise
        return self.store.update(
            "oai_jobs",
            job["id"],
            chain=[*job.get("chain", []), first.job_id],
            seq=0,
            session_id=sess.session_id,
            tenant=sess.tenant or "local",
            following=True,
            status="queued",
            want="",
        )

    @staticmethod
    def _close_session(c, session_id: str) -> None:
        try:
            c.close_session(session_id)
        except StropClientError as exc:  # gone already (a trainer restart): nothing is held
            log.info("session %s not closed: %s", session_id, exc.details)

    # ---- following ----------------------------------------------------------------------------------------

    def follow(self, api_key: str, job_id: str) -> None:
        with self._lock:
            t = self._threads.get(job_id)
            if t is not None and t.is_alive():
                return
            t = threading.Thread(
                target=self._follow, args=(api_key, job_id), name=f"oai-{job_id}", daemon=True
            )
            self._threads[job_id] = t
            t.start()

    def _follow(self, api_key: str, job_id: str) -> None:
        c = self.gw.clients.get(api_key)
        backoff = 0.5
        while not self._stop.is_set():
            job = self.store.get("oai_jobs", job_id)
            if job is None or not job.get("following"):
                return
            sid = job["chain"][-1]
            try:
                for ev in c.watch_job(sid, int(job.get("seq", 0))):
                    self._on_event(job_id, ev)
                    if self._stop.is_set():
                        return
                if not self._settle(api_key, job_id):
                    return
                backoff = 0.5  # the job goes on as a new strop job (after a trainer restart): follow that one
            except StropClientError as exc:
                if isinstance(exc, NotFoundError):
                    self._fail(
                        job_id, f"the trainer no longer knows job {sid}: {exc.details}", "server_error"
                    )
                    return
                # the key was revoked, say: its owner's next request follows again
                if exc.code not in TRANSIENT:
                    log.warning("job %s: not followed (%s: %s)", job_id, exc.code, exc.details)
                    self.gw.forget_owner(job["owner"])
                    return
                if self._stop.wait(backoff):
                    return
                backoff = min(backoff * 2, RETRY_MAX_S)
            except Exception:  # a bug of ours: the job is failed rather than followed forever
                if self._stop.is_set():  # the gateway is closing under the follower (its store, its channels)
                    return
                log.exception("following %s", job_id)
                self._fail(job_id, "the gateway could not follow this job (see its log)", "server_error")
                return

    def _on_event(self, job_id: str, ev: JobEvent) -> None:
        src = f"{ev.job_id}:{ev.seq}"  # each trainer event makes its records once, however often it is read
        job = self.store.get("oai_jobs", job_id)
        changes: dict = {"seq": ev.seq}
        if ev.state is not None and ev.state.state is JobState.RUNNING:
            if self.store.update_if("oai_jobs", job_id, "status", "queued", status="running"):
                self.event(job_id, "Fine-tuning job started", src=src)
        elif ev.step is not None:
            s = ev.step
            changes.update(tokens=s.tokens_seen, step=s.step, total_steps=s.total_steps, last_loss=s.loss)
            data = {"step": s.step, "total_steps": s.total_steps, "train_loss": s.loss}
            if s.dpo is not None:
                data.update(reward_margin=s.dpo.reward_margin, reward_accuracy=s.dpo.reward_accuracy)
            if s.rl is not None:  # reinforcement: the grader's mean score over the step's samples
                data.update(train_reward_mean=s.rl.reward_mean, train_reward_std=s.rl.reward_std)
            msg = f"Step {s.step}/{s.total_steps}: training loss={s.loss:.4f}"
            self.event(job_id, msg, data=data, src=src)
        elif ev.eval is not None:
            e = ev.eval
            data = {"step": e.step, "valid_loss": e.valid_loss}
            if e.valid_mean_token_accuracy is not None:
                data["valid_mean_token_accuracy"] = e.valid_mean_token_accuracy
            msg = f"Step {e.step}: validation loss={e.valid_loss:.4f}"
            if e.is_full:
                data["full_valid_loss"] = e.full_valid_loss
                if e.full_valid_mean_token_accuracy is not None:
                    data["full_valid_mean_token_accuracy"] = e.full_valid_mean_token_accuracy
                msg += f", full validation loss={e.full_valid_loss:.4f}"
            self.event(job_id, msg, data=data, src=src)
        elif ev.checkpoint is not None:
            self._checkpoint(job, ev.checkpoint, src)
        elif ev.log is not None:
            level = {"warning": "warn", "error": "error"}.get(ev.log.level, "info")
            self.event(job_id, ev.log.message, level=level, src=src)
        self.store.update("oai_jobs", job_id, **changes)

    def _checkpoint(self, job: dict, ck: Checkpoint, src: str) -> None:
        metrics = {"step": float(ck.step), "train_loss": ck.train_loss or job.get("last_loss")}
        for name in ("valid_loss", "full_valid_loss", "valid_mean_token_accuracy"):
            if getattr(ck, name) is not None:
                metrics[name] = getattr(ck, name)
        art = ck.artifact or Artifact()
        self.store.append(
            "oai_checkpoints",
            job["id"],
            "ftckpt",
            {
                "object": "fine_tuning.job.checkpoint",
                "created_at": int(art.created_at or time.time()),
                "fine_tuning_job_id": job["id"],
                "step_number": ck.step,
                "metrics": metrics,
                "fine_tuned_model_checkpoint": f"{model_name(job)}:ckpt-step-{ck.step}",
                "artifact_id": art.artifact_id,
            },
            src,
        )
        self.event(job["id"], f"Checkpoint created at step {ck.step}", src=src)

    # ---- settling -----------------------------------------------------------------------------------------

    def _settle(self, api_key: str, job_id: str) -> bool:
        """The strop job ended: the OpenAI job's outcome (or its pause), and its session closed. True when the job
        goes on as a new strop job (one the trainer interrupted continues from its checkpoint)."""
        c = self.gw.clients.get(api_key)
        job = self.store.get("oai_jobs", job_id)
        info = c.get_job(job["chain"][-1])
        self._close_session(c, job["session_id"])
        now = int(time.time())
        if job.get("want") == "pause":
            self.store.update("oai_jobs", job_id, following=False, status="paused")
            self.event(job_id, f"Fine-tuning job paused at step {info.step}")
            return False
        if job.get("want") == "cancel" or info.state is JobState.CANCELLED:
            self.store.update("oai_jobs", job_id, following=False, status="cancelled", finished_at=now)
            if job.get("want") != "cancel":
                self.event(job_id, "Fine-tuning job cancelled")
            return False
        if info.state is JobState.SUCCEEDED:
            name, adapter_id = model_name(job), info.adapter.artifact_id if info.adapter else ""
            results = self._result_files(api_key, job, info)
            exports, export_note = self._export(api_key, job, adapter_id)
            self.store.update(
                "oai_jobs",
                job_id,
                following=False,
                status="succeeded",
                finished_at=now,
                fine_tuned_model=name,
                adapter_id=adapter_id,
                result_files=results,
                trained_tokens=job.get("tokens", 0),
                exports=exports,
            )
            self.event(job_id, f"New fine-tuned model created: {name}")
            if export_note:
                self.event(job_id, export_note, level="warn" if not exports else "info")
            self.event(job_id, "The job has successfully completed")
            return False
        if info.state is JobState.INTERRUPTED and info.last_checkpoint is not None:
            self.event(
                job_id,
                f"The trainer stopped at step {info.step}; the job continues from its checkpoint",
                level="warn",
                src=f"{info.job_id}:interrupted",
            )
            delay = 0.5
            while True:  # the trainer may still be restarting (503) or full (429): wait for it
                try:
                    self.start(api_key, self.store.get("oai_jobs", job_id), resume_from=info.job_id)
                    return True
                except OpenAIError as exc:
                    if exc.status in (429, 502, 503, 504) and not self._stop.wait(delay):
                        delay = min(delay * 2, RETRY_MAX_S)
                        continue
                    if not self._stop.is_set():  # (closing: the next gateway process continues it)
                        self._fail(
                            job_id,
                            f"the job could not continue after the trainer stopped: {exc.message}",
                            "server_error",
                        )
                    return False
        code = "invalid_training_file" if info.error_code == "INVALID_ARGUMENT" else "server_error"
        self._fail(job_id, info.error or f"the trainer's job ended {info.state.value}", code)
        return False

    def _export(self, api_key: str, job: dict, adapter_id: str) -> tuple[list[dict], str]:
        """``metadata.strop_export``: the export service writes the fine-tuned model (its own job, followed there).
        The exports submitted (``[{export_id, artifacts}]``) and what to say of them in an event."""
        spec = (job.get("metadata") or {}).get(params.EXPORT_KEY)
        if not spec or self.gw.exporters is None:
            return [], ""
        try:
            exp = self.gw.exporters.get(api_key).create_export(
                params.export_targets(spec),
                adapter_artifact_id=adapter_id,
                name=re.sub(r"[^A-Za-z0-9._-]", "-", model_name(job)),
            )
        except StropClientError as exc:
            return [], f"The export ({spec}) was refused: {exc.details}"
        ids = [t.artifact_id for t in exp.request.targets]
        return [
            {"export_id": exp.export_id, "artifacts": ids}
        ], f"Export {exp.export_id} submitted ({spec}): " + (f"artifacts {', '.join(ids)}")

    def _fail(self, job_id: str, message: str, code: str) -> None:
        self.store.update(
            "oai_jobs",
            job_id,
            following=False,
            status="failed",
            finished_at=int(time.time()),
            error={"code": code, "message": message, "param": None},
        )
        self.event(job_id, f"Fine-tuning job failed: {message}", level="error")

    def _result_files(self, api_key: str, job: dict, info) -> list[str]:
        """The job's metrics CSV (the trainer's ``metrics.csv`` artifact) as a ``fine-tune-results`` file."""
        if info.metrics_csv is None or not info.metrics_csv.artifact_id:
            return []
        c = self.gw.clients.get(api_key)
        with tempfile.TemporaryDirectory() as tmp:
            dest = Path(tmp) / "m"
            try:
                c.download_artifact(info.metrics_csv.artifact_id, dest)
            except StropClientError as exc:
                log.warning("job %s: metrics CSV not fetched: %s", job["id"], exc.details)
                return []
            found = next(iter(sorted(dest.rglob("*.csv"))), None)
            if found is None:
                return []
            f = self.gw.files.store_file(
                job["owner"], "step_metrics.csv", "fine-tune-results", found.read_bytes()
            )
        return [f["id"]]

    # ---- what the routes call -----------------------------------------------------------------------------

    def cancel(self, api_key: str, job: dict) -> dict:
        if job["status"] in TERMINAL:
            raise OpenAIError(
                f"Job {job['id']} has already ended ({job['status']}); it cannot be cancelled",
                409,
                code="job_not_cancellable",
            )
        was_paused = job["status"] == "paused" and not job.get("following")
        _created(job)
        job = self.store.update(
            "oai_jobs", job["id"], want="cancel", status="cancelled", finished_at=int(time.time())
        )
        if not was_paused:
            self._stop_strop_job(api_key, job)
        self.event(job["id"], "Fine-tuning job cancelled")
        return job

    def pause(self, api_key: str, job: dict) -> dict:
        if job["status"] not in LIVE:
            raise OpenAIError(
                f"Job {job['id']} is {job['status']}; only a queued or running job can be paused",
                409,
                code="job_not_pausable",
            )
        _created(job)
        job = self.store.update("oai_jobs", job["id"], want="pause", status="paused")
        self._stop_strop_job(api_key, job)
        self.event(job["id"], "Pause requested: the job stops at its next step boundary, saving a checkpoint")
        return job

    def resume(self, api_key: str, job: dict) -> dict:
        if job["status"] != "paused":
            raise OpenAIError(
                f"Job {job['id']} is {job['status']}; only a paused job can be resumed",
                409,
                code="job_not_resumable",
            )
        c = self.gw.clients.get(api_key)
        deadline = (
            time.monotonic() + 60.0
        )  # a pause just asked: the strop job stops at its next step boundary
        while self.store.get("oai_jobs", job["id"]).get("following"):
            if time.monotonic() > deadline:
                raise OpenAIError(f"Job {job['id']} is still pausing; retry shortly", 409, code="job_pausing")
            time.sleep(0.1)
        info = c.get_job(job["chain"][-1])
        # a job paused before its first step has no checkpoint: it starts again from the beginning
        resume_from = info.job_id if info.last_checkpoint is not None else ""
        job = self.start(api_key, self.store.get("oai_jobs", job["id"]), resume_from=resume_from)
        at = (
            f"from step {info.last_checkpoint.step}"
            if resume_from
            else "from the beginning (no step had run)"
        )
        self.event(job["id"], f"Fine-tuning job resumed {at}")
        self.follow(api_key, job["id"])
        return job

    def _stop_strop_job(self, api_key: str, job: dict) -> None:
        c = self.gw.clients.get(api_key)
        try:
            c.cancel_job(job["chain"][-1])
        except StropClientError as exc:  # it ended meanwhile: the follower settles it
            log.info("job %s: cancel of %s: %s", job["id"], job["chain"][-1], exc.details)


def _created(job: dict) -> None:
    """A job still in its create request has no strop job to stop yet (409: the SDK's ConflictError)."""
    if not job.get("chain"):
        raise OpenAIError(
            f"Job {job['id']} is still being created; retry shortly", 409, code="job_validating"
        )


def model_name(job: dict) -> str:
    """``ft:<base>:<tenant>:<suffix>:<id>`` (OpenAI's form; the suffix empty when none was given)."""
    return f"ft:{job['model']}:{job.get('tenant') or 'local'}:{job.get('suffix') or ''}:{short_id(job['id'])}"


def new_job_id() -> str:
    return f"ftjob-{uuid.uuid4().hex[:24]}"
