"""strop.graders against their reference definitions: OpenAI's graders guide (string_check's operations, the
templating, multi's calculate_output), the metrics' published formulas worked by hand (BLEU, GLEU, ROUGE) and the
libraries OpenAI names (rapidfuzz, rouge-score). Bad specs and the SDK's types: test_grader_specs.py.
"""

from __future__ import annotations

import math
import time
from fractions import Fraction

import pytest

from strop.graders import (
    GradeInputError,
    GraderSpecError,
    ModelRequest,
    Sample,
    check_references,
    check_row,
    metrics,
    numeric,
    parse_grader,
)
from strop.graders.base import Score
from strop.graders.model import read_score
from tests.deps import locked
from tests.graders.specs import nc, sc, score, ts

locked("rapidfuzz")
locked("nltk")
locked("rouge_score")


# ---- string_check: the guide's four operations ---------------------------------------------------------------

STRING_CASES = [
    # (operation, input, reference, expected): eq/ne case-sensitive equality, like = contains (case-sensitive),
    # ilike = contains ignoring case (guide, "String check graders")
    ("eq", "Paris", "Paris", 1),
    ("eq", "Paris", "paris", 0),
    ("eq", "", "", 1),
    ("eq", "é", "e\u0301", 0),  # code points compared: composed é is not e + combining accent
    ("ne", "Paris", "paris", 1),
    ("ne", "", "", 0),
    ("like", "The answer is Paris.", "Paris", 1),
    ("like", "The answer is PARIS.", "Paris", 0),
    ("like", "anything", "", 1),  # the empty string is contained in every string
    ("like", "", "x", 0),
    ("like", "100 percent", "100%", 0),  # % is a literal character, not a SQL wildcard
    ("like", "score: 100%", "100%", 1),
    ("like", "a_c", "a_c", 1),
    ("like", "abc", "a_c", 0),  # _ is literal too
    ("ilike", "The answer is PARIS.", "paris", 1),
    ("ilike", "STRASSE", "straße", 1),  # Unicode case folding: ß folds to ss
    ("ilike", "ΣΊΣΥΦΟΣ", "σίσυφος", 1),
    ("ilike", "Lyon", "paris", 0),
]


@pytest.mark.parametrize(("op", "text", "ref", "want"), STRING_CASES)
def test_string_check_follows_the_guides_operations(op, text, ref, want):
    assert score(sc(op), text, {"ref": ref}) == want


# ---- text_similarity: the metrics against their definitions ---------------------------------------------------

HYP, REF = "the cat sat on the mat", "the cat sat on a mat"


def test_bleu_is_the_geometric_mean_of_clipped_precisions_with_nist_smoothing_and_brevity_penalty():
    # Papineni et al. 2002 worked by hand. HYP vs REF: clipped n-gram matches 5/6, 3/5, 2/4, 1/3, equal lengths
    assert score(ts("bleu"), HYP, {"ref": REF}) == pytest.approx(
        (5 / 6 * 3 / 5 * 2 / 4 * 1 / 3) ** 0.25, rel=1e-12
    )
    # no 4-gram matches (0/2): NIST geometric smoothing (sacreBLEU's sentence default) counts it as 1/(2·2)
    assert score(ts("bleu"), "a b c d e", {"ref": "a b c x e"}) == pytest.approx(
        (4 / 5 * 2 / 4 * 1 / 3 * 1 / 4) ** 0.25, rel=1e-12
    )
    # a 4-token prefix of a 6-token reference: every precision 1, brevity penalty exp(1 − 6/4)
    assert score(ts("bleu"), "the cat sat on", {"ref": HYP}) == pytest.approx(math.exp(1 - 6 / 4), rel=1e-12)
    assert score(ts("bleu"), HYP, {"ref": HYP}) == pytest.approx(1.0)
    assert score(ts("bleu"), "", {"ref": HYP}) == 0.0


