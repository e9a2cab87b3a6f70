"""``strop jobs plot JOB [-o FILE]``: fetch a job's loss curve (a PNG the trainer stores as the job ends)."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

from strop.client.errors import FailedPreconditionError

LOSS_CURVE_FILE = "loss.png"  # the file of a loss_curve artifact (trainer_svc.core.loss_curve.FILE_NAME)


def fetch_loss_curve(tc, job_id: str, out: str | os.PathLike = "") -> Path:
    """Write job ``job_id``'s loss curve to ``out`` (default ``<job_id>-loss.png``), replacing it atomically.

    Raises:
        FailedPreconditionError: the job has not ended yet, or it ended without recording a step.
    """
    job = tc.get_job(job_id)
    if job.loss_curve is None:
        if not job.state.terminal:
            raise FailedPreconditionError(
                f"job {job_id} is {job.state.value}; its loss curve is stored when it ends"
            )
        raise FailedPreconditionError(
            f"job {job_id} ended {job.state.value} without a loss curve (no step ran)"
        )
    dest = Path(out or f"{job_id}-loss.png")
    with tempfile.TemporaryDirectory(dir=dest.parent if dest.parent.is_dir() else None) as tmp:
        got = tc.download_artifact(job.loss_curve.artifact_id, Path(tmp) / "curve")
        shutil.move(got / LOSS_CURVE_FILE, Path(tmp) / dest.name)
        os.replace(Path(tmp) / dest.name, dest)
    return dest
