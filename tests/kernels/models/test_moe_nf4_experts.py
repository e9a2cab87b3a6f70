"""NF4 experts on a model (``kernels/models/moe_experts.quantize_experts``): a Qwen3-MoE and a Mixtral whose fused
expert stacks strop holds in NF4 train like HF + PEFT on the same model with those stacks dequantized by the NF4 op
(the reference: transformers' own MoE forward on the weights the 4-bit model multiplies).

Bounds. Patched, the grouped GEMM multiplies the NF4 values bit for bit (``tests/kernels/ops/test_moe_nf4.py``), so
the two sides compute the same fp32 function in another order: test_patch's ``S · √K · u``. Unpatched, HF's forward
runs on the stacks dequantized for the call: the same operations on the same values, so equal results.
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
locked("bitsandbytes")

from strop.kernels.models import patch_model  # noqa: E402
from tests.kernels.models.moe_setup import expert_lora, loss_and_grads, moe_config, rel  # noqa: E402
from tests.kernels.models.test_patch import parity_bound  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _base(model_type: str):
    torch.manual_seed(0)
    cfg = moe_config(model_type, norm_topk_prob=True)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float().to(DEVICE)


def _pair(model_type: str):
    """(NF4 experts model, reference with the NF4 stacks dequantized into 16-bit parameters), both under PEFT."""
    from strop.kernels.models.moe_experts import nf4_expert_modules, nf4_experts, quantize_experts

    ours = _base(model_type)
    ref = copy.deepcopy(ours)
    names = quantize_experts(ours)
    assert len(names) == 2 * 2, names
    with torch.no_grad():
        for name, module in nf4_expert_modules(ours).items():
            for pname in ("gate_up_proj", "down_proj"):
                dense = nf4_experts(module, pname).dequantize(torch.float32)
                getattr(ref.get_submodule(name), pname).copy_(dense)
    return expert_lora(ours), expert_lora(ref)


def test_nf4_experts_hold_no_16_bit_stack_and_hf_forward_sees_the_dequantized_one():
    from strop.kernels.models.moe_experts import nf4_expert_modules

    ours, ref = _pair("qwen3_moe")
    for module in nf4_expert_modules(ours).values():
        for pname in ("gate_up_proj", "down_proj"):
            p = module._parameters[pname]
            assert not p.requires_grad and p.stride() == (0, 0, 0), "the parameter holds no 16-bit stack"
            assert module._buffers[f"{pname}_nf4_packed"].numel() == p.numel() // 2, "two codes a byte"
    ids = torch.randint(0, 300, (2, 8), generator=torch.Generator().manual_seed(2)).to(DEVICE)
    loss, _, grads = loss_and_grads(ours, ids)
    ref_loss, _, ref_grads = loss_and_grads(ref, ids)
    assert loss == ref_loss, "HF's expert loop on the stacks dequantized for the call is the reference itself"
    for name, g in ref_grads.items():
        assert torch.equal(grads[name], g), name
    for module in nf4_expert_modules(ours).values():
        assert module._parameters["gate_up_proj"].stride() == (0, 0, 0), (
            "the dense stack is dropped after the call"
        )


@pytest.mark.parity
@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_nf4_experts_on_the_grouped_gemm_train_like_hf_peft_on_the_dequantized_stacks(model_type, caplog):
    ours, ref = _pair(model_type)
    report = patch_model(ours)
    assert len(report.patched["lora_mlp"]) == 2, report
    bound = parity_bound(ref.get_base_model().config)
    gen = torch.Generator().manual_seed(2)
    opt = torch.optim.AdamW([p for p in ref.parameters() if p.requires_grad], lr=1e-3)
    for step in range(2):
        ids = torch.randint(0, 300, (2, 8), generator=gen).to(DEVICE)
        with torch.no_grad():
            state = {n: p for n, p in ref.named_parameters() if p.requires_grad}
            for n, p in ours.named_parameters():
                if n in state:
                    p.copy_(state[n])
        ref_loss, _, ref_grads = loss_and_grads(ref, ids)
        loss, _, grads = loss_and_grads(ours, ids)
        assert abs(loss - ref_loss) <= bound * abs(ref_loss), (step, loss, ref_loss, bound)
        for name, g in ref_grads.items():
            err = rel(grads[name], g)
            assert err <= bound, f"step {step}: {name} gradient off by {err:.3g} (bound {bound:.3g})"
        opt.step()
    assert "reference path" not in caplog.text, "every call ran the grouped expert GEMM over the NF4 stacks"