def test_gleu_is_min_of_ngram_precision_and_recall_over_one_to_four_grams():
    # Wu et al. 2016: matches 5 + 3 + 2 + 1 = 11 of 18 n-grams on each side
    assert score(ts("gleu"), HYP, {"ref": REF}) == pytest.approx(11 / 18, rel=1e-12)
    # "the cat" vs HYP: 3 matching n-grams (the, cat, the cat); 3 in the input, 18 in the reference → recall 3/18
    assert score(ts("gleu"), "the cat", {"ref": HYP}) == pytest.approx(3 / 18, rel=1e-12)


@pytest.mark.parametrize(
    ("metric", "want"),
    [
        ("rouge_1", 5 / 6),  # unigram overlap 5 of 6 on both sides: F = 5/6
        ("rouge_2", 3 / 5),
        ("rouge_3", 2 / 4),
        ("rouge_4", 1 / 3),
        ("rouge_5", 0.0),  # the two 5-grams of each side differ
        ("rouge_l", 5 / 6),  # longest common subsequence: the cat sat on … mat
    ],
)
def test_rouge_is_the_f_measure_of_ngram_and_lcs_overlap(metric, want):
    assert score(ts(metric), HYP, {"ref": REF}) == pytest.approx(want, rel=1e-12)


def test_rouge_scores_equal_rouge_scores_own_and_rouge_l_stays_fast_on_long_texts():
    import random

    from rouge_score.rouge_scorer import RougeScorer

    rng = random.Random(0)
    words = ["the", "cat", "Sat", "on", "a", "mat,", "dog", "42", "été"]
    cases = [(HYP, REF), ("", "x"), ("x", ""), ("a b", "c d")]
    cases += [
        (
            " ".join(rng.choices(words, k=rng.randint(1, 30))),
            " ".join(rng.choices(words, k=rng.randint(1, 30))),
        )
        for _ in range(40)
    ]
    kinds = {"rouge_l": "rougeL", **{f"rouge_{n}": f"rouge{n}" for n in range(1, 6)}}
    scorer = RougeScorer(list(kinds.values()))
    for hyp, ref in cases:
        want = scorer.score(ref, hyp)  # rouge-score's score(target, prediction)
        for metric, kind in kinds.items():
            assert metrics.FUNCTIONS[metric](hyp, ref) == pytest.approx(want[kind].fmeasure, abs=1e-12), (
                metric,
                hyp,
                ref,
            )
    long = " ".join(rng.choices(words, k=2000))
    t0 = time.perf_counter()
    metrics.FUNCTIONS["rouge_l"](long, long[::-1])
    assert time.perf_counter() - t0 < 1  # rouge-score's own LCS table takes ≈ 6.6 s here


def test_rouge_lowercases_and_reads_only_ascii_alphanumerics_as_rouge_score_does():
    assert score(ts("rouge_1"), "The CAT, sat!", {"ref": "the cat sat"}) == pytest.approx(1.0)
    # rouge-score's tokenizer keeps runs of [a-z0-9]: text in another script has no tokens and scores 0
    assert score(ts("rouge_1"), "日本語のテキスト", {"ref": "日本語のテキスト"}) == 0.0


def test_fuzzy_match_is_rapidfuzz_wratio_with_default_processing():
    from rapidfuzz import fuzz, utils

    for a, b in [
        (HYP, REF),
        ("fuzzy wuzzy was a bear", "fuzzy wuzzy had no hair"),
        ("Café", "cafe"),
        ("", "x"),
    ]:
        want = fuzz.WRatio(a, b, processor=utils.default_process) / 100
        assert score(ts("fuzzy_match"), a, {"ref": b}) == pytest.approx(want, abs=1e-12)
    assert (
        score(ts("fuzzy_match"), "HELLO World!", {"ref": "hello world"}) == 1.0
    )  # case, punctuation dropped
    assert score(ts("fuzzy_match"), "", {"ref": "hello"}) == 0.0


def test_cosine_and_meteor_without_wordnet_are_refused_with_the_reason():
    with pytest.raises(GraderSpecError) as e:
        parse_grader(ts("cosine"))
    assert e.value.field == "grader.evaluation_metric" and "embedding model" in e.value.message
    if metrics.refusal("meteor") is None:  # NLTK's WordNet is installed here: meteor is accepted
        assert parse_grader(ts("meteor")) is not None
        return
    with pytest.raises(GraderSpecError) as e:
        parse_grader(ts("meteor"))
    assert e.value.field == "grader.evaluation_metric" and "WordNet" in e.value.message


