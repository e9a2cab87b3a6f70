"""Every bad grader spec is refused naming its exact field; openai-python's grader types and strop's parser agree."""

from __future__ import annotations

import pytest

from strop.graders import GraderSpecError, metrics, parse_grader
from tests.deps import locked
from tests.graders.specs import multi_spec as _multi
from tests.graders.specs import nc, sc, ts

locked("rapidfuzz")
locked("nltk")
locked("rouge_score")


# ---- bad specs: each names its field ----------------------------------------------------------------------------

BAD_SPECS = [
    ({"type": "python", "name": "p", "source": "def grade(s, i): return 1"}, "grader.type", "client-side"),
    ({"type": "nope", "name": "x"}, "grader.type", "not a grader type"),
    ({"name": "x"}, "grader.type", "required"),
    ([], "grader", "JSON object"),
    ({**sc("eq"), "operation": "contains"}, "grader.operation", "not one of"),
    ({**sc("eq"), "operation": "neq"}, "grader.operation", "'neq' is 'ne'"),
    ({**sc("eq"), "name": " "}, "grader.name", "empty"),
    ({**sc("eq"), "input": 3}, "grader.input", "string"),
    ({**sc("eq"), "reference": None}, "grader.reference", "required"),
    ({**sc("eq"), "refrence": "x"}, "grader.refrence", "not a field"),
    ({**sc("eq"), "input": "{{ foo.bar }}"}, "grader.input", "namespace"),
    ({**sc("eq"), "input": "{{ item }}"}, "grader.input", "no variable"),
    ({**sc("eq"), "input": "{{ sample.output_tools[0].function.name }}"}, "grader.input", "sampler"),
    ({**sc("eq"), "input": "{{ sample.output_text.x }}"}, "grader.input", "no fields"),
    ({**sc("eq"), "input": "{{ item.a"}, "grader.input", "without closing"),
    ({**sc("eq"), "pass_threshold": float("nan")}, "grader.pass_threshold", "finite"),
    ({**ts("bleu"), "evaluation_metric": "rouge_6"}, "grader.evaluation_metric", "not one of"),
    ({**nc(), "abs_tol": float("inf")}, "grader.abs_tol", "finite"),
    ({**nc(), "rel_tol": -1}, "grader.rel_tol", "≥ 0"),
    ({**nc(), "reference": "nan"}, "grader.reference", "not a number"),
    ({**nc(), "extract": "first"}, "grader.extract", "not one of"),
    (
        {"type": "regex_match", "name": "r", "input": "x", "pattern": "(a"},
        "grader.pattern",
        "regular expression",
    ),
    (
        {"type": "regex_match", "name": "r", "input": "x", "pattern": "a", "flags": ["x"]},
        "grader.flags",
        "list of",
    ),
    (
        {"type": "json_schema", "name": "j", "input": "x", "schema": {"properties": {"n": {"type": "nope"}}}},
        "grader.schema.properties.n.type",
        "not valid",
    ),
    (
        {"type": "length_penalty", "name": "l", "unit": "tokens", "target": 5, "limit": 5},
        "grader.limit",
        "greater",
    ),
    (
        {"type": "length_penalty", "name": "l", "unit": "tokens", "target": -1, "limit": 5},
        "grader.target",
        "≥ 0",
    ),
    (
        {"type": "length_penalty", "name": "l", "unit": "tokens", "input": "x", "target": 1, "limit": 5},
        "grader.input",
        "no input",
    ),
    (
        {
            "type": "score_model",
            "name": "j",
            "model": "m",
            "input": [{"role": "user", "content": "x"}],
            "range": [1, 1],
        },
        "grader.range",
        "below",
    ),
    (
        {
            "type": "score_model",
            "name": "j",
            "model": "m",
            "input": [{"role": "user", "content": "x"}],
            "range": [0, float("inf")],
        },
        "grader.range.1",
        "finite",
    ),
    (
        {"type": "score_model", "name": "j", "model": "m", "input": [{"role": "judge", "content": "x"}]},
        "grader.input.0.role",
        "not one of",
    ),
    (
        {
            "type": "score_model",
            "name": "j",
            "model": "m",
            "input": [{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}],
        },
        "grader.input.0.content.0.type",
        "text only",
    ),
    (
        {
            "type": "score_model",
            "name": "j",
            "model": "m",
            "input": [{"role": "user", "content": "x"}],
            "sampling_params": {"reasoning_effort": "high"},
        },
        "grader.sampling_params.reasoning_effort",
        "reasoning",
    ),
    (
        {
            "type": "score_model",
            "name": "j",
            "model": "m",
            "input": [{"role": "user", "content": "x"}],
            "sampling_params": {"temprature": 0},
        },
        "grader.sampling_params.temprature",
        "not a field",
    ),
    (
        {
            "type": "score_model",
            "name": "j",
            "model": "m",
            "input": [{"role": "user", "content": "x"}],
            "sampling_params": {"top_p": 0},
        },
        "grader.sampling_params.top_p",
        "must be in (0, 1]",
    ),
    (
        {
            "type": "label_model",
            "name": "l",
            "model": "m",
            "input": [{"role": "user", "content": "x"}],
            "labels": ["a"],
            "passing_labels": ["b"],
        },
        "grader.passing_labels",
        "not one of the labels",
    ),
    ({**_multi("a"), "calculate_output": "a +"}, "grader.calculate_output", "ends too early"),
    ({**_multi("a"), "calculate_output": "a + d"}, "grader.calculate_output", "unknown name 'd'"),
    ({**_multi("a"), "calculate_output": "pow(a, 2)"}, "grader.calculate_output", "unknown function"),
    ({**_multi("a"), "calculate_output": "sqrt(a, b)"}, "grader.calculate_output", "takes 1"),
    ({**_multi("a"), "calculate_output": "a b"}, "grader.calculate_output", "unexpected"),
    ({**_multi("a"), "calculate_output": "a % b"}, "grader.calculate_output", "unexpected character '%'"),
    (
        {**_multi("a"), "calculate_output": "__import__('os')"},
        "grader.calculate_output",
        "unexpected character",
    ),
    ({**_multi("a"), "calculate_output": "__import__(a)"}, "grader.calculate_output", "unknown function"),
    ({**_multi("a"), "calculate_output": "a.real"}, "grader.calculate_output", "unexpected character '.'"),
    ({**_multi("a"), "calculate_output": "(" * 100 + "a" + ")" * 100}, "grader.calculate_output", "deeper"),
    ({**_multi("a"), "graders": {}}, "grader.graders", "at least one"),
    ({**_multi("a"), "graders": {"a-b": sc("eq")}}, "grader.graders.a-b", "variable"),
    ({**_multi("a"), "graders": {"log": sc("eq")}}, "grader.graders.log", "function name"),
    (
        {**_multi("a"), "graders": {"a": {**sc("eq"), "operation": "x"}}},
        "grader.graders.a.operation",
        "not one of",
    ),
    (
        {**_multi("a"), "graders": [sc("eq"), {**sc("ilike"), "operation": "lik"}]},
        "grader.graders.1.operation",
        "not one of",
    ),
    ({**_multi("a"), "graders": [sc("eq"), sc("ne")]}, "grader.graders.1.name", "two graders"),
    ({**_multi("a"), "graders": {"a": _multi("x")}}, "grader.graders.a.type", "cannot hold another"),
    (
        {**_multi("a"), "graders": {"a": {"type": "python", "name": "p", "source": ""}}},
        "grader.graders.a.type",
        "client-side",
    ),
    ({**_multi("a"), "name": "a"}, "grader.name", "sub-grader"),
]


