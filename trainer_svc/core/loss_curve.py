"""A job's loss curve: loss by step from the job's stored step events, as a PNG artifact (``loss.png``).

Rendered with matplotlib's Agg canvas on a bare ``Figure`` (no pyplot: no process-wide figure state, so job
threads may render at once). The points are exactly the job's recorded ``StepMetrics`` (step, loss), in event
order; a resumed job's curve starts at the step it resumed from. A job with a validation set also plots its
valid_loss (``EvalMetrics``) and, as a marker, its full_valid_loss.
"""

from __future__ import annotations

import io
import logging
from typing import TYPE_CHECKING

from strop.common.artifacts import ArtifactStore
from strop.common.trainer_types import Artifact, JobInfo
from strop.trainer_svc.core.store import TrainerStore

if TYPE_CHECKING:
    from matplotlib.figure import Figure

log = logging.getLogger("strop.trainer")

FILE_NAME = "loss.png"
KIND = "loss_curve"
SIZE_INCHES = (8.0, 4.5)
DPI = 100  # 800 × 450 pixels


def loss_points(store: TrainerStore, job_id: str) -> tuple[list[int], list[float]]:
    """Every (step, loss) the job recorded, in order."""
    steps: list[int] = []
    losses: list[float] = []
    seq = 0
    while True:
        page = store.events_after(job_id, seq)
        if not page:
            return steps, losses
        for event in page:
            if event.step is not None:
                steps.append(event.step.step)
                losses.append(event.step.loss)
        seq = page[-1].seq


def eval_points(store: TrainerStore, job_id: str) -> tuple[list[int], list[float], list[int], list[float]]:
    """Every (step, valid_loss) the job evaluated, in order, and every (step, full_valid_loss)."""
    steps, valid, full_steps, full = [], [], [], []
    seq = 0
    while page := store.events_after(job_id, seq):
        for m in (e.eval for e in page if e.eval is not None):
            steps.append(m.step)
            valid.append(m.valid_loss)
            if m.is_full:
                full_steps.append(m.step)
                full.append(m.full_valid_loss)
        seq = page[-1].seq
    return steps, valid, full_steps, full


def loss_curve_figure(
    job: JobInfo,
    steps: list[int],
    losses: list[float],
    evals: tuple[list[int], list[float], list[int], list[float]] | None = None,
) -> Figure:
    """The figure of ``losses`` over ``steps`` (its first line, its data exactly the points given); with ``evals``
    (``eval_points``), the valid_loss line and the full_valid_loss markers after it."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=SIZE_INCHES, dpi=DPI)
    ax = fig.add_subplot()
    ax.plot(steps, losses, marker="." if len(steps) <= 50 else None, linewidth=1.2, label="loss")
    if evals and evals[0]:
        ax.plot(evals[0], evals[1], marker="o", markersize=3, linewidth=1.2, label="valid_loss")
        if evals[2]:
            ax.plot(evals[2], evals[3], linestyle="none", marker="*", markersize=9, label="full_valid_loss")
        ax.legend()
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    title = f"{job.job_id} · {job.config.method.value}"
    ax.set_title(f"{title} · {job.name}" if job.name else title)
    ax.grid(True, alpha=0.3)
    fig.tight_layout()
    return fig


def figure_png(fig: Figure) -> bytes:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    buf = io.BytesIO()
    FigureCanvasAgg(fig).print_png(buf)
    return buf.getvalue()


def publish_loss_curve(store: TrainerStore, artifacts: ArtifactStore, job_id: str) -> Artifact | None:
    """Render the job's curve into a new ``loss_curve`` artifact; None when the job recorded no step.

    A curve that cannot be drawn never changes how the job ends: the error is logged and None returned.
    """
    try:
        job = store.get_job(job_id)
        steps, losses = loss_points(store, job_id)
        if not steps:
            return None
        png = figure_png(loss_curve_figure(job, steps, losses, eval_points(store, job_id)))
        meta = {
            "job_id": job_id,
            "steps": str(len(steps)),
            "last_loss": repr(losses[-1]),
        }
        with artifacts.create(KIND, owner=job.tenant, metadata=meta) as pending:
            (pending.dir / FILE_NAME).write_bytes(png)
        return artifacts.get(pending.key)
    except Exception:
        log.exception("job %s: the loss curve could not be rendered", job_id)
        return None