# ---- numeric_check ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("42", Fraction(42)),
        ("-3.25", Fraction(-13, 4)),
        ("\u22123.25", Fraction(-13, 4)),  # U+2212 minus
        ("1,234,567.5", Fraction(2469135, 2)),
        ("2.5e-3", Fraction(1, 400)),
        (".5", Fraction(1, 2)),
        ("3/4", Fraction(3, 4)),
        ("-\\frac{3}{4}", Fraction(-3, 4)),
        ("\\dfrac{1}{3}", Fraction(1, 3)),
        ("$1,000", Fraction(1000)),
        ("50\\%", Fraction(50)),
        ("1/0", None),
        ("inf", None),
        ("nan", None),
        ("1,23", None),  # not groups of three: not a thousands separator
        ("12abc", None),
    ],
)
def test_numbers_are_read_exactly(text, want):
    assert numeric.parse_number(text, "exact") == want


@pytest.mark.parametrize(
    ("text", "want"),
    [
        ("First 3, then 4; so the answer is 7.", Fraction(7)),
        (
            "We get \\boxed{\\frac{3}{4}} after 12 steps",
            Fraction(3, 4),
        ),  # the boxed answer wins over later numbers
        ("\\boxed{1} then \\boxed{ 2 }", Fraction(2)),  # the last box
        ("\\boxed{\\text{no}} 5", None),  # a box whose content is not a number: no answer, not the 5 after it
        ("x2 and 3y", None),  # digits glued to letters are not numbers
        ("no digits here", None),
    ],
)
def test_the_answer_is_the_last_boxed_value_or_the_last_number(text, want):
    assert numeric.parse_number(text, "auto") == want


def test_numbers_too_long_to_read_quickly_are_no_numbers():
    # reading 1e999999999 exactly would build a billion-digit integer; Python refuses int strings over 4300 digits
    t0 = time.perf_counter()
    assert numeric.parse_number("1e999999999", "exact") is None
    assert numeric.parse_number("the answer is " + "7" * 5000, "auto") is None
    assert numeric.parse_number("2e1000", "exact") == 2 * 10**1000  # within the bounds: exact
    assert time.perf_counter() - t0 < 1


def test_outputs_nested_past_the_json_readers_limit_grade_without_raising():
    deep = "[" * 100_000
    assert Sample.of(deep).output_json is None
    spec = {
        "type": "json_schema",
        "name": "j",
        "input": "{{ sample.output_text }}",
        "schema": {"type": "array"},
    }
    r = parse_grader(spec).grade(Sample.of(deep + "]" * 100_000), {})
    assert r.score == 0.0 and "nests deeper" in r.invalid["j"]


def test_numeric_check_tolerances_are_inclusive_bounds_relative_to_the_reference():
    # |x − ref| ≤ max(abs_tol, rel_tol·|ref|), exactly in rationals (the tolerances' binary values)
    rel = nc(rel_tol=0.25)
    assert score(rel, "5", {"a": "4"}) == 1.0  # |5 − 4| = 1 = 0.25·4
    assert score(rel, "5.000001", {"a": "4"}) == 0.0
    assert score(rel, "3", {"a": "4"}) == 1.0
    absol = nc(abs_tol=0.5, rel_tol=0)
    assert score(absol, "2.5", {"a": 2}) == 1.0  # a row's number is read from its JSON text
    assert score(absol, "2.5000001", {"a": 2}) == 0.0
    # the default (rel 1e-9, abs 0) separates 1/3 from its 6-digit decimal, and accepts 1/3 == \frac{1}{3}
    assert score(nc(), "0.333333", {"a": "1/3"}) == 0.0
    assert score(nc(), "\\boxed{\\frac{1}{3}}", {"a": "1/3"}) == 1.0
    r = parse_grader(nc()).grade(Sample.of("I don't know"), {"a": "1"})
    assert r.score == 0.0 and "no number" in r.invalid["n"]
    r = parse_grader(nc()).grade(Sample.of("1"), {"a": "NaN"})
    assert r.score == 0.0 and "not a number" in r.invalid["n"]


