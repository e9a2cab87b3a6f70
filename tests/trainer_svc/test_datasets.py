"""Dataset validation: formats are detected like TRL's, and every bad row is reported by line number."""

from __future__ import annotations

import json

import pytest

from strop.common.errors import InvalidArgument, ResourceExhausted
from strop.common.trainer_types import DatasetFormat
from strop.trainer_svc.core.datasets import Limits, validate_jsonl


def jsonl(*rows) -> bytes:
    return "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows).encode()


@pytest.mark.parametrize(
    ("row", "fmt"),
    [
        ({"text": "hello"}, DatasetFormat.TEXT),
        (
            {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]},
            DatasetFormat.MESSAGES,
        ),
        ({"prompt": "Q", "completion": "A"}, DatasetFormat.PROMPT_COMPLETION),
        ({"prompt": "Q", "chosen": "A", "rejected": "B"}, DatasetFormat.PREFERENCE),
        (
            {
                "prompt": [{"role": "user", "content": "Q"}],
                "chosen": [{"role": "assistant", "content": "A"}],
                "rejected": [{"role": "assistant", "content": "B"}],
            },
            DatasetFormat.PREFERENCE,
        ),
        ({"prompt": "Q", "completion": "A", "label": False}, DatasetFormat.UNPAIRED_PREFERENCE),
    ],
)
def test_format_is_detected_from_the_rows(row, fmt):
    out = validate_jsonl([jsonl(row, row)], DatasetFormat.UNSPECIFIED, Limits())
    assert out.format is fmt
    assert len(out.rows) == 2


def test_rows_split_across_chunks_are_reassembled():
    data = jsonl({"text": "a" * 50}, {"text": "b"}, {"text": "c"})
    chunks = [data[i : i + 7] for i in range(0, len(data), 7)]
    out = validate_jsonl(chunks, DatasetFormat.UNSPECIFIED, Limits())
    assert [r["text"] for r in out.rows] == ["a" * 50, "b", "c"]


def test_malformed_json_is_reported_with_its_line_number():
    data = jsonl({"text": "ok"}, '{"text": "broken', {"text": "ok"}, "[1, 2]")
    with pytest.raises(InvalidArgument) as exc:
        validate_jsonl([data], DatasetFormat.UNSPECIFIED, Limits())
    msg = str(exc.value)
    assert "2 bad row(s)" in msg
    assert "line 2: not valid JSON" in msg
    assert "line 4: a row must be a JSON object" in msg


def test_preference_rows_without_rejected_name_the_missing_field():
    data = jsonl({"prompt": "Q", "chosen": "A"}, {"prompt": "Q2", "chosen": "A2"})
    with pytest.raises(InvalidArgument, match=r"line 1: missing 'rejected'.*line 2: missing 'rejected'"):
        validate_jsonl([data], DatasetFormat.UNSPECIFIED, Limits())


def test_declared_format_is_enforced_on_every_row():
    data = jsonl({"prompt": "Q", "completion": "A"}, {"text": "x"})
    with pytest.raises(InvalidArgument, match=r"line 2: missing 'prompt'"):
        validate_jsonl([data], DatasetFormat.PROMPT_COMPLETION, Limits())


def test_conversation_must_end_with_the_assistant():
    data = jsonl({"messages": [{"role": "user", "content": "hi"}]})
    with pytest.raises(InvalidArgument, match="last message must come from the assistant"):
        validate_jsonl([data], DatasetFormat.MESSAGES, Limits())


