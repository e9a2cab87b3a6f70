"""Sessions: a loaded base model (and its adapter) on the service's device, with its lock and busy flag."""

from __future__ import annotations

import json
import logging
import threading
import time
import uuid
from dataclasses import dataclass, field, replace
from pathlib import Path

from strop.common import auth
from strop.common.artifacts import ArtifactStore
from strop.common.errors import (
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unimplemented,
)
from strop.common.pretokenizers import Identification, PreTokenizerGuess, predict_for_tokenizer
from strop.common.trainer_types import Artifact, LoadModelRequest, LoraConfig, SessionInfo, SessionState
from strop.trainer_svc.core import adapter_state, model_loading
from strop.trainer_svc.core.store import TrainerStore

log = logging.getLogger("strop.trainer")


def predict_gguf_pre_tokenizer(loaded: model_loading.LoadedModel) -> PreTokenizerGuess:
    """What a GGUF export of this model will write as ``tokenizer.ggml.pre`` (or that it will refuse), told at
    load so a user learns it before training: the export's own decision (``strop.common.gguf_vocab.build_vocab``,
    proven with llama.cpp), or, where this host lacks gguf or llama-cpp-python, its pure-Python prediction."""
    model_dir = Path(loaded.model_dir)
    try:
        from strop.common.gguf_vocab import build_vocab

        config = json.loads((model_dir / "config.json").read_text(encoding="utf-8"))
        v = build_vocab(
            loaded.tokenizer,
            model_dir,
            config,
            tokenizer_config=_json_or_empty(model_dir / "tokenizer_config.json"),
            special_tokens_map=_json_or_empty(model_dir / "special_tokens_map.json"),
        )
        return PreTokenizerGuess(v.pre, Identification(v.pre_how), (v.pre,), note=v.pre_note)
    except (Unimplemented, InvalidArgument) as exc:
        return PreTokenizerGuess(note=f"GGUF export will be refused: {exc}", gguf_writable=False)
    except ImportError as exc:  # the GPU image carries neither gguf nor llama-cpp-python
        missing = exc.name or str(exc)
    except Exception as exc:  # a prediction never fails a load
        log.warning("could not decide the GGUF pre-tokenizer: %s", exc)
        return PreTokenizerGuess(note=f"could not decide the GGUF pre-tokenizer ({exc}); the export decides")
    try:
        guess = predict_for_tokenizer(
            loaded.tokenizer, sentencepiece_model=(model_dir / "tokenizer.model").is_file()
        )
    except Exception as exc:
        log.warning("could not predict the GGUF pre-tokenizer: %s", exc)
        return PreTokenizerGuess(note=f"could not predict the GGUF pre-tokenizer ({exc}); the export decides")
    return replace(
        guess,
        note=f"{guess.note} (predicted, not proven: {missing} is not installed on this trainer; the export "
        "proves the name with llama.cpp and may write another)",
    )


def _json_or_empty(path: Path) -> dict:
    return json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}


@dataclass
class Session:
    info: SessionInfo
    loaded: model_loading.LoadedModel
    lock: threading.RLock = field(default_factory=threading.RLock)  # held by a job for its whole run
    broken: str = ""  # why the session refuses all but CloseSession (a failed job's adapter not restored)
    # its jobs not yet ended, in order; info.busy_job_id is the first
    jobs: list[str] = field(default_factory=list)


