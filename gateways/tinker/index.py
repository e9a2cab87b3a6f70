"""What the gateway reads from the trainer instead of keeping it: the shared session of each base model, the
training run behind each Tinker model id, and the run that samples a base. The answers are cached in memory,
and every cache entry can be read from the trainer again (after a restart, or on another replica).

Shared bases: one session per base model, loaded with ``LoadModel(shared=true)``. Every tenant creates its runs on
that session, and the trainer shows each tenant only its own runs, futures and artifacts. The gateway uses a shared,
open session of the base that the caller can see (one an operator loaded, or one it loaded before); the oldest,
if there are several. When there is none, it loads one with its admin token (``--admin-token-file``), or with the
caller's key when the gateway has no admin token (this works with the trainer's authentication off, or for an
admin's key). Otherwise the answer is 403, naming both ways to fix it. When two replicas load the same base at
once, each keeps the oldest session and the loser closes its own.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from dataclasses import dataclass

from strop.client import TrainerClient
from strop.client.errors import StropClientError
from strop.common.step_types import RunLora, TrainingRunInfo
from strop.common.trainer_types import Quantization, SessionInfo, SessionState
from strop.gateways.tinker import handles
from strop.gateways.tinker.wire import WireError

BASE_RUN = (
    "tinker-base:"  # + base model: a tenant's rank-1 run that is never trained (samples the base exactly)
)


@dataclass
class Model:
    owner: str  # sha256 of the API key
    model_id: str
    run_id: str
    base_model: str
    rank: int
    created: float
    user_metadata: dict[str, str] | None = None

    @classmethod
    def of(cls, owner: str, info: TrainingRunInfo) -> Model | None:
        parsed = handles.parse_run_name(info.name)
        if parsed is None:
            return None
        return cls(owner, parsed[0], info.run_id, info.base_model, info.lora.rank, info.created_at, parsed[1])


@dataclass
class LoadSpec:
    """How the gateway loads a base it has to load itself."""

    quantization: Quantization = Quantization.UNSPECIFIED
    dtype: str = ""
    max_seq_length: int = 0


class TrainerIndex:
    def __init__(self, call: Callable, spec: LoadSpec, admin: TrainerClient | None):
        self._call = call  # runs a trainer call, turning its errors into WireErrors
        self.spec, self.admin = spec, admin
        self._lock = threading.Lock()
        self._locks: dict[tuple, threading.Lock] = {}
        self._models: dict[str, Model] = {}  # model id → its run (a cache)

    def lock(self, *key) -> threading.Lock:
        with self._lock:
            return self._locks.setdefault(key, threading.Lock())

    # ---- shared bases -------------------------------------------------------------------------------------

    @staticmethod
    def _shared(c: TrainerClient, base_model: str) -> list[SessionInfo]:
        found = [
            s
            for s in c.list_sessions()
            if s.shared
            and s.state is SessionState.LOADED
            and s.lora is None
            and s.facts.model_path == base_model
        ]
        return sorted(found, key=lambda s: (s.created_at, s.session_id))

    def base_session(self, c: TrainerClient, base_model: str) -> str:
        """The shared session of ``base_model`` (``c``: the caller's client; found, or loaded once)."""
        with self.lock("base", base_model):
            found = self._call(lambda: self._shared(c, base_model))
            if found:
                return found[0].session_id
            loader = self.admin or c
            try:
                s = self._call(
                    lambda: loader.load_model(
                        base_model,
                        quantization=self.spec.quantization,
                        dtype=self.spec.dtype,
                        max_seq_length=self.spec.max_seq_length,
                        name=f"tinker:{base_model}",
                        shared=True,
                    )
                )
            except WireError as exc:
                if exc.status != 403:
                    raise
                raise WireError(
                    f"base model {base_model!r} is not loaded as a shared session on the trainer, and this gateway "
                    "cannot load one: give it an admin token (--admin-token-file), or have an admin load it with "
                    "load_model(..., shared=True)",
                    403,
                ) from None
            found = self._call(lambda: self._shared(c, base_model))
            if found and found[0].session_id != s.session_id:  # another replica was first: keep the oldest
                with contextlib.suppress(StropClientError):
                    loader.close_session(s.session_id)
                return found[0].session_id
            return s.session_id

    # ---- models -------------------------------------------------------------------------------------------

    def remember(self, m: Model) -> Model:
        with self._lock:
            self._models[m.model_id] = m
        return m

    def forget(self, model_id: str) -> None:
        with self._lock:
            self._models.pop(model_id, None)

    def find(self, c: TrainerClient, owner: str, model_id: str) -> Model | None:
        """The caller's model ``model_id`` (the cache, else the caller's runs on the trainer), or None."""
        with self._lock:
            m = self._models.get(model_id)
        if m is not None and m.owner == owner:
            return m
        found = [m for m in self.models(c, owner) if m.model_id == model_id]
        return self.remember(min(found, key=lambda m: (m.created, m.run_id))) if found else None

    def models(self, c: TrainerClient, owner: str) -> list[Model]:
        """Every model of the caller, from its runs on the trainer (the runs the gateway named)."""
        runs = self._call(lambda: c.list_training_runs())
        out = [m for r in runs if (m := Model.of(owner, r)) is not None]
        return [m for m in out if handles.owns(m.model_id, owner)]

    # ---- the base sampler ---------------------------------------------------------------------------------

    def base_run(self, c: TrainerClient, owner: str, base_model: str) -> str:
        """The caller's never-trained run on the shared base (its LoRA's B is zero: it samples the base exactly)."""
        name = BASE_RUN + base_model
        with self.lock("base-run", owner, base_model):
            runs = self._call(lambda: c.list_training_runs())
            mine = sorted((r.created_at, r.run_id) for r in runs if r.name == name)
            if mine:
                return mine[0][1]
            base = self.base_session(c, base_model)
            lora = RunLora(rank=1, train_attn=True, train_mlp=False, train_unembed=False, seed=0)
            return self._call(lambda: c.create_training_run(base, lora, name=name)).run_id
