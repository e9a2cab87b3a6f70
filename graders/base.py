"""What every grader shares: the sample it grades, a leaf grader's score, the result of a grade."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from strop.graders.errors import GradeInputError
from strop.graders.template import Missing, Reference, Template


@dataclass(frozen=True)
class Sample:
    """One sampled completion. ``output_json`` is the output parsed as JSON when it is JSON (``Sample.of`` fills
    it), else None; ``num_tokens`` is the completion's length in tokens (the ``length_penalty`` grader's ``tokens``
    unit reads it)."""

    output_text: str
    output_json: Any = None
    num_tokens: int | None = None

    @classmethod
    def of(cls, output_text: str, num_tokens: int | None = None) -> Sample:
        try:
            parsed = json.loads(output_text)
        except (ValueError, RecursionError):  # RecursionError: nesting deeper than the interpreter's limit
            parsed = None
        return cls(output_text, parsed, num_tokens)

    def context(self) -> dict[str, Any]:
        out: dict[str, Any] = {"output_text": self.output_text}
        if self.output_json is not None:
            out["output_json"] = self.output_json
        return out


@dataclass(frozen=True)
class Score:
    """A leaf grader's score for one sample; ``invalid`` says why a score is 0 by rule (nothing to compare)."""

    value: float
    invalid: str | None = None


INVALID = 0.0  # OpenAI's rule for a python grader's unusable result, applied to every grader here


@dataclass(frozen=True)
class GradeResult:
    """A sample's grade: ``score`` (the top grader's), each grader's score and pass flag by name, and the names of
    graders whose score is 0 because there was nothing valid to compare (with why)."""

    score: float
    per_grader: dict[str, float]
    passed: dict[str, bool] = field(default_factory=dict)
    invalid: dict[str, str] = field(default_factory=dict)


class LeafGrader:
    """A grader that scores samples itself (every type but ``multi``)."""

    type: str = ""
    name: str = ""
    pass_threshold: float = 1.0
    templates: tuple[Template, ...] = ()

    def references(self) -> tuple[Reference, ...]:
        return tuple(r for t in self.templates for r in t.references)

    def models(self) -> set[str]:
        return set()

    def score_one(self, sample: Sample, item: dict) -> Score:
        raise NotImplementedError

    def score_batch(self, samples: Sequence[Sample], items: Sequence[dict], model_fn=None) -> list[Score]:
        return [self.score_one(s, i) for s, i in zip(samples, items, strict=True)]


def render(template: Template, sample: Sample, item: dict) -> str | Score:
    """The rendered template, or an invalid Score when the sample lacks what it reads (e.g. ``output_json`` of an
    output that is not JSON). A row lacking a field raises ``GradeInputError`` (``check_references`` should have
    refused the dataset before any sampling)."""
    try:
        return template.render({"item": item, "sample": sample.context()})
    except Missing as e:
        if e.ref.namespace == "item":
            raise GradeInputError(e.ref.field, e.ref.text) from None
        return Score(INVALID, f"the sample has no {e.ref.text}")


def finite_or_invalid(value: float, what: str) -> Score:
    return Score(value) if math.isfinite(value) else Score(INVALID, f"{what} is {value}")
