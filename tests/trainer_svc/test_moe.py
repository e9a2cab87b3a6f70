"""Mixtures of experts through the trainer: tiny Qwen3-MoE, Mixtral and gpt-oss fixtures (4 experts, 2 per token,
hidden 64) loaded 16-bit, NF4 on load and prequantized 4-bit; LoRA on q/k/v/o and every expert's gate/up/down (PEFT's
``target_parameters`` on the fused expert parameters), the router frozen unless asked; an SFT step of the trainer's
engine equal to HF + PEFT's own on the same batch, the load-balancing loss included as the config says.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from strop.common.errors import InvalidArgument
from strop.common.trainer_types import (
    LoadModelRequest,
    LoraConfig,
    Quantization,
    TrainConfig,
    TrainMethod,
)

ARCHS = ("qwen3_moe", "mixtral", "gpt_oss")
ROWS = [{"text": "the quick brown fox jumps over the lazy dog, and the dog sleeps on."}] * 4


@pytest.fixture(scope="module")
def moe_root(tmp_path_factory) -> Path:
    from strop.fixtures.tiny_models import TinyShape, make_tiny_model, quantize_4bit

    root = tmp_path_factory.mktemp("moe-models")
    shape = TinyShape(
        hidden_size=64, intermediate_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16
    )
    for arch in ARCHS:
        d = make_tiny_model(root / arch, arch=arch, shape=shape, dtype="float32", vocab_size=320)
        quantize_4bit(d, root / f"{arch}-4bit", compute_dtype="float32")
    return root


def _load(root: Path, name: str, quantization=Quantization.NONE):
    from strop.trainer_svc.core.model_loading import load_model

    req = LoadModelRequest(model_path=name, quantization=quantization, dtype="float32")
    return load_model(req, model_root=root, device="cpu")


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize(
    "name,quantization,label",
    [
        ("{a}", Quantization.NONE, "none"),
        ("{a}", Quantization.NF4, "bnb-nf4-on-load"),
        ("{a}-4bit", Quantization.UNSPECIFIED, "bnb-nf4-prequantized"),
    ],
)
def test_an_moe_loads_as_each_quantization_and_lora_wraps_attention_and_every_expert(
    moe_root, arch, name, quantization, label
):
    from bitsandbytes.nn import Linear4bit

    from strop.trainer_svc.core.model_loading import attach_lora

    loaded = _load(moe_root, name.format(a=arch), quantization)
    assert loaded.facts.model_type == arch and loaded.facts.quantization == label
    # bitsandbytes 4-bit covers nn.Linear only: attention is its NF4; a 4-bit session's Qwen3-MoE / Mixtral experts
    # are strop's NF4 stacks (gpt-oss's stay float32), and the session says which
    n4 = sum(isinstance(m, Linear4bit) for m in loaded.model.modules())
    assert n4 == (0 if label == "none" else 2 * 4), "q/k/v/o of two layers"
    nf4_experts = label != "none" and arch != "gpt_oss"
    held = "NF4" if nf4_experts else "float32"
    assert f"4 experts, 2 per token, experts held in {held}" in loaded.facts.kernels_reason
    stacks = [b for n, b in loaded.model.named_buffers() if n.endswith("_nf4_packed")]
    assert len(stacks) == (2 * 2 if nf4_experts else 0), "gate_up and down of two layers"
    attach_lora(loaded, LoraConfig(r=4, alpha=8, seed=0))
    trainable = {n for n, p in loaded.model.named_parameters() if p.requires_grad}
    for i in range(2):
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            assert any(f"layers.{i}.self_attn.{proj}.lora_A" in n for n in trainable), (i, proj)
        # PEFT nests one ParamWrapper per fused parameter: the outer wraps down_proj, the inner gate_up_proj
        experts = sorted(n for n in trainable if f"layers.{i}.mlp.experts" in n)
        assert len(experts) == 4, experts
    a = next(p for n, p in loaded.model.named_parameters() if "layers.0.mlp.experts.lora_A" in n)
    assert a.shape[0] == 4 * 4, "rank 4 for each of the 4 experts"
    assert not any(".router." in n or "mlp.gate." in n for n in trainable), "the router is frozen by default"
    assert loaded.facts.num_trainable_parameters == sum(
        p.numel() for p in loaded.model.parameters() if p.requires_grad
    )


def test_lora_targets_that_fused_experts_cannot_take_are_refused_precisely(moe_root):
    from strop.trainer_svc.core.model_loading import validate_lora

    loaded = _load(moe_root, "qwen3_moe")
    with pytest.raises(InvalidArgument, match="gate_proj and up_proj together"):
        validate_lora(LoraConfig(target_modules=["q_proj", "gate_proj"]), loaded.model)
    with pytest.raises(InvalidArgument, match="no dropout"):
        validate_lora(LoraConfig(dropout=0.1), loaded.model)
    with pytest.raises(InvalidArgument, match=r"unknown target module\(s\) \['w1'\]"):
        validate_lora(LoraConfig(target_modules=["w1"]), loaded.model)
    # attention-only LoRA with dropout is fine: PEFT's dropout applies to module targets
    assert validate_lora(LoraConfig(dropout=0.1, target_modules=["q_proj", "v_proj"]), loaded.model)


def _reference_peft(root: Path, arch: str, train_router: bool):
    """HF + PEFT as a user writes it for this fixture: the module and parameter targets PEFT documents for fused
    experts, the same seed before the adapter is made (so the same initial factors)."""
    import torch
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(root / arch, dtype=torch.float32, device_map="cpu")
    router = {"gpt_oss": "mlp.router"}.get(arch, "mlp.gate")
    torch.manual_seed(0)
    cfg = PeftLoraConfig(
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        target_parameters=["experts.down_proj", "experts.gate_up_proj"],
        modules_to_save=[router] if train_router else None,
        task_type="CAUSAL_LM",
    )
    return get_peft_model(model, cfg)


@pytest.mark.parametrize("arch,train_router", [("qwen3_moe", False), ("mixtral", True), ("gpt_oss", True)])
def test_an_sft_step_equals_hf_peft_with_the_load_balancing_loss(moe_root, tmp_path, arch, train_router):
    """One step of the trainer's SFT engine on a session against HF + PEFT's forward and backward on the same batch:
    the loss the job trains (and reports) is cross-entropy + router_aux_loss_coef · the model's own load-balancing
    loss, and every adapter gradient matches. Both sides are fp32 with the same weights and initial factors; the
    engine's loss comes from TRL's chunked log-probs instead of HF's full cross-entropy, so they agree to fp32
    rounding of a log-sum-exp over 320 logits (≈1e-6 relative), far below the aux term (≥ 1e-3 · 2 here)."""
    import torch

    from strop.trainer_svc.core.model_loading import attach_lora
    from strop.trainer_svc.core.training import JobControl, Sinks, build_trainer

    loaded = _load(moe_root, arch)
    attach_lora(loaded, LoraConfig(r=4, alpha=8, seed=0, train_router=train_router))
    from strop.trainer_svc.core.job_config import with_defaults

    cfg = TrainConfig(
        method=TrainMethod.SFT, max_steps=1, batch_size=2, learning_rate=1e-3, max_length=32, seed=0
    )
    cfg = with_defaults(cfg, session_max_len=loaded.facts.max_seq_length, num_rows=len(ROWS))
    sinks = Sinks(on_step=lambda m: None, on_checkpoint=lambda s, p: None, on_start=lambda n: None)
    trainer = build_trainer(loaded, ROWS, _text_format(), cfg, tmp_path, JobControl(), sinks)
    batch = next(iter(trainer.get_train_dataloader()))
    coef = float(loaded.model.config.router_aux_loss_coef)
    assert trainer.aux_loss_enabled and trainer.router_aux_loss_coef == coef, "as the fixture's config says"
    trainer.current_gradient_accumulation_steps = 1  # what HF's loop sets before its first step
    loss = trainer.training_step(trainer.model, dict(batch))
    ours = {n: p.grad.detach().clone() for n, p in loaded.model.named_parameters() if p.requires_grad}

    ref = _reference_peft(moe_root, arch, train_router)
    out = ref(
        input_ids=batch["input_ids"],
        attention_mask=batch.get("attention_mask"),
        labels=batch["labels"] if "labels" in batch else batch["input_ids"],
        output_router_logits=True,
    )
    out.loss.backward()
    expected = out.loss.item()  # HF adds router_aux_loss_coef · aux_loss itself when labels are given
    assert coef * out.aux_loss.item() > 1e-3 * 2 * 0.5, "the aux term is large enough to be told apart"
    assert math.isclose(loss.item(), expected, rel_tol=1e-5), (loss.item(), expected, out.aux_loss.item())
    refs = {n: p.grad for n, p in ref.named_parameters() if p.requires_grad}
    assert set(ours) == set(refs)
    if train_router:
        assert any("modules_to_save" in n for n in ours), "the router copy trains"
    for n, g in refs.items():
        scale = g.abs().max().item()
        assert torch.allclose(ours[n], g, rtol=1e-4, atol=1e-5 * max(scale, 1e-6)), (
            n,
            (ours[n] - g).abs().max(),
        )


def _text_format():
    from strop.common.trainer_types import DatasetFormat

    return DatasetFormat.TEXT


def _admission_moe():
    """The admission tests' Qwen3-MoE (16 experts, 2 per token), bf16, SDPA: its config and the model."""
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        hidden_size=256,
        intermediate_size=512,
        moe_intermediate_size=128,
        num_experts=16,
        num_experts_per_tok=2,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        head_dim=32,
        vocab_size=1000,
        max_position_embeddings=512,
        output_router_logits=True,
    )
    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(config).to(torch.bfloat16)
    model.config._attn_implementation = "sdpa"
    return config, model


