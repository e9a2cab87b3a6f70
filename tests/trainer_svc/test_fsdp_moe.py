"""FSDP2 over a 4-bit mixture of experts whose experts strop holds in NF4 (``fsdp.shard_nf4_experts``): 2 gloo ranks of
batch 1 train what one process of batch 2 trains over the same NF4 experts, each rank holding half of the experts'
codes and statistics, and a job resumed from its checkpoint continues exactly.

Each rank quantizes the same checkpoint into the same codes; the codes and absmax statistics become frozen parameters
sharded on dim 0 with their decoder layer, gathered as bytes (exact copies) for its forward and backward, so every
rank dequantizes the weights one process does. The two runs then compute the same fp32 function summed in another
order, with one rounding an element more in the gradients' reduce-scatter: ``test_ddp_moe.py``'s bound (its
derivation, the MoE layer's 12 sequential reductions beside a dense layer's 8), and its fixture without the
load-balancing loss (a product of two batch averages: another function on a rank's batch of 1). A rank computing
over 16-bit experts holds no NF4 bytes and moves the adapter by the NF4 rounding of the weights (~1e-2 of the gradient,
``test_ddp_moe.py``), far above the update bound (its losses need not leave the loss bound: measured 3e-5 apart at
step 1 on this fixture, against 5.5e-5); a shard of the codes read as the whole stack is off by O(1).

The resumed job continues from the checkpoint of step 2 (the whole adapter, SGD's param groups, the scheduler, the
data order) and computes steps 3 and 4 with the same operations on the same values as the uninterrupted job: its
losses and final adapter are the uninterrupted job's bit for bit. This test found that a resumed FSDP job's first
step ran at the schedule's initial learning rate (SGD keeps no state, and skipping its load skipped its param
groups' learning rate too: ``fsdp.restore_param_groups``): step 3's update was twice the uninterrupted job's, its
loss equal and step 4's 3e-4 apart.
"""

from __future__ import annotations

import json
import math
import random
import re

import pytest

from tests.trainer_svc.test_ddp import (
    LORA,
    ROW_TOKENS,
    ROWS,
    STEPS,
    U,
    _adapter,
    _events,
    _finish,
    _key,
    _launch,
    _spec,
)


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def fsdp_moe_runs(request, tmp_path_factory):
    from strop.common.trainer_types import LoadModelRequest, LoraConfig, Quantization
    from strop.fixtures.tiny_models import TinyShape, make_tiny_model
    from strop.trainer_svc.core import model_loading

    root = tmp_path_factory.mktemp("fsdp-moe-models")
    shape = TinyShape(
        hidden_size=64, intermediate_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16
    )
    arch = request.param
    d = make_tiny_model(root / arch, arch=arch, shape=shape, dtype="float32", vocab_size=320)
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "output_router_logits": False}))  # module docstring
    config = json.loads((d / "config.json").read_text())
    tmp = tmp_path_factory.mktemp("fsdp-moe")
    (tmp / "data").mkdir()
    rng = random.Random(0)
    with open(tmp / "data" / "tokens.jsonl", "w") as f:
        for _ in range(ROWS):
            row = [rng.randrange(3, config["vocab_size"]) for _ in range(ROW_TOKENS)]
            f.write(json.dumps({"input_ids": row}) + "\n")
    procs = {}
    for job, batch, nproc in (("moe-one", 2, 1), ("moe-fsdp", 1, 2)):
        spec = _spec(job, batch)
        spec["model"].update(model_path=arch, quantization="NF4")
        if nproc > 1:
            spec["config"].update(parallelism="FSDP", num_devices=nproc)
        procs[job] = _launch(tmp, root, job, batch_size=batch, nproc=nproc, spec=spec)
    # the adapter before training (seeded: every rank attaches the same) and the NF4 stacks one process holds
    req = LoadModelRequest(model_path=arch, quantization=Quantization.NF4, dtype="float32")
    loaded = model_loading.load_model(req, model_root=root, device="cpu")
    model_loading.attach_lora(loaded, LoraConfig(**LORA))
    initial = {
        n.replace(".default", ""): p.detach().clone()
        for n, p in loaded.model.named_parameters()
        if p.requires_grad
    }
    from strop.kernels.models.moe_experts import EXPERT_STACKS, nf4_expert_modules, nf4_experts

    stacks = [nf4_experts(m, p) for m in nf4_expert_modules(loaded.model).values() for p in EXPERT_STACKS]
    for job, proc in procs.items():
        _finish(proc, tmp, job, timeout=600)
    return tmp, root, arch, config, initial, stacks


def _losses(events: list[dict]) -> dict[int, float]:
    return {e["step"]["step"]: e["step"]["loss"] for e in events if e["step"]}


def _norm(tensors) -> float:
    import torch

    return float(torch.sqrt(sum((t.double() ** 2).sum() for t in tensors)))


