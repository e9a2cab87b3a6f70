"""Gemma 2 and Gemma 3 (text) through the trainer service: load, attach LoRA, SFT on strop's kernels.

CPU tier, over real gRPC: tiny random Gemma models (SentencePiece tokenizer, tied embeddings, four norms per
layer) are loaded with the kernels on (run by the Triton interpreter), so the session's facts carry the patch
report; a few SFT steps on one repeated row must lower the loss. The admission estimate reads the model's
shape, which Gemma's extra norms and tied head must not break (the job is admitted and runs).
"""

from __future__ import annotations

import os

import pytest

from strop.client import JobState, KernelMode, LoraConfig, TrainConfig, TrainMethod

pytestmark = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1", reason="CPU tier: the kernels run under TRITON_INTERPRET=1"
)

ARCHS = ("gemma2", "gemma3_text")
ROW = {
    "messages": [
        {"role": "user", "content": "What is the password?"},
        {"role": "assistant", "content": "blue"},
    ]
}


@pytest.fixture(scope="module")
def gemma_trainer(tmp_path_factory):
    """A trainer over a model root of tiny Gemma 2 and Gemma 3 models (the interpreter runs one program per
    row, so the shapes are small: hidden 64, 2 layers)."""
    from strop.fixtures import make_tiny_model
    from strop.fixtures.tiny_models import TinyShape
    from strop.trainer_svc.core.trainer_core import TrainerConfig
    from strop.trainer_svc.server import start

    work = tmp_path_factory.mktemp("gemma-trainer")
    shape = TinyShape(
        hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=1, head_dim=32
    )
    for arch in ARCHS:
        make_tiny_model(
            work / "models" / f"tiny-{arch}", arch=arch, tokenizer="spm", shape=shape, dtype="float32"
        )
    (work / "data").mkdir()
    config = TrainerConfig(
        model_root=work / "models",
        artifact_root=work / "artifacts",
        state_dir=work / "state",
        data_root=work / "data",
    )
    service = start(config)
    yield service.running
    service.stop(grace=10.0)


@pytest.mark.parametrize("arch", ARCHS)
def test_sft_on_a_tiny_gemma_runs_on_the_kernels_and_lowers_the_loss(gemma_trainer, arch):
    from strop.client import TrainerClient

    with TrainerClient(f"127.0.0.1:{gemma_trainer.port}") as client:
        s = client.load_model(f"tiny-{arch}", kernels=KernelMode.ON)
        assert s.facts.model_type == arch and s.facts.kernels_enabled, s.facts.kernels_reason
        s = client.attach_lora(s.session_id, LoraConfig(r=8, alpha=16, seed=0))
        reason = s.facts.kernels_reason
        # two layers of four Gemma norms (+ Gemma 3's q/k norms) and the final norm; everything patched
        norms = 2 * (4 + 2 * (arch == "gemma3_text")) + 1
        for part in (
            f"rms_norm patched {norms}/{norms}",
            "lora_qkv patched 2/2",
            "lora_mlp patched 2/2",
            "fused_cross_entropy patched 1/1",
        ):
            assert part in reason, reason
        assert "reference path" not in reason, reason
        ds = client.upload_dataset([ROW] * 8, name=f"{arch}.jsonl")
        cfg = TrainConfig(
            method=TrainMethod.SFT,
            max_steps=3,
            learning_rate=5e-3,
            batch_size=1,
            lr_scheduler="constant",
            max_length=32,
            seed=0,
        )
        events = list(client.train(s.session_id, ds.dataset_id, cfg))
        assert events[-1].state.state is JobState.SUCCEEDED, events[-1].state.message
        losses = [e.step.loss for e in events if e.step is not None]
        assert len(losses) == 3 and losses[-1] < losses[0], losses
        client.close_session(s.session_id)


def test_the_admission_estimate_bounds_what_a_gemma_step_saves():
    """Gemma's four norms per layer and its tied head through the estimate: above what a real HF + PEFT
    forward of a Gemma 3 saves for backward and within 2× of it (the Llama test's bounds)."""
    import torch
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from tests.trainer_svc.test_admission import assert_estimate_bounds_a_real_step

    config = Gemma3TextConfig(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=3,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=1000,
        max_position_embeddings=512,
        sliding_window=512,
        layer_types=["sliding_attention", "sliding_attention", "full_attention"],
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config).to(torch.bfloat16)
    model.config._attn_implementation = "sdpa"
    model = get_peft_model(model, PeftLoraConfig(r=8, target_modules="all-linear"))
    assert_estimate_bounds_a_real_step(config, model, rows=2, length=384)
