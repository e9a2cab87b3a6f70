"""The gateway's state and operations, free of HTTP: Tinker sessions, models (strop training runs), samplers and
futures, each owned by the API key that made it. Every trainer call carries the caller's API key as its bearer
token, so the trainer decides the tenant and hides other tenants' runs, futures and artifacts (NOT_FOUND); the
gateway's own maps are checked against the same key.

Results are the ``tinker`` SDK's own types (or its protobuf bytes for ``ForwardBackwardOutput`` and
``SampleResponse``), so what leaves the gateway is what the pinned SDK validates.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import hashlib
import threading
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tinker import types as tt

from strop.client import TrainerClient
from strop.client.errors import NotFoundError, StropClientError
from strop.common.serde import to_proto
from strop.common.step_types import (
    Datum,
    ForwardBackwardRequest,
    Future,
    FutureState,
    LossFn,
    OptimStepRequest,
    RunLora,
    SampleRequest,
)
from strop.common.trainer_types import Quantization
from strop.gateways.tinker import wire
from strop.gateways.tinker.wire import WireError
from strop.v1 import trainer_pb2

ANSWERED_TTL_S = 600.0  # a future whose final answer went out is forgotten this long after

# gRPC status of a trainer error → the HTTP status the SDK maps to its exception (docs/tinker-gateway.md)
HTTP_STATUS = {
    "INVALID_ARGUMENT": 400,
    "FAILED_PRECONDITION": 400,
    "OUT_OF_RANGE": 400,
    "ALREADY_EXISTS": 409,
    "NOT_FOUND": 404,
    "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403,
    "RESOURCE_EXHAUSTED": 429,
    "UNAVAILABLE": 503,
    "DEADLINE_EXCEEDED": 504,
}
USER_CODES = {"INVALID_ARGUMENT", "FAILED_PRECONDITION", "OUT_OF_RANGE", "NOT_FOUND", "ALREADY_EXISTS"}


def http_error(exc: StropClientError) -> WireError:
    return WireError(exc.details, HTTP_STATUS.get(exc.code, 502))


@dataclass
class GatewayConfig:
    trainer: str = "127.0.0.1:50051"  # the trainer's gRPC address
    model_root: Path | None = None  # the trainer's model root, read-only: base models and their tokenizers
    quantization: Quantization = Quantization.UNSPECIFIED  # how base sessions are loaded
    dtype: str = ""
    max_seq_length: int = 0
    poll_ms: int = 10_000  # how long retrieve_future holds a pending future before try_again
    default_max_tokens: int = 256  # SamplingParams.max_tokens=None
    max_chunk_datums: int = (
        1024  # the client config's fwdbwd_max_chunk_len: the SDK splits forward_backward there
    )
    lora_alpha: float | None = None  # None: strop's default for runs (DEFAULT_RUN_LORA_ALPHA)
    tls_ca: str | None = None


@dataclass
class _Owned:
    owner: str  # sha256 of the API key


@dataclass
class _Model(_Owned):
    model_id: str
    run_id: str
    base_model: str
    rank: int
    created: float
    user_metadata: dict[str, str] | None = None


@dataclass
class _Sampler(_Owned):
    sampler_id: str  # strop's snapshot id, or "" for a run's live adapter
    run_id: str
    base_model: str
    model_path: str | None


@dataclass
class _Pending(_Owned):
    """A Tinker future: a strop step future (``future_id``) or gateway work (``local``), and how to answer it."""

    kind: str
    future_id: str = ""
    local: cf.Future | None = None
    ctx: dict[str, Any] = field(default_factory=dict)
    answered_at: float = 0.0  # when its final answer was first sent (kept a while for the SDK's re-polls)


class Gateway:
    def __init__(self, config: GatewayConfig):
        self.config = config
        self._lock = threading.Lock()
        self._clients: dict[str, TrainerClient] = {}
        self._sessions: dict[str, str] = {}  # tinker session id → owner
        self._bases: dict[tuple[str, str], str] = {}  # (owner, base model) → strop session id
        self._base_locks: dict[tuple[str, str], threading.Lock] = {}
        self._base_runs: dict[tuple[str, str], str] = {}  # (owner, base) → a fresh run: samples the base
        self._models: dict[str, _Model] = {}
        self._samplers: dict[str, _Sampler] = {}
        self._snapshots: dict[str, str] = {}  # sampler_weights artifact id → strop snapshot id
        self._futures: dict[str, _Pending] = {}
        self._work = cf.ThreadPoolExecutor(max_workers=8, thread_name_prefix="tinker-gw")

    def close(self) -> None:
        self._work.shutdown(wait=False, cancel_futures=True)
        for c in self._clients.values():
            c.close()

    # ---- callers ------------------------------------------------------------------------------------------

    @staticmethod
    def owner_of(api_key: str | None) -> str:
        if not api_key:
            raise WireError("an API key is needed (header X-API-Key)", 401)
        if not api_key.startswith("tml-"):
            raise WireError("the API key must start with 'tml-'", 401)
        return hashlib.sha256(api_key.encode()).hexdigest()

    def client(self, api_key: str) -> TrainerClient:
        owner = self.owner_of(api_key)
        with self._lock:
            c = self._clients.get(owner)
            if c is None:
                c = TrainerClient(self.config.trainer, token=api_key, tls_ca=self.config.tls_ca)
                self._clients[owner] = c
            return c

    def _owned(self, table: dict, key: str, owner: str, what: str):
        with self._lock:
            item = table.get(key)
        if item is None or (item if isinstance(item, str) else item.owner) != owner:
            raise WireError(f"{what} {key!r} not found", 404)
        return item

    # ---- service ------------------------------------------------------------------------------------------

    def base_models(self) -> list[str]:
        root = self.config.model_root
        if root is None or not root.is_dir():
            return []
        found = [p.parent.relative_to(root).as_posix() for p in root.glob("*/config.json")]
        found += [p.parent.relative_to(root).as_posix() for p in root.glob("*/*/config.json")]
        return sorted(found)

    def capabilities(self) -> tt.GetServerCapabilitiesResponse:
        return tt.GetServerCapabilitiesResponse(
            supported_models=[
                {"model_name": m, "trainable": True, "sampleable": True} for m in self.base_models()
            ]
        )

    def create_session(self, api_key: str) -> tt.CreateSessionResponse:
        owner = self.owner_of(api_key)
        sid = f"tks-{uuid.uuid4().hex[:16]}"
        with self._lock:
            self._sessions[sid] = owner
        return tt.CreateSessionResponse(session_id=sid)

    def heartbeat(self, api_key: str, session_id: str) -> None:
        self._owned(self._sessions, session_id, self.owner_of(api_key), "session")

    # ---- bases and models ---------------------------------------------------------------------------------

    def _base_session(self, api_key: str, base_model: str) -> str:
        """The caller's session on ``base_model`` (loaded on first use; one per tenant and base)."""
        owner = self.owner_of(api_key)
        if base_model not in self.base_models():
            raise WireError(
                f"base_model {base_model!r} is not served here (get_server_capabilities lists the served ones)"
            )
        key = (owner, base_model)
        with self._lock:
            lock = self._base_locks.setdefault(key, threading.Lock())
        with lock:
            c = self.client(api_key)
            sid = self._bases.get(key)
            if sid is not None:
                try:
                    if c.get_session(sid).state.value in ("LOADED", "READY"):
                        return sid
                except NotFoundError:
                    pass
            s = self._call(lambda: c.load_model(
                base_model, quantization=self.config.quantization, dtype=self.config.dtype,
                max_seq_length=self.config.max_seq_length, name=f"tinker-{base_model.replace('/', '-')}",
            ))  # fmt: skip
            self._bases[key] = s.session_id
            return s.session_id

    def _local(self, api_key: str, kind: str, fn, **ctx) -> tt.UntypedAPIFuture:
        owner = self.owner_of(api_key)
        rid = f"tkf-{uuid.uuid4().hex}"
        with self._lock:
            self._sweep()
            self._futures[rid] = _Pending(owner, kind, local=self._work.submit(fn), ctx=ctx)
        return tt.UntypedAPIFuture(request_id=rid, model_id=ctx.get("model_id"))

    def _remote(self, api_key: str, kind: str, future: Future, **ctx) -> tt.UntypedAPIFuture:
        owner = self.owner_of(api_key)
        rid = f"tkf-{future.future_id}"
        with self._lock:
            self._sweep()
            self._futures[rid] = _Pending(owner, kind, future_id=future.future_id, ctx=ctx)
        return tt.UntypedAPIFuture(
            request_id=rid, model_id=ctx.get("model_id"), sample_sequence_ids=ctx.get("sequence_ids")
        )

    def _sweep(self) -> None:
        """Under the lock: forget futures answered more than ANSWERED_TTL_S ago."""
        old = time.monotonic() - ANSWERED_TTL_S
        for rid in [r for r, p in self._futures.items() if p.answered_at and p.answered_at < old]:
            del self._futures[rid]

    def _new_model(self, api_key, model_id, run, base_model, user_metadata) -> None:
        self._check_new_model_id(api_key, model_id)
        with self._lock:
            self._models[model_id] = _Model(
                self.owner_of(api_key), model_id, run.run_id, base_model, run.info.lora.rank, time.time(),
                {str(k): str(v) for k, v in (user_metadata or {}).items()} or None,
            )  # fmt: skip

    def _check_new_model_id(self, api_key: str, model_id: str) -> None:
        with self._lock:
            if model_id in self._models:
                raise WireError(f"model {model_id!r} exists already", 400)

    def _session_model_id(self, api_key: str, session_id: str | None, model_seq_id: int | None) -> str:
        if session_id is None or model_seq_id is None:
            raise WireError("session_id and model_seq_id are needed")
        self._owned(self._sessions, session_id, self.owner_of(api_key), "session")
        model_id = f"{session_id}:train:{int(model_seq_id)}"  # the SDK assumes exactly this form
        self._check_new_model_id(api_key, model_id)
        return model_id

    def create_model(self, api_key: str, req: tt.CreateModelRequest) -> tt.UntypedAPIFuture:
        model_id = self._session_model_id(api_key, req.session_id, req.model_seq_id)
        lc = req.lora_config or tt.LoraConfig(rank=32)
        if getattr(req.optimizer_config, "type", "adamw") != "adamw":
            raise WireError(f"optimizer_config type {req.optimizer_config.type!r} is not supported (adamw)")
        lora = RunLora(
            rank=int(lc.rank), alpha=self.config.lora_alpha, train_attn=lc.train_attn, train_mlp=lc.train_mlp,
            train_unembed=lc.train_unembed, seed=lc.seed,
        )  # fmt: skip
        base = self._base_session(api_key, req.base_model)  # an unknown base is a 400 at once

        def work():
            run = self.client(api_key).create_training_run(base, lora)
            self._new_model(api_key, model_id, run, req.base_model, req.user_metadata)
            return tt.CreateModelResponse(model_id=model_id)

        return self._local(api_key, "create_model", work, model_id=model_id)

    def model(self, api_key: str, model_id: str) -> _Model:
        return self._owned(self._models, model_id, self.owner_of(api_key), "model")

    def tokenizer_id(self, base_model: str) -> str:
        root = self.config.model_root
        return str(root / base_model) if root is not None else base_model

    def get_info(self, api_key: str, model_id: str) -> tt.GetInfoResponse:
        m = self.model(api_key, model_id)
        return tt.GetInfoResponse(
            model_id=model_id, model_data={"model_name": m.base_model, "tokenizer_id": self.tokenizer_id(m.base_model)},
            is_lora=True, lora_rank=m.rank, model_name=m.base_model,
        )  # fmt: skip

    def unload_model(self, api_key: str, model_id: str) -> None:
        m = self.model(api_key, model_id)
        self._call(lambda: self.client(api_key).delete_training_run(m.run_id))
        with self._lock:
            self._models.pop(model_id, None)

    @staticmethod
    def _call(fn):
        try:
            return fn()
        except StropClientError as exc:
            raise http_error(exc) from None

    def _step(self, api_key: str, rpc: str, msg) -> Future:
        from strop.common.serde import from_proto

        c = self.client(api_key)
        return self._call(lambda: from_proto(Future, c._call(getattr(c._stub, rpc), msg, name=rpc)))

    @contextlib.contextmanager
    def _seq_kept(self, api_key: str, run_id: str, seq_id: int):
        """A refused submission still uses up its seq id (the SDK numbers on; Tinker's rule), so the run does not
        wait for it: the seq is filled with a Forward of one token at weight 0, which changes nothing."""
        try:
            yield
        except WireError:
            if seq_id > 0:
                filler = ForwardBackwardRequest(
                    run_id=run_id, seq_id=seq_id, forward_only=True, loss_fn=LossFn.CROSS_ENTROPY,
                    data=[Datum.of([0], target_tokens=[0], weights=[0.0])],
                )  # fmt: skip
                with contextlib.suppress(WireError):
                    self._step(
                        api_key, "ForwardBackward", to_proto(trainer_pb2.ForwardBackwardRequest, filler)
                    )
            raise

    # ---- training -----------------------------------------------------------------------------------------

    def forward_backward(self, api_key: str, body: bytes) -> tt.UntypedAPIFuture:
        from tinker.proto import tinker_public_pb2 as pb

        msg = pb.ForwardBackwardRequest()
        try:
            msg.ParseFromString(body)
        except Exception as exc:
            raise WireError(f"the body is not a tinker ForwardBackwardRequest: {exc}") from None
        m = self.model(api_key, msg.model_id)
        with self._seq_kept(api_key, m.run_id, msg.seq_id):
            data, loss, config = wire.forward_backward_from_proto(msg)
            req = to_proto(trainer_pb2.ForwardBackwardRequest, ForwardBackwardRequest(
                run_id=m.run_id, seq_id=msg.seq_id, data=data, loss_fn=loss, loss_fn_config=config,
                forward_only=msg.forward_only,
            ))  # fmt: skip
            ks = []
            for d in data:
                t = d.inputs().get("target_tokens")
                ks.append(t.shape[1] if t is not None and len(t.shape) == 2 else 1)
            fut = self._step(api_key, "ForwardBackward", req)
        return self._remote(api_key, "forward_backward", fut, model_id=msg.model_id, ks=ks)

    def optim_step(self, api_key: str, req: tt.OptimStepRequest) -> tt.UntypedAPIFuture:
        m = self.model(api_key, req.model_id)
        with self._seq_kept(api_key, m.run_id, req.seq_id or 0):
            if not isinstance(req.optim_params, tt.AdamParams):
                raise WireError("optim_step: only adam_params are supported")
            msg = to_proto(trainer_pb2.OptimStepRequest, OptimStepRequest(
                m.run_id, req.seq_id or 0, wire.adam_from_wire(req.optim_params)))  # fmt: skip
            fut = self._step(api_key, "OptimStep", msg)
        return self._remote(api_key, "optim_step", fut, model_id=req.model_id)

    # ---- weights ------------------------------------------------------------------------------------------

    def save_weights(self, api_key: str, req: tt.SaveWeightsRequest) -> tt.UntypedAPIFuture:
        m = self.model(api_key, req.model_id)
        with self._seq_kept(api_key, m.run_id, req.seq_id or 0):
            name = wire.check_name(req.path or f"state-{uuid.uuid4().hex[:8]}", "path")
            aid = wire.artifact_id(req.model_id, "weights", name)
            msg = trainer_pb2.SaveRequest(run_id=m.run_id, seq_id=req.seq_id or 0, name=aid)
            fut = self._step(api_key, "SaveState", msg)
        return self._remote(
            api_key, "save_weights", fut, model_id=req.model_id,
            path=wire.tinker_path(req.model_id, "weights", name),
        )  # fmt: skip

    def save_weights_for_sampler(
        self, api_key: str, req: tt.SaveWeightsForSamplerRequest
    ) -> tt.UntypedAPIFuture:
        m = self.model(api_key, req.model_id)
        with self._seq_kept(api_key, m.run_id, req.seq_id or 0):
            if req.kind != "snapshot":
                raise WireError(f"save_weights_for_sampler kind {req.kind!r} is not supported (snapshot)")
            aid = path = ""
            if req.path:
                name = wire.check_name(req.path, "path")
                aid = wire.artifact_id(req.model_id, "sampler_weights", name)
                path = wire.tinker_path(req.model_id, "sampler_weights", name)
            msg = trainer_pb2.SaveRequest(run_id=m.run_id, seq_id=req.seq_id or 0, name=aid)
            fut = self._step(api_key, "SaveWeightsForSampler", msg)
        return self._remote(
            api_key, "save_weights_for_sampler", fut, model_id=req.model_id, path=path, artifact_id=aid,
            base_model=m.base_model, run_id=m.run_id,
        )  # fmt: skip

    @staticmethod
    def _training_artifact(path: str) -> str:
        src_model, kind, name = wire.parse_path(path)
        if kind != "weights":
            raise WireError(f"{path!r} holds sampler weights; load a training checkpoint (…/weights/…)")
        return wire.artifact_id(src_model, kind, name)

    def load_weights(self, api_key: str, req: tt.LoadWeightsRequest) -> tt.UntypedAPIFuture:
        c = self.client(api_key)
        if req.model_id:  # TrainingClient.load_state: into an existing model, in its seq order
            m = self.model(api_key, req.model_id)
            with self._seq_kept(api_key, m.run_id, req.seq_id or 0):
                aid = self._training_artifact(req.path)
                msg = trainer_pb2.LoadStateRequest(
                    run_id=m.run_id, seq_id=req.seq_id or 0, artifact_id=aid, with_optimizer=req.optimizer
                )
                fut = self._step(api_key, "LoadState", msg)
            return self._remote(api_key, "load_weights", fut, model_id=req.model_id, path=req.path)
        aid = self._training_artifact(req.path)
        model_id = self._session_model_id(api_key, req.session_id, req.model_seq_id)
        art = self._call(lambda: c.get_artifact(aid))
        if art.metadata.get("run_state") != "true":
            raise WireError(f"{req.path!r} holds no training state")
        base_model = art.metadata.get("base_model", "")
        base = self._base_session(api_key, base_model)

        def work():
            run = c.create_training_run(base, from_state=aid, with_optimizer=req.optimizer)
            self._new_model(api_key, model_id, run, base_model, req.user_metadata)
            return tt.LoadWeightsResponse(path=req.path, model_id=model_id)

        return self._local(api_key, "load_weights", work, model_id=model_id)

    # ---- sampling -----------------------------------------------------------------------------------------

    def create_sampling_session(self, api_key: str, req: tt.CreateSamplingSessionRequest):
        owner = self.owner_of(api_key)
        self._owned(self._sessions, req.session_id, owner, "session")
        if req.model_path:
            src_model, kind, name = wire.parse_path(req.model_path)
            aid = wire.artifact_id(src_model, kind, name)
            with self._lock:
                snap = self._snapshots.get(aid)
            if snap is None:
                raise WireError(
                    f"{req.model_path!r}: no sampler snapshot of it is loaded on the trainer (a sampler path is "
                    "sampled while its run holds the snapshot: save_weights_for_sampler, then sample)",
                    404,
                )
            self._call(lambda: self.client(api_key).get_artifact(aid))  # the tenant's, or NOT_FOUND
            src = self.model(api_key, src_model)
            s = _Sampler(owner, snap, src.run_id, src.base_model, req.model_path)
        elif req.base_model:
            s = _Sampler(owner, "", self._base_run(api_key, req.base_model), req.base_model, None)
        else:
            raise WireError("create_sampling_session needs model_path or base_model")
        sid = f"{req.session_id}:sample:{req.sampling_session_seq_id}"
        with self._lock:
            self._samplers[sid] = s
        return tt.CreateSamplingSessionResponse(sampling_session_id=sid)

    def _base_run(self, api_key: str, base_model: str) -> str:
        """A run never trained: its LoRA's B is zero, so it samples the base model exactly."""
        key = (self.owner_of(api_key), base_model)
        with self._lock:
            rid = self._base_runs.get(key)
        if rid is None:
            base = self._base_session(api_key, base_model)
            run = self._call(lambda: self.client(api_key).create_training_run(
                base, RunLora(rank=1, train_attn=True, train_mlp=False, train_unembed=False, seed=0)))  # fmt: skip
            with self._lock:
                rid = self._base_runs.setdefault(key, run.run_id)
        return rid

    def get_sampler(self, api_key: str, sampler_id: str) -> tt.GetSamplerResponse:
        s = self._owned(self._samplers, sampler_id, self.owner_of(api_key), "sampler")
        return tt.GetSamplerResponse(sampler_id=sampler_id, base_model=s.base_model, model_path=s.model_path)

    def sample(self, api_key: str, req: tt.SampleRequest) -> tt.UntypedAPIFuture:
        owner = self.owner_of(api_key)
        if req.sampling_session_id:
            s = self._owned(self._samplers, req.sampling_session_id, owner, "sampling session")
        else:
            raise WireError("sample needs a sampling_session_id")
        for what, v in (("topk_prompt_logprobs", req.topk_prompt_logprobs),
                        ("topk_sample_logprobs", req.topk_sample_logprobs),
                        ("prompt_alt_tokens_k", req.prompt_alt_tokens_k)):  # fmt: skip
            if v:
                raise WireError(f"{what} is not supported by this server")
        if req.target_prompt_logprobs is not None or req.record_stability_info:
            raise WireError(
                "target_prompt_logprobs and record_stability_info are not supported by this server"
            )
        sreq = SampleRequest(
            run_id="" if s.sampler_id else s.run_id, sampler_id=s.sampler_id, prompt=wire.prompt_tokens(req.prompt),
            num_samples=req.num_samples, params=wire.sampling_from_wire(req.sampling_params, self.config.default_max_tokens),
            prompt_logprobs=bool(req.prompt_logprobs),
        )  # fmt: skip
        fut = self._step(api_key, "Sample", to_proto(trainer_pb2.SampleRequest, sreq))
        ids = [f"{fut.future_id}:{i}" for i in range(req.num_samples)]
        return self._remote(
            api_key, "sample", fut, sequence_ids=ids, prompt_logprobs=bool(req.prompt_logprobs)
        )

    # ---- futures ------------------------------------------------------------------------------------------

    def retrieve(self, api_key: str, request_id: str) -> Any:
        """The result (an SDK model or protobuf bytes), a ``tt.RequestFailedResponse``, or None while pending."""
        p = self._owned(self._futures, request_id, self.owner_of(api_key), "future")
        out = self._answer(api_key, p)
        if out is not None and not p.answered_at:
            p.answered_at = time.monotonic()
        return out

    def _answer(self, api_key: str, p: _Pending) -> Any:
        wait = self.config.poll_ms / 1000.0
        if p.local is not None:
            try:
                return p.local.result(timeout=wait)
            except cf.TimeoutError:
                return None
            except WireError as exc:
                return _failed(str(exc), "user")
            except StropClientError as exc:
                return _failed(exc.details, "user" if exc.code in USER_CODES else "server")
        c = self.client(api_key)
        f = self._call(lambda: c.get_future(p.future_id, wait_ms=self.config.poll_ms))
        if not f.state.done:
            return None
        if f.state is not FutureState.SUCCEEDED:
            cat = (
                "user"
                if f.error_code in USER_CODES
                else "unknown"
                if f.state is FutureState.CANCELLED
                else "server"
            )
            return _failed(f.error or f.state.value, cat)
        return self._result(api_key, p, f)

    def _result(self, api_key: str, p: _Pending, f: Future) -> Any:
        if p.kind == "forward_backward":
            return wire.forward_backward_output_to_proto(f.forward_backward, p.ctx["ks"])
        if p.kind == "optim_step":
            return tt.OptimStepResponse(metrics={m.name: m.value for m in f.optim_step.metrics})
        if p.kind == "sample":
            return wire.sample_output_to_proto(f.sample, p.ctx["prompt_logprobs"])
        if p.kind == "save_weights":
            return tt.SaveWeightsResponse(path=p.ctx["path"])
        if p.kind == "load_weights":
            return tt.LoadWeightsResponse(path=p.ctx["path"], model_id=p.ctx["model_id"])
        if p.kind == "save_weights_for_sampler":
            snap = f.save.sampler_id
            if p.ctx["path"]:
                with self._lock:
                    self._snapshots[p.ctx["artifact_id"]] = snap
                return tt.SaveWeightsForSamplerResponseInternal(path=p.ctx["path"])
            owner = self.owner_of(api_key)
            sid = f"{p.ctx['model_id']}:sample:{snap}"
            with self._lock:
                self._samplers[sid] = _Sampler(owner, snap, p.ctx["run_id"], p.ctx["base_model"], None)
            return tt.SaveWeightsForSamplerResponseInternal(sampling_session_id=sid)
        raise AssertionError(p.kind)

    # ---- REST ---------------------------------------------------------------------------------------------

    def _checkpoints(self, api_key: str, model_id: str) -> list[tt.Checkpoint]:
        prefix = wire.run_key(model_id) + "-"
        arts = self._call(lambda: self.client(api_key).list_artifacts("adapter"))
        out = []
        for a in arts:
            if not a.artifact_id.startswith(prefix):
                continue
            letter, _, name = a.artifact_id[len(prefix) :].partition("-")
            kind = {v: k for k, v in wire.KINDS.items()}.get(letter)
            if kind is None:
                continue
            out.append(tt.Checkpoint(
                checkpoint_id=f"{kind}/{name}", checkpoint_type="training" if kind == "weights" else "sampler",
                time=datetime.fromtimestamp(a.created_at, UTC), tinker_path=wire.tinker_path(model_id, kind, name),
                size_bytes=a.size_bytes,
            ))  # fmt: skip
        return sorted(out, key=lambda c: c.time)

    def list_checkpoints(self, api_key: str, model_id: str) -> tt.CheckpointsListResponse:
        self.model(api_key, model_id)
        cps = self._checkpoints(api_key, model_id)
        return tt.CheckpointsListResponse(
            checkpoints=cps, cursor={"offset": 0, "limit": len(cps), "total_count": len(cps)}
        )

    def delete_checkpoint(self, api_key: str, model_id: str, checkpoint_id: str) -> None:
        self.model(api_key, model_id)
        kind, _, name = checkpoint_id.partition("/")
        if kind not in wire.KINDS:
            raise WireError(
                f"checkpoint id {checkpoint_id!r}: expected weights/<name> or sampler_weights/<name>"
            )
        aid = wire.artifact_id(model_id, kind, wire.check_name(name, "checkpoint name"))
        self._call(lambda: self.client(api_key).delete_artifact(aid))
        with self._lock:
            self._snapshots.pop(aid, None)

    def training_run(self, api_key: str, model_id: str) -> tt.TrainingRun:
        m = self.model(api_key, model_id)
        info = self._call(lambda: self.client(api_key).get_training_run(m.run_id))
        cps = self._checkpoints(api_key, model_id)
        last = {
            t: next((c for c in reversed(cps) if c.checkpoint_type == t), None)
            for t in ("training", "sampler")
        }
        return tt.TrainingRun(
            training_run_id=model_id, base_model=m.base_model, model_owner=info.tenant or "local", is_lora=True,
            lora_rank=m.rank, last_request_time=datetime.fromtimestamp(info.last_activity_at or m.created, UTC),
            last_checkpoint=last["training"], last_sampler_checkpoint=last["sampler"], user_metadata=m.user_metadata,
        )  # fmt: skip

    def training_runs(self, api_key: str, limit: int, offset: int) -> tt.TrainingRunsResponse:
        owner = self.owner_of(api_key)
        with self._lock:
            ids = sorted((m.created, m.model_id) for m in self._models.values() if m.owner == owner)
        page = [mid for _, mid in ids[offset : offset + limit]]
        runs = [self.training_run(api_key, mid) for mid in page]
        return tt.TrainingRunsResponse(
            training_runs=runs, cursor={"offset": offset, "limit": limit, "total_count": len(ids)}
        )

    def weights_info(self, api_key: str, path: str) -> tt.WeightsInfoResponse:
        src_model, kind, name = wire.parse_path(path)
        art = self._call(lambda: self.client(api_key).get_artifact(wire.artifact_id(src_model, kind, name)))
        return tt.WeightsInfoResponse(
            base_model=art.metadata.get("base_model", ""),
            is_lora=True,
            lora_rank=int(art.metadata.get("r", 0)) or None,
        )


def _failed(message: str, category: str) -> tt.RequestFailedResponse:
    return tt.RequestFailedResponse(error=message, category=category)
