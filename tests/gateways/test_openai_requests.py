"""What the OpenAI gateway refuses, and how: bad files name their line (the gateway's own refusals and the trainer's
row rules alike), bad job requests name their ``param``, unknown ids are 404, keys are checked, and a few dozen
malformed bodies each get a 4xx with OpenAI's error object, never a 500. Plus a script written for OpenAI's API run
unchanged against the gateway."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.deps import locked

openai = locked("openai")
httpx = locked("httpx")

from tests.gateways.openai_stack import KEY_A, chat_rows, jsonl, running_stack  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def stack(model_root, tmp_path_factory):
    yield from running_stack(model_root, tmp_path_factory)


@pytest.fixture(scope="module")
def train_file(stack):
    return stack.client().files.create(file=("t.jsonl", jsonl(chat_rows(4))), purpose="fine-tune")


def _upload_error(stack, lines: list[str]) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as e:
        stack.client().files.create(file=("bad.jsonl", "\n".join(lines).encode()), purpose="fine-tune")
    assert e.value.param == "file"
    return e.value


GOOD = json.dumps(chat_rows(1)[0])


def test_a_bad_row_is_named_by_its_line(stack):
    row = chat_rows(1)[0]
    row["messages"][2]["weight"] = 2  # the trainer's rule: 0 or 1
    err = _upload_error(stack, [GOOD, GOOD, json.dumps(row)])
    assert "line 3" in err.message and "weight" in err.message
    err = _upload_error(stack, [GOOD, "{not json", GOOD])
    assert "line 2" in err.message and "not valid JSON" in err.message
    row = chat_rows(1)[0]
    row["messages"] = row["messages"][:2]  # ends with the user: nothing to learn
    err = _upload_error(stack, [GOOD, json.dumps(row)])
    assert "line 2" in err.message and "last message must come from the assistant" in err.message


TOOLS = [
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object", "properties": {}}}}
]


def test_function_calling_rows_pass_to_the_trainer_and_images_are_refused_by_line(stack):
    c = stack.client()
    call = chat_rows(1)[0]
    call["tools"] = TOOLS
    call["parallel_tool_calls"] = False
    call["messages"][2:2] = [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1, "b": 1}'}}
            ],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "2"},
    ]
    legacy = chat_rows(1)[0]
    legacy["functions"] = [TOOLS[0]["function"]]
    legacy["messages"][2:2] = [
        {
            "role": "assistant",
            "content": None,
            "function_call": {"name": "add", "arguments": '{"a": 1, "b": 1}'},
        },
        {"role": "function", "name": "add", "content": "2"},
    ]
    f = c.files.create(file=("tools.jsonl", jsonl([call, legacy])), purpose="fine-tune")
    assert f.status == "processed"
    # the fixture model's chat template renders role and content only: the job is refused, naming the row
    with pytest.raises(openai.BadRequestError) as e:
        c.fine_tuning.jobs.create(model="tiny-llama", training_file=f.id)
    assert "row 1" in e.value.message and "does not render tools" in e.value.message, e.value.message
    bad = {**call, "tools": [{"type": "function", "function": {"parameters": {}}}]}
    err = _upload_error(stack, [GOOD, json.dumps(bad)])
    assert "line 2" in err.message and "'tools[0].function.name'" in err.message
    pref = {
        "input": {"messages": [{"role": "user", "content": "hi"}], "tools": TOOLS},
        "preferred_output": [{"role": "assistant", "content": "a"}],
        "non_preferred_output": [{"role": "assistant", "content": "b"}],
    }
    err = _upload_error(stack, [json.dumps(pref)])
    assert "line 1" in err.message and "'input.tools'" in err.message and "chat SFT rows" in err.message
    image = chat_rows(1)[0]
    image["messages"][1]["content"] = [{"type": "image_url", "image_url": {"url": "data:,"}}]
    err = _upload_error(stack, [GOOD, GOOD, json.dumps(image)])
    assert "line 3" in err.message and "'image_url' part" in err.message


def test_legacy_function_calling_is_mapped_to_tools():
    from strop.gateways.openai.files import convert_row

    row = {
        "functions": [TOOLS[0]["function"]],
        "parallel_tool_calls": True,
        "messages": [
            {"role": "user", "content": "1+1?"},
            {"role": "assistant", "content": None, "function_call": {"name": "add", "arguments": "{}"}},
            {"role": "function", "name": "add", "content": "2"},
            {"role": "assistant", "content": "2"},
        ],
    }
    out, kind = convert_row(row)
    assert (
        kind == "chat"
        and out["tools"] == TOOLS
        and "functions" not in out
        and "parallel_tool_calls" not in out
    )
    call = {"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    assert out["messages"][1] == {"role": "assistant", "content": None, "tool_calls": [call]}
    assert out["messages"][2] == {"role": "tool", "tool_call_id": "call_1", "name": "add", "content": "2"}


def test_text_parts_and_preference_rows_are_mapped(stack):
    c = stack.client()
    parts = chat_rows(1)[0]
    parts["messages"][1]["content"] = [
        {"type": "text", "text": "What is 1 "},
        {"type": "text", "text": "plus 1?"},
    ]
    assert c.files.create(file=("p.jsonl", jsonl([parts])), purpose="fine-tune").status == "processed"
    bad_pref = {
        "input": {"messages": [{"role": "user", "content": "hi"}]},
        "preferred_output": [{"role": "assistant", "content": "hello"}],
    }
    err = _upload_error(stack, [json.dumps(bad_pref)])
    assert "line 1" in err.message and "non_preferred_output" in err.message


def test_other_purposes_and_empty_files_are_refused(stack):
    c = stack.client()
    with pytest.raises(openai.BadRequestError) as e:
        c.files.create(file=("t.jsonl", jsonl(chat_rows(2))), purpose="assistants")
    assert e.value.param == "purpose"
    with pytest.raises(openai.BadRequestError) as e:
        c.files.create(file=("t.jsonl", b"\n\n"), purpose="fine-tune")
    assert e.value.param == "file"


def test_bad_job_requests_name_their_param(stack, train_file):
    c = stack.client()
    create = c.fine_tuning.jobs.create
    cases = {
        "model": dict(model="gpt-4o-mini-2024-07-18", training_file=train_file.id),
        "training_file": dict(model="tiny-llama", training_file="file-nope"),
        "method.type": dict(model="tiny-llama", training_file=train_file.id, method={"type": "rlhf"}),
        "method.reinforcement.grader": dict(
            model="tiny-llama", training_file=train_file.id, method={"type": "reinforcement"}
        ),
        "method.reinforcement.grader.operation": dict(
            model="tiny-llama",
            training_file=train_file.id,
            method={
                "type": "reinforcement",
                "reinforcement": {
                    "grader": {
                        "type": "string_check",
                        "name": "g",
                        "input": "a",
                        "reference": "b",
                        "operation": "zz",
                    }
                },
            },
        ),
        "method.reinforcement.hyperparameters.reasoning_effort": dict(
            model="tiny-llama",
            training_file=train_file.id,
            method={
                "type": "reinforcement",
                "reinforcement": {
                    "grader": {
                        "type": "string_check",
                        "name": "g",
                        "input": "a",
                        "reference": "b",
                        "operation": "eq",
                    },
                    "hyperparameters": {"reasoning_effort": "high"},
                },
            },
        ),
        "method.supervised.hyperparameters.n_epochs": dict(
            model="tiny-llama",
            training_file=train_file.id,
            method={"type": "supervised", "supervised": {"hyperparameters": {"n_epochs": 0}}},
        ),
        "method.dpo.hyperparameters.beta": dict(
            model="tiny-llama",
            training_file=train_file.id,
            method={"type": "dpo", "dpo": {"hyperparameters": {"beta": 3.0}}},
        ),
        "hyperparameters.learning_rate_multiplier": dict(
            model="tiny-llama", training_file=train_file.id, hyperparameters={"learning_rate_multiplier": -1}
        ),
        "integrations": dict(
            model="tiny-llama",
            training_file=train_file.id,
            integrations=[{"type": "wandb", "wandb": {"project": "p"}}],
        ),
        "suffix": dict(model="tiny-llama", training_file=train_file.id, suffix="has:colon"),
        "seed": dict(model="tiny-llama", training_file=train_file.id, seed=-3),
        "metadata": dict(model="tiny-llama", training_file=train_file.id, metadata={"k": "v" * 513}),
        "frobnicate": dict(model="tiny-llama", training_file=train_file.id, extra_body={"frobnicate": 1}),
    }
    for param, kwargs in cases.items():
        with pytest.raises(openai.BadRequestError) as e:
            create(**kwargs)
        assert e.value.param == param, (param, e.value.message)
        assert e.value.type == "invalid_request_error"
    assert list(c.fine_tuning.jobs.list()) == []  # nothing refused left a job behind


def test_unknown_ids_are_not_found(stack):
    c = stack.client()
    for call in (
        lambda: c.fine_tuning.jobs.retrieve("ftjob-nope"),
        lambda: c.fine_tuning.jobs.pause("ftjob-nope"),
        lambda: c.fine_tuning.jobs.checkpoints.list("ftjob-nope"),
        lambda: c.files.delete("file-nope"),
        lambda: c.models.retrieve("ft:tiny-llama:a::nope"),
        lambda: c.models.delete("nope"),
    ):
        with pytest.raises(openai.NotFoundError) as e:
            call()
        assert e.value.type == "not_found_error"


def test_keys_are_checked_and_org_headers_accepted(stack):
    with pytest.raises(openai.AuthenticationError):
        stack.client("sk-unknown-key").files.list()
    r = httpx.get(f"{stack.url}/files")
    assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    org = openai.OpenAI(
        base_url=stack.url, api_key=KEY_A, organization="org-x", project="proj-y", max_retries=0
    )
    assert [m.id for m in org.models.list()][:2] == ["tiny-llama", "tiny-llama-4bit"]


def test_malformed_requests_are_4xx_with_an_error_object(stack, train_file):
    auth = {"Authorization": f"Bearer {KEY_A}"}
    jobs = f"{stack.url}/fine_tuning/jobs"
    bodies = [
        b"{",
        b"[]",
        b'"x"',
        b"null",
        b"1e999999",
        b'{"model": 1}',
        b'{"model": "tiny-llama"}',
        b'{"model": "tiny-llama", "training_file": ["x"]}',
        b'{"model": "tiny-llama", "training_file": "f", "method": "sft"}',
        b'{"model": "tiny-llama", "training_file": "f", "method": {"type": "supervised", "supervised": []}}',
        b'{"model": "tiny-llama", "training_file": "f", "hyperparameters": {"n_epochs": "many"}}',
        b'{"model": "tiny-llama", "training_file": "f", "hyperparameters": {"batch_size": true}}',
        b'{"model": "tiny-llama", "training_file": "f", "hyperparameters": {"learning_rate_multiplier": NaN}}',
        b'{"model": "tiny-llama", "training_file": "f", "hyperparameters": []}',
        b'{"model": "tiny-llama", "metadata": []}',
        b'{"model": "tiny-llama", "training_file": "f", "seed": 1.5}',
        b"\xff\xfe",
        b'{"model": "tiny-llama", "training_file": "%s", "method": {"type": "dpo", "supervised": {}}}'
        % train_file.id.encode(),
    ]
    requests = [("POST", jobs, {"content": b}) for b in bodies]
    requests += [
        ("GET", f"{jobs}?limit=abc", {}),
        ("GET", f"{jobs}?limit=0", {}),
        ("GET", f"{stack.url}/files?order=up", {}),
        ("GET", f"{jobs}/ftjob-x/events?limit=1000", {}),
        ("POST", f"{stack.url}/files", {"content": b"plain"}),
        ("POST", f"{stack.url}/files", {"files": {"purpose": (None, "fine-tune")}}),
        ("POST", f"{stack.url}/files", {"files": {"file": ("a.jsonl", b"{}")}}),
        (
            "POST",
            f"{stack.url}/files",
            {"content": b"--x\r\nbroken", "headers": {"content-type": "multipart/form-data; boundary=x"}},
        ),
        ("DELETE", jobs, {}),
        ("GET", f"{stack.url}/nowhere", {}),
    ]
    for method, url, kw in requests:
        headers = {**auth, **kw.pop("headers", {})}
        r = httpx.request(method, url, headers=headers, **kw)
        assert 400 <= r.status_code < 500, (method, url, kw, r.status_code, r.text)
        err = r.json()["error"]
        assert err["message"] and err["type"], r.text


def test_a_script_written_for_openai_runs_unchanged(stack, tmp_path):
    data = tmp_path / "train.jsonl"
    data.write_bytes(jsonl(chat_rows(4)))
    env = {**os.environ, "OPENAI_BASE_URL": stack.url, "OPENAI_API_KEY": KEY_A}
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "docs/examples/openai_fine_tune.py"),
            str(data),
            "--model",
            "tiny-llama",
            "--epochs",
            "1",
            "--poll-seconds",
            "0.2",
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "fine-tuned model: ft:tiny-llama:a:example:" in out.stdout
    assert "[info] The job has successfully completed" in out.stdout
    assert "checkpoint ft:tiny-llama:a:example:" in out.stdout  # 4 rows, batch 4: one step, its checkpoint


def test_a_prompts_file_is_stored_but_not_trained_by_sft(stack):
    c = stack.client()
    rows = [
        {"messages": [{"role": "user", "content": f"What is {i} plus {i}?"}], "answer": str(2 * i)}
        for i in range(3)
    ]
    f = c.files.create(file=("rft.jsonl", jsonl(rows)), purpose="fine-tune")  # OpenAI's reinforcement rows
    with pytest.raises(openai.BadRequestError) as e:
        c.fine_tuning.jobs.create(model="tiny-llama", training_file=f.id)
    assert e.value.param == "training_file" and "prompts rows" in e.value.message


@pytest.mark.parametrize("method", ["supervised", "dpo"])
def test_an_openai_job_trains_on_its_file_alone_not_on_the_chat_recipe(method):
    """OpenAI's API has no retention knob and reports one model a step: a job's trainer config asks retention NONE
    (unset, SFT on chat data would run strop's chat recipe, whose scaled final adapter differs from the job's last
    checkpoint at the same step)."""
    from strop.common.trainer_types import Retention
    from strop.gateways.openai.params import JobRequest, resolve

    req = JobRequest("tiny-llama", "file-1", None, None, 0, None, method)
    cfg, _ = resolve(req, num_rows=8)
    assert cfg.retention is Retention.NONE and cfg.adapter_scale == 0.0
