"""The step API's futures and the device's one worker that runs them (``runs.py`` submits the primitives).

- Every primitive answers a :class:`Future` at once. Per run, futures run in ``seq_id`` order (a request
  without one takes the run's next; a duplicate ``(run, seq_id)`` returns the existing future; a hole blocks the
  run for ``hole_seconds``, then is skipped; a failed or cancelled seq still advances). Samples queue apart and
  all ready ones on a session run as one batch; a Sample of a run's live adapter is ready once every primitive
  of the run submitted before it has run (it sees their weights), a snapshot's at once.
- **Fairness**: the worker serves the runs with a ready head (and the sample queue) round robin, one primitive
  per turn. Each primitive takes the device from the job scheduler (``Jobs.device_turn``: queued jobs go
  first) and the session's lock.
- **Admission**: at most ``max_pending_per_run`` and ``max_pending`` futures not yet run (RESOURCE_EXHAUSTED).
- Results are kept for ``keep_finished`` futures (oldest dropped first).
- A run idle past ``idle_offload_seconds`` has its state moved to ``offload_device`` by the worker between
  primitives, and back on its next one.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

from strop.common import auth
from strop.common.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, StropError
from strop.common.metrics import TrainerMetrics
from strop.common.step_types import (
    Future,
    FutureState,
    PrimitiveKind,
    SampledSequence,
    SampleOutput,
    SampleRequest,
    TrainingRunInfo,
)
from strop.trainer_svc.core import step_ops
from strop.trainer_svc.core.sessions import Session

log = logging.getLogger("strop.trainer.runs")

SAMPLE_QUEUE = "\0samples"  # the sample queue's place in the round robin


@dataclass
class Entry:
    future: Future
    tenant: str
    work: Callable[[], Any] | None  # runs on the worker; returns the result field's value
    tokens: int = 0
    sample: SampleRequest | None = None
    # a Sample of a run's live adapter runs once the run has passed this seq (every primitive submitted before it)
    after_seq: int = 0
    done: threading.Event = field(default_factory=threading.Event)


@dataclass
class Run:
    info: TrainingRunInfo
    sess: Session
    optimizer: Any = None
    param_names: list[str] = field(default_factory=list)
    params: list[Any] = field(default_factory=list)
    queue: dict[int, Entry] = field(default_factory=dict)  # seq → entry, not yet run
    by_seq: dict[int, str] = field(default_factory=dict)  # seq → future id, every seq accepted
    next_exec: int = 1
    blocked_since: float = 0.0
    samplers: collections.OrderedDict[str, None] = field(default_factory=collections.OrderedDict)
    counts: collections.Counter = field(default_factory=collections.Counter)
    deleted: bool = False
    offloaded: bool = False  # its adapter and Adam state in host memory (idle past the TTL)

    @property
    def adapter(self) -> str:
        return self.info.run_id


class StepWorker:
    """The futures of every run on this device and the worker thread that runs them; ``TrainingRuns`` adds the
    runs themselves and the primitives."""

    def __init__(
        self,
        device_turn: Callable[[], contextlib.AbstractContextManager],
        *,
        metrics: TrainerMetrics | None,
        max_pending_per_run: int,
        max_pending: int,
        keep_finished: int,
        hole_seconds: float,
        idle_offload_seconds: float,
        offload_device: str,
    ) -> None:
        self.device_turn, self.metrics = device_turn, metrics
        self.max_pending_per_run, self.max_pending = max_pending_per_run, max_pending
        self.keep_finished, self.hole_seconds = keep_finished, hole_seconds
        # a run idle this long moves its adapter, gradients and Adam state to offload_device (0: never); its
        # next primitive brings them back (``_on_device``); only where offload_device is not the session's device
        self.idle_offload_seconds, self.offload_device = idle_offload_seconds, offload_device
        self._last_sweep, self.sweep_seconds = 0.0, 10.0
        self._runs: dict[str, Run] = {}
        # deleted runs, kept so watchers see their end (newest 1024)
        self._deleted: collections.OrderedDict[str, Run] = collections.OrderedDict()
        self._futures: collections.OrderedDict[str, Entry] = collections.OrderedDict()
        self._samples: collections.deque[Entry] = collections.deque()
        self._rotation: collections.deque[str] = collections.deque()
        self._cond = threading.Condition()
        self._worker: threading.Thread | None = None
        self._stopping = False

    # ---- futures ------------------------------------------------------------------------------------------

    def _entry(self, run: Run, seq: int, kind: PrimitiveKind, work, tokens: int = 0) -> Entry:
        fut = Future(
            future_id=f"fut-{uuid.uuid4().hex[:16]}",
            run_id=run.info.run_id,
            seq_id=seq,
            kind=kind,
            state=FutureState.PENDING,
            created_at=time.time(),
        )
        return Entry(fut, run.info.tenant, work, tokens)

    def _pending_count(self) -> int:
        with self._cond:
            return sum(pending(r) for r in self._runs.values()) + len(self._samples)

    def _check_queue(self, run: Run) -> None:
        mine = pending(run) + sum(1 for e in self._samples if e.future.run_id == run.info.run_id)
        if mine >= self.max_pending_per_run:
            raise ResourceExhausted(
                f"run {run.info.run_id} has {mine} futures pending (limit {self.max_pending_per_run}); wait for some"
            )
        total = sum(pending(r) for r in self._runs.values()) + len(self._samples)
        if total >= self.max_pending:
            raise ResourceExhausted(
                f"{total} futures are pending on this device (limit {self.max_pending}); retry later"
            )

    def _submit(self, run: Run, seq_id: int, kind: PrimitiveKind, work, tokens: int = 0) -> Future:
        if seq_id < 0:
            raise InvalidArgument(f"seq_id must be >= 0, got {seq_id}")
        with self._cond:
            if run.deleted:
                raise NotFound(f"training run {run.info.run_id!r} not found")
            if seq_id and seq_id in run.by_seq:  # a retry of an accepted request: the same future
                existing = self._futures.get(run.by_seq[seq_id])
                if existing is not None:
                    if existing.future.kind is not kind:
                        raise InvalidArgument(
                            f"seq_id {seq_id} of run {run.info.run_id} is already a {existing.future.kind.value}"
                        )
                    return replace(existing.future)
            if seq_id and seq_id < run.next_exec:
                raise InvalidArgument(
                    f"seq_id {seq_id} of run {run.info.run_id} has passed (the run is at {run.next_exec})"
                )
            self._check_queue(run)
            seq = seq_id or run.info.next_seq_id
            entry = self._entry(run, seq, kind, work, tokens)
            run.queue[seq] = entry
            run.by_seq[seq] = entry.future.future_id
            run.info.next_seq_id = max(run.info.next_seq_id, seq + 1)
            run.info.last_activity_at = time.time()
            self._futures[entry.future.future_id] = entry
            self._trim()
            self._start_worker()
            self._cond.notify_all()
            return replace(entry.future)

    def _trim(self) -> None:
        while len(self._futures) > self.keep_finished:
            fid, oldest = next(iter(self._futures.items()))
            if not oldest.future.state.done:
                break
            self._futures.pop(fid)

    def _visible(self, future_id: str) -> Entry:
        with self._cond:
            entry = self._futures.get(future_id)
        if entry is None or not auth.current().can_see(entry.tenant):
            raise NotFound(f"future {future_id!r} not found")
        return entry

    def get_future(self, future_id: str, wait_seconds: float = 0.0) -> Future:
        entry = self._visible(future_id)
        if wait_seconds > 0:
            entry.done.wait(wait_seconds)
        with self._cond:
            return replace(entry.future)

    def result(self, future_id: str, timeout: float | None = None) -> Future:
        """Block until the future is done (or ``timeout``), then return it."""
        entry = self._visible(future_id)
        entry.done.wait(timeout)
        with self._cond:
            return replace(entry.future)

    def cancel(self, future_id: str) -> Future:
        entry = self._visible(future_id)
        with self._cond:
            if entry.future.state is FutureState.PENDING:
                if entry in self._samples:
                    self._samples.remove(entry)
                self._finish(entry, FutureState.CANCELLED, error="cancelled", code="CANCELLED")
                self._cond.notify_all()
            elif entry.future.state is FutureState.RUNNING:
                raise FailedPrecondition(f"future {future_id} is running; it cannot be cancelled")
            return replace(entry.future)

    def seq_done(self, run_id: str, seq_id: int) -> tuple[Future | None, bool]:
        """The run's future of ``seq_id`` once it is done (else None), and whether the run has ended (deleted),
        without blocking: the gRPC layer polls it from the event loop, holding no thread per watcher."""
        run = self._run_any(run_id)
        with self._cond:
            fid = run.by_seq.get(seq_id)
            entry = self._futures.get(fid) if fid else None
            if entry is not None and entry.future.state.done:
                return replace(entry.future), False
            return None, run.deleted

    def watch(self, run_id: str, after_seq_id: int, *, poll_seconds: float = 0.05) -> Iterator[Future]:
        """The run's seq-ordered futures with seq_id > ``after_seq_id``, each once it is done, in order, until the
        run is deleted (blocking)."""
        seq = after_seq_id + 1
        while True:
            done, ended = self.seq_done(run_id, seq)
            if done is not None:
                yield done
                seq += 1
            elif ended:
                return
            else:
                time.sleep(poll_seconds)

    def _run_any(self, run_id: str) -> Run:
        """A visible run, deleted ones included (a watcher learns that its run ended)."""
        with self._cond:
            run = self._runs.get(run_id) or self._deleted.get(run_id)
        if run is None or not auth.current().can_see(run.info.tenant):
            raise NotFound(f"training run {run_id!r} not found")
        return run

    def _finish(
        self, entry: Entry, state: FutureState, *, result=None, error: str = "", code: str = ""
    ) -> None:
        f = entry.future
        f.state, f.error, f.error_code, f.finished_at = state, error, code, time.time()
        if result is not None:
            setattr(f, _RESULT_FIELD[f.kind], result)
        entry.work = None
        entry.done.set()

    # ---- the worker ---------------------------------------------------------------------------------------

    def _start_worker(self) -> None:
        if self._worker is None or not self._worker.is_alive():
            self._worker = threading.Thread(target=self._loop, name="strop-step-worker", daemon=True)
            self._worker.start()

    def _ready(self, run: Run) -> Entry | None:
        """The run's head if it may run now (skipping done seqs and holes older than ``hole_seconds``)."""
        while True:
            entry = run.queue.get(run.next_exec)
            if entry is not None and entry.future.state.done:  # cancelled while pending: its seq is spent
                del run.queue[run.next_exec]
                run.next_exec += 1
                continue
            if entry is not None:
                run.blocked_since = 0.0
                return entry
            if not run.queue:
                return None
            now = time.monotonic()
            run.blocked_since = run.blocked_since or now
            if now - run.blocked_since < self.hole_seconds:
                return None
            log.warning(
                "run %s: seq %d never came in %.0fs; skipped",
                run.info.run_id,
                run.next_exec,
                self.hole_seconds,
            )
            run.next_exec += 1
            run.blocked_since = 0.0

    def _pick(self) -> tuple[str, list[Entry]] | None:
        for _ in range(len(self._rotation)):
            key = self._rotation[0]
            self._rotation.rotate(-1)
            if key == SAMPLE_QUEUE:
                batch = self._sample_batch() if self._samples else []
                if batch:
                    return key, batch
                continue
            run = self._runs.get(key)
            if run is None:
                continue
            entry = self._ready(run)
            if entry is not None:
                return key, [entry]
        return None

    def _sample_ready(self, e: Entry) -> bool:
        """A snapshot's sample is ready at once; a live run's once the run has run every seq up to ``after_seq``
        (the worker runs one thing at a time, so a seq below ``next_exec`` has finished)."""
        run = self._runs.get(e.future.run_id)
        return run is None or bool(e.sample.sampler_id) or run.next_exec > e.after_seq

    def _sample_batch(self) -> list[Entry]:
        """Every ready sample on the session of the oldest ready one (one decode batch; adapters switch per
        group); empty when none is ready."""
        ready = [e for e in self._samples if self._sample_ready(e)]
        if not ready:
            return []
        head = ready[0]
        sess_id = self._runs[head.future.run_id].info.session_id if head.future.run_id in self._runs else None
        batch = [
            e
            for e in ready
            if e.future.run_id in self._runs and self._runs[e.future.run_id].info.session_id == sess_id
        ]
        if not batch:
            batch = [head]
        for e in batch:
            self._samples.remove(e)
        return batch

    def _loop(self) -> None:
        while True:
            idle: list[Run] = []
            with self._cond:
                if SAMPLE_QUEUE not in self._rotation:
                    self._rotation.append(SAMPLE_QUEUE)
                picked = self._pick()
                if picked is None:
                    if self._stopping:
                        return
                    self._cond.wait(1.0)
                    idle = self._idle_runs()
                else:
                    key, entries = picked
                    run = self._runs.get(key)
                    for e in entries:
                        e.future.state = FutureState.RUNNING
                        if key != SAMPLE_QUEUE:
                            del run.queue[e.future.seq_id]
                            run.next_exec = e.future.seq_id + 1
            if picked is None:
                for r in idle:
                    self._offload(r)
                continue
            try:
                if key == SAMPLE_QUEUE:
                    self._run_samples(entries)
                else:
                    self._run_one(run, entries[0])
            except Exception:  # never lose the worker: the futures fail instead
                log.exception("the step worker failed outside a primitive")
                with self._cond:
                    for e in entries:
                        if not e.future.state.done:
                            self._finish(e, FutureState.FAILED, error="internal error", code="INTERNAL")
                    self._cond.notify_all()

    def _run_one(self, run: Run, entry: Entry) -> None:
        start = time.monotonic()
        state, result, error, code = FutureState.SUCCEEDED, None, "", ""
        try:
            with self.device_turn(), run.sess.lock:
                self._check_session(run.sess)
                if run.deleted:
                    raise NotFound(f"training run {run.info.run_id!r} was deleted")
                self._on_device(run)
                result = entry.work()
        except Exception as exc:
            state, error, code = FutureState.FAILED, *_failure(exc)
            if code == "INTERNAL":
                log.exception(
                    "run %s: %s seq %d failed", run.info.run_id, entry.future.kind.value, entry.future.seq_id
                )
        seconds = time.monotonic() - start
        with self._cond:
            run.counts[entry.future.kind.value.lower()] += 1
            run.info.last_activity_at = time.time()
            self._finish(entry, state, result=result, error=error, code=code)
            self._cond.notify_all()
        if self.metrics is not None:
            self.metrics.on_primitive(
                entry.future.kind.value.lower(), state.value.lower(), seconds, entry.tokens
            )

    def _check_session(self, sess: Session) -> None:
        if sess.info.state.value == "CLOSED" or sess.loaded.model is None:
            raise FailedPrecondition(f"session {sess.info.session_id} is closed")
        if sess.broken:
            raise FailedPrecondition(f"session {sess.info.session_id}: {sess.broken}")

    def _run_samples(self, entries: list[Entry]) -> None:
        """One call of the sampler per adapter among the pending samples (each group batched together)."""
        groups: dict[str, list[Entry]] = {}
        for e in entries:
            adapter = e.sample.sampler_id or e.sample.run_id
            groups.setdefault(adapter, []).append(e)
        for adapter, group in groups.items():
            start = time.monotonic()
            run = self._runs.get(group[0].future.run_id)
            results, error, code = None, "", ""
            try:
                if run is None:
                    raise NotFound(f"training run {group[0].future.run_id!r} was deleted")
                with self.device_turn(), run.sess.lock:
                    self._check_session(run.sess)
                    if adapter not in run.sess.loaded.model.peft_config:
                        raise NotFound(f"sampler {adapter!r} was evicted by newer snapshots")
                    self._on_device(run)
                    results = _sample(run.sess.loaded, adapter, [e.sample for e in group])
            except Exception as exc:
                error, code = _failure(exc)
                if code == "INTERNAL":
                    log.exception("sampling with %s failed", adapter)
            seconds = time.monotonic() - start
            with self._cond:
                for i, e in enumerate(group):
                    if results is not None:
                        self._finish(e, FutureState.SUCCEEDED, result=results[i])
                    else:
                        self._finish(e, FutureState.FAILED, error=error, code=code)
                    if run is not None:
                        run.counts["sample"] += 1
                self._cond.notify_all()
            if self.metrics is not None:
                state = "succeeded" if results is not None else "failed"
                for e in group:
                    self.metrics.on_primitive("sample", state, seconds / len(group), e.tokens)

    def _idle_runs(self) -> list[Run]:
        """Runs idle past the TTL, not yet offloaded (checked every ``sweep_seconds``; called under the lock)."""
        now = time.time()
        if not self.idle_offload_seconds or now - self._last_sweep < self.sweep_seconds:
            return []
        self._last_sweep = now
        return [
            r
            for r in self._runs.values()
            if not r.offloaded
            and not r.queue
            and now - r.info.last_activity_at > self.idle_offload_seconds
            and (r.sess.loaded.device != self.offload_device or self._offload_same_device)
        ]

    _offload_same_device = False  # tests: run the offload's bookkeeping on a CPU session (a move to itself)

    def _offload(self, run: Run) -> None:
        with run.sess.lock:
            if run.deleted or run.offloaded or run.queue:
                return
            if run.sess.loaded.model is None or run.sess.loaded.model.active_adapter == run.adapter:
                return  # the active adapter stays: a forward outside the step API (Generate) may read it
            step_ops.move_run_state(run.params, run.optimizer, self.offload_device)
            run.offloaded = True
        log.info(
            "run %s idle for %.0fs: its state moved to %s",
            run.info.run_id,
            self.idle_offload_seconds,
            self.offload_device,
        )

    def _on_device(self, run: Run) -> None:
        """Bring an offloaded run's state back to its session's device (under the session's lock)."""
        if run.offloaded:
            step_ops.move_run_state(run.params, run.optimizer, run.sess.loaded.device)
            run.offloaded = False

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()


