"""``parse_grader``: a grader spec (OpenAI's JSON, plus strop's types) checked whole, into a ``Grader`` that grades.

The types (``TYPES``): OpenAI's ``string_check``, ``text_similarity``, ``score_model``, ``label_model`` and
``multi``; strop's ``numeric_check``, ``regex_match``, ``json_schema`` and ``length_penalty``. OpenAI's ``python``
grader is refused: strop never runs a user's code in its services; the same reward runs client-side through the
step API (docs/graders.md shows how).

``multi`` (OpenAI's graders guide, "Combined graders"): ``graders`` maps names to graders (the guide's form; the
names are the formula's variables), and ``calculate_output`` combines their scores (``formula.py``). strop also
takes a list of graders (each grader's ``name`` is its variable) and, as openai-python's ``MultiGrader`` types it,
a single grader object. A multi grader cannot hold another (the guide: "You cannot nest one multigrader inside
another").

Every problem is a ``GraderSpecError`` whose ``field`` is the dotted path from ``root`` (default ``grader``), e.g.
``grader.graders.email.operation``; list items are numbered (``grader.graders.0.operation``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from strop.graders.base import INVALID, GradeResult, LeafGrader, Sample
from strop.graders.errors import GraderSpecError
from strop.graders.formula import FUNCTIONS, Formula, FormulaSyntaxError, FormulaValueError
from strop.graders.kinds import KINDS
from strop.graders.model import LabelModel, ModelFn, ScoreModel
from strop.graders.spec import Spec
from strop.graders.template import Reference

LEAF_TYPES: dict[str, type[LeafGrader]] = {**KINDS, "score_model": ScoreModel, "label_model": LabelModel}
TYPES = (*LEAF_TYPES, "multi")
PYTHON_REFUSAL = (
    "python graders run the user's code, which strop never does in its services: score samples with your own "
    "code client-side through the step API (sample, score, forward_backward; docs/graders.md)"
)
_IDENT = re.compile(r"[A-Za-z_]\w*")


def _leaf(raw: Any, path: str, *, in_multi: bool) -> LeafGrader:
    s = Spec(raw, path)
    kind = s.raw.get("type")
    if kind is None:
        raise GraderSpecError(s.at("type"), "is required")
    if kind == "python":
        raise GraderSpecError(s.at("type"), PYTHON_REFUSAL)
    if kind == "multi" and in_multi:
        raise GraderSpecError(s.at("type"), "a multi grader cannot hold another multi grader")
    if kind not in LEAF_TYPES:
        raise GraderSpecError(
            s.at("type"), f"{kind!r} is not a grader type (types: {', '.join(TYPES)}, python)"
        )
    return LEAF_TYPES[kind](s)


class Grader:
    """A parsed grader: ``grade``/``grade_many`` score samples against their dataset rows.

    ``per_grader`` of a result holds the top grader's score under its name and, for ``multi``, each sub-grader's
    under its variable name. A grade never raises for what a sample says; a row lacking a field the templates read
    raises ``GradeInputError`` (``check_references`` refuses such a dataset before any sampling)."""

    def __init__(
        self,
        name: str,
        type_: str,
        leaves: dict[str, LeafGrader],
        formula: Formula | None,
        pass_threshold: float,
        model_fn: ModelFn | None,
    ) -> None:
        self.name, self.type = name, type_
        self.leaves = leaves
        self.formula = formula
        self.pass_threshold = pass_threshold
        self.model_fn = model_fn

    @property
    def models(self) -> set[str]:
        """The grader models this grader asks (the trainer must serve each, and inject ``model_fn``)."""
        return set().union(*(g.models() for g in self.leaves.values()))

    def model_fields(self) -> tuple[tuple[str, str], ...]:
        """``(field, model)`` for every model grader: the dotted spec field naming each model, and the name."""
        return tuple((g.model_field, g.model) for g in self.leaves.values() if g.models())

    def references(self) -> tuple[Reference, ...]:
        return tuple(r for g in self.leaves.values() for r in g.references())

    def grade(self, sample: Sample, item: dict) -> GradeResult:
        return self.grade_many([sample], [item])[0]

    def grade_many(self, samples: Sequence[Sample], items: Sequence[dict]) -> list[GradeResult]:
        """One result per (sample, item) pair; each model grader asks its model once for the whole batch."""
        if len(samples) != len(items):
            raise ValueError(f"{len(samples)} samples but {len(items)} items")
        if self.models and self.model_fn is None:
            raise RuntimeError(
                f"grader {self.name!r} asks {sorted(self.models)}: give parse_grader a model_fn"
            )
        scores = {k: g.score_batch(samples, items, self.model_fn) for k, g in self.leaves.items()}
        out = []
        for i in range(len(samples)):
            per = {k: scores[k][i].value for k in self.leaves}
            passed = {k: scores[k][i].value >= self.leaves[k].pass_threshold for k in self.leaves}
            invalid = {k: s[i].invalid for k, s in scores.items() if s[i].invalid}
            if self.formula is None:
                (top,) = per.values()
            else:
                try:
                    top = self.formula.evaluate(per)
                except FormulaValueError as e:
                    top = INVALID
                    invalid[self.name] = str(e)
                per = {**per, self.name: top}
                passed = {**passed, self.name: top >= self.pass_threshold}
            out.append(GradeResult(score=top, per_grader=per, passed=passed, invalid=invalid))
        return out


def parse_grader(spec: dict, *, root: str = "grader", model_fn: ModelFn | None = None) -> Grader:
    """Check the whole spec and build its grader; ``GraderSpecError(field, message)`` on the first problem.

    ``model_fn`` answers the prompts of ``score_model``/``label_model`` graders (see ``model.py``); a grader that
    has none can be parsed (and checked) without it, and refuses to grade."""
    s = Spec(spec, root)
    if s.raw.get("type") != "multi":
        leaf = _leaf(spec, root, in_multi=False)
        return Grader(leaf.name, leaf.type, {leaf.name: leaf}, None, leaf.pass_threshold, model_fn)
    name = s.name()
    raw = s.required("graders")
    if isinstance(raw, dict) and "type" in raw and isinstance(raw.get("type"), str):
        entries = [(None, raw, s.at("graders"))]  # openai-python's MultiGrader: one grader object
    elif isinstance(raw, dict):
        entries = [(k, v, f"{s.at('graders')}.{k}") for k, v in raw.items()]
    elif isinstance(raw, list):
        entries = [(None, v, f"{s.at('graders')}.{i}") for i, v in enumerate(raw)]
    else:
        raise GraderSpecError(s.at("graders"), "must map names to graders")
    if not entries:
        raise GraderSpecError(s.at("graders"), "must hold at least one grader")
    leaves: dict[str, LeafGrader] = {}
    for key, sub, path in entries:
        leaf = _leaf(sub, path, in_multi=True)
        var = key if key is not None else leaf.name
        where = path if key is not None else f"{path}.name"
        if not _IDENT.fullmatch(var) or var in FUNCTIONS:
            raise GraderSpecError(
                where, f"{var!r} cannot be a formula variable (letters, digits, _; not a function name)"
            )
        if var in leaves:
            raise GraderSpecError(where, f"two graders are named {var!r}")
        leaves[var] = leaf
    if name in leaves:
        raise GraderSpecError(s.at("name"), f"{name!r} is also a sub-grader's name")
    try:
        formula = Formula.parse(s.string("calculate_output"), leaves)
    except FormulaSyntaxError as e:
        raise GraderSpecError(s.at("calculate_output"), str(e)) from None
    threshold = s.number("pass_threshold", 1.0)
    s.done()
    return Grader(name, "multi", leaves, formula, threshold, model_fn)


@dataclass(frozen=True)
class MissingReference:
    """A template reference to a dataset field the rows lack: ``field`` is the spec field holding the template."""

    field: str
    reference: str

    @property
    def message(self) -> str:
        return f"{{{{ {self.reference} }}}} reads a field the dataset's rows do not have"

    def error(self) -> GraderSpecError:
        return GraderSpecError(self.field, self.message)


def check_references(grader: Grader, item_fields: Iterable[str]) -> MissingReference | None:
    """The first template reference to a top-level row field not in ``item_fields``, or None."""
    have = set(item_fields)
    for ref in grader.references():
        if ref.namespace == "item" and str(ref.path[0]) not in have:
            return MissingReference(ref.field, ref.text)
    return None


def check_row(grader: Grader, row: dict) -> MissingReference | None:
    """The first template reference (nested paths too) that ``row`` cannot answer, or None."""
    from strop.graders.template import Missing, resolve

    for ref in grader.references():
        if ref.namespace == "item":
            try:
                resolve(ref, {"item": row})
            except Missing:
                return MissingReference(ref.field, ref.text)
    return None