class Sessions:
    """Open sessions in memory (their models live on the device), every session's record in the store."""

    def __init__(
        self,
        store: TrainerStore,
        artifacts: ArtifactStore,
        *,
        model_root: Path,
        device: str,
        max_sessions: int,
    ) -> None:
        self.store, self.artifacts = store, artifacts
        self.model_root, self.device, self.max_sessions = Path(model_root), device, max_sessions
        self._sessions: dict[str, Session] = {}
        self._loading = 0  # loads in progress hold a slot, so concurrent loads cannot pass the cap together
        self._lock = threading.RLock()
        # called with a session's id before CloseSession releases its model (the step API drops its runs)
        self.on_close: list = []

    def load(self, req: LoadModelRequest) -> SessionInfo:
        if req.shared and not auth.current().admin:
            raise PermissionDenied(
                "shared: only an admin may load a shared session (a base every tenant may create training runs on)"
            )
        with self._lock:
            open_sessions = sum(
                1
                for s in self._sessions.values()
                if s.info.state in (SessionState.LOADED, SessionState.READY)
            )
            if open_sessions + self._loading >= self.max_sessions:
                raise ResourceExhausted(
                    f"{open_sessions} sessions are open and {self._loading} loading "
                    f"(limit {self.max_sessions}); close one first"
                )
            self._loading += 1
        try:
            loaded = model_loading.load_model(req, model_root=self.model_root, device=self.device)
        except BaseException:
            with self._lock:
                self._loading -= 1
            raise
        pre = predict_gguf_pre_tokenizer(loaded)
        info = SessionInfo(
            session_id=f"sess-{uuid.uuid4().hex[:12]}",
            name=req.name,
            state=SessionState.LOADED,
            facts=loaded.facts,
            created_at=time.time(),
            tenant=auth.current().tenant,
            gguf_pre_tokenizer=pre.name,
            gguf_pre_tokenizer_note=pre.note,
            shared=req.shared,
        )
        with self._lock:  # the slot passes from "loading" to "open" under one lock
            self._loading -= 1
            self._sessions[info.session_id] = Session(info, loaded)
        self.store.put_session(info)
        log.info(
            "session %s: loaded %s (%s, %s)",
            info.session_id,
            loaded.facts.model_path,
            loaded.facts.quantization,
            loaded.facts.kernels_reason,
        )
        log.info("session %s: GGUF pre-tokenizer %s", info.session_id, pre.note)
        return info

    def open(self, session_id: str, *, for_runs: bool = False) -> Session:
        """An open session the caller may use: its own (or any, for an admin); a shared one only ``for_runs``
        (creating training runs on it), any other use of another tenant's shared session is PERMISSION_DENIED."""
        with self._lock:
            sess = self._sessions.get(session_id)
        if sess is None:
            stored = self.store.get_session(session_id)  # NotFound for unknown ids
            _check_use(stored, for_runs=for_runs)
            if stored.state is SessionState.LOST:
                raise FailedPrecondition(
                    f"session {session_id} was lost when the service restarted; load the model again"
                )
            raise FailedPrecondition(f"session {session_id} is {stored.state.value.lower()}")
        _check_use(sess.info, for_runs=for_runs)
        if sess.info.state is SessionState.CLOSED:
            raise FailedPrecondition(f"session {session_id} is closed")
        return sess

    def idle(self, session_id: str, *, closing: bool = False, for_runs: bool = False) -> Session:
        sess = self.open(session_id, for_runs=for_runs)
        if sess.broken and not closing:
            raise FailedPrecondition(f"session {session_id}: {sess.broken}")
        if sess.info.busy_job_id:
            raise FailedPrecondition(f"session {session_id} is busy with job {sess.info.busy_job_id}")
        return sess

    def attach_lora(self, session_id: str, lora: LoraConfig) -> SessionInfo:
        sess = self.idle(session_id)
        if sess.loaded.extra.get("step_runs"):
            raise FailedPrecondition(
                f"session {session_id} holds training runs (the step API); a job adapter needs a session without them"
            )
        with sess.lock:
            model_loading.attach_lora(sess.loaded, lora)
            sess.info.lora = sess.loaded.lora
            sess.info.facts = sess.loaded.facts
            sess.info.state = SessionState.READY
            self.store.put_session(sess.info)
        return sess.info

    def get(self, session_id: str) -> SessionInfo:
        with self._lock:
            sess = self._sessions.get(session_id)
        info = sess.info if sess else self.store.get_session(session_id)
        # a shared session is every tenant's to see (not its runs: they are their owners')
        if not info.shared:
            auth.check_visible(info.tenant, f"session {session_id!r}")
        return info

    def list(self, include_closed: bool = False) -> list[SessionInfo]:
        out = []
        me = auth.current()
        for stored in self.store.list_sessions():
            if not (me.can_see(stored.tenant) or stored.shared):
                continue
            info = self.get(stored.session_id)
            if include_closed or info.state in (SessionState.LOADED, SessionState.READY):
                out.append(info)
        return out

    def close(self, session_id: str) -> SessionInfo:
        sess = self.idle(session_id, closing=True)
        for hook in self.on_close:
            hook(session_id)
        with sess.lock:
            model_loading.release(sess.loaded)
            sess.info.state = SessionState.CLOSED
            sess.info.facts.device_memory_bytes = 0
            self.store.put_session(sess.info)
        with self._lock:
            self._sessions.pop(session_id, None)
        return sess.info

    def generate(
        self,
        session_id: str,
        prompts: list[str],
        *,
        max_new_tokens: int = 64,
        disable_adapter: bool = False,
        apply_chat_template: bool = False,
        time_budget: float | None = None,
    ) -> list[str]:
        sess = self.idle(session_id)
        with sess.lock:
            return model_loading.generate(
                sess.loaded,
                prompts,
                max_new_tokens=max_new_tokens or 64,
                disable_adapter=disable_adapter,
                apply_chat_template=apply_chat_template,
                time_budget=time_budget,
            )

    def save_adapter(self, session_id: str, name: str = "") -> Artifact:
        sess = self.idle(session_id)
        if sess.loaded.lora is None:
            raise FailedPrecondition(f"session {session_id} has no adapter; call AttachLora first")
        with sess.lock:
            return self.publish_adapter(sess, artifact_id=name or None, metadata={"session_id": session_id})

    def publish_adapter(
        self, sess: Session, *, artifact_id: str | None, metadata: dict[str, str]
    ) -> Artifact:
        return publish_adapter(
            self.artifacts, sess.loaded, tenant=sess.info.tenant, artifact_id=artifact_id, metadata=metadata
        )


def _check_use(info: SessionInfo, *, for_runs: bool) -> None:
    """Another tenant's session is NOT_FOUND, unless it is shared: then creating runs is allowed and everything
    else (AttachLora, Train, Generate, SaveAdapter, CloseSession) is its owner's or an admin's."""
    if auth.current().can_see(info.tenant):
        return
    if not info.shared:
        raise NotFound(f"session {info.session_id!r} not found")
    if not for_runs:
        raise PermissionDenied(
            f"session {info.session_id} is shared by {info.tenant!r}: other tenants may create training runs on it; "
            "only its owner or an admin may close it or use it otherwise"
        )


def publish_adapter(
    artifacts: ArtifactStore,
    loaded: model_loading.LoadedModel,
    *,
    tenant: str,
    artifact_id: str | None,
    metadata: dict[str, str],
) -> Artifact:
    """Write ``loaded``'s adapter into the store as an ``adapter`` artifact (a session's, or a distributed
    job's rank 0's, ``dist_worker``), with the base's metadata, ``metadata`` and the tenant."""
    adapter_state.check_finite(loaded, "the adapter " + (f"{artifact_id!r}" if artifact_id else "to save"))
    meta = {**model_loading.adapter_metadata(loaded), **metadata}
    with artifacts.create("adapter", owner=tenant, artifact_id=artifact_id, metadata=meta) as pending:
        model_loading.write_adapter(loaded, pending.dir)
    return artifacts.get(pending.key)
