"""The graders that need no model: OpenAI's ``string_check`` and ``text_similarity``, and strop's
``numeric_check``, ``regex_match``, ``json_schema`` and ``length_penalty``.

OpenAI's definitions (graders guide, developers.openai.com/api/docs/guides/graders; openai-python
``openai.types.graders``): ``string_check`` scores 1 or 0 — ``eq`` the input equals the reference, ``ne`` it does
not (both case-sensitive), ``like`` the input contains the reference (case-sensitive), ``ilike`` it contains it
ignoring case. "Contains" is a plain substring test: ``%`` and ``_`` are literal characters, not SQL wildcards,
and an empty reference is contained in every input. Case is ignored by Unicode case folding (``str.casefold``:
"STRASSE" ilike "straße" is 1). ``text_similarity`` scores a metric of ``metrics.py``; its ``pass_threshold`` is
the guide's field (not in the SDK's type, which strop accepts without it).
"""

from __future__ import annotations

import json

from strop.graders import metrics, numeric
from strop.graders.base import INVALID, LeafGrader, Sample, Score, finite_or_invalid, render
from strop.graders.errors import GraderSpecError
from strop.graders.spec import Spec

REGEX_TIMEOUT_S = 0.25  # a pattern that backtracks catastrophically on an output scores 0 instead of hanging


class PairGrader(LeafGrader):
    """A leaf grader of an ``input`` template against a ``reference`` template."""

    def read_pair(self, s: Spec) -> None:
        self.input, self.reference = s.template("input"), s.template("reference")
        self.templates = (self.input, self.reference)

    def render_pair(self, sample: Sample, item: dict) -> tuple[str, str] | Score:
        """Both rendered, or the score of the first that cannot be."""
        text = render(self.input, sample, item)
        if isinstance(text, Score):
            return text
        ref = render(self.reference, sample, item)
        return ref if isinstance(ref, Score) else (text, ref)


class StringCheck(PairGrader):
    type = "string_check"
    OPERATIONS = ("eq", "ne", "like", "ilike")

    def __init__(self, s: Spec) -> None:
        self.name = s.name()
        if s.raw.get("operation") == "neq":
            raise GraderSpecError(
                s.at("operation"), "'neq' is 'ne' (the guide's prose says neq; its schema and SDK, ne)"
            )
        self.operation = s.choice("operation", self.OPERATIONS)
        self.read_pair(s)
        self.pass_threshold = s.number("pass_threshold", 1.0)
        s.done()

    def score_one(self, sample: Sample, item: dict) -> Score:
        pair = self.render_pair(sample, item)
        if isinstance(pair, Score):
            return pair
        text, ref = pair
        if self.operation == "eq":
            hit = text == ref
        elif self.operation == "ne":
            hit = text != ref
        elif self.operation == "like":
            hit = ref in text
        else:
            hit = ref.casefold() in text.casefold()
        return Score(1.0 if hit else 0.0)


class TextSimilarity(PairGrader):
    type = "text_similarity"

    def __init__(self, s: Spec) -> None:
        self.name = s.name()
        self.metric = s.choice("evaluation_metric", metrics.METRICS)
        why = metrics.refusal(self.metric)
        if why:
            raise GraderSpecError(s.at("evaluation_metric"), why)
        self.read_pair(s)
        self.pass_threshold = s.number("pass_threshold", 1.0)
        s.done()

    def score_one(self, sample: Sample, item: dict) -> Score:
        pair = self.render_pair(sample, item)
        if isinstance(pair, Score):
            return pair
        text, ref = pair
        return finite_or_invalid(metrics.FUNCTIONS[self.metric](text, ref), self.metric)


class NumericCheck(PairGrader):
    """1 when the number the input states is within tolerance of the reference's, else 0 (``numeric.py``)."""

    type = "numeric_check"

    def __init__(self, s: Spec) -> None:
        self.name = s.name()
        self.read_pair(s)
        self.extract = s.choice("extract", ("auto", "exact"), "auto")
        self.abs_tol = s.number("abs_tol", 0.0, lo=0.0)
        self.rel_tol = s.number("rel_tol", 1e-9, lo=0.0)
        self.pass_threshold = s.number("pass_threshold", 1.0)
        s.done()
        if not self.reference.references and numeric.parse_number(self.reference.source, "exact") is None:
            raise GraderSpecError(s.at("reference"), f"{self.reference.source!r} is not a number")

    def score_one(self, sample: Sample, item: dict) -> Score:
        pair = self.render_pair(sample, item)
        if isinstance(pair, Score):
            return pair
        text, ref = pair
        want = numeric.parse_number(ref, "exact")
        if want is None:
            return Score(INVALID, f"the reference {ref[:80]!r} is not a number")
        got = numeric.parse_number(text, self.extract)
        if got is None:
            return Score(INVALID, "the input states no number")
        return Score(1.0 if numeric.within(got, want, self.abs_tol, self.rel_tol) else 0.0)


