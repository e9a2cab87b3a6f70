"""docs/examples/client_side_reward.py, run against a real trainer over gRPC: a user's own reward code scores the
samples on the client side and the step API trains on it (the way strop runs what OpenAI's python grader would)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from strop.client import RunLora
from strop.common.trainer_types import Quantization

EXAMPLE = Path(__file__).resolve().parents[2] / "docs" / "examples" / "client_side_reward.py"


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("client_side_reward", EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.slow
def test_the_client_side_reward_example_raises_its_reward_on_a_real_trainer(client, model_root, example):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_root / "tiny-llama")
    session = client.load_model("tiny-llama", quantization=Quantization.NONE, dtype="float32")
    run = client.create_training_run(session.session_id, RunLora(rank=8, seed=0, train_unembed=True))
    before = example.evaluate(run, tokenizer, example.ROWS, n=64, max_tokens=1)
    means = example.train(
        run, tokenizer, example.ROWS, steps=10, group_size=16, max_tokens=1, learning_rate=1e-2
    )
    after = example.evaluate(run, tokenizer, example.ROWS, n=64, max_tokens=1)
    # rewards are 0, 0.5 or 1 (std ≤ 0.5): a mean over 2 × 64 held-out samples has σ ≤ 0.045, so a rise of 0.2 is
    # more than 4σ; the random 640-token model states a number with about one token in six (96 of 640 have a digit)
    assert after > before + 0.2, (before, after, means)
    run.delete()
    client.close_session(session.session_id)
