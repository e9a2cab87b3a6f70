"""Progress display for event streams: what the ``strop`` CLI and the demo print while a job or an export runs.

Part of the SDK (tqdm only, never torch), for pipelines that want the same live view.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterable
from typing import Any

# tqdm's own rate and times are left out: they count the wall-clock time events arrive in, and a replay
# (``jobs watch --after-seq 0`` on a running or finished job) delivers hours of recorded steps in milliseconds
# ("4,000 step/s"). The rate shown is the recorded one, from the events' own timestamps.
_BAR_FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} [{postfix}]"
_BAR_FORMAT_NO_TOTAL = "{desc}: {n_fmt} [{postfix}]"


class _RecordedRate:
    """Steps per second between the first step event seen and the latest, by the events' recorded times
    (``JobEvent.time``); by arrival time for events that carry none."""

    def __init__(self) -> None:
        self.first: tuple[int, float] | None = None

    def __call__(self, step: int, ev: Any) -> str:
        recorded = getattr(ev, "time", 0.0) or 0.0
        t = recorded if recorded > 0 else time.monotonic()
        if self.first is None:
            self.first = (step, t)
        first_step, first_t = self.first
        if step <= first_step or t <= first_t:
            return "-"
        return f"{(step - first_step) / (t - first_t):.3g}step/s"


def follow(events: Iterable[Any], on_event: Callable | None = None) -> str:
    """Show a job's events with a progress bar (live loss) until the stream ends; return the job id.

    The bar's rate is the job's as recorded (the events' timestamps), so a replayed history shows the rate it
    trained at, not the rate it was replayed at."""
    from tqdm import tqdm

    bar = None
    job_id = ""
    rate = _RecordedRate()
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
                    bar_format=_BAR_FORMAT if s.total_steps else _BAR_FORMAT_NO_TOTAL,
                )
            bar.update(s.step - bar.n)
            post = {
                "rate": rate(s.step, ev),
                "loss": f"{s.loss:.4f}",
                "lr": f"{s.learning_rate:.2e}",
                "tok/s": f"{s.tokens_per_second:.0f}",
            }
            if s.dpo is not None:
                post["margin"] = f"{s.dpo.reward_margin:.3f}"
            rl = getattr(s, "rl", None)  # GRPO's
            if rl is not None:
                post["reward"] = f"{rl.reward_mean:.3f}"
                if rl.eval_reward_mean is not None:
                    post["eval"] = f"{rl.eval_reward_mean:.3f}"
            bar.set_postfix(post)
        elif ev.state is not None:
            tqdm.write(f"[{job_id}] {ev.state.state.value}: {ev.state.message}", file=sys.stderr)
        elif ev.checkpoint is not None:
            c = ev.checkpoint
            losses = "" if c.valid_loss is None else f" (valid_loss {c.valid_loss:.4f})"
            tqdm.write(
                f"[{job_id}] checkpoint at step {c.step}: {c.artifact.artifact_id}{losses}", file=sys.stderr
            )
        elif ev.eval is not None:
            tqdm.write(f"[{job_id}] {eval_line(ev.eval)}", file=sys.stderr)
        elif ev.adapter is not None:
            tqdm.write(f"[{job_id}] adapter {ev.adapter.artifact_id}", file=sys.stderr)
        elif ev.log is not None:
            tqdm.write(f"[{job_id}] {ev.log.message}", file=sys.stderr)
        elif ev.retention is not None and not ev.retention.held_out:  # no forgetting metric: the scale alone
            tqdm.write(f"[{job_id}] adapter scale {ev.retention.adapter_scale:g} (chosen)", file=sys.stderr)
        elif ev.retention is not None:
            r = ev.retention
            tqdm.write(
                f"[{job_id}] retention: {r.kept} of {r.held_out} held-out answers of the base still given word for "
                f"word (token agreement {r.token_agreement:.1%}, NLL {r.mean_nll:.3f})"
                + (f"; {r.replay_rows} base answers replayed" if r.replay_rows else "")
                + (f"; adapter scale {r.adapter_scale:g}" if r.adapter_scale else ""),
                file=sys.stderr,
            )
    if bar is not None:
        bar.close()
    return job_id


def eval_line(m: Any) -> str:
    """An evaluation (``EvalMetrics``) in one line: the sample's loss, the whole set's when it was evaluated."""
    line = f"eval at step {m.step}: valid_loss {m.valid_loss:.4f}"
    if m.valid_mean_token_accuracy is not None:
        line += f", token accuracy {m.valid_mean_token_accuracy:.1%}"
    if m.dpo is not None:
        line += f", reward accuracy {m.dpo.reward_accuracy:.1%}"
    if m.is_full:
        line += f"; full_valid_loss {m.full_valid_loss:.4f}"
    return line + f" ({m.rows} rows, {m.tokens} tokens)"


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