class RegexMatch(LeafGrader):
    """1 when the pattern matches the input (``search``: anywhere; ``fullmatch``: the whole input), else 0.

    The pattern is fixed in the spec (no templates) and compiled once with the ``regex`` package, whose matching
    takes a timeout (``REGEX_TIMEOUT_S``): an output that sends the pattern into catastrophic backtracking scores
    0 and marks the grade invalid instead of stalling the job."""

    type = "regex_match"
    FLAGS = ("ignorecase", "multiline", "dotall")

    def __init__(self, s: Spec) -> None:
        import regex

        self.name = s.name()
        self.input = s.template("input")
        self.templates = (self.input,)
        pattern = s.string("pattern")
        flags = s.get("flags", [])
        if not isinstance(flags, list) or any(f not in self.FLAGS for f in flags):
            raise GraderSpecError(s.at("flags"), f"must be a list of {', '.join(self.FLAGS)}, got {flags!r}")
        self.mode = s.choice("match", ("search", "fullmatch"), "search")
        bits = 0
        for f in flags:
            bits |= {"ignorecase": regex.IGNORECASE, "multiline": regex.MULTILINE, "dotall": regex.DOTALL}[f]
        try:
            self.pattern = regex.compile(pattern, bits | regex.VERSION0)
        except regex.error as e:
            raise GraderSpecError(s.at("pattern"), f"is not a valid regular expression: {e}") from None
        self.pass_threshold = s.number("pass_threshold", 1.0)
        s.done()

    def score_one(self, sample: Sample, item: dict) -> Score:
        text = render(self.input, sample, item)
        if isinstance(text, Score):
            return text
        match = self.pattern.fullmatch if self.mode == "fullmatch" else self.pattern.search
        try:
            hit = match(text, timeout=REGEX_TIMEOUT_S)
        except TimeoutError:
            return Score(INVALID, f"the pattern ran past {REGEX_TIMEOUT_S} s on this output")
        return Score(1.0 if hit else 0.0)


class JsonSchema(LeafGrader):
    """1 when the input is JSON that the schema accepts, else 0 (the ``jsonschema`` library; the schema's own
    draft from ``$schema``, else 2020-12; remote ``$ref`` never fetched: a schema that needs one scores 0)."""

    type = "json_schema"

    def __init__(self, s: Spec) -> None:
        import jsonschema
        import referencing
        import referencing.exceptions

        self.name = s.name()
        self.input = s.template("input")
        self.templates = (self.input,)
        schema = s.required("schema")
        if not isinstance(schema, dict | bool):
            raise GraderSpecError(s.at("schema"), "must be a JSON Schema (an object or a boolean)")
        cls = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
        try:
            cls.check_schema(schema)
        except jsonschema.SchemaError as e:
            where = ".".join(str(p) for p in e.absolute_path)
            raise GraderSpecError(s.at("schema") + (f".{where}" if where else ""), e.message) from None

        def no_retrieval(uri: str):
            raise referencing.exceptions.NoSuchResource(ref=uri)

        self.validator = cls(schema, registry=referencing.Registry(retrieve=no_retrieval))
        self.pass_threshold = s.number("pass_threshold", 1.0)
        s.done()

    def score_one(self, sample: Sample, item: dict) -> Score:
        import referencing.exceptions

        text = render(self.input, sample, item)
        if isinstance(text, Score):
            return text
        try:
            doc = json.loads(text)
        except ValueError:
            return Score(0.0)
        except RecursionError:
            return Score(INVALID, "the input nests deeper than the JSON reader's limit")
        try:
            return Score(1.0 if self.validator.is_valid(doc) else 0.0)
        except referencing.exceptions.Unresolvable as e:
            return Score(INVALID, f"the schema's reference {e} cannot be resolved here")
        except RecursionError:
            return Score(INVALID, "the input nests deeper than the validator's limit")


class LengthPenalty(LeafGrader):
    """1 up to ``target`` units, falling linearly to 0 at ``limit``, 0 beyond: the shape of DAPO's soft overlong
    punishment (Yu et al. 2025, arXiv:2503.14476, eq. 13), mapped from its [−1, 0] to [0, 1] so it combines with
    the other graders in a ``multi`` formula (e.g. ``answer * length``).

    ``unit``: ``tokens`` (the sample's ``num_tokens``, set by the trainer), ``chars`` (Unicode code points of the
    input) or ``words`` (whitespace-separated runs of the input). ``input`` defaults to the sample's text."""

    type = "length_penalty"

    def __init__(self, s: Spec) -> None:
        self.name = s.name()
        self.unit = s.choice("unit", ("tokens", "chars", "words"))
        if self.unit == "tokens" and s.has("input"):
            raise GraderSpecError(
                s.at("input"), "the tokens unit counts the sample's tokens: it reads no input"
            )
        self.input = s.template("input", "{{ sample.output_text }}")
        self.templates = (self.input,) if self.unit != "tokens" else ()
        self.target = s.integer("target", lo=0)
        self.limit = s.integer("limit", lo=0)
        if self.limit <= self.target:
            raise GraderSpecError(
                s.at("limit"), f"must be greater than target ({self.target}), got {self.limit}"
            )
        self.pass_threshold = s.number("pass_threshold", 1.0)
        s.done()

    def length(self, sample: Sample, item: dict) -> int | Score:
        if self.unit == "tokens":
            if sample.num_tokens is None:
                raise ValueError(
                    f"{self.name}: the length_penalty grader counts tokens: Sample.num_tokens is unset"
                )
            return sample.num_tokens
        text = render(self.input, sample, item)
        if isinstance(text, Score):
            return text
        return len(text) if self.unit == "chars" else len(text.split())

    def score_one(self, sample: Sample, item: dict) -> Score:
        n = self.length(sample, item)
        if isinstance(n, Score):
            return n
        if n <= self.target:
            return Score(1.0)
        return Score(max(0.0, (self.limit - n) / (self.limit - self.target)))


KINDS = {
    k.type: k for k in (StringCheck, TextSimilarity, NumericCheck, RegexMatch, JsonSchema, LengthPenalty)
}
