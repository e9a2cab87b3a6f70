"""Function calling in chat SFT rows (OpenAI's ``tools`` and ``tool_calls``): accepted where the model's chat template
renders them, refused by row where it does not, and trained on as the assistant's turns: the loss covers the calls,
not the tools' results. Checked on the labels TRL's SFTTrainer builds from strop's rows."""

from __future__ import annotations

import json

import pytest

from strop.common.errors import InvalidArgument
from strop.common.trainer_types import DatasetFormat, TrainConfig, TrainMethod
from strop.trainer_svc.core.datasets import Limits, validate_jsonl
from strop.trainer_svc.core.job_config import check_tools_rendered, sft_rows

# Fixture data: a chat template in the style of Qwen2.5's / Hermes' tool templates (tools listed in a system turn,
# calls as <tool_call> JSON in the assistant turn, results as <tool_response> in a user turn).
TOOL_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n# Tools\n<tools>"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor %}\n</tools><|im_end|>\n{% endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'assistant' %}<|im_start|>assistant\n{{ message.content }}"
    "{%- for tc in message.tool_calls or [] %}{%- set f = tc.function if tc.function is defined else tc %}"
    '<tool_call>\n{"name": "{{ f.name }}", "arguments": {{ f.arguments | tojson }}}\n</tool_call>'
    "{%- endfor %}<|im_end|>\n"
    "{% elif message.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ message.content }}\n"
    "</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'},
}
ROW = {
    "tools": TOOLS,
    "messages": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "tool_call_id": "call_1", "content": "rain, 4C"},
        {"role": "assistant", "content": "Rainy and 4C."},
    ],
}
PLAIN = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}


@pytest.fixture(scope="module")
def tool_tokenizer(tiny_hf):
    import copy

    tok = copy.deepcopy(tiny_hf[1])
    tok.chat_template = TOOL_TEMPLATE
    return tok


def _validate(rows: list[dict]):
    return validate_jsonl(
        [("\n".join(json.dumps(r) for r in rows)).encode()], DatasetFormat.UNSPECIFIED, Limits()
    )


def test_tool_rows_are_accepted_and_bad_ones_named_by_line():
    ds = _validate([PLAIN, ROW])
    assert ds.format is DatasetFormat.MESSAGES and ds.rows[1]["tools"] == TOOLS
    bad_args = json.loads(json.dumps(ROW))
    bad_args["messages"][1]["tool_calls"][0]["function"]["arguments"] = "{city"
    on_user = json.loads(json.dumps(ROW))
    on_user["messages"][0]["tool_calls"] = [CALL]
    no_name = {**ROW, "tools": [{"type": "function", "function": {"description": "x"}}]}
    with pytest.raises(InvalidArgument) as e:
        _validate([PLAIN, bad_args, on_user, no_name])
    msg = str(e.value)
    assert "line 2: 'messages[1].tool_calls[0].function.arguments' is not valid JSON" in msg
    assert "line 3: 'messages[0].tool_calls' belongs on assistant messages only" in msg
    assert "line 4: 'tools[0].function.name' must be a non-empty string" in msg
    with pytest.raises(
        InvalidArgument, match=r"line 1: 'tools': function definitions are trained in chat SFT"
    ):
        _validate([{"prompt": "a", "completion": "b", "tools": TOOLS}])


def test_a_template_that_drops_tools_is_refused_by_row(tiny_hf, tool_tokenizer):
    plain_tok = tiny_hf[1]  # the fixture's template: role and content only
    check_tools_rendered([PLAIN], plain_tok)  # no function calling: nothing to check
    with pytest.raises(InvalidArgument, match=r"^row 2: the model's chat template does not render tools"):
        check_tools_rendered([PLAIN, ROW], plain_tok)
    calls_only = {"messages": ROW["messages"]}
    with pytest.raises(InvalidArgument, match=r"row 1: the model's chat template does not render tool calls"):
        check_tools_rendered([calls_only], plain_tok)
    check_tools_rendered([PLAIN, ROW, calls_only], tool_tokenizer)


def _trained_spans(model, tokenizer, rows, cfg, tmp_path) -> list[str]:
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    sft, masked = sft_rows(rows, DatasetFormat.MESSAGES, cfg, tokenizer)
    args = SFTConfig(
        output_dir=str(tmp_path),
        completion_only_loss=masked,
        report_to=[],
        per_device_train_batch_size=1,
        bf16=False,
        use_cpu=True,
    )
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=Dataset.from_list(sft), processing_class=tokenizer
    )
    batch = next(iter(trainer.get_train_dataloader()))
    ids, labels = batch["input_ids"][0].tolist(), batch["labels"][0].tolist()
    whole = tokenizer.decode(ids)
    spans, cur = [], []
    for tid, lab in zip(ids, labels, strict=True):
        if lab != -100:
            cur.append(tid)
        elif cur:
            spans.append(tokenizer.decode(cur))
            cur = []
    if cur:
        spans.append(tokenizer.decode(cur))
    return whole, spans


def test_the_loss_covers_tool_calls_not_tool_results(tiny_hf, tool_tokenizer, tmp_path):
    model = tiny_hf[0]
    whole, spans = _trained_spans(model, tool_tokenizer, [ROW], TrainConfig(method=TrainMethod.SFT), tmp_path)
    # the template saw the tools and the call (arguments as an object, as HF's tool templates take them)
    assert '"name": "get_weather"' in whole and "The weather in a city." in whole
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call><|im_end|>\n'
    assert spans == [call, "Rainy and 4C.<|im_end|>\n"], spans
    assert "rain, 4C" in whole and not any("rain, 4C" in s for s in spans)
    _, last = _trained_spans(
        model, tool_tokenizer, [ROW], TrainConfig(method=TrainMethod.SFT, completion_only_loss=True), tmp_path
    )
    assert last == ["Rainy and 4C.<|im_end|>\n"], last
    _, every = _trained_spans(
        model, tool_tokenizer, [ROW], TrainConfig(method=TrainMethod.SFT, loss_on_all_tokens=True), tmp_path
    )
    assert len(every) == 1 and "<tool_response>" in every[0] and "<tools>" in every[0]
