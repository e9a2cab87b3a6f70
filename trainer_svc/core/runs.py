"""Training runs and the step API's futures: many tenants' LoRA runs on one loaded session, each primitive a
future run by the device's one worker.

- A **run** is a PEFT named adapter on a session's model plus its own AdamW (``step_ops``), owned by a tenant
  (another tenant's run or future is NOT_FOUND). Runs need a session without a job adapter (no AttachLora).
- Every primitive is validated when submitted (bad input: INVALID_ARGUMENT naming the field, nothing queued),
  then answers a :class:`Future` at once. Per run, futures run in ``seq_id`` order (a request without one takes
  the run's next; a duplicate ``(run, seq_id)`` returns the existing future; a hole blocks the run for
  ``hole_seconds``, then is skipped; a failed or cancelled seq still advances). Samples queue apart and all
  ready ones on a session run as one batch; a Sample of a run's live adapter is ready once every primitive of
  the run submitted before it has run (it sees their weights), a snapshot's at once.
- **Fairness**: the worker serves the runs with a ready head (and the sample queue) round robin, one primitive
  per turn. Each primitive takes the device from the job scheduler (``Jobs.device_turn``: queued jobs go
  first) and the session's lock.
- **Admission**: at most ``max_pending_per_run`` and ``max_pending`` futures not yet run (RESOURCE_EXHAUSTED);
  on CUDA a run's adapter state (16 bytes a trainable parameter: fp32 weight, gradient, Adam's two moments)
  and a ForwardBackward's activations (``admission.estimate``'s per-token figures) must fit in the free memory.
- Results are kept for ``keep_finished`` futures (oldest dropped first).

Runs live in the process, like the sessions they sit on: a restart loses them (SaveState is the durable form).
"""

from __future__ import annotations

import collections
import contextlib
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from strop.common import auth
from strop.common.artifacts import ArtifactStore, key_of
from strop.common.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, StropError
from strop.common.metrics import TrainerMetrics
from strop.common.step_types import (
    AdamParams,
    CreateTrainingRun,
    Datum,
    DatumOutput,
    ForwardBackwardOutput,
    ForwardBackwardRequest,
    Future,
    FutureState,
    LoadStateRequest,
    LossFn,
    Metric,
    OptimStepOutput,
    OptimStepRequest,
    PrimitiveKind,
    RunLora,
    SampledSequence,
    SampleOutput,
    SampleRequest,
    SaveOutput,
    SaveRequest,
    TrainingRunInfo,
)
from strop.trainer_svc.core import step_ops
from strop.trainer_svc.core.sessions import Session, Sessions

log = logging.getLogger("strop.trainer.runs")

SAMPLE_QUEUE = "\0samples"  # the sample queue's place in the round robin
MAX_SAMPLE_TOKENS = 1 << 20  # num_samples × (prompt + max_tokens) of one request


@dataclass
class _Entry:
    future: Future
    tenant: str
    work: Callable[[], Any] | None  # runs on the worker; returns the result field's value
    tokens: int = 0
    sample: SampleRequest | None = None
    # a Sample of a run's live adapter runs once the run has passed this seq (every primitive submitted before it)
    after_seq: int = 0
    done: threading.Event = field(default_factory=threading.Event)


@dataclass
class _Run:
    info: TrainingRunInfo
    sess: Session
    optimizer: Any = None
    param_names: list[str] = field(default_factory=list)
    params: list[Any] = field(default_factory=list)
    queue: dict[int, _Entry] = field(default_factory=dict)  # seq → entry, not yet run
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