def test_the_admission_estimate_bounds_what_an_moe_step_saves():
    """Experts, routing and PEFT's merged expert stacks through the estimate: above what a real HF + PEFT forward
    of a Qwen3-MoE (16 experts, 2 per token, LoRA on attention and experts) saves for backward and within 2× of it
    (the dense archs' bounds)."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    from tests.trainer_svc.test_admission import assert_estimate_bounds_a_real_step

    config, model = _admission_moe()
    cfg = PeftLoraConfig(
        r=8,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        target_parameters=["experts.gate_up_proj", "experts.down_proj"],
    )
    model = get_peft_model(model, cfg)
    assert_estimate_bounds_a_real_step(config, model, rows=2, length=96, expert_lora=True)


@pytest.mark.parametrize("expert_lora", [False, True], ids=["attention-lora", "expert-lora"])
def test_the_admission_estimate_counts_what_hf_saves_of_nf4_experts(expert_lora):
    """NF4 experts on HF's expert path: the stacks dequantized for each layer's call are what its expert GEMMs save
    (attention-only LoRA) or are merged with s·BA (expert LoRA); the estimate still bounds the real step within 2×."""
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    from strop.kernels.models.moe_experts import quantize_experts
    from tests.trainer_svc.test_admission import assert_estimate_bounds_a_real_step

    config, model = _admission_moe()
    assert len(quantize_experts(model)) == 4
    params = ["experts.gate_up_proj", "experts.down_proj"] if expert_lora else None
    cfg = PeftLoraConfig(
        r=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"], target_parameters=params
    )
    model = get_peft_model(model, cfg)
    assert_estimate_bounds_a_real_step(
        config, model, rows=2, length=96, expert_lora=expert_lora, nf4_experts=True
    )


@pytest.fixture(scope="module")
def moe_trainer(moe_root):
    from strop.trainer_svc.core.trainer_core import TrainerConfig
    from strop.trainer_svc.server import start

    work = moe_root.parent / f"{moe_root.name}-svc"
    (work / "data").mkdir(parents=True)
    service = start(
        TrainerConfig(
            model_root=moe_root,
            artifact_root=work / "artifacts",
            state_dir=work / "state",
            data_root=work / "data",
        )
    )
    yield service.running
    service.stop(grace=10.0)


@pytest.mark.parametrize(
    "arch,name,kernels",
    [("qwen3_moe", "qwen3_moe-4bit", False), ("mixtral", "mixtral", False), ("qwen3_moe", "qwen3_moe", True)],
)
def test_an_sft_job_on_an_moe_runs_over_grpc_and_lowers_the_loss(moe_trainer, arch, name, kernels):
    """Through the service and the SDK: LoadModel (prequantized 4-bit, or 16-bit), AttachLora with the router trained
    on request, a 4-step SFT job whose loss falls."""
    from strop.client import JobState, KernelMode, TrainerClient
    from strop.client import LoraConfig as ClientLora

    with TrainerClient(f"127.0.0.1:{moe_trainer.port}") as client:
        mode = KernelMode.ON if kernels else KernelMode.UNSPECIFIED
        s = client.load_model(name, dtype="float32", kernels=mode)
        assert s.facts.model_type == arch and "4 experts, 2 per token" in s.facts.kernels_reason
        s = client.attach_lora(s.session_id, ClientLora(r=4, alpha=8, seed=0, train_router=arch == "mixtral"))
        # the interpreter runs them: attention, norms, loss and the grouped expert GEMM all patched
        if kernels:
            assert "lora_mlp patched 2/2" in s.facts.kernels_reason, s.facts.kernels_reason
            assert "reference path" not in s.facts.kernels_reason, s.facts.kernels_reason
        ds = client.upload_dataset(ROWS * 2, name=f"{arch}.jsonl")
        cfg = TrainConfig(
            method=TrainMethod.SFT,
            max_steps=4,
            learning_rate=5e-3,
            batch_size=2,
            lr_scheduler="constant",
            max_length=32,
            seed=0,
        )
        events = list(client.train(s.session_id, ds.dataset_id, cfg))
        assert events[-1].state.state is JobState.SUCCEEDED, events[-1].state.message
        losses = [e.step.loss for e in events if e.step is not None]
        assert len(losses) == 4 and losses[-1] < losses[0], losses
        client.close_session(s.session_id)
