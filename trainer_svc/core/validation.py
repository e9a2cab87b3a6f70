"""A job's validation set, as records: the request checked, each checkpoint's losses, the best checkpoint kept as
the job's adapter, and the job's metrics CSV (docs/validation.md). The evaluations themselves run inside the job's
trainer (``evaluation``).
"""

from __future__ import annotations

import csv
import io
import logging
import math
from collections.abc import Iterator
from dataclasses import replace

from strop.common.artifacts import ArtifactStore, key_for
from strop.common.errors import InvalidArgument
from strop.common.trainer_types import (
    Artifact,
    Checkpoint,
    DatasetFormat,
    JobEvent,
    JobInfo,
    LogMessage,
    TrainConfig,
    TrainMethod,
)
from strop.trainer_svc.core import adapter_state, job_config
from strop.trainer_svc.core.datasets import Datasets
from strop.trainer_svc.core.evaluation import BATCH_LOSS, ValidationSet
from strop.trainer_svc.core.store import TrainerStore

log = logging.getLogger("strop.trainer")

CSV_FILE = "metrics.csv"
CSV_KIND = "metrics_csv"
# OpenAI's fine-tuning result file columns, then the full-set ones its checkpoint metrics carry
CSV_COLUMNS = (
    "step",
    "train_loss",
    "train_accuracy",
    "valid_loss",
    "valid_mean_token_accuracy",
    "full_valid_loss",
    "full_valid_mean_token_accuracy",
)
ADAPTER_FILE = "adapter_model.safetensors"  # what HF's Trainer writes into a PEFT checkpoint


def load(
    datasets: Datasets, dataset_id: str, cfg: TrainConfig, train_format: DatasetFormat, vocab_size: int
) -> ValidationSet | None:
    """The job's validation set, checked like its training set (the caller's own: NotFound otherwise), or None.

    Raises:
        InvalidArgument: eval settings without a validation set; a method without a held-out loss; a set whose format is not the training set's, or
            that does not fit the method (the row named); a job on several ranks.
        NotFound: an unknown dataset, or another tenant's.
    """
    if not dataset_id:
        asked = [f for f in ("eval_every_steps", "keep_best_checkpoint", "eval_rows") if getattr(cfg, f)]
        if asked:
            raise InvalidArgument(f"config: {', '.join(asked)} need a validation set (validation_dataset_id)")
        return None
    # GRPO evaluates its held-out prompts' mean reward itself (trainer_svc/core/grpo.py, RlMetrics.eval_reward_mean)
    if cfg.method not in BATCH_LOSS and cfg.method is not TrainMethod.GRPO:
        raise InvalidArgument(
            f"validation_dataset_id: {cfg.method.value} jobs have no held-out loss here; validation covers "
            + ", ".join(m.value for m in BATCH_LOSS)
            + " (and GRPO's held-out mean reward)"
        )
    info, rows = datasets.rows(dataset_id)
    if info.format is not train_format:
        raise InvalidArgument(
            f"validation_dataset_id: the validation set is {info.format.value.lower()} rows and the training set "
            f"{train_format.value.lower()} rows; a job evaluates rows of its training format (the same masking)"
        )
    try:
        job_config.check_dataset_fits(cfg, info.format, rows, vocab_size)
    except InvalidArgument as exc:
        raise InvalidArgument(f"validation_dataset_id {dataset_id}: {exc}") from None
    if cfg.ranks() > 1:
        raise InvalidArgument(
            f"validation runs in single-process jobs only; this job has {cfg.ranks()} ranks (num_devices "
            f"{cfg.num_devices}): drop validation_dataset_id or train on one device"
        )
    return ValidationSet(dataset_id, rows)


def with_losses(ckpt: Checkpoint, job: JobInfo) -> Checkpoint:
    """``ckpt`` with the losses of its step: the step's train loss, and the job's evaluation there if any (HF
    evaluates a step before it saves the step's checkpoint)."""
    ev = job.last_eval
    at = ev is not None and ev.step == ckpt.step
    return replace(
        ckpt,
        train_loss=job.last_loss if job.step == ckpt.step else 0.0,
        valid_loss=ev.valid_loss if at else None,
        full_valid_loss=ev.full_valid_loss if at and ev.is_full else None,
        valid_mean_token_accuracy=ev.valid_mean_token_accuracy if at else None,
    )


