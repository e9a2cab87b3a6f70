"""The gateway's operations, free of HTTP: Tinker sessions, models (strop training runs on shared bases),
samplers and futures. Every trainer call carries the caller's API key as its bearer token. So the trainer decides
the tenant, and it hides other tenants' runs, futures and artifacts (NOT_FOUND).

The gateway keeps no state that a restart loses. The ids the SDK holds carry what is needed to answer them
(``handles``), and the rest is read from the trainer (``index``: shared bases, model id → run). The only tables
in memory are caches and the work in flight, and both can be rebuilt.

Results are the ``tinker`` SDK's own types, or its protobuf bytes for ``ForwardBackwardOutput`` and
``SampleResponse``. So what leaves the gateway is what the pinned SDK validates.
"""

from __future__ import annotations

import concurrent.futures as cf
import contextlib
import threading
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from tinker import types as tt

from strop.client import TrainerClient
from strop.client.errors import StropClientError
from strop.common.serde import from_proto, to_proto
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
from strop.gateways.common import HTTP_STATUS, USER_CODES, TrainerClients, base_models, owner_hash
from strop.gateways.tinker import handles, wire
from strop.gateways.tinker.index import LoadSpec, Model, TrainerIndex
from strop.gateways.tinker.wire import WireError
from strop.v1 import trainer_pb2


def http_error(exc: StropClientError) -> WireError:
    return WireError(exc.details, HTTP_STATUS.get(exc.code, 502))


@dataclass
class GatewayConfig:
    trainer: str = "127.0.0.1:50051"  # the trainer's gRPC address
    model_root: Path | None = None  # the trainer's model root, read-only: base models and their tokenizers
    quantization: Quantization = Quantization.UNSPECIFIED  # how the gateway loads a shared base
    dtype: str = ""
    max_seq_length: int = 0
    poll_ms: int = 10_000  # how long retrieve_future holds a pending future before try_again
    default_max_tokens: int = 256  # SamplingParams.max_tokens=None
    max_chunk_datums: int = (
        1024  # the client config's fwdbwd_max_chunk_len: the SDK splits forward_backward there
    )
    lora_alpha: float | None = None  # None: strop's default for runs (DEFAULT_RUN_LORA_ALPHA)
    tls_ca: str | None = None
    admin_token: str | None = None  # loads shared bases; None: the caller's key tries (index.py)


