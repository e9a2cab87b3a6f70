"""Declarative graders for reinforcement fine-tuning: OpenAI's grader definitions (string_check, text_similarity,
score_model, label_model, multi) plus strop's numeric_check, regex_match, json_schema and length_penalty.

No user code runs here (OpenAI's ``python`` grader is refused; a user's own reward runs client-side through the
step API). This room imports no service, gateway or torch: the trainer's GRPO loop and the OpenAI gateway both use
it. docs/graders.md describes every type, its reference definition and what is refused.

    grader = parse_grader(spec)                      # GraderSpecError(field, message) on a bad spec
    missing = check_references(grader, row_fields)   # a template reading a field the rows lack, before sampling
    result = grader.grade(Sample.of(text), row)      # GradeResult(score, per_grader, passed, invalid)
"""

from strop.graders.base import GradeResult, Sample
from strop.graders.core import TYPES, Grader, MissingReference, check_references, check_row, parse_grader
from strop.graders.errors import GradeInputError, GraderSpecError
from strop.graders.model import ModelFn, ModelRequest, SamplingParams

__all__ = [
    "TYPES",
    "GradeInputError",
    "GradeResult",
    "Grader",
    "GraderSpecError",
    "MissingReference",
    "ModelFn",
    "ModelRequest",
    "Sample",
    "SamplingParams",
    "check_references",
    "check_row",
    "parse_grader",
]