# ---- regex_match, json_schema, length_penalty -----------------------------------------------------------------


def test_regex_match_searches_or_fullmatches_with_flags():
    spec = {
        "type": "regex_match",
        "name": "r",
        "input": "{{ sample.output_text }}",
        "pattern": r"answer:\s*\d+",
    }
    assert score(spec, "so, answer: 42") == 1.0
    assert score(spec, "so, ANSWER: 42") == 0.0
    assert score({**spec, "flags": ["ignorecase"]}, "so, ANSWER: 42") == 1.0
    assert score({**spec, "match": "fullmatch"}, "so, answer: 42") == 0.0
    assert score({**spec, "match": "fullmatch"}, "answer: 42") == 1.0


def test_a_catastrophically_backtracking_pattern_scores_zero_within_its_timeout():
    spec = {"type": "regex_match", "name": "r", "input": "{{ sample.output_text }}", "pattern": r"^(a|aa)+$"}
    t0 = time.perf_counter()
    r = parse_grader(spec).grade(Sample.of("a" * 40 + "b"), {})  # Fibonacci(40) ≈ 1e8 ways to split the a's
    assert time.perf_counter() - t0 < 5
    assert r.score == 0.0 and "ran past" in r.invalid["r"]


def test_json_schema_scores_json_the_schema_accepts():
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    spec = {"type": "json_schema", "name": "j", "input": "{{ sample.output_text }}", "schema": schema}
    assert score(spec, '{"n": 3}') == 1.0
    assert score(spec, '{"n": "3"}') == 0.0
    assert score(spec, "{n: 3}") == 0.0  # not JSON
    remote = {**spec, "schema": {"$ref": "https://example.com/s.json"}}
    r = parse_grader(remote).grade(Sample.of("{}"), {})  # never fetched
    assert r.score == 0.0 and "cannot be resolved" in r.invalid["j"]


def test_length_penalty_falls_linearly_from_target_to_limit():
    spec = {"type": "length_penalty", "name": "l", "unit": "tokens", "target": 10, "limit": 20}
    g = parse_grader(spec)
    got = [g.grade(Sample("x", num_tokens=n), {}).score for n in (0, 10, 15, 19, 20, 40)]
    assert got == [1.0, 1.0, 0.5, pytest.approx(0.1), 0.0, 0.0]
    words = {**spec, "unit": "words", "target": 2, "limit": 4}
    assert score(words, "one two  three") == 0.5
    chars = {**spec, "unit": "chars", "target": 1, "limit": 3}
    assert score(chars, "日本") == 0.5  # code points, not bytes
    with pytest.raises(ValueError, match="num_tokens"):
        g.grade(Sample("x"), {})


# ---- templates -------------------------------------------------------------------------------------------------


def test_templates_read_nested_fields_and_render_non_strings_as_json():
    spec = sc("eq", inp="{{item.a.b[1]}}|{{ item.n }}|{{ item.t }}|{{ item.o }}|{{ item.l.0 }}", ref="x")
    g = parse_grader(spec)
    item = {"a": {"b": ["p", "q"]}, "n": 1.5, "t": True, "o": {"k": "é"}, "l": ["z"]}
    assert g.leaves["s"].input.render({"item": item, "sample": {}}) == 'q|1.5|true|{"k": "é"}|z'
    js = sc("eq", inp="{{ sample.output_json.name }}", ref="{{ item['full name'] }}")
    assert score(js, '{"name": "Ada"}', {"full name": "Ada"}) == 1.0
    r = parse_grader(js).grade(Sample.of("Ada"), {"full name": "Ada"})  # not JSON: nothing to compare
    assert r.score == 0.0 and "output_json" in r.invalid["s"]


