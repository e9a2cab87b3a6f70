"""strop's fast path on an NF4 base sharded by FSDP2: the gathered weight carries no quant state, the kernels
restore it from the layer (``kernels.models.patch._base_weight``) and compute what they compute unsharded.

One gloo process (FSDP2 over a mesh of 1 still holds every parameter as a DTensor and gathers a plain tensor for
each forward, which is all this needs) with the codes relabelled as fp32 words for the sharding, as the trainer
does (``trainer_svc.core.fsdp.shard_4bit_as_compute_dtype``). The patched, sharded twin must give the unsharded
reference's loss and LoRA gradients within the fp32 parity bound of ``test_patch`` (the same fp32 function,
summed in another order), with no layer falling back to the reference path: without the restored quant state
every projection would (the gathered weight is neither an ``nn.Linear`` weight nor NF4).
"""

from __future__ import annotations

import copy
import logging
import os

import pytest
import torch

from tests.deps import locked

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

locked("bitsandbytes")
transformers = locked("transformers")

from strop.kernels.models import patch_model  # noqa: E402
from strop.trainer_svc.core.fsdp import shard_4bit_as_compute_dtype  # noqa: E402

from .test_patch import _config, _loss_and_grads, _model, _peft, _rel, nf4_reload, parity_bound  # noqa: E402


@pytest.fixture
def one_rank_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parity
def test_patched_nf4_layers_sharded_by_fsdp2_run_the_kernels_like_the_unsharded_reference(
    one_rank_group, tmp_path, caplog
):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    model = _peft(_model("llama", True, tmp_path)).train()
    twin = copy.deepcopy(model)
    report = patch_model(twin)
    assert not any(report.skipped.values()), report
    assert (
        shard_4bit_as_compute_dtype(twin, torch.float32) == 7 * twin.get_base_model().config.num_hidden_layers
    )
    for layer in twin.get_base_model().model.layers:
        fully_shard(layer)
    fully_shard(twin)
    q = twin.get_base_model().model.layers[0].self_attn.q_proj.base_layer
    assert isinstance(q.weight, DTensor) and getattr(q.weight, "quant_state", None) is None
    ids = torch.randint(0, 300, (2, 8), generator=torch.Generator().manual_seed(2))
    bound = parity_bound(model.get_base_model().config)
    ref_loss, ref = _loss_and_grads(model, ids)
    with caplog.at_level(logging.WARNING, logger="strop.kernels"):
        loss, ours = _loss_and_grads(twin, ids)
    assert not [r.message for r in caplog.records if "reference path" in r.message]
    assert abs(loss - ref_loss) <= bound * abs(ref_loss), (loss, ref_loss, bound)
    for name, g in ref.items():
        mine = ours[name].full_tensor() if isinstance(ours[name], DTensor) else ours[name]
        if not g.any():
            assert not mine.any(), name
            continue
        assert _rel(mine, g) <= bound, (name, _rel(mine, g), bound)


