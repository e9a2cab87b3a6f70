"""DDP over a 4-bit mixture of experts whose experts strop holds in NF4 (``moe.hold_experts_in_nf4``): 2 gloo ranks of
batch 1 train what one process of batch 2 trains, as ``test_ddp.py`` shows for a dense model, with LoRA on
attention and on every expert's gate/up/down.

Each rank quantizes its experts from the same checkpoint (the same codes: a deterministic function of the same
tensor), and DDP leaves the frozen placeholders and the NF4 buffers alone (``dist_worker.frozen_names``), so the two
runs compute the same fp32 function summed in another order. The bound is ``test_ddp.py``'s derivation with an MoE
layer's sequential reductions: 8 a layer and pass as a dense layer's, plus the router's GEMM, its softmax, the
top-k weights' normalisation and the weighted sum of the chosen experts (12), beside the head's and the loss's 4.
The fixture's load-balancing loss is off: it is a product of two averages over a micro-batch's tokens (the share
routed to each expert and its mean probability), not a mean of per-row terms, so a rank's batch of 1 computes
another function than one process's batch of 2, as in HF's Trainer under DDP (with it on, the adapters differ by
more than this bound while the losses stay within it). A rank whose experts were 16-bit while the other's (or the
one process's) were NF4 would differ by the NF4 rounding of the weights, ~1e-2 of the gradient, far above the
bound; so would an unsynchronised rank.
"""

from __future__ import annotations

import json
import math
import random

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
    _launch,
    _spec,
)


@pytest.fixture(scope="module")
def moe_runs(tmp_path_factory):
    from strop.common.trainer_types import LoadModelRequest, LoraConfig, Quantization
    from strop.fixtures.tiny_models import TinyShape, make_tiny_model
    from strop.trainer_svc.core import model_loading

    root = tmp_path_factory.mktemp("ddp-moe-models")
    shape = TinyShape(
        hidden_size=64, intermediate_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16
    )
    d = make_tiny_model(root / "qwen3_moe", arch="qwen3_moe", shape=shape, dtype="float32", vocab_size=320)
    # no load-balancing loss (module docstring): the two runs then compute one function
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "output_router_logits": False}))
    tmp = tmp_path_factory.mktemp("ddp-moe")
    (tmp / "data").mkdir()
    config = json.loads((root / "qwen3_moe" / "config.json").read_text())
    rng = random.Random(0)
    with open(tmp / "data" / "tokens.jsonl", "w") as f:
        for _ in range(ROWS):
            f.write(
                json.dumps({"input_ids": [rng.randrange(3, config["vocab_size"]) for _ in range(ROW_TOKENS)]})
            )
            f.write("\n")
    procs = {}
    for job, batch, nproc in (("moe-one", 2, 1), ("moe-ddp", 1, 2)):
        spec = _spec(job, batch)
        spec["model"].update(model_path="qwen3_moe", quantization="NF4")
        procs[job] = _launch(tmp, root, job, batch_size=batch, nproc=nproc, spec=spec)
    # the adapter before training, as every rank attaches it (seeded), while the jobs train
    req = LoadModelRequest(model_path="qwen3_moe", quantization=Quantization.NF4, dtype="float32")
    loaded = model_loading.load_model(req, model_root=root, device="cpu")
    model_loading.attach_lora(loaded, LoraConfig(**LORA))
    initial = {
        n.replace(".default", ""): p.detach().clone()
        for n, p in loaded.model.named_parameters()
        if p.requires_grad
    }
    for job, proc in procs.items():
        _finish(proc, tmp, job, timeout=300)
    return tmp, config, initial


def test_ddp_ranks_hold_nf4_experts_and_train_what_one_process_trains(moe_runs):
    import torch

    tmp, config, initial = moe_runs
    one, ddp = _events(tmp, "moe-one"), _events(tmp, "moe-ddp")
    adapter_one, meta_one = _adapter(tmp, one)
    adapter_ddp, meta_ddp = _adapter(tmp, ddp)
    assert meta_one["base_quant.experts"] == "nf4" and meta_one["base_quant.expert_stacks"] == "4"
    # rank 0 publishes the single process's metadata: its experts' codes have the one process's digest
    assert meta_ddp == {**meta_one, "job_id": "moe-ddp", "world_size": "2"}
    assert any("DDP over 2 processes" in e["log"]["message"] for e in ddp if e["log"])
    assert any(".experts." in n for n in adapter_one), "LoRA on the fused experts"

    s = (8 + 4) * config["num_hidden_layers"] * 2 + 4
    k = max(config["hidden_size"], config["moe_intermediate_size"], config["vocab_size"], 2 * ROW_TOKENS)
    loss_bound, update_bound = s * math.sqrt(k) * U, STEPS * (s * math.sqrt(k) + 1) * U
    losses_one = [e["step"]["loss"] for e in one if e["step"]]
    losses_ddp = [e["step"]["loss"] for e in ddp if e["step"]]
    assert len(losses_ddp) == len(losses_one) == STEPS
    worst = max(abs(a - b) / abs(b) for a, b in zip(losses_ddp, losses_one, strict=True))
    assert worst <= loss_bound, (losses_ddp, losses_one, loss_bound)

    def norm(tensors) -> float:
        return float(torch.sqrt(sum((t.double() ** 2).sum() for t in tensors)))

    names = sorted(adapter_one)
    assert names == sorted(adapter_ddp) == sorted(initial)
    update = norm(adapter_one[n] - initial[n] for n in names)
    delta = norm(adapter_ddp[n] - adapter_one[n] for n in names)
    assert update > 0.01 * norm(initial.values()), (update, norm(initial.values()))
    assert delta / update <= update_bound, (delta / update, update_bound)