def test_references_to_fields_the_rows_lack_are_found_before_grading():
    spec = {
        "type": "multi",
        "name": "m",
        "graders": {"a": sc("eq", ref="{{ item.answer }}"), "b": sc("like", ref="{{ item.meta.city }}")},
        "calculate_output": "a + b",
    }
    g = parse_grader(spec)
    assert check_references(g, {"answer", "meta"}) is None
    miss = check_references(g, {"meta"})
    assert (miss.field, miss.reference) == ("grader.graders.a.reference", "item.answer")
    assert miss.error().field == "grader.graders.a.reference"
    miss = check_row(g, {"answer": "x", "meta": {"country": "FR"}})
    assert (miss.field, miss.reference) == ("grader.graders.b.reference", "item.meta.city")
    with pytest.raises(GradeInputError) as e:
        g.grade(Sample.of("x"), {"meta": {"city": "Paris"}})
    assert e.value.field == "grader.graders.a.reference"


# ---- multi -----------------------------------------------------------------------------------------------------

FORMULAS = [
    # (calculate_output, the same in Python, where ^ is **): a = 0.5, b = 0.25, c = 2
    ("a + b * c", 0.5 + 0.25 * 2),
    ("(a + b) * c", (0.5 + 0.25) * 2),
    ("a - b - c", 0.5 - 0.25 - 2),  # left associative
    ("a / b / c", 0.5 / 0.25 / 2),
    ("c ^ c ^ 3", 2 ** (2**3)),  # right associative
    ("-c ^ 2", -(2**2)),  # power binds tighter than unary minus
    ("c ^ -1", 2**-1),
    ("2 * -a", 2 * -0.5),
    ("min(a, b, 0.3) + max(a)", min(0.5, 0.25, 0.3) + 0.5),
    ("abs(b - a) + floor(c * 1.7) + ceil(a)", abs(0.25 - 0.5) + math.floor(3.4) + math.ceil(0.5)),
    ("exp(a) * sqrt(c) - log(c)", math.exp(0.5) * math.sqrt(2) - math.log(2)),
    ("1e-1 * .5 + 3.", 1e-1 * 0.5 + 3.0),
]


@pytest.mark.parametrize(("formula", "want"), FORMULAS)
def test_calculate_output_has_the_documented_operators_functions_and_precedence(formula, want):
    from strop.graders.formula import Formula

    got = Formula.parse(formula, {"a", "b", "c"}).evaluate({"a": 0.5, "b": 0.25, "c": 2.0})
    assert got == pytest.approx(want, rel=1e-15)


@pytest.mark.parametrize(
    "formula", ["s / b", "log(b)", "sqrt(b - c)", "exp(1000 * c)", "b ^ -1", "(b - c) ^ 0.5"]
)
def test_a_formula_without_a_finite_value_scores_zero_and_says_why(formula):
    spec = {
        "type": "multi",
        "name": "total",
        "graders": [sc("eq"), {**sc("like"), "name": "c"}, {**sc("ne"), "name": "b"}],
        "calculate_output": formula,
    }
    # eq (s) 1, like (c) 1, ne (b) 0: each formula divides by zero, leaves log's or sqrt's domain, or overflows
    r = parse_grader(spec).grade(Sample.of("x"), {"ref": "x"})
    assert r.per_grader == {"s": 1.0, "c": 1.0, "b": 0.0, "total": 0.0}
    assert "total" in r.invalid and not r.passed["total"]


def test_multi_grades_the_guides_example_and_each_sub_grader_by_name():
    spec = {  # OpenAI's graders guide, "Combined graders"
        "type": "multi",
        "name": "m",
        "graders": {
            "name": {
                "name": "name_grader",
                "type": "text_similarity",
                "input": "{{sample.output_json.name}}",
                "reference": "{{item.name}}",
                "evaluation_metric": "fuzzy_match",
                "pass_threshold": 0.9,
            },
            "email": {
                "name": "email_grader",
                "type": "string_check",
                "input": "{{sample.output_json.email}}",
                "reference": "{{item.email}}",
                "operation": "eq",
            },
        },
        "calculate_output": "(name + email) / 2",
    }
    from rapidfuzz import fuzz, utils

    g = parse_grader(spec)
    item = {"name": "John Doe", "email": "john.doe@gmail.com"}
    samples = [Sample.of('{"name": "Jon Doe", "email": "john.doe@gmail.com"}'), Sample.of('{"name": "x"}')]
    a, b = g.grade_many(samples, [item, item])
    fuzzy = fuzz.WRatio("Jon Doe", "John Doe", processor=utils.default_process) / 100
    assert a.per_grader == {"name": pytest.approx(fuzzy), "email": 1.0, "m": pytest.approx((fuzzy + 1) / 2)}
    assert a.passed["name"] is (fuzzy >= 0.9) and a.passed["email"]
    assert b.per_grader["email"] == 0.0 and "email" in b.invalid  # the output has no email
    assert [g.grade(s, item) for s in samples] == [a, b]


