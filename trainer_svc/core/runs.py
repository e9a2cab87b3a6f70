"""Training runs: many tenants' LoRA runs on one loaded session, each primitive a future run by the device's
one worker (``step_worker.py``: the futures, their order, fairness and the queue limits).

- A **run** is a PEFT named adapter on a session's model plus its own AdamW (``step_ops``), owned by a tenant
  (another tenant's run or future is NOT_FOUND). Runs need a session without a job adapter (no AttachLora).
- Every primitive is validated when submitted (``step_checks``: bad input is INVALID_ARGUMENT naming the field,
  nothing queued), then answers a :class:`Future` at once.
- **Admission**: on CUDA a run's adapter state (16 bytes a trainable parameter: fp32 weight, gradient, Adam's two
  moments; counted from the model's shapes, every expert's LoRA pair on a mixture of experts) and a
  ForwardBackward's activations (``admission.estimate``'s per-token figures) must fit in the free memory; the
  queue's limits are the worker's.

Runs live in the process, like the sessions they sit on: a restart loses them (SaveState is the durable form).
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from strop.common import auth
from strop.common.artifacts import ArtifactStore, key_of
from strop.common.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted
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
    SampleRequest,
    SaveOutput,
    SaveRequest,
    TrainingRunInfo,
)
from strop.trainer_svc.core import step_ops
from strop.trainer_svc.core.sessions import Session, Sessions
from strop.trainer_svc.core.step_checks import (
    artifact_name,
    check_adam,
    check_lora,
    check_sample,
    loss_config,
    merge_adam,
    validate_data,
)
from strop.trainer_svc.core.step_worker import Run, StepWorker, pending

log = logging.getLogger("strop.trainer.runs")


class TrainingRuns(StepWorker):
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
        super().__init__(
            device_turn,
            metrics=metrics,
            max_pending_per_run=max_pending_per_run,
            max_pending=max_pending,
            keep_finished=keep_finished,
            hole_seconds=hole_seconds,
            idle_offload_seconds=idle_offload_seconds,
            offload_device=offload_device,
        )
        self.sessions, self.artifacts = sessions, artifacts
        self.max_samplers_per_run = max_samplers_per_run
        self._samplers: dict[str, str] = {}  # sampler id → run id
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
        check_lora(lora)
        if lora.seed is None:
            lora = replace(lora, seed=int.from_bytes(uuid.uuid4().bytes[:4], "little"))
        opt = AdamParams() if req.optimizer is None else req.optimizer
        check_adam(opt, "optimizer")
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
            run = Run(
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

    def _admit_run(self, sess: Session, lora: RunLora) -> None:
        if not sess.loaded.device.startswith("cuda"):
            return
        import torch

        need = run_state_bytes(sess.loaded, lora)
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

    def _run(self, run_id: str) -> Run:
        with self._cond:
            run = self._runs.get(run_id)
        if run is None or not auth.current().can_see(run.info.tenant):
            raise NotFound(f"training run {run_id!r} not found")
        return run

    def _info(self, run: Run) -> TrainingRunInfo:
        with self._cond:
            info = replace(
                run.info,
                pending_futures=pending(run),
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
        cfg = loss_config(loss, req.loss_fn_config)
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
        adam = merge_adam(run.info.optimizer, req.adam_params)
        check_adam(adam, "adam_params")

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

    @contextlib.contextmanager
    def _adapter_artifact(self, run: Run, artifact_id: str, adapter: str, **extra_meta: str):
        """The run's adapter ``adapter`` written as an adapter artifact (its base, the run and step in the
        metadata, plus ``extra_meta``); the artifact is open in the block for more files."""
        loaded = run.sess.loaded
        meta = {
            **step_ops.adapter_base_metadata(loaded, run.info.lora.rank),
            "run_id": run.info.run_id,
            "step": str(run.info.step),
            **extra_meta,
        }
        with self.artifacts.create(
            "adapter", owner=run.info.tenant, artifact_id=artifact_id, metadata=meta
        ) as p:
            step_ops.write_adapter(loaded, adapter, p.dir, rank=run.info.lora.rank)
            yield p

    def save_weights(self, req: SaveRequest) -> Future:
        run = self._run(req.run_id)
        artifact_id = artifact_name(req.name, "name")

        def work():
            _check_finite(run)
            with self._adapter_artifact(run, artifact_id, run.adapter) as p:
                pass
            return SaveOutput(artifact_id=p.artifact_id, step=run.info.step)

        return self._submit(run, req.seq_id, PrimitiveKind.SAVE_WEIGHTS, work)

    def save_state(self, req: SaveRequest) -> Future:
        run = self._run(req.run_id)
        artifact_id = artifact_name(req.name, "name")

        def work():
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
            with self._adapter_artifact(run, artifact_id, run.adapter, run_state="true") as p:
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

    def _load_state_into(self, run: Run, state, *, with_optimizer: bool) -> None:
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
        artifact_id = artifact_name(req.name, "name") if req.name else None

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
                # sampler_id: the snapshot Sample reads while the run holds it
                with self._adapter_artifact(run, artifact_id, sampler_id, sampler_id=sampler_id) as p:
                    pass
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
        check_sample(req, run.sess.loaded.facts)
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

    # ---- helpers ------------------------------------------------------------------------------------------

    def _artifact_dir(self, artifact_id: str, what: str) -> Path:
        if not artifact_id:
            raise InvalidArgument(f"{what} is required")
        key = key_of(auth.current().tenant, artifact_id)
        self.artifacts.verify(key)  # NotFound for unknown ids (and other tenants'), checksum checked
        return self.artifacts.path_of(key)

    def _admit_batch(self, run: Run, data: list[Datum]) -> None:
        loaded = run.sess.loaded
        if not loaded.device.startswith("cuda"):
            return
        import torch

        est = forward_backward_estimate(loaded, run.info, data)
        free, _ = torch.cuda.mem_get_info(torch.device(loaded.device))
        free += torch.cuda.memory_reserved(loaded.device) - torch.cuda.memory_allocated(loaded.device)
        if est.total > free:
            raise ResourceExhausted(
                f"this ForwardBackward needs {est} but {free / 2**30:.2f} GiB are free: send fewer or shorter datums"
            )


def run_state_bytes(loaded, lora: RunLora) -> int:
    """Device bytes a run's adapter state takes: 16 a parameter (fp32 weight, gradient, Adam's two moments), the
    parameters counted from the model's shapes (``step_ops.adapter_numel``: every expert's pair on a mixture of
    experts, most of such a run's parameters)."""
    return 16 * step_ops.adapter_numel(loaded.model, lora)


