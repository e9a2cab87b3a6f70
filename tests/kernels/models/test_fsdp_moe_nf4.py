"""The grouped expert GEMM over NF4 experts sharded by FSDP2 (``trainer_svc.core.fsdp.shard_nf4_experts``): each
stack's codes and statistics are frozen parameters FSDP2 shards with the decoder layer and gathers for its forward
and backward, the stride-0 placeholders PEFT wraps are left out of the sharding, and the patched experts read the
gathered storage as they read the buffers of an unsharded model.

One gloo process, as ``test_fsdp_nf4.py`` (a mesh of 1 still holds every parameter as a DTensor and gathers a plain
tensor for each forward). The sharded twin runs the same kernels on the same bytes as the unsharded patched model,
so its loss and LoRA gradients are within test_patch's ``S·√K·u`` of it (the same fp32 function; the twin's
parameters are gathered copies), with no call falling back to HF's expert loop; a twin reading a shard, or a
placeholder, as the stack would be off by O(1) or fail. The trainer's 2-rank job over these experts:
``tests/trainer_svc/test_fsdp_moe.py``.
"""

from __future__ import annotations

import logging
import os

import pytest
import torch

from tests.deps import locked

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

transformers = locked("transformers")
locked("peft")
locked("bitsandbytes")

from strop.kernels.models import patch_model  # noqa: E402
from strop.kernels.models.moe_experts import nf4_placeholders, quantize_experts  # noqa: E402
from strop.trainer_svc.core.fsdp import (  # noqa: E402
    device_bytes_after_sharding,
    nf4_expert_bytes_held,
    shard_nf4_experts,
)
from tests.kernels.models.moe_setup import expert_lora, loss_and_grads, moe_config, rel  # noqa: E402
from tests.kernels.models.test_patch import parity_bound  # noqa: E402


