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
from tests.kernels.models.moe_setup import expert_lora, loss_and_grads, moe_config, rel  # noqa: E402
from tests.kernels.models.test_patch import nf4_reload, parity_bound  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _model(model_type: str, qlora: bool, tmp_path):
    torch.manual_seed(0)
    attn = "eager" if model_type == "gpt_oss" else "sdpa"  # HF has no SDPA path for gpt-oss's sinks
    model = transformers.AutoModelForCausalLM.from_config(
        moe_config(model_type, norm_topk_prob=True), attn_implementation=attn
    ).float()
    if qlora:
        model = nf4_reload(model, tmp_path / model_type)
    return expert_lora(model.to(DEVICE))


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
    assert done == {
        "rms_norm": (2 + qk) * layers + 1,
        "rope": layers,
        "lora_qkv": layers,
        "lora_o": layers,
        "lora_mlp": layers,
        "moe_router": layers,
        "fused_cross_entropy": 1,
    }, report
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
        ref_loss, ref_aux, ref_grads = loss_and_grads(model, ids)
        loss, aux, grads = loss_and_grads(twin, ids)
        assert coef * ref_aux > 10 * bound * abs(ref_loss), (
            "the aux term is far above the bound: dropping it fails"
        )
        assert abs(loss - ref_loss) <= bound * abs(ref_loss), (step, loss, ref_loss, bound)
        assert abs(aux - ref_aux) <= bound * abs(ref_aux), (step, aux, ref_aux)
        for name, ref in ref_grads.items():
            err = rel(grads[name], ref)
            assert err <= bound, f"step {step}: {name} gradient off by {err:.3g} (bound {bound:.3g})"
        opt.step()
    assert "reference path" not in caplog.text, (
        "every call ran the kernels (the grouped expert GEMM included)"
    )


@pytest.mark.parity
def test_a_trained_router_runs_the_fused_router_op_and_gets_hf_peft_gradients():
    """``train_router``: PEFT's modules_to_save wraps each router (its frozen original and the trainable copy the
    forward runs); both are patched, and the copy's weight gradient (the fused op's logits gradient through torch's
    linear layer) is HF + PEFT's within test_patch's bound. Mixtral: renormalised weights kept in fp32."""
    torch.manual_seed(0)
    base = transformers.AutoModelForCausalLM.from_config(moe_config("mixtral"), attn_implementation="sdpa")
    torch.manual_seed(1)
    lora = peft.LoraConfig(
        r=4,
        lora_alpha=8,
        init_lora_weights=False,
        target_modules=["q_proj", "v_proj"],
        target_parameters=["experts.gate_up_proj", "experts.down_proj"],
        modules_to_save=["mlp.gate"],
    )
    model = peft.get_peft_model(base.float().to(DEVICE), lora)
    twin = copy.deepcopy(model)
    report = patch_model(twin)
    assert len(report.patched["moe_router"]) == 2 * 2, report  # 2 layers × (original, trainable copy)
    assert not report.skipped["moe_router"], report
    ids = torch.randint(0, 300, (2, 8), generator=torch.Generator().manual_seed(3)).to(DEVICE)
    ref_loss, ref_aux, ref_grads = loss_and_grads(model, ids)
    loss, aux, grads = loss_and_grads(twin, ids)
    bound = parity_bound(model.get_base_model().config)
    assert abs(loss - ref_loss) <= bound * abs(ref_loss) and abs(aux - ref_aux) <= bound * abs(ref_aux)
    routers = [n for n in ref_grads if "mlp.gate" in n]
    assert len(routers) == 2, "each layer's router copy trains"
    for name, ref in ref_grads.items():
        err = rel(grads[name], ref)
        assert err <= bound, f"{name} gradient off by {err:.3g} (bound {bound:.3g})"


def test_gpt_oss_keeps_hf_peft_and_kernels_on_is_refused_naming_it():
    from strop.common.errors import InvalidArgument
    from strop.common.trainer_types import KernelMode
    from strop.trainer_svc.core.model_loading import decide_kernels

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
