"""Mixture-of-experts models on strop's kernels: Qwen3-MoE and Mixtral with their attention, norms and loss patched
and their experts on the grouped expert GEMM (``kernels/lora/moe.py``) train like HF + PEFT (LoRA on q/k/v/o and on
the fused expert parameters, the load-balancing loss included); gpt-oss is refused with its reason.

The bound is test_patch's (the module docstring there derives it): both sides compute the same fp32 function,
teacher-forced step by step, so loss and every adapter gradient agree to ``S · √K · u`` relative. The experts' path
is the same code on both sides, so a wrong patch anywhere (a dropped aux loss: ≥ 1e-3 relative here) is off by far
more.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

from tests.deps import locked

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

transformers = locked("transformers")
peft = locked("peft")

from strop.kernels.models import patch_model  # noqa: E402
from tests.kernels.models.test_patch import nf4_reload, parity_bound  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _config(model_type: str):
    common = dict(
        hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        vocab_size=300, max_position_embeddings=64, rms_norm_eps=1e-6, tie_word_embeddings=False,
        num_experts_per_tok=2, output_router_logits=True, router_aux_loss_coef=0.02,
    )  # fmt: skip
    if model_type == "qwen3_moe":
        return transformers.Qwen3MoeConfig(
            **common, intermediate_size=128, moe_intermediate_size=64, num_experts=4, norm_topk_prob=True
        )
    if model_type == "mixtral":
        return transformers.MixtralConfig(**common, intermediate_size=64, num_local_experts=4)
    return transformers.GptOssConfig(**common, intermediate_size=64, num_local_experts=4)


def _model(model_type: str, qlora: bool, tmp_path):
    torch.manual_seed(0)
    attn = "eager" if model_type == "gpt_oss" else "sdpa"  # HF has no SDPA path for gpt-oss's sinks
    model = transformers.AutoModelForCausalLM.from_config(
        _config(model_type), attn_implementation=attn
    ).float()
    if qlora:
        model = nf4_reload(model, tmp_path / model_type)
    torch.manual_seed(1)
    lora = peft.LoraConfig(
        r=4, lora_alpha=8, init_lora_weights=False, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
        target_parameters=["experts.gate_up_proj", "experts.down_proj"],
    )  # fmt: skip
    return peft.get_peft_model(model.to(DEVICE), lora)


def _loss_and_grads(model, ids):
    model.zero_grad(set_to_none=True)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    return out.loss.item(), out.aux_loss.item(), grads


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


@pytest.mark.parity
@pytest.mark.parametrize(  # QLoRA (NF4 attention) on Mixtral only: the interpreter is slow, attention is shared
    "model_type,qlora", [("qwen3_moe", False), ("mixtral", True)], ids=["qwen3_moe", "mixtral-qlora"]
)
def test_an_moe_on_the_kernels_trains_like_hf_peft(model_type, qlora, tmp_path, caplog):
    model = _model(model_type, qlora, tmp_path)
    twin = copy.deepcopy(model)
    report = patch_model(twin)
    layers, qk = 2, 2 * (model_type == "qwen3_moe")
    done = {c: len(v) for c, v in report.patched.items()}
    assert done == {"rms_norm": (2 + qk) * layers + 1, "rope": layers, "lora_qkv": layers, "lora_o": layers,
                    "lora_mlp": layers, "fused_cross_entropy": 1}, report  # fmt: skip
    assert not any(report.skipped.values()), report
    bound = parity_bound(model.get_base_model().config)
    gen = torch.Generator().manual_seed(2)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    coef = model.get_base_model().config.router_aux_loss_coef
    for step in range(2):
        ids = torch.randint(0, 300, (2, 8), generator=gen).to(DEVICE)
        with torch.no_grad():
            state = {n: p for n, p in model.named_parameters() if p.requires_grad}
            for n, p in twin.named_parameters():
                if n in state:
                    p.copy_(state[n])
        ref_loss, ref_aux, ref_grads = _loss_and_grads(model, ids)
        loss, aux, grads = _loss_and_grads(twin, ids)
        assert coef * ref_aux > 10 * bound * abs(ref_loss), (
            "the aux term is far above the bound: dropping it fails"
        )
        assert abs(loss - ref_loss) <= bound * abs(ref_loss), (step, loss, ref_loss, bound)
        assert abs(aux - ref_aux) <= bound * abs(ref_aux), (step, aux, ref_aux)
        for name, ref in ref_grads.items():
            err = _rel(grads[name], ref)
            assert err <= bound, f"step {step}: {name} gradient off by {err:.3g} (bound {bound:.3g})"
        opt.step()
    assert "reference path" not in caplog.text, (
        "every call ran the kernels (the grouped expert GEMM included)"
    )


def test_gpt_oss_keeps_hf_peft_and_kernels_on_is_refused_naming_it():
    from strop.common.errors import InvalidArgument
    from strop.common.trainer_types import KernelMode
    from strop.trainer_svc.core.models import decide_kernels

    model = _model("gpt_oss", False, None)
    report = patch_model(model)
    assert not any(report.patched.values())
    assert all(
        "gpt_oss has no fast path: its attention adds learned sinks" in r
        for r in report.skipped["rope"].values()
    )
    with pytest.raises(InvalidArgument, match="gpt_oss has no fast path"):
        decide_kernels(KernelMode.ON, "cpu", "gpt_oss")
    assert decide_kernels(KernelMode.UNSPECIFIED, "cpu", "gpt_oss")[0] is False


def test_the_long_context_tiling_leaves_moe_blocks_whole_and_says_why():
    from strop.kernels.models.tiled_mlp import disable_tiled_mlp, enable_tiled_mlp

    model = _model("qwen3_moe", False, None)
    report = enable_tiled_mlp(model)
    assert report.tiled == []
    assert set(report.skipped.values()) == {"mixture-of-experts block (router logits recorded per call)"}
    assert len(report.skipped) == 2
    disable_tiled_mlp(model)