def test_fsdp_ranks_shard_nf4_experts_and_train_what_one_process_trains(fsdp_moe_runs):
    from safetensors.torch import load_file

    from strop.common.adapter_base import NF4_STATS_FILE
    from strop.common.artifacts import ArtifactStore
    from strop.kernels.models.moe_experts import SHARDABLE_ROLES

    tmp, _, _, config, initial, stacks = fsdp_moe_runs
    one, fsdp = _events(tmp, "moe-one"), _events(tmp, "moe-fsdp")
    messages = [e["log"]["message"] for e in fsdp if e["log"]]
    assert any(m.startswith("FSDP2 over 2 processes") for m in messages), messages

    # rank 0 holds its shard of every code and statistics tensor (torch.chunk's first, the larger) and the double
    # quantization's code book and offset whole (1 KiB a stack: a sixth of this fixture's small stacks, nothing
    # beside a real model's); with the stacks unsharded it would hold all of them
    (held_line,) = [m for m in messages if "of the NF4 experts'" in m]
    held, whole = (int(x.replace(",", "")) for x in re.findall(r"[\d,]+(?= of| bytes)", held_line))
    assert whole == sum(t.numel() * t.element_size() for q in stacks for t in q.tensors().values())
    # the sharded tensors are held as words of the stack's compute dtype (fsdp module docstring)
    expected = sum(
        -(-t.numel() * t.element_size() // q.dtype.itemsize // 2) * q.dtype.itemsize
        if role in SHARDABLE_ROLES
        else t.numel() * t.element_size()
        for q in stacks
        for role, t in q.tensors().items()
    )
    replicated = sum(
        t.numel() * t.element_size()
        for q in stacks
        for role, t in q.tensors().items()
        if role not in SHARDABLE_ROLES
    )
    assert held == expected, (held, expected, whole)
    assert held - replicated <= (whole - replicated) / 2 + 3 * len(stacks), (held, replicated, whole)
    (base_line,) = [m for m in messages if "of the frozen base's" in m]
    base_held, base_whole = (int(x.replace(",", "")) for x in re.findall(r"[\d,]+(?= of| bytes)", base_line))
    assert base_held <= 0.5 * base_whole + 4 * config["vocab_size"] + 2 * 1028 * len(stacks), base_line

    s = (8 + 4) * config["num_hidden_layers"] * 2 + 4
    expert = config.get("moe_intermediate_size", config["intermediate_size"])  # Qwen3-MoE's, Mixtral's
    k = max(config["hidden_size"], expert, config["vocab_size"], 2 * ROW_TOKENS)
    loss_bound, update_bound = s * math.sqrt(k) * U, STEPS * (s * math.sqrt(k) + 1) * U
    losses_one, losses_fsdp = _losses(one), _losses(fsdp)
    assert sorted(losses_fsdp) == sorted(losses_one) == list(range(1, STEPS + 1))
    worst = max(abs(losses_fsdp[i] - losses_one[i]) / abs(losses_one[i]) for i in losses_one)
    assert worst <= loss_bound, (losses_fsdp, losses_one, loss_bound)

    adapter_one, meta_one = _adapter(tmp, one)
    adapter_fsdp, meta_fsdp = _adapter(tmp, fsdp)
    assert meta_one["base_quant.experts"] == "nf4" and meta_one["base_quant.expert_stacks"] == str(
        len(stacks)
    )
    # rank 0 publishes the one process's metadata: the digest of its experts' codes read before the sharding
    assert meta_fsdp == {**meta_one, "job_id": "moe-fsdp", "world_size": "2"}
    names = sorted(adapter_one)
    assert any(".experts." in n for n in names), "LoRA on the fused experts"
    assert names == sorted(adapter_fsdp) == sorted(initial)
    update = _norm(adapter_one[n] - initial[n] for n in names)
    delta = _norm(adapter_fsdp[n] - adapter_one[n] for n in names)
    assert update > 0.01 * _norm(initial.values()), (update, _norm(initial.values()))
    assert delta / update <= update_bound, (delta / update, update_bound)

    # the NF4 statistics file rank 0 wrote holds the whole statistics, the one process's bit for bit
    store = ArtifactStore(tmp / "artifacts")
    (key_one,) = [_key(e["adapter"]) for e in one if e["adapter"]]
    (key_fsdp,) = [_key(e["adapter"]) for e in fsdp if e["adapter"]]
    stats_one = load_file(str(store.path_of(key_one) / NF4_STATS_FILE))
    stats_fsdp = load_file(str(store.path_of(key_fsdp) / NF4_STATS_FILE))
    experts = sorted(k for k in stats_one if ".experts." in k)
    assert experts and sorted(stats_fsdp) == sorted(stats_one)
    assert all(
        stats_fsdp[k].shape == stats_one[k].shape and bool((stats_fsdp[k] == stats_one[k]).all())
        for k in experts
    )


def test_an_fsdp_job_over_nf4_experts_resumed_from_its_checkpoint_continues_exactly(fsdp_moe_runs):
    tmp, root, arch, _, _, _ = fsdp_moe_runs
    fsdp = _events(tmp, "moe-fsdp")
    (ckpt,) = [e["checkpoint"] for e in fsdp if e["checkpoint"] and e["checkpoint"]["step"] == 2]
    spec = _spec("moe-fsdp-resumed", 1)
    spec["model"].update(model_path=arch, quantization="NF4")
    spec["config"].update(parallelism="FSDP", num_devices=2, checkpoint_every_steps=0)
    spec["resume_from"] = _key(ckpt["artifact"])
    proc = _launch(tmp, root, "moe-fsdp-resumed", batch_size=1, nproc=2, spec=spec)
    _finish(proc, tmp, "moe-fsdp-resumed", timeout=600)
    resumed = _events(tmp, "moe-fsdp-resumed")
    losses, before = _losses(resumed), _losses(fsdp)
    assert sorted(losses) == list(range(3, STEPS + 1))
    assert all(losses[i] == before[i] for i in losses), (losses, before)
    adapter, _ = _adapter(tmp, resumed)
    adapter_before, _ = _adapter(tmp, fsdp)
    assert sorted(adapter) == sorted(adapter_before)
    assert all(bool((adapter[n] == adapter_before[n]).all()) for n in adapter)
