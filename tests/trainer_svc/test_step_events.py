"""A job's step events are stored off the job thread (``training.StepEventsOffThread``): the job thread goes on to the
next step while the event's commit runs, the job's events keep the order of the calls, a failed write fails the job
on its own thread, and the writes run in the job thread's logging context."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from strop.common import logs
from strop.common.trainer_types import StepMetrics
from strop.trainer_svc.core import training


def _metrics(step: int) -> StepMetrics:
    return StepMetrics(
        step=step,
        total_steps=3,
        epoch=0.0,
        loss=1.0,
        learning_rate=1e-4,
        grad_norm=0.0,
        tokens_per_second=0.0,
        tokens_seen=step,
        peak_memory_bytes=0,
        step_seconds=0.0,
    )


def test_the_job_thread_goes_on_while_a_step_event_is_stored_and_the_events_keep_their_order():
    released = threading.Event()
    order: list[str] = []

    def on_step(m: StepMetrics) -> None:
        # blocks until the test (on the job thread) has gone on past the call: a synchronous sink would time out
        order.append(
            f"step {m.step} {'overlapped' if released.wait(timeout=10) else 'blocked the job thread'}"
        )

    sinks = training.Sinks(
        on_step=on_step,
        on_checkpoint=lambda step, path: order.append(f"checkpoint {step}"),
        on_start=lambda total: order.append(f"start {total}"),
        on_eval=lambda m: order.append("eval"),
    )
    events = training.StepEventsOffThread(sinks)
    ordered = events.sinks()
    try:
        ordered.on_start(3)
        ordered.on_step(_metrics(1))
        ordered.on_step(_metrics(2))
        order.append("job thread went on")
        released.set()
        ordered.on_checkpoint(2, Path("ckpt"))  # waits for the steps before it
        ordered.on_step(_metrics(3))
        ordered.on_eval(object())
        events.wait()
    finally:
        events.close()
    assert order == [
        "start 3",
        "job thread went on",
        "step 1 overlapped",
        "step 2 overlapped",
        "checkpoint 2",
        "step 3 overlapped",
        "eval",
    ]
    assert ordered.on_retention is None, "a sink the job has none of stays None"


def test_a_failed_step_write_is_raised_on_the_job_thread():
    def on_step(m: StepMetrics) -> None:
        if m.step == 2:
            raise OSError("disk full")

    events = training.StepEventsOffThread(
        training.Sinks(on_step=on_step, on_checkpoint=lambda s, p: None, on_start=lambda t: None)
    )
    ordered = events.sinks()
    try:
        ordered.on_step(_metrics(1))
        ordered.on_step(_metrics(2))
        with pytest.raises(OSError, match="disk full"):
            events.wait()
        events.wait()  # raised once: the write is not retried
    finally:
        events.close()


def test_a_step_write_runs_in_the_job_threads_logging_context():
    seen = []
    token = logs.bind(job_id="job-7")
    try:
        events = training.StepEventsOffThread(
            training.Sinks(
                on_step=lambda m: seen.append((threading.current_thread().name, logs._context.get())),
                on_checkpoint=lambda s, p: None,
                on_start=lambda t: None,
            )
        )
        events.sinks().on_step(_metrics(1))
        events.wait()
        events.close()
    finally:
        logs.unbind(token)
    ((thread, context),) = seen
    assert thread.startswith("strop-step-events") and context == {"job_id": "job-7"}
