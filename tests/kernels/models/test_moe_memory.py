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
