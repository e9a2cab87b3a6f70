"""Progress display for event streams: what the ``strop`` CLI and the demo print while a job or an export runs.

Part of the SDK (tqdm only, never torch), for pipelines that want the same live view.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterable
from typing import Any


def follow(events: Iterable[Any], on_event: Callable | None = None) -> str:
    """Show a job's events with a progress bar (live loss) until the stream ends; return the job id."""
    from tqdm import tqdm

    bar = None
    job_id = ""
    for ev in events:
        job_id = ev.job_id
        if on_event:
            on_event(ev)
        if ev.step is not None:
            s = ev.step
            if bar is None:
                # The bar starts at the first step seen, so its rate counts only steps seen after it (starting
                # at 0 made step 1 arrive "in 50 µs": 18,001 step/s on the first tick).
                bar = tqdm(
                    total=s.total_steps or None,
                    initial=s.step,
                    desc=job_id,
                    unit="step",
                    file=sys.stderr,
                    mininterval=0.5,
                )
            bar.update(s.step - bar.n)
            post = {
                "loss": f"{s.loss:.4f}",
                "lr": f"{s.learning_rate:.2e}",
                "tok/s": f"{s.tokens_per_second:.0f}",
            }
            if s.dpo is not None:
                post["margin"] = f"{s.dpo.reward_margin:.3f}"
            bar.set_postfix(post)
        elif ev.state is not None:
            tqdm.write(f"[{job_id}] {ev.state.state.value}: {ev.state.message}", file=sys.stderr)
        elif ev.checkpoint is not None:
            tqdm.write(
                f"[{job_id}] checkpoint at step {ev.checkpoint.step}: {ev.checkpoint.artifact.artifact_id}",
                file=sys.stderr,
            )
        elif ev.adapter is not None:
            tqdm.write(f"[{job_id}] adapter {ev.adapter.artifact_id}", file=sys.stderr)
        elif ev.log is not None:
            tqdm.write(f"[{job_id}] {ev.log.message}", file=sys.stderr)
    if bar is not None:
        bar.close()
    return job_id


def export_progress_printer() -> Callable[[Any], None]:
    """A callback printing an ``ExportProgress`` line per phase change (first, second and last item of each)."""
    last: dict[str, str] = {}

    def show(p) -> None:
        done, total = p.items_done, p.items_total
        key = f"{p.target}/{p.phase}"
        line = f"[{p.target or 'export'}] {p.phase}"
        if total:
            line += f" {done}/{total}"
        if p.bytes_total:
            line += f" {p.bytes_written / 2**20:.1f}/{p.bytes_total / 2**20:.1f} MiB"
        if p.item:
            line += f" {p.item}"
        if last.get(key) != line and (done in (0, 1, total) or not total):
            print(line, file=sys.stderr)
        last[key] = line

    return show