# ---- model graders ---------------------------------------------------------------------------------------------


def test_score_model_renders_its_prompts_asks_once_per_batch_and_reads_scores_leniently():
    spec = {
        "type": "score_model",
        "name": "judge",
        "model": "judge-session",
        "range": [0, 10],
        "input": [
            {"role": "developer", "content": "You grade answers."},
            {
                "role": "user",
                "content": [
                    {"type": "input_text", "text": "Ref: {{ item.ref }}"},
                    "Got: {{ sample.output_text }}",
                ],
            },
        ],
        "sampling_params": {"temperature": 0.0, "seed": 7, "max_completions_tokens": 64},
        "pass_threshold": 5,
    }
    replies = [
        '{"result": 7.5, "steps": [{"description": "d", "conclusion": "c"}]}',
        '```json\n{"result": 12}\n```',  # above the range: clipped to 10
        'I think "result": -3 overall',  # embedded, below the range: clipped to 0
        " 4 ",
        "a fine answer",  # no number: 0, invalid (OpenAI: non-numeric outputs score 0)
        '{"result": NaN}',
        '{"result": 1%s}' % ("0" * 400),  # an integer past float's range: clipped to the top
        '"result": -1e999',  # past float's range below: clipped to the bottom
    ]
    calls: list[list[ModelRequest]] = []

    def model_fn(requests):
        calls.append(list(requests))
        return replies[: len(requests)]

    g = parse_grader(spec, model_fn=model_fn)
    assert g.models == {"judge-session"}
    out = g.grade_many([Sample.of(f"answer {i}") for i in range(8)], [{"ref": "R"}] * 8)
    assert len(calls) == 1 and len(calls[0]) == 8
    req = calls[0][2]
    assert req.model == "judge-session" and req.sampling.temperature == 0.0 and req.sampling.seed == 7
    assert req.messages[0]["role"] == "system" and req.messages[0]["content"].startswith("You grade answers.")
    assert '"result": <a number from 0 to 10>' in req.messages[0]["content"]
    assert req.messages[1] == {"role": "user", "content": "Ref: R\nGot: answer 2"}
    assert [r.score for r in out] == [7.5, 10.0, 0.0, 4.0, 0.0, 0.0, 10.0, 0.0]
    assert [r.passed["judge"] for r in out] == [True, True, False, False, False, False, True, False]
    assert set(out[4].invalid) == {"judge"} and set(out[5].invalid) == {"judge"}
    with pytest.raises(RuntimeError, match="model_fn"):
        parse_grader(spec).grade(Sample.of("x"), {"ref": "R"})


def test_a_bare_number_among_whitespace_float_refuses_reads_as_that_number():
    """re's \\s takes the separators \\x1c-\\x1f (str.isspace), float() does not: a sampled reply such as
    "\\x1d\\n\\n9" must read as 9, not end the job with a ValueError."""
    for reply, want in [("\x1d\n\n9", 9.0), ("\x1c 3.5 \x1f", 3.5), ("\u2003-2e0\n", 0.0)]:
        assert read_score(reply, 0.0, 10.0) == Score(want), reply


def test_label_model_passes_the_passing_labels():
    spec = {
        "type": "label_model",
        "name": "lab",
        "model": "m",
        "input": [{"role": "user", "content": "Is {{ sample.output_text }} polite?"}],
        "labels": ["polite", "rude"],
        "passing_labels": ["polite"],
    }
    g = parse_grader(spec, model_fn=lambda reqs: ['{"label": "polite"}', "Rude", "maybe"][: len(reqs)])
    out = g.grade_many([Sample.of("a"), Sample.of("b"), Sample.of("c")], [{}] * 3)
    assert [r.score for r in out] == [1.0, 0.0, 0.0] and set(out[2].invalid) == {"lab"}
