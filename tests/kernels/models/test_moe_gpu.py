"""GPU tier: a Qwen3-MoE and a Mixtral in bf16 on strop's kernels as ``patch_model`` installs them by default
(attention, norms, loss; every MoE layer's router on the fused router op and its experts on the grouped expert GEMM,
the counting-sort routing plan and the split down product whose checkpointed recompute runs no u GEMM) under each
memory mode the trainer installs, against HF + PEFT; LoRA on attention and the fused experts.

Bound (DESIGN's bf16 rule): against an fp32 run of the same weights, strop's bf16 loss and adapter gradients are no
further off than 2× HF + PEFT's own bf16 run (plus a 1e-6 floor of the value's scale). Run with
``pytest -m gpu tests/kernels/models/test_moe_gpu.py`` on the H200.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.deps import locked

transformers = locked("transformers")
peft = locked("peft")

from tests.kernels.models.moe_setup import expert_lora, moe_config  # noqa: E402

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _model(model_type: str):
    common = dict(
        hidden_size=1024,
        num_hidden_layers=6,
        num_attention_heads=16,
        num_key_value_heads=4,
        head_dim=64,
        vocab_size=32000,
        max_position_embeddings=4096,
        num_experts_per_tok=4,
        output_router_logits=True,
        router_aux_loss_coef=0.01,
        tie_word_embeddings=False,
    )
    cfg = moe_config(model_type, common, dense=2816, expert=512, experts=16)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        cfg, attn_implementation="sdpa", dtype=torch.float32
    )
    return expert_lora(model.cuda(), r=16, alpha=16)


def _step(model, ids, autocast: bool):
    model.zero_grad(set_to_none=True)
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    grads = {n: p.grad.float().clone() for n, p in model.named_parameters() if p.requires_grad}
    return loss.item(), grads


def _err(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


@pytest.mark.parametrize("mode", ["NONE", "STANDARD", "LONG_CONTEXT"])
@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_an_moe_on_the_kernels_in_bf16_is_within_twice_hf_peft_error(model_type, mode):
    from strop.common.trainer_types import MemoryMode
    from strop.kernels.models import StepShape, apply_memory_mode, patch_model

    fp32 = _model(model_type)
    gen = torch.Generator().manual_seed(2)
    ids = torch.randint(0, 32000, (2, 1024), generator=gen).cuda()
    truth_loss, truth = _step(fp32, ids, autocast=False)
    bf16 = copy.deepcopy(fp32)
    for p in bf16.parameters():
        if not p.requires_grad:
            p.data = p.data.bfloat16()
    hf_loss, hf = _step(bf16, ids, autocast=True)
    bf16.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    report = patch_model(bf16)
    assert report.patched["lora_qkv"] and report.patched["fused_cross_entropy"], report
    layers = bf16.config.num_hidden_layers
    assert len(report.patched["lora_mlp"]) == len(report.patched["moe_router"]) == layers, report.summary()
    installed = None
    if mode != "NONE":
        installed = apply_memory_mode(bf16, MemoryMode(mode), step=StepShape(2, 1024, True), device="cuda")
    ours_loss, ours = _step(bf16, ids, autocast=True)
    if installed is not None:
        installed.remove()
    assert abs(ours_loss - truth_loss) <= 2 * abs(hf_loss - truth_loss) + 1e-6 * abs(truth_loss), (
        ours_loss,
        hf_loss,
        truth_loss,
    )
    for n, g in truth.items():
        if not g.any():
            continue
        assert _err(ours[n], g) <= 2 * _err(hf[n], g) + 1e-6, (n, _err(ours[n], g), _err(hf[n], g))
