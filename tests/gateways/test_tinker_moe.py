"""Tinker trains a mixture of experts: the official ``tinker`` SDK (0.38.0) through the real gateway and trainer on
a tiny fp32 Qwen3-MoE (4 experts, 2 per token): a LoRA training client's run puts LoRA on every expert's
gate/up/down (``train_mlp``, the SDK's default), trains, samples with its expert pairs, and stays apart from
another API key's run on the same base."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

os.environ.setdefault("TINKER_TELEMETRY", "0")
from tests.deps import locked

tinker = locked("tinker")
from tinker import types  # noqa: E402

from strop.trainer_svc.core import step_ops  # noqa: E402
from tests.gateways.conftest import KEY_A, KEY_B  # noqa: E402

SEQ = list(range(40, 61))  # 21 tokens of the fixture's 320
SEQ2 = [7, 9, 300, 12, 200, 33, 1, 2, 3, 99, 100]


def datum(tokens) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
    )


@pytest.fixture(scope="module")
def model_root(tmp_path_factory) -> Path:
    """The module's stack serves a tiny Qwen3-MoE (this overrides the session's tiny-Llama root)."""
    from strop.fixtures.tiny_models import TinyShape, make_tiny_model

    root = tmp_path_factory.mktemp("tinker-moe")
    shape = TinyShape(
        hidden_size=64, intermediate_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16
    )
    make_tiny_model(root / "qwen3_moe", arch="qwen3_moe", shape=shape, dtype="float32", vocab_size=320)
    return root


def test_a_tinker_run_on_an_moe_trains_and_samples_with_lora_on_every_expert(tinker_stack):
    sc_a = tinker.ServiceClient(base_url=tinker_stack[0], api_key=KEY_A)
    sc_b = tinker.ServiceClient(base_url=tinker_stack[0], api_key=KEY_B)
    tb = sc_b.create_lora_training_client("qwen3_moe", rank=4, seed=1).result()
    b_before = tb.forward([datum(SEQ)], "cross_entropy").result().metrics["loss:sum"]
    tc = sc_a.create_lora_training_client("qwen3_moe", rank=4, seed=0).result()
    (run,) = [r.info for r in tinker_stack[2].core.runs._runs.values() if r.info.tenant == "a"]
    # the SDK's defaults: attention, MLP (here every expert's gate/up/down) and the unembedding
    assert run.target_modules == [*step_ops.ATTN_MODULES, *step_ops.MLP_MODULES, "lm_head"]
    losses = []
    for _ in range(8):
        losses.append(tc.forward_backward([datum(SEQ)], "cross_entropy").result().metrics["loss:sum"])
        tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    # the trainer's own test of this loop (fp32, HF's path) goes 115.8 → 95.9 nats in ten steps
    assert losses[-1] < 0.9 * losses[0], losses
    # b's run on the same base: a's eight steps (its expert pairs) never entered b's forward
    assert tb.forward([datum(SEQ)], "cross_entropy").result().metrics["loss:sum"] == b_before
    sampler = tc.save_weights_and_get_sampling_client().result()
    prompt = SEQ[:8]
    r = sampler.sample(
        types.ModelInput.from_ints(prompt),
        num_samples=1,
        sampling_params=types.SamplingParams(max_tokens=3, seed=3),
        include_prompt_logprobs=True,
    ).result()
    fwd = tc.forward([datum(prompt)], "cross_entropy").result().loss_fn_outputs[0]["logprobs"].tolist()
    # fp32, a KV-cache prefill vs one full forward of 7 tokens: ~1e-6 apart
    assert r.prompt_logprobs[1:] == pytest.approx(fwd, abs=1e-4)