def _assert_same_bf16_step(reference, model) -> None:
    """One bf16-autocast step of ``model`` (sharded or not) against ``reference``'s: loss and LoRA gradients within
    one bf16 rounding (u = 2⁻⁸ relative), DTensor gradients gathered whole first."""
    from torch.distributed.tensor import DTensor

    ids = torch.randint(0, 300, (2, 64), generator=torch.Generator().manual_seed(2)).cuda()
    with torch.autocast("cuda", dtype=torch.bfloat16):
        ref_loss, ref = _loss_and_grads(reference, ids)
        loss, ours = _loss_and_grads(model, ids)
    u = 2.0**-8
    assert abs(loss - ref_loss) <= u * abs(ref_loss), (loss, ref_loss)
    for name, g in ref.items():
        mine = ours[name].full_tensor() if isinstance(ours[name], DTensor) else ours[name]
        assert _rel(mine.float(), g.float()) <= u, (name, _rel(mine.float(), g.float()))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_bf16_codes_sharded_by_fsdp2_train_like_the_unsharded_patched_model(tmp_path):
    """The CUDA setting: NF4 with bf16 compute under bf16 autocast, fp32 adapters, codes relabelled as bf16 words
    and sharded by FSDP2 (one NCCL rank), no parameter cast for the gather (``MixedPrecisionPolicy()``: autocast
    rounds at each matmul, as in one process or DDP). The sharded patched model must compute what the unsharded
    patched model computes: the same kernels on the same bytes, so within one bf16 rounding (measured on the H200:
    bitwise equal loss and LoRA gradients). With ``param_dtype=bf16`` (what accelerate sets for a bf16 FSDP job)
    the adapters themselves are rounded to bf16 before the step and the LoRA gradients move by ~2% (measured
    2.2e-2, loss 2e-5): a different computation from DDP's, not checked here."""
    import torch.distributed as dist
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        model = _peft(_model("llama", True, tmp_path)).train()
        for m in model.modules():  # bf16 compute, as the trainer loads a CUDA base
            if hasattr(m, "compute_dtype"):
                m.compute_dtype = torch.bfloat16
        twin = copy.deepcopy(model)
        patch_model(model)
        patch_model(twin)
        assert shard_4bit_as_compute_dtype(twin, torch.bfloat16) > 0
        for layer in twin.get_base_model().model.layers:
            fully_shard(layer, mp_policy=MixedPrecisionPolicy())
        fully_shard(twin, mp_policy=MixedPrecisionPolicy())
        _assert_same_bf16_step(model, twin)
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_4bit_base_staged_in_host_memory_is_moved_by_fsdp2_and_trains_like_one_loaded_on_the_device(
    tmp_path,
):
    """How a rank of a sharded job loads a base larger than its device (``trainer_svc.core.fsdp.staging_device``):
    into host memory, patched, with the trainer's default memory mode installed there, codes relabelled; then
    ``fully_shard``, layer by layer as accelerate calls it, moves each layer to the device, and ``Params4bit.to``
    carries its quant state along. Everything the steps read must end up on the device (parameters, buffers, quant
    states), and the staged model must compute what the same model loaded on the device computes: the same bytes
    under the same kernels, so within one bf16 rounding (one NCCL rank; the sharding itself is
    ``test_on_cuda_bf16_codes_sharded_by_fsdp2_train_like_the_unsharded_patched_model``'s)."""
    import torch.distributed as dist
    from bitsandbytes.nn import Linear4bit
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from strop.common.trainer_types import MemoryMode
    from strop.kernels.models import StepShape, apply_memory_mode
    from strop.trainer_svc.core.fsdp import base_bytes_held

    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        cfg = _config("llama")
        staged = _peft(
            nf4_reload(
                transformers.AutoModelForCausalLM.from_config(cfg).float(),
                tmp_path / "m",
                device_map={"": "cpu"},
            )
        ).train()
        for m in staged.modules():  # bf16 compute, as the trainer loads a CUDA base
            if hasattr(m, "compute_dtype"):
                m.compute_dtype = torch.bfloat16
        assert all(p.device.type == "cpu" for p in staged.parameters())
        on_device = copy.deepcopy(staged).to("cuda")
        for model in (on_device, staged):
            report = patch_model(model, device="cuda")  # where it will run: staged is still in host memory
            assert not any(report.skipped.values()), report
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        installed = [
            apply_memory_mode(m, MemoryMode.STANDARD, step=StepShape(2, 64)) for m in (on_device, staged)
        ]
        assert shard_4bit_as_compute_dtype(staged, torch.bfloat16) > 0
        torch.cuda.reset_peak_memory_stats()
        for layer in staged.get_base_model().model.layers:
            fully_shard(layer, mp_policy=MixedPrecisionPolicy())
        fully_shard(staged, mp_policy=MixedPrecisionPolicy())
        assert all(p.device.type == "cuda" for p in staged.parameters())
        assert all(b.device.type == "cuda" for b in staged.buffers())
        four_bit = [m for m in staged.modules() if isinstance(m, Linear4bit)]
        assert four_bit and all(m.quant_state.absmax.device.type == "cuda" for m in four_bit)
        held, whole = base_bytes_held(staged)
        assert held == whole > 0  # one rank holds it all; 2 ranks hold half (test_ddp's gloo test)
        _assert_same_bf16_step(on_device, staged)
        for i in installed:
            i.remove()
    finally:
        dist.destroy_process_group()