def _sharded_pair(model_type: str, device: str, backend: str, tmp_path, staged: bool = False):
    """(patched model with NF4 experts, its twin sharded by FSDP2 over one ``backend`` rank as the trainer shards).
    ``staged``: both built and quantized in host memory, as a rank of a sharded job on accelerators loads; the
    reference then moved to ``device`` whole, the twin moved by ``fully_shard`` (its placeholders stay behind)."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor import DTensor

    dist.init_process_group(backend, init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    cfg = moe_config(model_type, norm_topk_prob=True)
    pair = []
    for _ in range(2):  # built twice from the same seeds (a deep copy would expand the stride-0 placeholders)
        torch.manual_seed(0)
        base = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").float()
        base = base.to("cpu" if staged else device)
        assert len(quantize_experts(base)) == 2 * cfg.num_hidden_layers
        pair.append(expert_lora(base).train())
    if staged:
        pair[0].to(device)  # the reference (its placeholders expand: a tiny model)
    for m in pair:
        report = patch_model(m, device=device)
        assert len(report.patched["lora_mlp"]) == cfg.num_hidden_layers, report
    model, twin = pair
    # admission's count of what the sharding places (before it, the storage is buffers; after, parameters): the
    # NF4 stacks' bytes, none of the placeholders' 16-bit shapes
    estimate = device_bytes_after_sharding(twin, 2)
    nf4_bytes = nf4_expert_bytes_held(twin)[1]
    assert 0 < shard_nf4_experts(twin) == 3 * 2 * cfg.num_hidden_layers  # codes, absmax, its scales a stack
    assert device_bytes_after_sharding(twin, 2) == estimate
    stacks = sum(p.numel() * 2 for p in nf4_placeholders(twin))  # what they would be in 16 bits
    assert nf4_bytes < stacks / 3
    placeholders = nf4_placeholders(twin)
    assert len(placeholders) == 2 * cfg.num_hidden_layers
    # what fully_shard shards must be floating point: torch 2.11's FSDP2 wraps each shard as nn.Parameter(shard),
    # requiring gradients, before freezing it (uint8 codes raised there); the storage is held as fp32 words
    left_out = {id(p) for p in placeholders}
    sharded = [(n, p) for n, p in twin.named_parameters() if id(p) not in left_out]
    assert all(p.is_floating_point() for _, p in sharded), [
        (n, p.dtype) for n, p in sharded if not p.is_floating_point()
    ]
    assert {p.dtype for n, p in sharded if "_nf4_" in n} == {torch.float32}
    for layer in twin.get_base_model().model.layers:
        fully_shard(layer, mp_policy=MixedPrecisionPolicy(), ignored_params=set(nf4_placeholders(layer)))
    fully_shard(twin, mp_policy=MixedPrecisionPolicy(), ignored_params=set(placeholders))
    experts = twin.get_base_model().model.layers[0].mlp.experts.base_layer.base_layer
    assert isinstance(experts._parameters["gate_up_proj_nf4_packed"], DTensor)
    assert not isinstance(experts._parameters["gate_up_proj"], DTensor), "the placeholder is left alone"
    assert all(p.stride() == (0, 0, 0) for p in placeholders), "no 16-bit rows copied out"
    for p in twin.parameters():  # torch 2.11's wrapping of each shard
        if isinstance(p, DTensor):
            torch.nn.Parameter(p.to_local().detach())
    held, whole = nf4_expert_bytes_held(twin)
    assert held == whole > 0  # one rank holds it all; 2 ranks hold half (tests/trainer_svc/test_fsdp_moe.py)
    nf4 = [t for n, t in [*twin.named_parameters(), *twin.named_buffers()] if "_nf4_" in n]
    assert nf4 and all(t.device.type == torch.device(device).type for t in nf4), (
        "fully_shard moved the storage"
    )
    return model, twin


def test_nf4_experts_whose_storage_is_not_whole_words_are_refused_before_the_sharding():
    """A stack of one expert and one NF4 block holds one byte of nested absmax codes: not a word of its compute
    dtype (fp32, 4 bytes), so FSDP2 could not shard it as words; refused, the storage left as it was."""
    from strop.common.errors import FailedPrecondition

    class TinyExperts(torch.nn.Module):  # the fused SwiGLU layout of HF's experts modules
        def __init__(self):
            super().__init__()
            self.gate_up_proj = torch.nn.Parameter(torch.randn(1, 2, 32))
            self.down_proj = torch.nn.Parameter(torch.randn(1, 32, 2))

    model = torch.nn.Sequential(TinyExperts())
    assert len(quantize_experts(model)) == 2
    with pytest.raises(FailedPrecondition, match=r"1 bytes are not whole torch\.float32 words"):
        shard_nf4_experts(model)
    assert not list(model.parameters(recurse=True))[2:], "no storage moved"
    assert model[0]._buffers["gate_up_proj_nf4_packed"].dtype == torch.uint8, "left a buffer, as quantized"


@pytest.mark.parity
@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_nf4_experts_sharded_by_fsdp2_run_the_grouped_gemm_like_the_unsharded_model(
    model_type, tmp_path, caplog
):
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    try:
        model, twin = _sharded_pair(model_type, "cpu", "gloo", tmp_path)
        bound = parity_bound(model.get_base_model().config)
        ids = torch.randint(0, 300, (2, 8), generator=torch.Generator().manual_seed(2))
        ref_loss, _, ref = loss_and_grads(model, ids)
        with caplog.at_level(logging.INFO, logger="strop.kernels"):
            loss, _, ours = loss_and_grads(twin, ids)
        assert "reference path" not in caplog.text, "every call ran the grouped expert GEMM"
        assert abs(loss - ref_loss) <= bound * abs(ref_loss), (loss, ref_loss, bound)
        assert any(".experts." in n for n in ref)
        for name, g in ref.items():
            mine = ours[name].full_tensor() if isinstance(ours[name], DTensor) else ours[name]
            assert rel(mine, g) <= bound, (name, rel(mine, g), bound)
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("staged", [False, True], ids=["on-device", "staged"])
@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral"])
def test_on_cuda_nf4_experts_sharded_by_fsdp2_train_like_the_unsharded_patched_model(
    model_type, staged, tmp_path
):
    """bf16 autocast on one NCCL rank: the same kernels on the same bytes, so within one bf16 rounding
    (u = 2⁻⁸ relative) in the loss and every LoRA gradient; built on the device, or staged in host memory (the
    codes quantized there) and moved by ``fully_shard`` as a rank of a sharded job on GPUs loads."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    try:
        model, twin = _sharded_pair(model_type, "cuda", "nccl", tmp_path, staged=staged)
        ids = torch.randint(0, 300, (2, 64), generator=torch.Generator().manual_seed(2)).cuda()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            ref_loss, _, ref = loss_and_grads(model, ids)
            loss, _, ours = loss_and_grads(twin, ids)
        u = 2.0**-8
        assert abs(loss - ref_loss) <= u * abs(ref_loss), (loss, ref_loss)
        for name, g in ref.items():
            mine = ours[name].full_tensor() if isinstance(ours[name], DTensor) else ours[name]
            assert rel(mine.float(), g.float()) <= u, (name, rel(mine.float(), g.float()))
    finally:
        dist.destroy_process_group()