def _events(store: TrainerStore, job_id: str) -> Iterator[JobEvent]:
    seq = 0
    while page := store.events_after(job_id, seq):
        yield from page
        seq = page[-1].seq


def candidates(store: TrainerStore, job_id: str) -> list[Checkpoint]:
    """The evaluated checkpoints of the job and of the jobs it resumed (its run from the first step), by step."""
    found: dict[int, Checkpoint] = {}
    while job_id:
        for e in _events(store, job_id):
            c = e.checkpoint
            if c is not None and c.valid_loss is not None and math.isfinite(c.valid_loss):
                found.setdefault(
                    c.step, c
                )  # a resumed job's own checkpoint of a step wins over the earlier job's
        job_id = store.get_job(job_id).resumed_from_job_id
    return [found[s] for s in sorted(found)]


def best_of(checkpoints: list[Checkpoint]) -> Checkpoint | None:
    """The checkpoint of least valid_loss (the earliest of equals); None for none."""
    return min(checkpoints, key=lambda c: c.valid_loss, default=None)


def keep_best(
    store: TrainerStore, artifacts: ArtifactStore, loaded, job_id: str, final_step: int
) -> Checkpoint | None:
    """keep_best_checkpoint, once a job trained to its end: the session's adapter becomes the best checkpoint's (its
    adapter file verified and copied into the same parameters), so the adapter the job then publishes is that one.
    Records ``Job.best_checkpoint`` and a log event; None when no checkpoint was evaluated."""
    best = best_of(candidates(store, job_id))
    if best is None:
        return None
    if best.step != final_step:
        from safetensors.torch import load_file

        key = key_for(best.artifact)
        artifacts.verify(key)
        adapter_state.restore(loaded, load_file(str(artifacts.path_of(key) / ADAPTER_FILE)))
    store.update_job(job_id, best_checkpoint=best)
    store.append_event(
        JobEvent(
            job_id=job_id,
            log=LogMessage(
                "info",
                f"keep_best_checkpoint: the job's adapter is step {best.step}'s (valid_loss {best.valid_loss:.6g}"
                + ("" if best.step == final_step else f"; the final step {final_step}'s was not the least")
                + ")",
            ),
        )
    )
    return best


def metrics_rows(store: TrainerStore, job_id: str) -> list[dict[str, object]]:
    """One row a step the job recorded (a step's train loss, and its evaluation if any), by step."""
    rows: dict[int, dict[str, object]] = {}
    for e in _events(store, job_id):
        if e.step is not None:
            rows.setdefault(e.step.step, {})["train_loss"] = e.step.loss
        elif e.eval is not None:
            m = e.eval
            row = rows.setdefault(m.step, {})
            row["valid_loss"] = m.valid_loss
            row["valid_mean_token_accuracy"] = m.valid_mean_token_accuracy
            if m.is_full:
                row["full_valid_loss"] = m.full_valid_loss
                row["full_valid_mean_token_accuracy"] = m.full_valid_mean_token_accuracy
    return [{"step": s, **rows[s]} for s in sorted(rows)]


def metrics_csv(rows: list[dict[str, object]]) -> str:
    """``rows`` in ``CSV_COLUMNS``; what a step has not got is empty (train_accuracy: not recorded per step)."""
    buf = io.StringIO()
    w = csv.DictWriter(buf, fieldnames=CSV_COLUMNS, lineterminator="\n")
    w.writeheader()
    for row in rows:
        w.writerow({k: ("" if row.get(k) is None else _cell(row[k])) for k in CSV_COLUMNS})
    return buf.getvalue()


def _cell(v: object) -> str:
    return repr(float(v)) if isinstance(v, float) else str(v)  # repr: the float read back exactly


def publish_metrics_csv(store: TrainerStore, artifacts: ArtifactStore, job_id: str) -> Artifact | None:
    """The job's metrics as a ``metrics_csv`` artifact (file ``metrics.csv``); None when it recorded no step. A CSV
    that cannot be written never changes how the job ends: logged, None."""
    try:
        rows = metrics_rows(store, job_id)
        if not rows:
            return None
        job = store.get_job(job_id)
        meta = {"job_id": job_id, "steps": str(len(rows))}
        with artifacts.create(CSV_KIND, owner=job.tenant, metadata=meta) as pending:
            (pending.dir / CSV_FILE).write_text(metrics_csv(rows))
        return artifacts.get(pending.key)
    except Exception:
        log.exception("job %s: the metrics CSV could not be written", job_id)
        return None
