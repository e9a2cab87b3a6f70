"""Model graders: ``score_model`` and ``label_model``, as OpenAI defines them, asking a model the trainer serves.

The spec's ``model`` names a model the trainer can sample from (a trainer session: the trainer decides how the name
resolves; ``trainer_svc/core/grader_sessions.py`` for GRPO jobs). This module renders the prompts and reads the replies; the sampling itself is a callable the trainer
injects (``ModelFn``): a batch of ``ModelRequest`` in, one reply text per request out, in order. A grade asks for
every sample of a batch in one call.

OpenAI's definitions (graders guide; openai-python ``ScoreModelGrader``, ``LabelModelGrader``):
- ``score_model``: ``input`` is chat messages (role ``system``, ``developer``, ``user`` or ``assistant``; content a
  string or text parts, each may hold templates), ``range`` defaults to [0, 1], ``sampling_params`` (``seed``,
  ``top_p``, ``temperature``, ``max_completions_tokens``, ``reasoning_effort``). OpenAI asks the model for
  ``{"result": float, "steps": [{"description", "conclusion"}]}`` through structured outputs; "the output of the
  grader will be truncated to the given range, and default to 0 for all non-numeric outputs". strop's sampler has
  no structured outputs: the same format is asked for in words (``SCORE_FORMAT``, added to the system message) and
  the reply is read leniently: a JSON object's ``result``, else a ``"result": <number>`` anywhere, else a reply that
  is only a number; anything else scores 0 and is marked invalid. ``reasoning_effort`` is refused (strop's models
  take no such setting).
- ``label_model``: ``labels`` and ``passing_labels`` (a subset); scores 1 when the model's label passes, else 0.
  The reply is read as ``{"label": …}`` or a reply that is only a label (exact, then ignoring case).

Image, audio and file content parts are refused when the spec is parsed (the trainer samples text models).
``developer`` messages are sent as ``system`` (chat templates of open models know no developer role).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from strop.graders.base import INVALID, LeafGrader, Sample, Score, render
from strop.graders.errors import GraderSpecError
from strop.graders.spec import Spec, finite
from strop.graders.template import Template

ROLES = ("system", "developer", "user", "assistant")
TEXT_PARTS = ("input_text", "output_text")

SCORE_FORMAT = (
    "Reply with only a JSON object of this form, nothing else: "
    '{{"result": <a number from {lo} to {hi}>, "steps": [{{"description": "<what you checked>", '
    '"conclusion": "<what you found>"}}]}}'
)
LABEL_FORMAT = 'Reply with only a JSON object of this form, nothing else: {{"label": <one of {labels}>}}'


@dataclass(frozen=True)
class SamplingParams:
    seed: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    max_completions_tokens: int | None = None


@dataclass(frozen=True)
class ModelRequest:
    """One prompt for a grader model: chat messages (``{"role", "content"}``, content a string)."""

    model: str
    messages: tuple[dict[str, str], ...]
    sampling: SamplingParams


ModelFn = Callable[[Sequence[ModelRequest]], Sequence[str]]


def _sampling(s: Spec) -> SamplingParams:
    raw = s.get("sampling_params", {})
    if not isinstance(raw, dict):
        raise GraderSpecError(s.at("sampling_params"), "must be an object")
    p = Spec(raw, s.at("sampling_params"))
    if p.has("reasoning_effort"):
        raise GraderSpecError(
            p.at("reasoning_effort"), "strop's grader models take no reasoning effort setting"
        )
    p.read.add("reasoning_effort")
    out = SamplingParams(
        seed=p.integer("seed", 0, lo=-(2**63)) if p.has("seed") else None,
        temperature=p.number("temperature", 1.0, lo=0.0) if p.has("temperature") else None,
        top_p=p.number("top_p", 1.0) if p.has("top_p") else None,
        max_completions_tokens=p.integer("max_completions_tokens", 1, lo=1)
        if p.has("max_completions_tokens")
        else None,
    )
    if out.top_p is not None and not 0 < out.top_p <= 1:
        raise GraderSpecError(p.at("top_p"), f"must be in (0, 1], got {out.top_p}")
    p.done(implicit=())
    return out


def _messages(s: Spec) -> tuple[tuple[str, tuple[Template, ...]], ...]:
    raw = s.required("input")
    if not isinstance(raw, list) or not raw:
        raise GraderSpecError(s.at("input"), "must be a non-empty list of messages")
    out = []
    for i, msg in enumerate(raw):
        path = f"{s.at('input')}.{i}"
        if not isinstance(msg, dict):
            raise GraderSpecError(path, "a message is an object with role and content")
        m = Spec(msg, path)
        role = m.choice("role", ROLES)
        if m.get("type", "message") != "message":
            raise GraderSpecError(m.at("type"), "must be 'message'")
        content = m.required("content")
        parts = content if isinstance(content, list) else [content]
        templates = []
        for j, part in enumerate(parts):
            ppath = m.at("content") + (f".{j}" if isinstance(content, list) else "")
            if isinstance(part, str):
                templates.append(Template.parse(part, ppath))
                continue
            if not isinstance(part, dict):
                raise GraderSpecError(ppath, "a content part is a string or an object")
            kind = part.get("type")
            if kind not in TEXT_PARTS:
                raise GraderSpecError(
                    f"{ppath}.type",
                    f"{kind!r} content is not supported: strop's grader models read text only",
                )
            extra = sorted(set(part) - {"type", "text"})
            if extra:
                raise GraderSpecError(f"{ppath}.{extra[0]}", "is not a field of a text part")
            if not isinstance(part.get("text"), str):
                raise GraderSpecError(f"{ppath}.text", "must be a string")
            templates.append(Template.parse(part["text"], f"{ppath}.text"))
        m.done(implicit=())
        out.append(("system" if role == "developer" else role, tuple(templates)))
    return tuple(out)


class _ModelGrader(LeafGrader):
    def _parse_common(self, s: Spec) -> None:
        self.name = s.name()
        self.model = s.string("model", nonempty=True)
        self.model_field = s.at("model")  # where a model the trainer cannot resolve is reported
        self.messages = _messages(s)
        self.templates = tuple(t for _, ts in self.messages for t in ts)

    def models(self) -> set[str]:
        return {self.model}

    def instruction(self) -> str:
        raise NotImplementedError

    def request(self, sample: Sample, item: dict) -> ModelRequest | Score:
        msgs = []
        for role, templates in self.messages:
            texts = []
            for t in templates:
                text = render(t, sample, item)
                if isinstance(text, Score):
                    return text
                texts.append(text)
            msgs.append({"role": role, "content": "\n".join(texts)})
        sys_at = next((i for i, m in enumerate(msgs) if m["role"] == "system"), None)
        if sys_at is None:
            msgs.insert(0, {"role": "system", "content": self.instruction()})
        else:
            msgs[sys_at] = {
                "role": "system",
                "content": msgs[sys_at]["content"] + "\n\n" + self.instruction(),
            }
        return ModelRequest(self.model, tuple(msgs), self.sampling)

    def read(self, reply: str) -> Score:
        raise NotImplementedError

    def score_batch(self, samples, items, model_fn: ModelFn | None = None) -> list[Score]:
        if model_fn is None:
            raise RuntimeError(
                f"{self.type} grader {self.name!r} needs a model: none was given to grade with"
            )
        asks = [self.request(s, i) for s, i in zip(samples, items, strict=True)]
        todo = [a for a in asks if isinstance(a, ModelRequest)]
        replies = list(model_fn(todo)) if todo else []
        if len(replies) != len(todo):
            raise RuntimeError(f"the grader model answered {len(replies)} of {len(todo)} requests")
        it = iter(replies)
        return [self.read(next(it)) if isinstance(a, ModelRequest) else a for a in asks]

    def score_one(self, sample: Sample, item: dict) -> Score:
        raise RuntimeError("model graders grade through score_batch with a model")


_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?"  # one way to match a digit run: no quadratic backtracking


def _json_object(reply: str):
    text = reply.strip()
    fence = re.fullmatch(r"```(?:json)?\s*(.*?)\s*```", text, re.DOTALL)
    if fence:
        text = fence.group(1)
    try:
        return json.loads(text)
    except (ValueError, RecursionError):
        start, end = text.find("{"), text.rfind("}")
        if 0 <= start < end:
            try:
                return json.loads(text[start : end + 1])
            except (ValueError, RecursionError):
                return None
    return None


def read_score(reply: str, lo: float, hi: float) -> Score:
    """The score a grader model's reply states, clipped to [lo, hi]; 0 (invalid) when it states none."""
    obj = _json_object(reply)
    value = None
    if (
        isinstance(obj, dict)
        and isinstance(obj.get("result"), int | float)
        and not isinstance(obj["result"], bool)
    ):
        try:
            value = float(obj["result"])
        except OverflowError:  # an integer past float's range
            value = math.inf if obj["result"] > 0 else -math.inf
    elif m := re.search(rf'"result"\s*:\s*({_NUMBER})', reply):
        value = float(m.group(1))  # a stated number past float's range reads as ±inf, then clips to the range
    elif m := re.fullmatch(rf"\s*({_NUMBER})\s*", reply):
        # the number alone: re's \s takes whitespace float() refuses (the separators \x1c-\x1f)
        value = float(m.group(1))
    if value is None or math.isnan(value):
        return Score(INVALID, f"the grader model's reply states no score: {reply[:120]!r}")
    return Score(min(max(value, lo), hi))


