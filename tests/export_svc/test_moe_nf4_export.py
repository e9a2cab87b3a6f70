"""Exports of MoE adapters trained on NF4 experts: a 4-bit Qwen3-MoE / Mixtral session holds its fused expert stacks
in strop's NF4 storage (``trainer_svc/core/moe.hold_experts_in_nf4``), so the model as trained multiplies the stacks'
NF4 values, not the checkpoint's 16-bit experts; the merged export re-creates those codes from the checkpoint (the
trainer's recorded scale statistics where the adapter carries them) and merges into them.

Bounds (``test_moe_export.py``'s): the merged fp32 directory and the trainer's own session compute the same fp32
function up to where ``s · B_e A_e`` is added, ~1e-6 of logits of O(1); FP32_BOUND 1e-4 leaves room. Merging into the
16-bit experts instead moves every expert weight by its NF4 error (≥ 1e-3 of the tiny model's weights here), so a merge
that missed the NF4 experts fails the weight check by orders of magnitude.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from strop.common.export_types import ExportRequest, ExportTarget, ExportTargetKind
from strop.export_svc.core.pipeline import run_export
from tests.deps import locked

locked("bitsandbytes")

FP32_BOUND = 1e-4
IDS = torch.tensor([list(range(5, 37))])


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> Path:
    from strop.fixtures.tiny_models import TinyShape, make_tiny_model, quantize_4bit

    root = tmp_path_factory.mktemp("moe-nf4-export")
    shape = TinyShape(
        hidden_size=64, intermediate_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16
    )
    for arch in ("qwen3_moe", "mixtral"):
        d = make_tiny_model(root / arch, arch=arch, shape=shape, dtype="float32", vocab_size=320)
        quantize_4bit(d, root / f"{arch}-4bit", compute_dtype="float32")
    return root


def _trained(root: Path, base: str, quantization) -> tuple[Path, torch.Tensor]:
    """A trainer session on ``base`` (NF4 experts), an adapter with B randomised as if trained, written as the
    trainer writes it; and the session's own logits on IDS (the model as trained)."""
    from strop.common.trainer_types import LoadModelRequest, LoraConfig
    from strop.trainer_svc.core.model_loading import attach_lora, load_model, release, write_adapter

    loaded = load_model(
        LoadModelRequest(model_path=base, dtype="float32", quantization=quantization),
        model_root=root,
        device="cpu",
    )
    try:
        assert "experts held in NF4" in loaded.facts.kernels_reason, loaded.facts.kernels_reason
        attach_lora(loaded, LoraConfig(r=4, alpha=8, seed=0))
        gen = torch.Generator().manual_seed(3)
        with torch.no_grad():
            for name, p in loaded.model.named_parameters():
                if "lora_B" in name:
                    p.add_(torch.randn(p.shape, generator=gen) * 0.05)
        out = root / f"{base}-lora"
        write_adapter(loaded, out)
        loaded.model.eval()
        with torch.no_grad():
            logits = loaded.model(input_ids=IDS).logits[0]
    finally:
        release(loaded)
    return out, logits


@pytest.mark.parametrize(
    "arch,base,quantization",
    [
        ("qwen3_moe", "qwen3_moe", "NF4"),
        ("mixtral", "mixtral", "NF4"),
        ("qwen3_moe", "qwen3_moe-4bit", "UNSPECIFIED"),
    ],
    ids=["qwen3_moe-nf4-on-load", "mixtral-nf4-on-load", "qwen3_moe-prequantized"],
)
def test_a_merged_export_of_an_nf4_expert_session_is_the_model_as_trained(
    moe_models, tmp_path, arch, base, quantization
):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    from strop.common.artifacts import ArtifactStore
    from strop.common.trainer_types import Quantization

    adapter, want = _trained(moe_models, base, getattr(Quantization, quantization))
    meta = json.loads((adapter / "strop_base.json").read_text())
    assert meta["base_quant.experts"] == "nf4" and meta["base_quant.expert_stacks"] == "4", meta
    store = ArtifactStore(tmp_path / "artifacts")
    req = ExportRequest(
        targets=[ExportTarget(kind=ExportTargetKind.MERGED_SAFETENSORS, dtype="float32")],
        adapter_path=adapter.name,
        base_model_path=base,
    )
    (merged,) = run_export(req, model_root=moe_models, store=store)
    v = merged.verification
    assert v.as_trained.max_abs_logit_delta < FP32_BOUND, v.as_trained
    codes = merged.artifact.metadata["merge.nf4_expert_codes"]
    assert codes.startswith("bit-identical to the trainer's (model.layers.0.mlp.experts."), codes
    d = store.path_of(merged.artifact.artifact_id)
    got = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = got(input_ids=IDS).logits[0]
    delta = float((logits - want).abs().max())
    assert delta < FP32_BOUND * float(want.abs().max()), f"merged vs the trainer's own session: {delta:.3g}"
    # the merged experts are the NF4 ones plus the delta, not the checkpoint's 16-bit experts plus it
    mlp = "block_sparse_moe" if arch == "mixtral" else "mlp"
    leaf = "w3" if arch == "mixtral" else "up_proj"
    key = f"model.layers.0.{mlp}.experts.2.{leaf}.weight"
    wm = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(str(d / wm[key]), "pt") as f:
        merged_w = f.get_tensor(key)
    src = moe_models / arch / "model.safetensors"
    with safe_open(str(src), "pt") as f:
        w16 = f.get_tensor(key)
    assert (merged_w - w16).abs().max() > 1e-3, "the 16-bit expert plus a small delta would be this close"