def forward_backward_estimate(loaded, info: TrainingRunInfo, data: list[Datum]):
    """``admission.estimate`` of one ForwardBackward of ``data`` by the run ``info`` on the session ``loaded``: the
    rows as one SFT batch, each layer checkpointed (``step_ops.add_adapter`` on CUDA), the run's adapter state
    admitted when it was created; a mixture of experts counted as a Train job's is (LoRA on its experts, experts
    held in NF4)."""
    from strop.common.trainer_types import TrainConfig, TrainMethod
    from strop.trainer_svc.core import admission, moe

    base = loaded.model.get_base_model()
    longest = max(len(d.model_input) for d in data)
    return admission.estimate(
        base.config,
        TrainConfig(method=TrainMethod.SFT, batch_size=len(data), max_length=longest),
        longest_row=longest,
        n_trainable=0,
        checkpointed=True,
        offloaded=False,
        kernels=loaded.facts.kernels_enabled,
        expert_lora=moe.expert_lora(base.config, info),
        nf4_experts=moe.holds_nf4_experts(base),
    )


def _owner(sess: Session) -> str:
    """A new run's tenant: the caller's; with authentication off (no tenant), the session's."""
    return auth.current().tenant or sess.info.tenant


def _check_finite(run: Run) -> None:
    import torch

    for name, p in zip(run.param_names, run.params, strict=True):
        if not torch.isfinite(p).all():
            raise FailedPrecondition(
                f"the run's adapter holds non-finite values (first in {name}); not saved"
            )