@pytest.mark.parametrize(
    ("spec", "field", "message"), BAD_SPECS, ids=[f"{i}-{f}" for i, (_, f, _) in enumerate(BAD_SPECS)]
)
def test_every_bad_spec_is_refused_naming_its_field(spec, field, message):
    with pytest.raises(GraderSpecError) as e:
        parse_grader(spec)
    assert e.value.field == field, e.value
    assert message in e.value.message, e.value.message
    assert str(e.value).startswith(f"{field}: ")
    assert e.value.grpc_code == "INVALID_ARGUMENT"


# ---- OpenAI's SDK types and these graders agree ------------------------------------------------------------------


def test_openai_sdk_grader_types_match_what_strop_parses():
    graders = locked("openai.types.graders")
    from typing import get_args

    from strop.graders.kinds import StringCheck
    from strop.graders.model import ROLES

    ann = graders.StringCheckGrader.model_fields["operation"].annotation
    assert get_args(ann) == StringCheck.OPERATIONS
    ann = graders.TextSimilarityGrader.model_fields["evaluation_metric"].annotation
    assert get_args(ann) == metrics.METRICS
    assert set(get_args(graders.score_model_grader.Input.model_fields["role"].annotation)) == set(ROLES)
    # every field of the SDK's types is one strop reads (reasoning_effort: read, then refused)
    examples = [
        (graders.StringCheckGrader, sc("ilike")),
        (graders.TextSimilarityGrader, ts("rouge_l")),
        (
            graders.ScoreModelGrader,
            {
                "type": "score_model",
                "name": "j",
                "model": "m",
                "input": [{"role": "system", "content": "x", "type": "message"}],
                "range": [0, 1],
                "sampling_params": {"seed": 1, "top_p": 1, "temperature": 0.5, "max_completions_tokens": 8},
            },
        ),
        (
            graders.LabelModelGrader,
            {
                "type": "label_model",
                "name": "l",
                "model": "m",
                "input": [{"role": "user", "content": "x"}],
                "labels": ["a", "b"],
                "passing_labels": ["a"],
            },
        ),
    ]
    for sdk_type, spec in examples:
        sdk_type.model_validate(spec)  # the SDK accepts it
        parse_grader(spec)  # and so does strop
        assert set(sdk_type.model_fields) <= set(spec) | {"sampling_params", "range"}
    assert set(graders.score_model_grader.SamplingParams.model_fields) == {
        "seed",
        "top_p",
        "temperature",
        "max_completions_tokens",
        "reasoning_effort",
    }
    assert set(graders.MultiGrader.model_fields) == {"calculate_output", "graders", "name", "type"}