class ScoreModel(_ModelGrader):
    type = "score_model"

    def __init__(self, s: Spec) -> None:
        self._parse_common(s)
        rng = s.get("range", [0.0, 1.0])
        if not isinstance(rng, list) or len(rng) != 2:
            raise GraderSpecError(s.at("range"), f"must be two numbers [low, high], got {rng!r}")
        self.lo, self.hi = (finite(v, f"{s.at('range')}.{k}") for k, v in enumerate(rng))
        if not self.lo < self.hi:
            raise GraderSpecError(s.at("range"), f"low must be below high, got {rng}")
        self.sampling = _sampling(s)
        self.pass_threshold = s.number("pass_threshold", self.hi)
        s.done()

    def instruction(self) -> str:
        return SCORE_FORMAT.format(lo=f"{self.lo:g}", hi=f"{self.hi:g}")

    def read(self, reply: str) -> Score:
        return read_score(reply, self.lo, self.hi)


class LabelModel(_ModelGrader):
    type = "label_model"

    def __init__(self, s: Spec) -> None:
        self._parse_common(s)
        self.labels = self._strings(s, "labels")
        self.passing = self._strings(s, "passing_labels")
        stray = [p for p in self.passing if p not in self.labels]
        if stray:
            raise GraderSpecError(s.at("passing_labels"), f"{stray[0]!r} is not one of the labels")
        self.sampling = _sampling(s)
        self.pass_threshold = s.number("pass_threshold", 1.0)
        s.done()

    @staticmethod
    def _strings(s: Spec, key: str) -> tuple[str, ...]:
        raw = s.required(key)
        if not isinstance(raw, list) or not raw or any(not isinstance(x, str) or not x for x in raw):
            raise GraderSpecError(s.at(key), "must be a non-empty list of non-empty strings")
        if len(set(raw)) != len(raw):
            raise GraderSpecError(s.at(key), "lists a label twice")
        return tuple(raw)

    def instruction(self) -> str:
        return LABEL_FORMAT.format(labels=json.dumps(list(self.labels), ensure_ascii=False))

    def read(self, reply: str) -> Score:
        obj = _json_object(reply)
        label = obj.get("label") if isinstance(obj, dict) else reply.strip().strip('"')
        if label not in self.labels:
            folded = [x for x in self.labels if isinstance(label, str) and x.casefold() == label.casefold()]
            if len(folded) != 1:
                return Score(INVALID, f"the grader model's reply names no label: {reply[:120]!r}")
            label = folded[0]
        return Score(1.0 if label in self.passing else 0.0)
