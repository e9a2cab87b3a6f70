"""Which tokens SFT's loss covers: assistant messages by default on chat data (as the OpenAI fine-tuning API),
checked on the labels TRL's SFTTrainer really builds from strop's rows."""

from __future__ import annotations

import pytest

from strop.common.errors import InvalidArgument
from strop.common.trainer_types import DatasetFormat, TrainConfig, TrainMethod
from strop.fixtures.tokenizers_tiny import make_bpe_tokenizer
from strop.trainer_svc.core.job_config import check_dataset_fits, sft_rows

CONVERSATION = [
    {"role": "system", "content": "You answer in one short sentence."},
    {"role": "user", "content": "What colour is the sky?"},
    {"role": "assistant", "content": "The sky is blue."},
    {"role": "user", "content": "And grass?"},
    {"role": "assistant", "content": "Grass is green.", "weight": 0},
    {"role": "user", "content": "And snow?"},
    {"role": "assistant", "content": "Snow is white."},
]


@pytest.fixture(scope="module")
def tokenizer(tiny_hf):
    return tiny_hf[1]


def _trained_text(tiny_hf, cfg: TrainConfig, tmp_path) -> list[str]:
    """The spans of the conversation whose tokens carry labels in the first batch TRL's SFTTrainer builds."""
    from datasets import Dataset
    from trl import SFTConfig, SFTTrainer

    model, tokenizer = tiny_hf
    rows, masked = sft_rows([{"messages": CONVERSATION}], DatasetFormat.MESSAGES, cfg, tokenizer)
    args = SFTConfig(
        output_dir=str(tmp_path),
        completion_only_loss=masked,
        report_to=[],
        per_device_train_batch_size=1,
        bf16=False,
        use_cpu=True,
    )
    trainer = SFTTrainer(
        model=model, args=args, train_dataset=Dataset.from_list(rows), processing_class=tokenizer
    )
    batch = next(iter(trainer.get_train_dataloader()))
    spans, cur = [], []
    for tid, lab in zip(batch["input_ids"][0].tolist(), batch["labels"][0].tolist(), strict=True):
        if lab != -100:
            cur.append(tid)
        elif cur:
            spans.append(tokenizer.decode(cur))
            cur = []
    if cur:
        spans.append(tokenizer.decode(cur))
    return spans


def test_chat_sft_trains_on_assistant_messages_only_by_default(tiny_hf, tmp_path):
    spans = _trained_text(tiny_hf, TrainConfig(method=TrainMethod.SFT), tmp_path)
    # each trained span is an assistant message and its end-of-turn token, nothing of the system or user turns
    assert spans == ["The sky is blue.<|im_end|>\n", "Snow is white.<|im_end|>\n"], spans


def test_completion_only_trains_on_the_last_assistant_message(tiny_hf, tmp_path):
    spans = _trained_text(tiny_hf, TrainConfig(method=TrainMethod.SFT, completion_only_loss=True), tmp_path)
    assert spans == ["Snow is white.<|im_end|>\n"], spans


def test_loss_on_all_tokens_trains_on_the_whole_conversation(tiny_hf, tokenizer, tmp_path):
    spans = _trained_text(tiny_hf, TrainConfig(method=TrainMethod.SFT, loss_on_all_tokens=True), tmp_path)
    whole = tokenizer.apply_chat_template(
        [{k: m[k] for k in ("role", "content")} for m in CONVERSATION], tokenize=False
    )
    assert spans == [whole], spans


def test_a_template_that_rewrites_earlier_turns_is_refused_with_the_way_out():
    tok = make_bpe_tokenizer()
    # renders only the last message's role marker differently: earlier turns change once more follow
    tok.chat_template = (
        "{% for m in messages %}{% if loop.last %}[last]{% endif %}{{ m['role'] + ': ' + m['content'] + '\n' }}"
        "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
    )
    with pytest.raises(InvalidArgument, match="loss_on_all_tokens"):
        sft_rows(
            [{"messages": CONVERSATION}], DatasetFormat.MESSAGES, TrainConfig(method=TrainMethod.SFT), tok
        )


def test_completion_only_on_text_rows_is_refused():
    cfg = TrainConfig(method=TrainMethod.SFT, completion_only_loss=True)
    with pytest.raises(InvalidArgument, match="completion_only_loss"):
        check_dataset_fits(cfg, DatasetFormat.TEXT, [{"text": "a"}], 100)


@pytest.mark.parametrize(
    ("messages", "problem"),
    [
        ([{"role": "user", "content": "Q", "weight": 1}, {"role": "assistant", "content": "A"}], "weight"),
        ([{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", "weight": 2}], "weight"),
        (
            [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A", "weight": 0}],
            "teaches nothing",
        ),
    ],
)
def test_message_weights_are_those_of_the_openai_format(messages, problem):
    import json

    from strop.trainer_svc.core.datasets import Limits, validate_jsonl

    with pytest.raises(InvalidArgument, match=problem):
        validate_jsonl(
            [json.dumps({"messages": messages}).encode() + b"\n"], DatasetFormat.MESSAGES, Limits()
        )