class TrainingRuns:
    def __init__(
        self,
        sessions: Sessions,
        artifacts: ArtifactStore,
        device_turn: Callable[[], contextlib.AbstractContextManager],
        *,
        metrics: TrainerMetrics | None = None,
        max_pending_per_run: int = 64,
        max_pending: int = 1024,
        max_samplers_per_run: int = 4,
        keep_finished: int = 10_000,
        hole_seconds: float = 60.0,
        idle_offload_seconds: float = 600.0,
        offload_device: str = "cpu",
    ) -> None:
        self.sessions, self.artifacts, self.device_turn, self.metrics = (
            sessions,
            artifacts,
            device_turn,
            metrics,
        )
        self.max_pending_per_run, self.max_pending = max_pending_per_run, max_pending
        self.max_samplers_per_run, self.keep_finished, self.hole_seconds = (
            max_samplers_per_run,
            keep_finished,
            hole_seconds,
        )
        # a run idle this long moves its adapter, gradients and Adam state to offload_device (0: never); its
        # next primitive brings them back (``_on_device``); only where offload_device is not the session's device
        self.idle_offload_seconds, self.offload_device = idle_offload_seconds, offload_device
        self._last_sweep, self.sweep_seconds = 0.0, 10.0
        self._runs: dict[str, _Run] = {}
        # deleted runs, kept so watchers see their end (newest 1024)
        self._deleted: collections.OrderedDict[str, _Run] = collections.OrderedDict()
        self._samplers: dict[str, str] = {}  # sampler id → run id
        self._futures: collections.OrderedDict[str, _Entry] = collections.OrderedDict()
        self._samples: collections.deque[_Entry] = collections.deque()
        self._rotation: collections.deque[str] = collections.deque()
        self._cond = threading.Condition()
        self._worker: threading.Thread | None = None
        self._stopping = False
        sessions.on_close.append(self._session_closed)
        if metrics is not None:
            metrics.training_runs.set_function(lambda: float(len(self._runs)))
            metrics.futures_pending.set_function(lambda: float(self._pending_count()))

    # ---- runs ---------------------------------------------------------------------------------------------

    def create(self, req: CreateTrainingRun) -> TrainingRunInfo:
        sess = self.sessions.idle(req.session_id, for_runs=True)  # a shared session takes every tenant's runs
        if sess.loaded.lora is not None:
            raise FailedPrecondition(
                f"session {req.session_id} has a job adapter (AttachLora); training runs need a session without one"
            )
        state = None
        lora = req.lora or RunLora()
        if req.from_state:
            state_dir = self._artifact_dir(req.from_state, "from_state")
            state = step_ops.read_state(state_dir)
            saved = state[0]["lora"]
            lora = RunLora(
                **{k: saved[k] for k in ("rank", "alpha", "train_attn", "train_mlp", "train_unembed", "seed")}
            )
        self._check_lora(lora)
        if lora.seed is None:
            lora = replace(lora, seed=int.from_bytes(uuid.uuid4().bytes[:4], "little"))
        opt = AdamParams() if req.optimizer is None else req.optimizer
        _check_adam(opt, "optimizer")
        run_id = f"run-{uuid.uuid4().hex[:12]}"
        now = time.time()
        with sess.lock:
            if sess.info.busy_job_id:
                raise FailedPrecondition(f"session {req.session_id} is busy with job {sess.info.busy_job_id}")
            self._admit_run(sess, lora)
            targets = step_ops.add_adapter(sess.loaded, run_id, lora, trainable=True)
            sess.loaded.extra.setdefault("step_runs", set()).add(run_id)
            named = step_ops.run_params(sess.loaded, run_id)
            params = [p for _, p in named]
            run = _Run(
                TrainingRunInfo(
                    run_id=run_id,
                    name=req.name,
                    session_id=req.session_id,
                    tenant=_owner(sess),
                    base_model=sess.loaded.model_rel,
                    lora=lora,
                    optimizer=opt,
                    target_modules=targets,
                    num_trainable_parameters=sum(p.numel() for p in params),
                    created_at=now,
                    last_activity_at=now,
                ),
                sess,
                optimizer=step_ops.new_optimizer(params, {**opt.resolved()}),
                param_names=[n for n, _ in named],
                params=params,
            )
            if state is not None:
                try:
                    self._load_state_into(run, state, with_optimizer=req.with_optimizer)
                except BaseException:
                    step_ops.delete_adapter(sess.loaded, run_id)
                    raise
        with self._cond:
            self._runs[run_id] = run
            self._rotation.append(run_id)
        log.info("run %s on session %s: rank %d, %s", run_id, req.session_id, lora.rank, targets)
        return self._info(run)

    def _check_lora(self, lora: RunLora) -> None:
        if not 0 < lora.rank <= 1024:
            raise InvalidArgument(f"lora.rank must be in 1..1024, got {lora.rank}")
        if lora.alpha is not None and not (math.isfinite(lora.alpha) and lora.alpha > 0):
            raise InvalidArgument(f"lora.alpha must be a positive finite number, got {lora.alpha}")
        if not (lora.train_attn or lora.train_mlp or lora.train_unembed):
            raise InvalidArgument("lora: at least one of train_attn, train_mlp, train_unembed must be true")

    def _admit_run(self, sess: Session, lora: RunLora) -> None:
        if not sess.loaded.device.startswith("cuda"):
            return
        import torch

        f = sess.loaded.facts
        per_layer = (
            7 * lora.rank * 2 * f.hidden_size * 2
        )  # ≤ 7 projections, A and B, ≤ 2·hidden wide (upper bound)
        need = 16 * per_layer * f.num_layers
        free, _ = torch.cuda.mem_get_info(torch.device(sess.loaded.device))
        if need > free:
            raise ResourceExhausted(
                f"a rank-{lora.rank} run's adapter state needs ≈{need / 2**30:.2f} GiB; {free / 2**30:.2f} GiB free"
            )

    def get(self, run_id: str) -> TrainingRunInfo:
        return self._info(self._run(run_id))

    def list(self, session_id: str = "") -> list[TrainingRunInfo]:
        me = auth.current()
        with self._cond:
            runs = list(self._runs.values())
        return [
            self._info(r)
            for r in runs
            if me.can_see(r.info.tenant) and (not session_id or r.info.session_id == session_id)
        ]

    def delete(self, run_id: str) -> TrainingRunInfo:
        run = self._run(run_id)
        with self._cond:
            run.deleted = True
            for entry in run.queue.values():
                self._finish(entry, FutureState.CANCELLED, error="the run was deleted", code="CANCELLED")
            run.queue.clear()
            self._runs.pop(run_id, None)
            self._deleted[run_id] = run
            while len(self._deleted) > 1024:
                self._deleted.popitem(last=False)
            with contextlib.suppress(ValueError):
                self._rotation.remove(run_id)
            samplers = list(run.samplers)
            for s in samplers:
                self._samplers.pop(s, None)
        with run.sess.lock:  # a primitive of the run running now finishes first
            for s in samplers:
                step_ops.delete_adapter(run.sess.loaded, s)
            step_ops.delete_adapter(run.sess.loaded, run.adapter)
            run.sess.loaded.extra.get("step_runs", set()).discard(run_id)
            run.optimizer, run.params = None, []
        return self._info(run)

    def _session_closed(self, session_id: str) -> None:
        """CloseSession deletes the session's runs (their pending futures end CANCELLED) before its model goes."""
        with self._cond:
            doomed = [r.info.run_id for r in self._runs.values() if r.info.session_id == session_id]
        token = auth.set_current(
            auth.ANONYMOUS
        )  # the session's owner (or an admin) closes it: all its runs go
        try:
            for run_id in doomed:
                self.delete(run_id)
        finally:
            auth.reset_current(token)

    def _run(self, run_id: str) -> _Run:
        with self._cond:
            run = self._runs.get(run_id)
        if run is None or not auth.current().can_see(run.info.tenant):
            raise NotFound(f"training run {run_id!r} not found")
        return run

    def _info(self, run: _Run) -> TrainingRunInfo:
        with self._cond:
            info = replace(
                run.info,
                pending_futures=_waiting(run),
                sampler_ids=list(run.samplers),
                counts=[Metric(k, float(v)) for k, v in sorted(run.counts.items())],
            )
        return info

    # ---- submissions --------------------------------------------------------------------------------------

    def forward_backward(self, req: ForwardBackwardRequest) -> Future:
        run = self._run(req.run_id)
        loss = LossFn.parse(req.loss_fn)
        if loss is LossFn.UNSPECIFIED:
            raise InvalidArgument(
                "loss_fn is required (cross_entropy, importance_sampling, ppo, cispo or dro)"
            )
        cfg = _loss_config(loss, req.loss_fn_config)
        f = run.sess.loaded.facts
        inputs = validate_data(req.data, loss, vocab_size=f.vocab_size, max_length=f.max_seq_length)
        tokens = sum(len(d.model_input) for d in req.data)
        self._admit_batch(run, req.data)
        kind = PrimitiveKind.FORWARD if req.forward_only else PrimitiveKind.FORWARD_BACKWARD

        def work():
            loaded = run.sess.loaded
            batch = step_ops.make_batch([d.model_input for d in req.data], inputs, loaded.device)
            step_ops.activate(loaded, run.adapter, trainable=not req.forward_only)
            loss_value, lps = step_ops.forward_backward(
                loaded, batch, loss.wire, cfg, backward=not req.forward_only
            )
            if not req.forward_only:
                run.info.has_gradients = True
            return ForwardBackwardOutput(
                loss_fn_outputs=[DatumOutput(lp) for lp in lps],
                metrics=[Metric("loss:sum", loss_value)],
            )

        return self._submit(run, req.seq_id, kind, work, tokens=tokens)

    def optim_step(self, req: OptimStepRequest) -> Future:
        run = self._run(req.run_id)
        adam = _merge_adam(run.info.optimizer, req.adam_params)
        _check_adam(adam, "adam_params")

        def work():
            if not run.info.has_gradients:
                raise FailedPrecondition(
                    f"run {run.info.run_id} has no gradients: call ForwardBackward before OptimStep"
                )
            step_ops.activate(run.sess.loaded, run.adapter, trainable=True)
            try:
                metrics = step_ops.optim_step(run.optimizer, run.params, adam.resolved())
            finally:
                run.info.has_gradients = any(p.grad is not None for p in run.params)
            run.info.step += 1
            return OptimStepOutput(
                [Metric(k, v) for k, v in metrics.items()] + [Metric("step:max", run.info.step)]
            )

        return self._submit(run, req.seq_id, PrimitiveKind.OPTIM_STEP, work)

    def save_weights(self, req: SaveRequest) -> Future:
        run = self._run(req.run_id)
        artifact_id = _artifact_name(req.name, "name")

        def work():
            loaded = run.sess.loaded
            meta = {
                **step_ops.adapter_base_metadata(loaded, run.info.lora.rank),
                "run_id": run.info.run_id,
                "step": str(run.info.step),
            }
            _check_finite(run)
            with self.artifacts.create(
                "adapter", owner=run.info.tenant, artifact_id=artifact_id, metadata=meta
            ) as p:
                step_ops.write_adapter(loaded, run.adapter, p.dir, rank=run.info.lora.rank)
            return SaveOutput(artifact_id=p.artifact_id, step=run.info.step)

        return self._submit(run, req.seq_id, PrimitiveKind.SAVE_WEIGHTS, work)

    def save_state(self, req: SaveRequest) -> Future:
        run = self._run(req.run_id)
        artifact_id = _artifact_name(req.name, "name")

        def work():
            loaded = run.sess.loaded
            meta = {
                **step_ops.adapter_base_metadata(loaded, run.info.lora.rank),
                "run_id": run.info.run_id,
                "step": str(run.info.step),
                "run_state": "true",
            }
            state = {
                "run_id": run.info.run_id,
                "step": run.info.step,
                "lora": {
                    "rank": run.info.lora.rank,
                    "alpha": run.info.lora.alpha,
                    "train_attn": run.info.lora.train_attn,
                    "train_mlp": run.info.lora.train_mlp,
                    "train_unembed": run.info.lora.train_unembed,
                    "seed": run.info.lora.seed,
                },
                "param_names": run.param_names,
            }
            _check_finite(run)
            with self.artifacts.create(
                "adapter", owner=run.info.tenant, artifact_id=artifact_id, metadata=meta
            ) as p:
                step_ops.write_adapter(loaded, run.adapter, p.dir, rank=run.info.lora.rank)
                step_ops.write_state(p.dir, state, step_ops.optimizer_tensors(run.optimizer, run.param_names))
            return SaveOutput(artifact_id=p.artifact_id, step=run.info.step)

        return self._submit(run, req.seq_id, PrimitiveKind.SAVE_STATE, work)

    def load_state(self, req: LoadStateRequest) -> Future:
        run = self._run(req.run_id)
        state_dir = self._artifact_dir(req.artifact_id, "artifact_id")

        def work():
            self._load_state_into(run, step_ops.read_state(state_dir), with_optimizer=req.with_optimizer)
            return SaveOutput(artifact_id=req.artifact_id, step=run.info.step)

        return self._submit(run, req.seq_id, PrimitiveKind.LOAD_STATE, work)

    def _load_state_into(self, run: _Run, state, *, with_optimizer: bool) -> None:
        meta, adapter, opt = state
        if meta.get("param_names") != run.param_names:
            raise FailedPrecondition(
                "the saved state's adapter does not match the run's (rank or target modules differ)"
            )
        step_ops.load_adapter_state(run.sess.loaded, run.adapter, adapter)
        for p in run.params:
            p.grad = None
        run.info.has_gradients = False
        if with_optimizer:
            if opt is None:
                raise FailedPrecondition("the saved state holds no optimizer state")
            step_ops.load_optimizer_tensors(run.optimizer, run.param_names, opt)
            run.info.step = int(meta.get("step", 0))
        else:
            run.optimizer.state.clear()
            run.info.step = 0

    def save_weights_for_sampler(self, req: SaveRequest) -> Future:
        run = self._run(req.run_id)
        artifact_id = _artifact_name(req.name, "name") if req.name else None

        def work():
            loaded = run.sess.loaded
            sampler_id = f"smp-{uuid.uuid4().hex[:12]}"
            step_ops.add_adapter(loaded, sampler_id, run.info.lora, trainable=False)
            step_ops.load_adapter_state(loaded, sampler_id, step_ops.adapter_state_dict(loaded, run.adapter))
            evicted = []
            with self._cond:
                run.samplers[sampler_id] = None
                self._samplers[sampler_id] = run.info.run_id
                while len(run.samplers) > self.max_samplers_per_run:
                    old, _ = run.samplers.popitem(last=False)
                    self._samplers.pop(old, None)
                    evicted.append(old)
            for old in evicted:
                step_ops.delete_adapter(loaded, old)
            out = SaveOutput(sampler_id=sampler_id, step=run.info.step)
            if artifact_id:
                meta = {
                    **step_ops.adapter_base_metadata(loaded, run.info.lora.rank),
                    "run_id": run.info.run_id,
                    "step": str(run.info.step),
                    "sampler_id": sampler_id,  # the snapshot Sample reads while the run holds it
                }
                with self.artifacts.create(
                    "adapter", owner=run.info.tenant, artifact_id=artifact_id, metadata=meta
                ) as p:
                    step_ops.write_adapter(loaded, sampler_id, p.dir, rank=run.info.lora.rank)
                out.artifact_id = p.artifact_id
            return out

        return self._submit(run, req.seq_id, PrimitiveKind.SAVE_WEIGHTS_FOR_SAMPLER, work)

    def sample(self, req: SampleRequest) -> Future:
        if bool(req.run_id) == bool(req.sampler_id):
            raise InvalidArgument(
                "give exactly one of run_id (the run's live adapter) and sampler_id (a snapshot)"
            )
        if req.sampler_id:
            with self._cond:
                owner = self._samplers.get(req.sampler_id)
            if owner is None:
                raise NotFound(
                    f"sampler {req.sampler_id!r} not found (unknown, or evicted by newer snapshots)"
                )
            run = self._run(owner)
        else:
            run = self._run(req.run_id)
        _validate_sample(req, run.sess.loaded.facts)
        tokens = req.num_samples * (len(req.prompt) + req.params.max_tokens)
        entry = self._entry(run, 0, PrimitiveKind.SAMPLE, None, tokens)
        entry.sample = req
        with self._cond:
            self._check_queue(run)
            if not req.sampler_id:  # the live weights: after every seq the run has accepted so far
                entry.after_seq = run.info.next_seq_id - 1
            self._futures[entry.future.future_id] = entry
            self._samples.append(entry)
            self._start_worker()
            self._cond.notify_all()
        return replace(entry.future)

    # ---- futures ------------------------------------------------------------------------------------------

    def _entry(self, run: _Run, seq: int, kind: PrimitiveKind, work, tokens: int = 0) -> _Entry:
        fut = Future(
            future_id=f"fut-{uuid.uuid4().hex[:16]}", run_id=run.info.run_id, seq_id=seq, kind=kind,
            state=FutureState.PENDING, created_at=time.time(),
        )  # fmt: skip
        return _Entry(fut, run.info.tenant, work, tokens)

    def _pending_count(self) -> int:
        with self._cond:
            return sum(_waiting(r) for r in self._runs.values()) + len(self._samples)

    def _check_queue(self, run: _Run) -> None:
        mine = _waiting(run) + sum(1 for e in self._samples if e.future.run_id == run.info.run_id)
        if mine >= self.max_pending_per_run:
            raise ResourceExhausted(
                f"run {run.info.run_id} has {mine} futures pending (limit {self.max_pending_per_run}); wait for some"
            )
        total = sum(_waiting(r) for r in self._runs.values()) + len(self._samples)
        if total >= self.max_pending:
            raise ResourceExhausted(
                f"{total} futures are pending on this device (limit {self.max_pending}); retry later"
            )

    def _submit(self, run: _Run, seq_id: int, kind: PrimitiveKind, work, tokens: int = 0) -> Future:
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

    def _visible(self, future_id: str) -> _Entry:
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

    def _run_any(self, run_id: str) -> _Run:
        """A visible run, deleted ones included (a watcher learns that its run ended)."""
        with self._cond:
            run = self._runs.get(run_id) or self._deleted.get(run_id)
        if run is None or not auth.current().can_see(run.info.tenant):
            raise NotFound(f"training run {run_id!r} not found")
        return run

    def _finish(
        self, entry: _Entry, state: FutureState, *, result=None, error: str = "", code: str = ""
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

    def _ready(self, run: _Run) -> _Entry | None:
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

    def _pick(self) -> tuple[str, list[_Entry]] | None:
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

    def _sample_ready(self, e: _Entry) -> bool:
        """A snapshot's sample is ready at once; a live run's once the run has run every seq up to ``after_seq``
        (the worker runs one thing at a time, so a seq below ``next_exec`` has finished)."""
        run = self._runs.get(e.future.run_id)
        return run is None or bool(e.sample.sampler_id) or run.next_exec > e.after_seq

    def _sample_batch(self) -> list[_Entry]:
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
            idle: list[_Run] = []
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

    def _run_one(self, run: _Run, entry: _Entry) -> None:
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

    def _run_samples(self, entries: list[_Entry]) -> None:
        """One call of the sampler per adapter among the pending samples (each group batched together)."""
        groups: dict[str, list[_Entry]] = {}
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

    def _idle_runs(self) -> list[_Run]:
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

    def _offload(self, run: _Run) -> None:
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

    def _on_device(self, run: _Run) -> None:
        """Bring an offloaded run's state back to its session's device (under the session's lock)."""
        if run.offloaded:
            step_ops.move_run_state(run.params, run.optimizer, run.sess.loaded.device)
            run.offloaded = False

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify_all()

    # ---- helpers ------------------------------------------------------------------------------------------

    def _artifact_dir(self, artifact_id: str, what: str) -> Path:
        if not artifact_id:
            raise InvalidArgument(f"{what} is required")
        key = key_of(auth.current().tenant, artifact_id)
        self.artifacts.verify(key)  # NotFound for unknown ids (and other tenants'), checksum checked
        return self.artifacts.path_of(key)

    def _admit_batch(self, run: _Run, data: list[Datum]) -> None:
        loaded = run.sess.loaded
        if not loaded.device.startswith("cuda"):
            return
        import torch

        from strop.common.trainer_types import TrainConfig, TrainMethod
        from strop.trainer_svc.core import admission

        longest = max(len(d.model_input) for d in data)
        est = admission.estimate(
            loaded.model.get_base_model().config,
            TrainConfig(method=TrainMethod.SFT, batch_size=len(data), max_length=longest),
            longest_row=longest, n_trainable=0, checkpointed=True, offloaded=False,
            kernels=loaded.facts.kernels_enabled,
        )  # fmt: skip
        free, _ = torch.cuda.mem_get_info(torch.device(loaded.device))
        free += torch.cuda.memory_reserved(loaded.device) - torch.cuda.memory_allocated(loaded.device)
        if est.total > free:
            raise ResourceExhausted(
                f"this ForwardBackward needs {est} but {free / 2**30:.2f} GiB are free: send fewer or shorter datums"
            )


def _owner(sess: Session) -> str:
    """A new run's tenant: the caller's; with authentication off (no tenant), the session's."""
    return auth.current().tenant or sess.info.tenant


def _waiting(run: _Run) -> int:
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


def _check_finite(run: _Run) -> None:
    import torch

    for name, p in zip(run.param_names, run.params, strict=True):
        if not torch.isfinite(p).all():
            raise FailedPrecondition(
                f"the run's adapter holds non-finite values (first in {name}); not saved"
            )


def _artifact_name(name: str, what: str) -> str | None:
    if not name:
        return None
    from strop.common.artifacts import check_artifact_id

    try:
        return check_artifact_id(name)
    except StropError as exc:
        raise InvalidArgument(f"{what}: {exc}") from None


def _merge_adam(run_default: AdamParams, step: AdamParams | None) -> AdamParams:
    if step is None:
        return run_default
    return AdamParams(
        **{
            k: (getattr(step, k) if getattr(step, k) is not None else getattr(run_default, k))
            for k in vars(step)
        }
    )


def _check_adam(adam: AdamParams, what: str) -> None:
    r = adam.resolved()
    for k, v in r.items():
        if not math.isfinite(v):
            raise InvalidArgument(f"{what}.{k} must be finite, got {v}")
    if r["learning_rate"] < 0:
        raise InvalidArgument(f"{what}.learning_rate must be >= 0, got {r['learning_rate']}")
    for k in ("beta1", "beta2"):
        if not 0.0 <= r[k] < 1.0:
            raise InvalidArgument(f"{what}.{k} must be in [0, 1), got {r[k]}")
    if r["eps"] <= 0:
        raise InvalidArgument(f"{what}.eps must be > 0, got {r['eps']}")
    if r["weight_decay"] < 0 or r["grad_clip_norm"] < 0:
        raise InvalidArgument(f"{what}.weight_decay and grad_clip_norm must be >= 0")


def _loss_config(loss: LossFn, entries: list[Metric]) -> dict[str, float]:
    from strop.kernels.losses.rl import LOSSES

    spec = LOSSES[loss.wire]
    cfg = {}
    for m in entries:
        if m.name not in spec.config:
            known = ", ".join(sorted(spec.config)) or "none"
            raise InvalidArgument(
                f"loss_fn_config: unknown key {m.name!r} for {loss.wire} (its keys: {known})"
            )
        if not math.isfinite(m.value):
            raise InvalidArgument(f"loss_fn_config[{m.name!r}] must be finite, got {m.value}")
        cfg[m.name] = m.value
    return cfg


def validate_data(
    data: list[Datum], loss: LossFn, *, vocab_size: int, max_length: int
) -> list[dict[str, list]]:
    """Every datum checked against the loss's inputs (``rl.LOSSES``); the per-token inputs by name.

    Raises:
        InvalidArgument: naming the datum, the input and the position at fault.
    """
    from strop.kernels.losses.rl import LOSSES

    spec = LOSSES[loss.wire]
    if not data:
        raise InvalidArgument("data: at least one datum is required")
    out = []
    for i, d in enumerate(data):
        n = len(d.model_input)
        if n == 0:
            raise InvalidArgument(f"data[{i}].model_input is empty")
        if n > max_length:
            raise InvalidArgument(
                f"data[{i}].model_input has {n} tokens; the session's max_seq_length is {max_length}"
            )
        bad = next((j for j, t in enumerate(d.model_input) if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise InvalidArgument(
                f"data[{i}].model_input[{bad}] = {d.model_input[bad]} is outside the vocabulary [0, {vocab_size})"
            )
        names = [t.name for t in d.loss_fn_inputs]
        dup = next((x for x in names if names.count(x) > 1), None)
        if dup:
            raise InvalidArgument(f"data[{i}].loss_fn_inputs: {dup!r} given twice")
        inputs = d.inputs()
        allowed = set(spec.required) | set(spec.optional)
        unknown = sorted(set(inputs) - allowed)
        if unknown:
            raise InvalidArgument(
                f"data[{i}].loss_fn_inputs: {unknown[0]!r} is not an input of {loss.wire} (it reads "
                f"{', '.join(spec.required + spec.optional)})"
            )
        missing = [k for k in spec.required if k not in inputs]
        if missing:
            raise InvalidArgument(f"data[{i}].loss_fn_inputs: {loss.wire} needs {missing[0]!r}")
        values: dict[str, list] = {}
        # cross_entropy scores K candidates per position when target_tokens (and weights) are [N, K] (Tinker's
        # top-K distillation); every other input is [N]
        k = _candidates(inputs.get("target_tokens"), n) if loss is LossFn.CROSS_ENTROPY else 1
        for name, t in inputs.items():
            field_ = f"data[{i}].loss_fn_inputs[{name!r}]"
            want_int = name == "target_tokens"
            shape = [n, k] if k > 1 and name in ("target_tokens", "weights") else [n]
            if t.shape and list(t.shape) != shape:
                raise InvalidArgument(
                    f"{field_} has shape {list(t.shape)}; expected {shape} (one per model_input token"
                    + (f", {k} candidates each)" if len(shape) == 2 else ")")
                )
            n_values = n * (shape[1] if len(shape) == 2 else 1)
            vals = t.int_values if want_int else t.float_values
            if (want_int and t.float_values) or (not want_int and t.int_values):
                raise InvalidArgument(f"{field_} must be {'int64' if want_int else 'float32'}")
            if len(vals) != n_values:
                raise InvalidArgument(
                    f"{field_} has {len(vals)} values; expected {n_values} ({'×'.join(map(str, shape))})"
                )
            if want_int:
                bad = next((j for j, v in enumerate(vals) if not 0 <= v < vocab_size), None)
                if bad is not None:
                    raise InvalidArgument(
                        f"{field_}[{bad}] = {vals[bad]} is outside the vocabulary [0, {vocab_size})"
                    )
            else:
                bad = next((j for j, v in enumerate(vals) if not math.isfinite(v)), None)
                if bad is not None:
                    raise InvalidArgument(f"{field_}[{bad}] is {vals[bad]}; values must be finite")
            values[name] = list(vals)
        out.append(values)
    ks = {len(v["target_tokens"]) // len(d.model_input) for v, d in zip(out, data, strict=True)}
    if len(ks) > 1:
        raise InvalidArgument(
            f"data: every datum needs the same number of target candidates, got {sorted(ks)}"
        )
    keys = set(out[0])
    ragged = next((i for i, v in enumerate(out) if set(v) != keys), None)
    if ragged is not None:
        raise InvalidArgument(
            f"data[{ragged}].loss_fn_inputs names other inputs than data[0]'s ({sorted(keys)})"
        )
    return out


def _candidates(t, n: int) -> int:
    """K of a [N, K] ``target_tokens`` (1 for [N] or no shape)."""
    if t is None or len(t.shape) != 2 or t.shape[0] != n or t.shape[1] < 1:
        return 1
    return int(t.shape[1])


def _validate_sample(req: SampleRequest, facts) -> None:
    if not req.prompt:
        raise InvalidArgument("prompt is empty")
    bad = next((j for j, t in enumerate(req.prompt) if not 0 <= t < facts.vocab_size), None)
    if bad is not None:
        raise InvalidArgument(
            f"prompt[{bad}] = {req.prompt[bad]} is outside the vocabulary [0, {facts.vocab_size})"
        )
    p = req.params
    if req.num_samples < 1:
        raise InvalidArgument(f"num_samples must be >= 1, got {req.num_samples}")
    if p.max_tokens < 1:
        raise InvalidArgument(f"params.max_tokens must be >= 1, got {p.max_tokens}")
    if len(req.prompt) + p.max_tokens > facts.max_seq_length:
        raise InvalidArgument(
            f"prompt ({len(req.prompt)} tokens) + params.max_tokens ({p.max_tokens}) exceed the session's "
            f"max_seq_length {facts.max_seq_length}"
        )
    if req.num_samples * (len(req.prompt) + p.max_tokens) > MAX_SAMPLE_TOKENS:
        raise InvalidArgument(f"num_samples × (prompt + max_tokens) is above {MAX_SAMPLE_TOKENS} tokens")
    if not (math.isfinite(p.temperature) and p.temperature >= 0):
        raise InvalidArgument(f"params.temperature must be finite and >= 0, got {p.temperature}")
    if not (0 < p.top_p <= 1):
        raise InvalidArgument(f"params.top_p must be in (0, 1], got {p.top_p}")
    if p.top_k == 0 or p.top_k < -1:
        raise InvalidArgument(f"params.top_k must be -1 (off) or >= 1, got {p.top_k}")
    bad = next((t for t in p.stop_token_ids if not 0 <= t < facts.vocab_size), None)
    if bad is not None:
        raise InvalidArgument(f"params.stop_token_ids: {bad} is outside the vocabulary")


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
