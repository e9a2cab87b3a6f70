"""The models a GRPO job's ``score_model``/``label_model`` graders ask: sessions loaded on the same trainer.

A model grader's ``model`` (``strop.graders.model``) names one of the trainer's open sessions the job's caller may
use, resolved once when the job is submitted (``resolve``), before anything is sampled:

- a session id (``sess-…``), or a session's name (unique among the caller's open sessions): that session's model as
  Generate serves it, its job adapter (AttachLora) active if it has one, else its base;
- a base model, as LoadModel was given it (``tiny-llama``): that base with every adapter off, on the job's own
  session when the job trains that base (one copy of the base on the device judges and trains), else on the one
  open session that loaded it (several: INVALID_ARGUMENT listing them, name a session id instead).

Another tenant's shared session (a base every tenant may create step-API runs on) serves its base only, never its
owner's adapter. A session holding step-API runs has no single adapter of its own: it serves its base too.

Grading (``GraderSessions.answer``, the ``ModelFn`` the job's grader is given) renders each request's messages with
the grader session's chat template and samples every request of a batch in one call of the step API's sampler
(``sampler.sample``) on that session's model, under its lock: greedy unless ``sampling_params`` says otherwise, at
most ``max_completions_tokens`` new tokens (``DEFAULT_MAX_TOKENS`` when unset). A request without a ``seed`` that
samples at a temperature above 0 is seeded from its own prompt, so a job's grades depend only on what it sampled
(exact resume holds). A prompt too long for the grader session's ``max_seq_length`` gets an empty reply, which the
grader scores 0 (invalid), as for any reply that states no score.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Sequence
from dataclasses import dataclass

from strop.common import auth
from strop.common.errors import FailedPrecondition, InvalidArgument
from strop.common.trainer_types import SessionState
from strop.trainer_svc.core.chat_sampling import eos_ids, prompt_ids, reply_text
from strop.trainer_svc.core.guard import BrokenTraining, names
from strop.trainer_svc.core.model_loading import repacked_4bit_layers
from strop.trainer_svc.core.sampler import SampleRequest, SamplingParams, sample
from strop.trainer_svc.core.sessions import Session, Sessions

# new tokens a grader model may write when its sampling_params set no max_completions_tokens: room for OpenAI's
# {"result": …, "steps": […]} reply with a few short steps
DEFAULT_MAX_TOKENS = 256


@dataclass(frozen=True)
class GraderSession:
    """One grader model: the session that answers it, and whether its job adapter is on (else the base alone)."""

    session: Session
    adapter: bool

    def describe(self) -> str:
        what = "its adapter" if self.adapter else "its base"
        return f"session {self.session.info.session_id} ({what})"


def resolve(grader, sessions: Sessions, own: Session) -> dict[str, GraderSession]:
    """Each model the grader names, resolved for the caller (the job's submitter) as the module docstring says.

    Raises:
        InvalidArgument: a model that names no open session the caller may use (or several), or a session whose
            tokenizer has no chat template; the message names the spec field (``config.grpo.grader…model``).
    """
    out: dict[str, GraderSession] = {}
    for field, model in grader.model_fields():
        if model not in out:
            out[model] = _resolve_one(field, model, sessions, own)
    return out


def _resolve_one(field: str, model: str, sessions: Sessions, own: Session) -> GraderSession:
    where = f"config.grpo.{field}"
    me = auth.current()
    visible = [i for i in sessions.list() if i.state in (SessionState.LOADED, SessionState.READY)]
    by_id = [i for i in visible if i.session_id == model]
    by_name = [i for i in visible if i.name == model and me.can_see(i.tenant)]
    by_base = [i for i in visible if i.facts.model_path == model]
    if by_id or by_name:
        found = by_id or by_name
        if len(found) > 1:
            raise InvalidArgument(
                f"{where}: {len(found)} open sessions are named {model!r} "
                f"({', '.join(i.session_id for i in found)}); name one by its session id"
            )
        sess = sessions.open(found[0].session_id, for_runs=True)
        adapter = sess.loaded.lora is not None and me.can_see(sess.info.tenant)
    elif by_base:
        mine = [i for i in by_base if i.session_id == own.info.session_id]
        if not mine and len(by_base) > 1:
            raise InvalidArgument(
                f"{where}: base {model!r} is loaded by {len(by_base)} open sessions "
                f"({', '.join(i.session_id for i in by_base)}); name one by its session id"
            )
        sess = own if mine else sessions.open(by_base[0].session_id, for_runs=True)
        adapter = False
    else:
        raise InvalidArgument(
            f"{where}: {model!r} names no open session on this trainer (a session id, a session's name, or a base "
            "model a session has loaded); load the grader model first (LoadModel) and name it"
        )
    if not getattr(sess.loaded.tokenizer, "chat_template", None):
        raise InvalidArgument(
            f"{where}: session {sess.info.session_id}'s tokenizer has no chat template to render the grader's "
            "messages with"
        )
    return GraderSession(sess, adapter)


def _seed(req) -> int:
    text = json.dumps([req.model, list(req.messages)], sort_keys=True)
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:7], "little")


class GraderSessions:
    """The job's ``ModelFn``: a batch of grader ``ModelRequest`` in, one reply per request out, in order."""

    def __init__(self, table: dict[str, GraderSession]) -> None:
        self.table = table

    def answer(self, requests: Sequence) -> list[str]:
        replies = [""] * len(requests)
        by_model: dict[str, list[int]] = {}
        for i, r in enumerate(requests):
            by_model.setdefault(r.model, []).append(i)
        for model, idx in by_model.items():
            texts = self._ask(self.table[model], [requests[i] for i in idx])
            for i, text in zip(idx, texts, strict=True):
                replies[i] = text
        return replies

    __call__ = answer

    @staticmethod
    def _ask(gs: GraderSession, requests: list) -> list[str]:
        sess = gs.session
        with sess.lock:
            loaded = sess.loaded
            if sess.info.state is SessionState.CLOSED or loaded.model is None:
                raise FailedPrecondition(
                    f"grader {gs.describe()} was closed while the job ran; load it again and resume the job"
                )
            limit = loaded.facts.max_seq_length
            asks, where = [], []
            for k, r in enumerate(requests):
                ids = prompt_ids(loaded.tokenizer, list(r.messages))
                sp = r.sampling
                max_tokens = sp.max_completions_tokens or DEFAULT_MAX_TOKENS
                if limit and len(ids) + max_tokens > limit:
                    continue  # the empty reply scores 0, invalid
                temperature = 0.0 if sp.temperature is None else sp.temperature
                seed = sp.seed if sp.seed is not None else (_seed(r) if temperature > 0 else None)
                params = SamplingParams(
                    max_tokens=max_tokens, temperature=temperature, top_p=sp.top_p or 1.0, seed=seed
                )
                asks.append(SampleRequest(ids, 1, params))
                where.append(k)
            if not asks:
                return [""] * len(requests)
            model = loaded.model
            off = not gs.adapter and hasattr(model, "disable_adapter")
            eos = eos_ids(loaded)
            with model.disable_adapter() if off else contextlib.nullcontext():
                results = sample(model, asks, tokenizer=loaded.tokenizer, eos_token_ids=eos, max_length=limit)
            packed = repacked_4bit_layers(model)
            if packed:  # bitsandbytes' CPU inference layout has no backward (DESIGN.md, facts)
                raise BrokenTraining(
                    f"sampling the grader model left {len(packed)} 4-bit layers in an inference layout: "
                    f"{names(packed)}"
                )
            out = [""] * len(requests)
            for k, res in zip(where, results, strict=True):
                out[k] = reply_text(loaded.tokenizer, res.sequences[0], eos)
            return out