def pending(run: Run) -> int:
    """The run's futures not yet run (a cancelled one keeps its seq in the queue until the run passes it)."""
    return sum(1 for e in run.queue.values() if not e.future.state.done)


_RESULT_FIELD = {
    PrimitiveKind.FORWARD_BACKWARD: "forward_backward",
    PrimitiveKind.FORWARD: "forward_backward",
    PrimitiveKind.OPTIM_STEP: "optim_step",
    PrimitiveKind.SAMPLE: "sample",
    PrimitiveKind.SAVE_WEIGHTS: "save",
    PrimitiveKind.SAVE_STATE: "save",
    PrimitiveKind.LOAD_STATE: "save",
    PrimitiveKind.SAVE_WEIGHTS_FOR_SAMPLER: "save",
}


def _failure(exc: BaseException) -> tuple[str, str]:
    import torch

    if isinstance(exc, torch.OutOfMemoryError):
        return f"out of device memory: {str(exc).splitlines()[0]}", "RESOURCE_EXHAUSTED"
    if isinstance(exc, StropError):
        return str(exc), exc.grpc_code
    return f"{type(exc).__name__}: {exc}", "INTERNAL"


def _sample(loaded, adapter: str, reqs: list[SampleRequest]) -> list[SampleOutput]:
    """The sampler (``core/sampler.py``) on ``adapter``, all requests in one batch."""
    from strop.trainer_svc.core import sampler

    step_ops.activate(loaded, adapter, trainable=False)
    sreqs = [
        sampler.SampleRequest(
            prompt=list(r.prompt),
            num_samples=r.num_samples,
            params=sampler.SamplingParams(
                max_tokens=r.params.max_tokens,
                temperature=r.params.temperature,
                top_p=r.params.top_p,
                top_k=r.params.top_k,
                stop_token_ids=tuple(r.params.stop_token_ids),
                stop_strings=tuple(r.params.stop_strings),
                seed=r.params.seed,
            ),
            prompt_logprobs=r.prompt_logprobs,
        )
        for r in reqs
    ]
    tok = loaded.tokenizer
    eos = tuple(x for x in [getattr(tok, "eos_token_id", None)] if x is not None)
    results = sampler.sample(
        loaded.model, sreqs, tokenizer=tok, eos_token_ids=eos, max_length=loaded.facts.max_seq_length
    )
    return [
        SampleOutput(
            sequences=[
                SampledSequence(list(s.tokens), list(s.logprobs), s.stop_reason) for s in res.sequences
            ],
            prompt_logprobs=[float("nan") if v is None else v for v in (res.prompt_logprobs or [])],
        )
        for res in results
    ]