def test_prompts_end_with_the_user_and_keep_their_reference_fields():
    # detected from a conversation that ends with the user's turn (OpenAI's reinforcement fine-tuning rows)
    row = {"messages": [{"role": "user", "content": "2+2?"}], "answer": "4", "meta": {"k": [1]}}
    out = validate_jsonl([jsonl(row, row)], DatasetFormat.UNSPECIFIED, Limits())
    assert (
        out.format is DatasetFormat.PROMPTS
        and out.rows[0]["answer"] == "4"
        and out.rows[0]["meta"] == {"k": [1]}
    )
    done = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    with pytest.raises(InvalidArgument, match=r"line 2: the last message must be the user's"):
        validate_jsonl([jsonl(row, done)], DatasetFormat.UNSPECIFIED, Limits())
    with pytest.raises(InvalidArgument, match=r"line 1: 'messages' must be a non-empty list"):
        validate_jsonl([jsonl({"messages": [], "answer": "4"})], DatasetFormat.PROMPTS, Limits())


def test_unknown_role_is_rejected():
    data = jsonl({"messages": [{"role": "robot", "content": "hi"}, {"role": "assistant", "content": "x"}]})
    with pytest.raises(InvalidArgument, match=r"messages\[0\].role"):
        validate_jsonl([data], DatasetFormat.UNSPECIFIED, Limits())


def test_unrecognised_keys_explain_the_expected_formats():
    with pytest.raises(InvalidArgument, match="cannot tell the format"):
        validate_jsonl([jsonl({"question": "Q"})], DatasetFormat.UNSPECIFIED, Limits())


def test_size_limits_are_enforced():
    with pytest.raises(ResourceExhausted, match="size limit"):
        validate_jsonl([jsonl({"text": "x" * 100})], DatasetFormat.UNSPECIFIED, Limits(max_bytes=50))
    with pytest.raises(ResourceExhausted, match="limit is 20"):
        validate_jsonl([jsonl({"text": "x" * 100})], DatasetFormat.UNSPECIFIED, Limits(max_row_bytes=20))


def test_empty_dataset_is_rejected():
    with pytest.raises(InvalidArgument, match="no rows"):
        validate_jsonl([b"\n\n"], DatasetFormat.UNSPECIFIED, Limits())


def test_pre_tokenized_rows_are_detected_and_checked():
    good = validate_jsonl(
        [jsonl({"input_ids": [1, 2, 3], "completion_mask": [0, 1, 1]})], DatasetFormat.UNSPECIFIED, Limits()
    )
    assert good.format is DatasetFormat.TOKENS
    bad = jsonl({"input_ids": [1, -2]}, {"input_ids": [1, 2], "completion_mask": [1]}, {"input_ids": []})
    with pytest.raises(InvalidArgument) as exc:
        validate_jsonl([bad], DatasetFormat.UNSPECIFIED, Limits())
    msg = str(exc.value)
    assert "line 1: 'input_ids' must hold non-negative integers" in msg
    assert "line 2: 'completion_mask' must be a list of 0/1 as long as 'input_ids'" in msg
    assert "line 3: 'input_ids' must be a non-empty list" in msg


def test_json_nested_past_the_recursion_limit_is_a_bad_row_not_a_crash():
    from strop.trainer_svc.core.datasets import Limits, validate_jsonl

    deep = b'{"text": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n"
    with pytest.raises(InvalidArgument, match="line 1: JSON nested too deeply"):
        validate_jsonl([deep], DatasetFormat.UNSPECIFIED, Limits())


def test_unpaired_preference_rows_need_a_boolean_label_and_a_completion():
    data = jsonl(
        {"prompt": "Q", "completion": "A", "label": True},
        {"prompt": "Q", "completion": "A", "label": 1},  # JSON 1 is not a label: TRL reads a bool
        {"prompt": "Q", "label": False},
        {"prompt": "Q", "completion": [{"role": "assistant", "content": "A"}], "label": False},
    )
    with pytest.raises(InvalidArgument) as exc:
        validate_jsonl([data], DatasetFormat.UNSPECIFIED, Limits())
    msg = str(exc.value)
    assert "3 bad row(s)" in msg
    assert "line 2: 'label' must be true or false" in msg
    assert "line 3: missing 'completion'" in msg
    assert "line 4" in msg and "mix strings and message lists" in msg
