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

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before any kernel module is imported

pytest.importorskip("bitsandbytes")
transformers = pytest.importorskip("transformers")

from strop.kernels.models import patch_model  # noqa: E402
from strop.trainer_svc.core.fsdp import shard_4bit_as_compute_dtype  # noqa: E402

from .test_patch import _loss_and_grads, _model, _peft, _rel, parity_bound  # noqa: E402


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
