from __future__ import annotations

import contextlib

import pytest

from strop.client import FailedPreconditionError, LoraConfig, TrainConfig, TrainMethod
from strop.demo.data import sft_rows

FAST_LORA = LoraConfig(r=8, alpha=16, seed=0)


def sft_config(steps: int, **kw) -> TrainConfig:
    defaults = dict(learning_rate=2e-3, batch_size=2, lr_scheduler="constant", seed=0)
    return TrainConfig(method=TrainMethod.SFT, max_steps=steps, **{**defaults, **kw})


@pytest.fixture
def ready_session(client):
    """A 4-bit session with LoRA attached."""
    s = client.load_model("tiny-llama-4bit")
    client.attach_lora(s.session_id, FAST_LORA)
    yield s.session_id
    with contextlib.suppress(FailedPreconditionError):  # already closed by the test
        client.close_session(s.session_id)


@pytest.fixture
def sft_dataset(client):
    return client.upload_dataset(sft_rows(), name="sft.jsonl")


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    """A tiny fp32 Llama and its tokenizer, as transformers loads them (one per test module: tests train it)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from strop.fixtures.tiny_models import make_tiny_model

    path = make_tiny_model(tmp_path_factory.mktemp("m") / "tiny", dtype="float32")
    return AutoModelForCausalLM.from_pretrained(path), AutoTokenizer.from_pretrained(path)
