"""Grader specs the graders' tests build on."""

from __future__ import annotations

from strop.graders import Sample, parse_grader


def sc(op: str, inp: str = "{{ sample.output_text }}", ref: str = "{{ item.ref }}") -> dict:
    return {"type": "string_check", "name": "s", "operation": op, "input": inp, "reference": ref}


def ts(metric: str) -> dict:
    return {
        "type": "text_similarity",
        "name": "t",
        "input": "{{ sample.output_text }}",
        "reference": "{{ item.ref }}",
        "evaluation_metric": metric,
    }


def score(spec: dict, text: str, item: dict | None = None) -> float:
    return parse_grader(spec).grade(Sample.of(text), item or {}).score


def nc(**kw) -> dict:
    return {
        "type": "numeric_check",
        "name": "n",
        "input": "{{ sample.output_text }}",
        "reference": "{{ item.a }}",
        **kw,
    }


def multi_spec(formula: str) -> dict:
    return {
        "type": "multi",
        "name": "total",
        "graders": {
            "a": {**ts("fuzzy_match"), "name": "fa"},
            "b": sc("eq"),
            "c": sc("like"),
        },
        "calculate_output": formula,
    }