class Gateway:
    def __init__(self, config: GatewayConfig):
        self.config = config
        self._lock = threading.Lock()
        self._clients = TrainerClients(config.trainer, config.tls_ca)
        admin = None
        if config.admin_token:
            admin = TrainerClient(config.trainer, token=config.admin_token, tls_ca=config.tls_ca)
        spec = LoadSpec(config.quantization, config.dtype, config.max_seq_length)
        self.index = TrainerIndex(self._call, spec, admin)
        self._inflight: dict[str, cf.Future] = {}  # request id → the gateway's own work (create_model, load)
        self._work = cf.ThreadPoolExecutor(max_workers=8, thread_name_prefix="tinker-gw")

    def close(self) -> None:
        self._work.shutdown(wait=False, cancel_futures=True)
        self._clients.close()
        if self.index.admin is not None:
            self.index.admin.close()

    # ---- callers ------------------------------------------------------------------------------------------

    @staticmethod
    def owner_of(api_key: str | None) -> str:
        if not api_key:
            raise WireError("an API key is needed (header X-API-Key)", 401)
        if not api_key.startswith("tml-"):
            raise WireError("the API key must start with 'tml-'", 401)
        return owner_hash(api_key)

    def client(self, api_key: str) -> TrainerClient:
        self.owner_of(api_key)
        return self._clients.get(api_key)

    @staticmethod
    def _call(fn):
        try:
            return fn()
        except StropClientError as exc:
            raise http_error(exc) from None

    # ---- service ------------------------------------------------------------------------------------------

    def base_models(self) -> list[str]:
        return base_models(self.config.model_root)

    def capabilities(self) -> tt.GetServerCapabilitiesResponse:
        return tt.GetServerCapabilitiesResponse(
            supported_models=[
                {"model_name": m, "trainable": True, "sampleable": True} for m in self.base_models()
            ]
        )

    def create_session(self, api_key: str) -> tt.CreateSessionResponse:
        return tt.CreateSessionResponse(session_id=handles.new_session_id(self.owner_of(api_key)))

    def heartbeat(self, api_key: str, session_id: str) -> None:
        handles.check_session(session_id, self.owner_of(api_key))

    def _check_base(self, base_model: str | None) -> str:
        if base_model not in self.base_models():
            raise WireError(
                f"base_model {base_model!r} is not served here (get_server_capabilities lists the served ones)"
            )
        return base_model

    # ---- models: the gateway's own work, idempotent (a restarted gateway does it again or finds it done) -----

    def _submit(self, api_key: str, payload: dict[str, Any]) -> tt.UntypedAPIFuture:
        owner = self.owner_of(api_key)
        # a trainer call with the key now: an unknown key is a 401 here, not a failed future later
        self.index.find(self.client(api_key), owner, payload["m"])
        rid = handles.encode(handles.FUTURE, owner, payload)
        self._start(api_key, rid, payload)
        return tt.UntypedAPIFuture(request_id=rid, model_id=payload.get("m"))

    def _start(self, api_key: str, rid: str, payload: dict[str, Any]) -> cf.Future:
        with self._lock:
            fut = self._inflight.get(rid)
            if fut is None:
                fut = self._inflight[rid] = self._work.submit(self._ensure_model, api_key, payload)
            return fut

    def _ensure_model(self, api_key: str, p: dict[str, Any]) -> Any:
        """Creates the model ``p["m"]`` unless its run exists already (a retried or re-done request)."""
        owner, model_id = self.owner_of(api_key), p["m"]
        c = self.client(api_key)
        with self.index.lock("model", owner, model_id):
            m = self.index.find(c, owner, model_id)
            if m is None:
                name = handles.run_name(model_id, p.get("u"))
                if p["k"] == "create_model":
                    lora = RunLora(**p["l"])
                    base = self.index.base_session(c, p["b"])
                    run = self._call(lambda: c.create_training_run(base, lora, name=name))
                else:  # load_weights into a new model: the run is created from the state
                    base = self.index.base_session(c, p["b"])
                    run = self._call(
                        lambda: c.create_training_run(
                            base, from_state=p["a"], with_optimizer=bool(p["o"]), name=name
                        )
                    )
                self.index.remember(Model.of(owner, run.info))
        if p["k"] == "create_model":
            return tt.CreateModelResponse(model_id=model_id)
        return tt.LoadWeightsResponse(path=p["path"], model_id=model_id)

    def _new_model_id(self, api_key: str, session_id: str | None, model_seq_id: int | None) -> str:
        if session_id is None or model_seq_id is None:
            raise WireError("session_id and model_seq_id are needed")
        handles.check_session(session_id, self.owner_of(api_key))
        return handles.model_id(session_id, model_seq_id)

    def create_model(self, api_key: str, req: tt.CreateModelRequest) -> tt.UntypedAPIFuture:
        model_id = self._new_model_id(api_key, req.session_id, req.model_seq_id)
        lc = req.lora_config or tt.LoraConfig(rank=32)
        if getattr(req.optimizer_config, "type", "adamw") != "adamw":
            raise WireError(f"optimizer_config type {req.optimizer_config.type!r} is not supported (adamw)")
        lora = RunLora(
            rank=int(lc.rank),
            alpha=self.config.lora_alpha,
            train_attn=lc.train_attn,
            train_mlp=lc.train_mlp,
            train_unembed=lc.train_unembed,
            seed=lc.seed,
        )
        meta = {str(k): str(v) for k, v in (req.user_metadata or {}).items()} or None
        return self._submit(
            api_key,
            {
                "k": "create_model",
                "m": model_id,
                "b": self._check_base(req.base_model),
                "l": vars(lora),
                "u": meta,
            },
        )

    def model(self, api_key: str, model_id: str) -> Model:
        owner = self.owner_of(api_key)
        handles.check_model(model_id, owner)
        m = self.index.find(self.client(api_key), owner, model_id)
        if m is None:
            raise WireError(f"model {model_id!r} not found", 404)
        return m

    def tokenizer_id(self, base_model: str) -> str:
        root = self.config.model_root
        return str(root / base_model) if root is not None else base_model

    def get_info(self, api_key: str, model_id: str) -> tt.GetInfoResponse:
        m = self.model(api_key, model_id)
        return tt.GetInfoResponse(
            model_id=model_id,
            model_data={"model_name": m.base_model, "tokenizer_id": self.tokenizer_id(m.base_model)},
            is_lora=True,
            lora_rank=m.rank,
            model_name=m.base_model,
        )

    def unload_model(self, api_key: str, model_id: str) -> None:
        m = self.model(api_key, model_id)
        self._call(lambda: self.client(api_key).delete_training_run(m.run_id))
        self.index.forget(model_id)

    # ---- primitives: strop step futures -------------------------------------------------------------------

    def _step(self, api_key: str, rpc: str, msg) -> Future:
        c = self.client(api_key)
        return self._call(lambda: from_proto(Future, c._call(getattr(c._stub, rpc), msg, name=rpc)))

    def _remote(self, api_key: str, kind: str, future: Future, **ctx) -> tt.UntypedAPIFuture:
        rid = handles.encode(
            handles.FUTURE, self.owner_of(api_key), {"k": kind, "f": future.future_id, **ctx}
        )
        return tt.UntypedAPIFuture(
            request_id=rid, model_id=ctx.get("model_id"), sample_sequence_ids=ctx.get("sequence_ids")
        )

    @contextlib.contextmanager
    def _seq_kept(self, api_key: str, run_id: str, seq_id: int):
        """A refused submission still uses up its seq id (the SDK numbers on; Tinker's rule), so the run does not
        wait for it: the seq is filled with a Forward of one token at weight 0, which changes nothing."""
        try:
            yield
        except WireError:
            if seq_id > 0:
                filler = ForwardBackwardRequest(
                    run_id=run_id,
                    seq_id=seq_id,
                    forward_only=True,
                    loss_fn=LossFn.CROSS_ENTROPY,
                    data=[Datum.of([0], target_tokens=[0], weights=[0.0])],
                )
                with contextlib.suppress(WireError):
                    self._step(
                        api_key, "ForwardBackward", to_proto(trainer_pb2.ForwardBackwardRequest, filler)
                    )
            raise

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
            req = to_proto(
                trainer_pb2.ForwardBackwardRequest,
                ForwardBackwardRequest(
                    run_id=m.run_id,
                    seq_id=msg.seq_id,
                    data=data,
                    loss_fn=loss,
                    loss_fn_config=config,
                    forward_only=msg.forward_only,
                ),
            )
            ks = []
            for d in data:
                t = d.inputs().get("target_tokens")
                ks.append(t.shape[1] if t is not None and len(t.shape) == 2 else 1)
            fut = self._step(api_key, "ForwardBackward", req)
        return self._remote(api_key, "forward_backward", fut, model_id=msg.model_id, ks=handles.runs_of(ks))

    def optim_step(self, api_key: str, req: tt.OptimStepRequest) -> tt.UntypedAPIFuture:
        m = self.model(api_key, req.model_id)
        with self._seq_kept(api_key, m.run_id, req.seq_id or 0):
            if not isinstance(req.optim_params, tt.AdamParams):
                raise WireError("optim_step: only adam_params are supported")
            msg = to_proto(
                trainer_pb2.OptimStepRequest,
                OptimStepRequest(m.run_id, req.seq_id or 0, wire.adam_from_wire(req.optim_params)),
            )
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
            api_key,
            "save_weights",
            fut,
            model_id=req.model_id,
            path=wire.tinker_path(req.model_id, "weights", name),
        )

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
            api_key,
            "save_weights_for_sampler",
            fut,
            model_id=req.model_id,
            path=path,
            base_model=m.base_model,
        )

    @staticmethod
    def _training_artifact(path: str) -> str:
        src_model, kind, name = wire.parse_path(path)
        if kind != "weights":
            raise WireError(f"{path!r} holds sampler weights; load a training checkpoint (…/weights/…)")
        return wire.artifact_id(src_model, kind, name)

    def load_weights(self, api_key: str, req: tt.LoadWeightsRequest) -> tt.UntypedAPIFuture:
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
        model_id = self._new_model_id(api_key, req.session_id, req.model_seq_id)
        art = self._call(lambda: self.client(api_key).get_artifact(aid))
        if art.metadata.get("run_state") != "true":
            raise WireError(f"{req.path!r} holds no training state")
        meta = {str(k): str(v) for k, v in (req.user_metadata or {}).items()} or None
        return self._submit(
            api_key,
            {
                "k": "load_weights",
                "m": model_id,
                "b": self._check_base(art.metadata.get("base_model", "")),
                "a": aid,
                "o": bool(req.optimizer),
                "path": req.path,
                "u": meta,
            },
        )

    # ---- sampling -----------------------------------------------------------------------------------------

    def _sampler_id(self, owner: str, snapshot: str, run_id: str, base_model: str, path: str | None) -> str:
        return handles.encode(
            handles.SAMPLER, owner, {"s": snapshot, "r": run_id, "b": base_model, "p": path}
        )

    def create_sampling_session(self, api_key: str, req: tt.CreateSamplingSessionRequest):
        owner = self.owner_of(api_key)
        handles.check_session(req.session_id, owner)
        c = self.client(api_key)
        if req.model_path:
            src_model, kind, name = wire.parse_path(req.model_path)
            art = self._call(lambda: c.get_artifact(wire.artifact_id(src_model, kind, name)))  # or NOT_FOUND
            snap = art.metadata.get("sampler_id", "") if kind == "sampler_weights" else ""
            if not snap:
                raise WireError(
                    f"{req.model_path!r}: no sampler snapshot of it is loaded on the trainer (a sampler path is "
                    "sampled while its run holds the snapshot: save_weights_for_sampler, then sample)",
                    404,
                )
            sid = self._sampler_id(owner, snap, "", art.metadata.get("base_model", ""), req.model_path)
        elif req.base_model:
            base = self._check_base(req.base_model)
            sid = self._sampler_id(owner, "", self.index.base_run(c, owner, base), base, None)
        else:
            raise WireError("create_sampling_session needs model_path or base_model")
        return tt.CreateSamplingSessionResponse(sampling_session_id=sid)

    def _sampler(self, api_key: str, sampler_id: str | None, what: str) -> dict[str, Any]:
        s = handles.decode(handles.SAMPLER, self.owner_of(api_key), sampler_id, what)
        if not all(isinstance(s.get(k), str) for k in "srb") or not (s["s"] or s["r"]):
            raise WireError(f"{what} {sampler_id!r} not found", 404)
        return s

    def get_sampler(self, api_key: str, sampler_id: str) -> tt.GetSamplerResponse:
        s = self._sampler(api_key, sampler_id, "sampler")
        path = s.get("p") if isinstance(s.get("p"), str) else None
        return tt.GetSamplerResponse(sampler_id=sampler_id, base_model=s["b"], model_path=path)

    def sample(self, api_key: str, req: tt.SampleRequest) -> tt.UntypedAPIFuture:
        if not req.sampling_session_id:
            raise WireError("sample needs a sampling_session_id")
        s = self._sampler(api_key, req.sampling_session_id, "sampling session")
        for what, v in (
            ("topk_prompt_logprobs", req.topk_prompt_logprobs),
            ("topk_sample_logprobs", req.topk_sample_logprobs),
            ("prompt_alt_tokens_k", req.prompt_alt_tokens_k),
        ):
            if v:
                raise WireError(f"{what} is not supported by this server")
        if req.target_prompt_logprobs is not None or req.record_stability_info:
            raise WireError(
                "target_prompt_logprobs and record_stability_info are not supported by this server"
            )
        sreq = SampleRequest(
            run_id="" if s["s"] else s["r"],
            sampler_id=s["s"],
            prompt=wire.prompt_tokens(req.prompt),
            num_samples=req.num_samples,
            params=wire.sampling_from_wire(req.sampling_params, self.config.default_max_tokens),
            prompt_logprobs=bool(req.prompt_logprobs),
        )
        fut = self._step(api_key, "Sample", to_proto(trainer_pb2.SampleRequest, sreq))
        ids = [f"{fut.future_id}:{i}" for i in range(req.num_samples)]
        return self._remote(
            api_key, "sample", fut, sequence_ids=ids, prompt_logprobs=bool(req.prompt_logprobs)
        )

    # ---- futures ------------------------------------------------------------------------------------------

    def retrieve(self, api_key: str, request_id: str) -> Any:
        """The result (an SDK model or protobuf bytes), a ``tt.RequestFailedResponse``, or None while pending."""
        p = handles.decode(handles.FUTURE, self.owner_of(api_key), request_id, "future")
        try:
            if "f" in p:
                return self._answer_step(api_key, p)
            return self._answer_local(api_key, request_id, p)
        except (KeyError, TypeError, ValueError, AttributeError):  # a payload edited by its holder
            raise WireError(f"future {request_id!r} not found", 404) from None

    def _answer_local(self, api_key: str, rid: str, p: dict[str, Any]) -> Any:
        handles.check_model(p["m"], self.owner_of(api_key))
        if p["k"] not in ("create_model", "load_weights"):
            raise KeyError(p["k"])
        fut = self._start(api_key, rid, p)  # after a restart: done again, or found done
        try:
            return fut.result(timeout=self.config.poll_ms / 1000.0)
        except cf.TimeoutError:
            return None
        except WireError as exc:
            return _failed(str(exc), "user" if exc.status < 500 else "server")
        except StropClientError as exc:
            return _failed(exc.details, "user" if exc.code in USER_CODES else "server")
        finally:
            if fut.done():  # answered (or a payload that cannot be done): a later poll finds the model again
                with self._lock:
                    self._inflight.pop(rid, None)

    def _answer_step(self, api_key: str, p: dict[str, Any]) -> Any:
        c = self.client(api_key)
        f = self._call(lambda: c.get_future(str(p["f"]), wait_ms=self.config.poll_ms))
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

    def _result(self, api_key: str, p: dict[str, Any], f: Future) -> Any:
        kind = p["k"]
        if kind == "forward_backward":
            return wire.forward_backward_output_to_proto(f.forward_backward, handles.from_runs(p["ks"]))
        if kind == "optim_step":
            return tt.OptimStepResponse(metrics={m.name: m.value for m in f.optim_step.metrics})
        if kind == "sample":
            return wire.sample_output_to_proto(f.sample, bool(p["prompt_logprobs"]))
        if kind == "save_weights":
            return tt.SaveWeightsResponse(path=p["path"])
        if kind == "load_weights":
            return tt.LoadWeightsResponse(path=p["path"], model_id=p["model_id"])
        if kind == "save_weights_for_sampler":
            if p["path"]:
                return tt.SaveWeightsForSamplerResponseInternal(path=p["path"])
            sid = self._sampler_id(self.owner_of(api_key), f.save.sampler_id, f.run_id, p["base_model"], None)
            return tt.SaveWeightsForSamplerResponseInternal(sampling_session_id=sid)
        raise KeyError(kind)

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
            out.append(
                tt.Checkpoint(
                    checkpoint_id=f"{kind}/{name}",
                    checkpoint_type="training" if kind == "weights" else "sampler",
                    time=datetime.fromtimestamp(a.created_at, UTC),
                    tinker_path=wire.tinker_path(model_id, kind, name),
                    size_bytes=a.size_bytes,
                )
            )
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

    def _training_run(self, api_key: str, m: Model) -> tt.TrainingRun:
        info = self._call(lambda: self.client(api_key).get_training_run(m.run_id))
        cps = self._checkpoints(api_key, m.model_id)
        last = {
            t: next((c for c in reversed(cps) if c.checkpoint_type == t), None)
            for t in ("training", "sampler")
        }
        return tt.TrainingRun(
            training_run_id=m.model_id,
            base_model=m.base_model,
            model_owner=info.tenant or "local",
            is_lora=True,
            lora_rank=m.rank,
            last_request_time=datetime.fromtimestamp(info.last_activity_at or m.created, UTC),
            last_checkpoint=last["training"],
            last_sampler_checkpoint=last["sampler"],
            user_metadata=m.user_metadata,
        )

    def training_run(self, api_key: str, model_id: str) -> tt.TrainingRun:
        return self._training_run(api_key, self.model(api_key, model_id))

    def training_runs(self, api_key: str, limit: int, offset: int) -> tt.TrainingRunsResponse:
        models = self.index.models(self.client(api_key), self.owner_of(api_key))
        models.sort(key=lambda m: (m.created, m.model_id))
        runs = [self._training_run(api_key, m) for m in models[offset : offset + limit]]
        return tt.TrainingRunsResponse(
            training_runs=runs, cursor={"offset": offset, "limit": limit, "total_count": len(models)}
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
