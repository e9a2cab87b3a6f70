"""Memory modes on an MoE keep the router's aux-loss gradient (the offloaded checkpoint's no-grad forward would
record the router logits detached through HF's output hooks; such layers go to torch's checkpoint instead).

Bound: a memory mode is the same math in fp32 (recompute replays the same inputs and RNG), so the adapter
gradients match the unmodified model to fp32 round-off; 1e-5 relative is far below the ~1e-2 the dropped aux term
costs on this model.
"""

from __future__ import annotations

import copy
import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

from tests.kernels.models.moe_setup import loss_and_grads, rel
from tests.kernels.models.test_moe_patch import _model


@pytest.mark.parametrize("mode", ["STANDARD", "LONG_CONTEXT"])
def test_memory_modes_keep_the_moe_aux_loss_gradient(mode):
    from strop.common.trainer_types import MemoryMode
    from strop.kernels.models import StepShape, apply_memory_mode

    model = _model("qwen3_moe", False, None)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    ids = torch.randint(0, 300, (2, 8), generator=torch.Generator().manual_seed(2))
    ref_loss, ref_aux, ref_grads = loss_and_grads(model, ids)
    twin = copy.deepcopy(model)
    installed = apply_memory_mode(
        twin,
        MemoryMode(mode),
        step=StepShape(2, 8, True),
        device="cpu",
        budget_bytes=1,
        offload_cpu_tensors=True,
        min_offload_bytes=0,
    )
    try:
        loss, aux, grads = loss_and_grads(twin, ids)
        stats = installed.memory.offloader.stats.torch_checkpoint
    finally:
        installed.remove()
    assert (loss, aux) == pytest.approx((ref_loss, ref_aux), rel=1e-6)
    for name, ref in ref_grads.items():
        assert rel(grads[name], ref) <= 1e-5, (name, rel(grads[name], ref))
    assert any("router_logits" in reason for reason in stats), stats


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_the_offloaded_recompute_of_an_moe_layer_skips_its_down_product_with_the_same_gradients(
    model_type, monkeypatch
):
    """strop's offloaded checkpoint recomputes a whole layer (torch's non-reentrant one stops at the down
    projection's input); an MoE layer ending in the experts' sum skips, in that recompute, the down product (and its
    merge there) and the sum (``lora_moe_experts``' ``output_unused_in_recompute``). Their values are never read:
    with every uninitialised tensor of that step filled with NaN, the loss and every gradient are bitwise those of
    the full recompute. The skip shows as one down merge fewer a layer in the recompute; with the down stacks in the
    scratch buffer's second slot, the backward's gate/up reads the stack the recompute merged (four merges a layer,
    the last layer's down stack still held from its forward)."""
    from strop.common.trainer_types import MemoryMode
    from strop.kernels.lora import moe as lora_moe
    from strop.kernels.models import StepShape, apply_memory_mode, patch_model
    from strop.kernels.ops import moe_gemm
    from tests.kernels.models.moe_setup import TINY, expert_lora, moe_config, transformers

    torch.manual_seed(0)
    extra = {"norm_topk_prob": True} if model_type == "qwen3_moe" else {}
    config = moe_config(model_type, {**TINY, "output_router_logits": False}, **extra)
    model = expert_lora(
        transformers.AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").float()
    )
    report = patch_model(model)
    assert len(report.patched["lora_mlp"]) == 2, report
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    installed = apply_memory_mode(
        model,
        MemoryMode.STANDARD,
        step=StepShape(2, 8, True),
        device="cpu",
        offload_cpu_tensors=True,
        min_offload_bytes=0,
    )
    merges, fills = [], []
    merged, merge_into = moe_gemm._merged, moe_gemm._merge_into
    monkeypatch.setattr(moe_gemm, "_merged", lambda *a, **k: merges.append(1) or merged(*a, **k))
    monkeypatch.setattr(moe_gemm, "_merge_into", lambda *a: fills.append(tuple(a[1].shape)) or merge_into(*a))
    ids = torch.randint(0, 300, (2, 8), generator=torch.Generator().manual_seed(2))

    def step():
        merges.clear()
        fills.clear()
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        return out.loss.item(), grads, len(merges)

    empty = torch.Tensor.new_empty

    def nan_empty(self, *size, **kwargs):
        t = empty(self, *size, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    try:
        with monkeypatch.context() as m:  # what is never read may hold anything
            m.setattr(torch.Tensor, "new_empty", nan_empty)
            loss, grads, skipped = step()
        filled = list(fills)
        with monkeypatch.context() as m:  # the full recompute, as before the skip
            m.setattr(lora_moe, "recompute_outputs_unused_now", lambda: False)
            ref_loss, ref_grads, full = step()
        offloaded = installed.memory.offloader.stats
    finally:
        installed.remove()
    assert not offloaded.torch_checkpoint, offloaded.torch_checkpoint
    # the standard mode's saved attention keeps q, k, v too (after RoPE for Mixtral, before Qwen3's q/k norm);
    # the last layer keeps its input on the device
    assert offloaded.attention_saved == offloaded.qkv_saved == 2, offloaded  # layer 0 in each of two steps
    assert loss == ref_loss
    assert grads.keys() == ref_grads.keys() and any("experts" in n for n in grads)
    for name, ref in ref_grads.items():
        assert torch.equal(grads[name], ref), name
    # each layer's recompute merged its down stack; now it does not
    assert full - skipped == 2, (full, skipped)
    # the stacks written: the forward's four; the last layer's recompute gate/up (its down stack, the forward's last,
    # still in the buffer's second slot); the first layer's recompute gate/up and backward down; each layer's
    # backward gate/up reads the first slot as its recompute left it (with one slot the down merge took it: 10)
    gu, down = filled[0], filled[1]
    assert filled == [gu, down, gu, down, gu, gu, down], filled
