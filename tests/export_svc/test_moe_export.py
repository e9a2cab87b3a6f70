"""Mixture-of-experts exports: an adapter the trainer attached to a tiny Qwen3-MoE or Mixtral (LoRA on q/k/v/o and on
the fused experts, PEFT ``target_parameters``; B randomised as if trained) merged into the per-expert checkpoint layout
vLLM loads, written back as a PEFT adapter, and as GGUF (F32, llama.cpp's expert tensors); each verified in its
consumer against the model as trained (the base with the adapter unmerged, by PEFT). Q4_K_M of 256-wide fixtures, the
base's and with an adapter the trainer's SFT engine trained merged: no fallback, and the trained file is the model as
trained, not the base (bounds in that test). GGUF LoRA of fused experts, a PEFT adapter with a trained router and
gpt-oss are refused with their reasons.

Bounds. The merged fp32 directory and the as-trained model compute the same function in fp32, differing in
whether ``s · B_e A_e`` is added to the weights before the product or (PEFT's ``ParamWrapper``) to the expert stack
before the product as well: the same sums in another order, ~1e-6 of logits of O(1) over two layers; 1e-4 leaves
room and is still far below what a wrong expert slice moves (a whole expert's delta: ~1e-2 here).
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import torch

from strop.common.artifacts import ArtifactStore
from strop.common.errors import StropError
from strop.common.export_types import (
    ExportRequest,
    ExportResult,
    ExportTarget,
    ExportTargetKind,
)
from strop.export_svc.core.pipeline import run_export

FP32_BOUND = 1e-4
F32_GGUF_BOUND = 1e-3


def _trained_adapter(root: Path, arch: str, train_router: bool, dirname: str = "") -> Path:
    from strop.common.trainer_types import LoadModelRequest, LoraConfig, Quantization
    from strop.trainer_svc.core.model_loading import attach_lora, load_model, write_adapter

    loaded = load_model(
        LoadModelRequest(model_path=arch, dtype="float32", quantization=Quantization.NONE),
        model_root=root,
        device="cpu",
    )
    attach_lora(loaded, LoraConfig(r=4, alpha=8, seed=0, train_router=train_router))
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in loaded.model.named_parameters():
            if "lora_B" in name or ("modules_to_save" in name and p.requires_grad):
                p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    out = root / (dirname or f"{arch}-lora")
    write_adapter(loaded, out)
    return out


@pytest.fixture(scope="module")
def moe_models(tmp_path_factory) -> Path:
    from strop.fixtures.tiny_models import TinyShape, make_tiny_model

    root = tmp_path_factory.mktemp("moe-export")
    shape = TinyShape(
        hidden_size=64, intermediate_size=32, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=16
    )
    for arch in ("qwen3_moe", "mixtral", "gpt_oss"):
        make_tiny_model(root / arch, arch=arch, shape=shape, dtype="float32", vocab_size=320)
    _trained_adapter(root, "qwen3_moe", train_router=False)
    _trained_adapter(root, "mixtral", train_router=True)
    _trained_adapter(root, "mixtral", train_router=False, dirname="mixtral-frozen-router-lora")
    return root


def _targets(*kinds):
    return [
        ExportTarget(
            kind=k,
            dtype="float32" if k is ExportTargetKind.MERGED_SAFETENSORS else "",
            gguf_type="F32" if k is ExportTargetKind.GGUF else "",
        )
        for k in kinds
    ]


@pytest.fixture(scope="module")
def exported(moe_models, tmp_path_factory):
    """One export per arch (one probe, one as-trained model each): Qwen3-MoE to merged fp32 + PEFT + F32 GGUF,
    Mixtral (router trained) to merged fp32 + F32 GGUF. Returns the store and the results by arch and kind."""
    store = ArtifactStore(tmp_path_factory.mktemp("moe-artifacts"))
    k = ExportTargetKind
    out = {}
    for arch, kinds in (
        ("qwen3_moe", (k.MERGED_SAFETENSORS, k.PEFT_ADAPTER, k.GGUF)),
        ("mixtral", (k.MERGED_SAFETENSORS, k.GGUF)),
    ):
        req = ExportRequest(targets=_targets(*kinds), adapter_path=f"{arch}-lora", base_model_path=arch)
        out[arch] = {r.target.kind: r for r in run_export(req, model_root=moe_models, store=store)}
    return store, out


def test_a_qwen3_moe_adapter_merges_into_per_expert_tensors_and_round_trips_as_peft(moe_models, exported):
    from safetensors import safe_open

    from strop.export_svc.core.hf_dir import check_vllm_model_dir
    from strop.export_svc.core.moe import expert_pairs

    store, results = exported
    by = results["qwen3_moe"]
    merged = by[ExportTargetKind.MERGED_SAFETENSORS]
    v = merged.verification
    assert v.max_abs_logit_delta < FP32_BOUND and v.as_trained.max_abs_logit_delta < FP32_BOUND, (
        v.max_abs_logit_delta,
        v.as_trained.max_abs_logit_delta,
    )
    d = store.path_of(merged.artifact.artifact_id)
    assert check_vllm_model_dir(d) == [], "per-expert names and shapes vLLM's Qwen3MoeForCausalLM loads"
    wm = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in wm and not any("gate_up_proj" in k for k in wm)
    # every expert moved by its own slice of the fused LoRA: expert e's gate = base + s · B[:I, e::E] @ A[e·r:(e+1)·r]
    ad = moe_models / "qwen3_moe-lora"
    with safe_open(str(ad / "adapter_model.safetensors"), "pt") as f:
        pairs = [p for (m, _), p in expert_pairs(f.keys()).items() if m.endswith("layers.0.mlp.experts")]
        # gate_up's A reads the hidden state (64), down's the expert's intermediate (32)
        (gate_up,) = [p for p in pairs if f.get_slice(p["lora_A"]).get_shape()[1] == 64]
        a, b = f.get_tensor(gate_up["lora_A"]), f.get_tensor(gate_up["lora_B"])
    with safe_open(str(moe_models / "qwen3_moe" / "model.safetensors"), "pt") as f:
        base_up = f.get_tensor("model.layers.0.mlp.experts.2.up_proj.weight")
    shard = d / wm["model.layers.0.mlp.experts.2.up_proj.weight"]
    with safe_open(str(shard), "pt") as f:
        got = f.get_tensor("model.layers.0.mlp.experts.2.up_proj.weight")
    want = base_up + 2.0 * (b[32:, 2::4] @ a[8:12])  # alpha 8 / r 4; up rows follow the 32 gate rows
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-7)
    peft = by[ExportTargetKind.PEFT_ADAPTER].verification
    assert peft.max_abs_logit_delta < FP32_BOUND, (
        "PeftModel.from_pretrained on the base reproduces the logits"
    )


def test_a_mixtral_adapter_with_a_trained_router_merges_into_block_sparse_moe_names(moe_models, exported):
    store, results = exported
    r = results["mixtral"][ExportTargetKind.MERGED_SAFETENSORS]
    assert r.verification.as_trained.max_abs_logit_delta < FP32_BOUND
    d = store.path_of(r.artifact.artifact_id)
    wm = json.loads((d / "model.safetensors.index.json").read_text())["weight_map"]
    assert {
        "model.layers.0.block_sparse_moe.gate.weight",
        "model.layers.0.block_sparse_moe.experts.1.w3.weight",
    } <= set(wm)
    from safetensors import safe_open

    with safe_open(str(d / wm["model.layers.0.block_sparse_moe.gate.weight"]), "pt") as f:
        router = f.get_tensor("model.layers.0.block_sparse_moe.gate.weight")
    with safe_open(str(moe_models / "mixtral" / "model.safetensors"), "pt") as f:
        assert not torch.equal(router, f.get_tensor("model.layers.0.block_sparse_moe.gate.weight")), (
            "the trained router's copy replaced the base's"
        )


def test_a_mixtral_adapter_with_its_router_frozen_exports_as_peft_and_round_trips(moe_models, store):
    """Mixtral's PEFT target (refused below when the router trained: vLLM refuses modules_to_save) with the router
    frozen: PeftModel.from_pretrained on the base reproduces the model as trained within the merged bound, and the
    file holds the fused-expert pairs under block_sparse_moe's names as PEFT saved them."""
    from safetensors import safe_open

    req = ExportRequest(
        targets=_targets(ExportTargetKind.PEFT_ADAPTER),
        adapter_path="mixtral-frozen-router-lora",
        base_model_path="mixtral",
    )
    (r,) = run_export(req, model_root=moe_models, store=store)
    assert r.verification.max_abs_logit_delta < FP32_BOUND, r.verification.max_abs_logit_delta
    d = store.path_of(r.artifact.artifact_id)
    cfg = json.loads((d / "adapter_config.json").read_text())
    assert sorted(cfg["target_parameters"]) == ["experts.down_proj", "experts.gate_up_proj"], cfg
    assert not cfg.get("modules_to_save"), "a frozen router is not saved"
    with safe_open(str(d / "adapter_model.safetensors"), "pt") as f:
        keys = list(f.keys())
    assert any("experts" in k and "lora_A" in k for k in keys) and not any(".gate.weight" in k for k in keys)


@pytest.mark.parametrize(
    "kind,adapter,base,match",
    [
        (ExportTargetKind.GGUF_LORA, "qwen3_moe-lora", "qwen3_moe", "LoRA on fused experts"),
        (ExportTargetKind.PEFT_ADAPTER, "mixtral-lora", "mixtral", "modules_to_save"),
        (ExportTargetKind.MERGED_SAFETENSORS, None, "gpt_oss", "'gpt_oss' is not exported"),
    ],
)
def test_what_moe_exports_cannot_do_is_refused_naming_why(moe_models, store, kind, adapter, base, match):
    target = ExportTarget(kind=kind)
    req = ExportRequest(targets=[target], adapter_path=adapter or "", base_model_path=base)
    with pytest.raises(StropError, match=match):
        run_export(req, model_root=moe_models, store=store)


@pytest.mark.parametrize("arch", ["qwen3_moe", "mixtral"])
def test_an_moe_gguf_has_llama_cpps_expert_tensors_and_matches_the_model_as_trained(exported, arch):
    """F32 GGUF through llama.cpp (llama-cpp-python) against the merged fp32 model and the model as trained: the
    expert tensors stacked [E, out, in] per layer, the router as ffn_gate_inp, expert_count / expert_used_count.
    Bound: F32_GGUF_BOUND, llama.cpp's kernels in another summation order over two layers (the dense archs' F32
    GGUFs measure ~1e-5 to 1e-4 here; a wrong expert or routing is O(1e-2) or more)."""
    import gguf

    store, results = exported
    r = results[arch][ExportTargetKind.GGUF]
    v = r.verification
    assert v.max_abs_logit_delta < F32_GGUF_BOUND and v.as_trained.max_abs_logit_delta < F32_GGUF_BOUND, (
        v.max_abs_logit_delta,
        v.as_trained.max_abs_logit_delta,
    )
    # the pre-tokenizer: llama.cpp's own tokenizer gives transformers' ids for the prompts and held-out text
    assert v.tokens_checked and v.tokens_match, v.token_mismatches
    path = next(store.path_of(r.artifact.artifact_id).glob("*.gguf"))
    reader = gguf.GGUFReader(path)
    gguf_arch = reader.get_field("general.architecture").contents()
    assert reader.get_field(f"{gguf_arch}.expert_count").contents() == 4
    assert reader.get_field(f"{gguf_arch}.expert_used_count").contents() == 2
    tensors = {t.name: t for t in reader.tensors}
    for kind, shape in (("gate", (4, 32, 64)), ("up", (4, 32, 64)), ("down", (4, 64, 32))):
        t = tensors[f"blk.1.ffn_{kind}_exps.weight"]
        assert tuple(reversed([int(x) for x in t.shape])) == shape, (kind, t.shape)
    assert "blk.0.ffn_gate_inp.weight" in tensors


def test_a_qwen3_moe_without_top_k_renormalization_is_refused_as_gguf():
    """llama.cpp's qwen3moe always renormalizes the top-k routing weights: measured on the tiny fixture, the same
    F32 GGUF is within 2.2e-4 of HF's logits with norm_topk_prob true and 2.6e-2 off with it false."""
    from strop.common.archs import MOE_ARCHS
    from strop.export_svc.core.gguf_arch import gguf_refusals

    config = {"model_type": "qwen3_moe", "num_hidden_layers": 2, "norm_topk_prob": False}
    assert gguf_refusals(config, MOE_ARCHS["qwen3_moe"]) == [
        "norm_topk_prob false: llama.cpp's qwen3moe always renormalizes the top-k routing weights"
    ]
    assert gguf_refusals({**config, "norm_topk_prob": True}, MOE_ARCHS["qwen3_moe"]) == []


# K-quants pack rows in 256-wide super-blocks: hidden and expert intermediate 256, so nothing falls back
WIDE = dict(hidden_size=256, intermediate_size=256, num_layers=2, num_heads=4, num_kv_heads=2, head_dim=64)
# the text the K-quant tests' adapter is trained on (SFT on raw text)
TRAINED_TEXT = "the quick brown fox jumps over the lazy dog, and the dog sleeps on."
# a few steps of the trainer's optimizer: enough for the adapter and each of its parts to move the text's log-probs
# far beyond Q4_K_M's error (asserted), few enough that the trained weights are the same on any CPU up to rounding
# (Adam's later steps amplify rounding differences into different trajectories)
SFT_STEPS, SFT_LR = 12, 1e-2


@dataclass
class KQuantExports:
    """A 256-wide base's Q4_K_M; an adapter trained on it by the trainer's SFT engine, merged and quantized to Q4_K_M
    through the export's path; the same with the adapter's expert pairs zeroed (what a merge that missed them would
    write); and the trained text's next-token log-probs (``logprobs``) of the fp32 models the files are judged
    against: the model as trained (the trainer's session, the adapter unmerged), the base, and the model as trained
    without its expert pairs or without its attention pairs."""

    base: ExportResult
    trained: ExportResult
    no_experts: ExportResult
    store: ArtifactStore
    ids: list[int]
    logprobs: dict[str, np.ndarray]

    def gguf_logprobs(self, r: ExportResult) -> np.ndarray:
        from strop.export_svc.core.verify import LlamaCpp

        lc = LlamaCpp(self.store.path_of(r.artifact.artifact_id) / r.artifact.metadata["gguf.file"], n_ctx=64)
        try:
            return next_token_logprobs(lc.logits(self.ids), self.ids)
        finally:
            lc.close()


def next_token_logprobs(logits, ids: list[int]) -> np.ndarray:
    """log p(ids[i+1] | ids[..i]) at every position, in fp64."""
    lp = torch.as_tensor(np.asarray(logits[:-1]), dtype=torch.float64).log_softmax(-1)
    return lp.gather(1, torch.tensor(ids[1:])[:, None]).squeeze(1).numpy()


def _pair_groups(model) -> dict[str, list[torch.nn.Parameter]]:
    """The session's LoRA B factors by the part of the adapter left out when they are zeroed."""
    b = {n: p for n, p in model.named_parameters() if "lora_B" in n}
    groups = {
        "without the expert pairs": [n for n in b if ".experts." in n],
        "without the attention pairs": [n for n in b if ".self_attn." in n],
    }
    assert sorted(n for names in groups.values() for n in names) == sorted(b) and all(groups.values()), (
        sorted(b)
    )
    return {label: [b[n] for n in names] for label, names in groups.items()}


@contextmanager
def _zeroed(params: list[torch.nn.Parameter]):
    kept = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.zero_()
    try:
        yield
    finally:
        with torch.no_grad():
            for p, k in zip(params, kept, strict=True):
                p.copy_(k)


def _sft_session_logprobs(loaded, ids: list[int]) -> dict[str, np.ndarray]:
    """The session's log-probs on ``ids`` as trained, with its adapter disabled, and with each group of B factors
    zeroed (restored after)."""
    model = loaded.model.eval()

    def run() -> np.ndarray:
        with torch.no_grad():
            return next_token_logprobs(model(input_ids=torch.tensor([ids])).logits[0], ids)

    out = {"as trained": run()}
    with model.disable_adapter():
        out["base"] = run()
    for label, params in _pair_groups(model).items():
        with _zeroed(params):
            out[label] = run()
    return out


@pytest.fixture(scope="module", params=["qwen3_moe", "mixtral"])
def k_quant(request, moe_models, tmp_path_factory) -> KQuantExports:
    """``KQuantExports`` of one arch: the trainer's own path (load, LoRA on attention and every expert's gate/up/down,
    ``run_training`` SFT on TRAINED_TEXT, ``write_adapter``), then ExportRequests as a user's."""
    from safetensors import safe_open

    from strop.common.trainer_types import (
        DatasetFormat,
        LoadModelRequest,
        LoraConfig,
        Quantization,
        TrainConfig,
        TrainMethod,
    )
    from strop.export_svc.core.moe import expert_pairs
    from strop.fixtures.tiny_models import TinyShape, make_tiny_model
    from strop.trainer_svc.core import training
    from strop.trainer_svc.core.job_config import with_defaults
    from strop.trainer_svc.core.model_loading import attach_lora, load_model, release, write_adapter

    arch = request.param
    name = f"{arch}-256"
    make_tiny_model(moe_models / name, arch=arch, shape=TinyShape(**WIDE), dtype="float32", vocab_size=320)
    store = ArtifactStore(tmp_path_factory.mktemp(f"{arch}-k-quant-artifacts"))
    req = ExportRequest(targets=[ExportTarget.gguf("Q4_K_M")], base_model_path=name)
    (base,) = run_export(req, model_root=moe_models, store=store)

    loaded = load_model(
        LoadModelRequest(model_path=name, dtype="float32", quantization=Quantization.NONE),
        model_root=moe_models,
        device="cpu",
    )
    try:
        attach_lora(loaded, LoraConfig(r=4, alpha=8, seed=0))
        rows = [{"text": TRAINED_TEXT}] * 4
        cfg = TrainConfig(
            method=TrainMethod.SFT,
            max_steps=SFT_STEPS,
            batch_size=1,
            learning_rate=SFT_LR,
            lr_scheduler="constant",
            max_length=64,
            seed=0,
        )
        cfg = with_defaults(cfg, session_max_len=loaded.facts.max_seq_length, num_rows=len(rows))
        sinks = training.Sinks(
            on_step=lambda m: None, on_checkpoint=lambda s, p: None, on_start=lambda n: None
        )
        work = tmp_path_factory.mktemp(f"{arch}-sft")
        steps = training.run_training(
            loaded, rows, DatasetFormat.TEXT, cfg, work, training.JobControl(), sinks
        )
        assert steps == SFT_STEPS
        ids = loaded.tokenizer(TRAINED_TEXT)["input_ids"]
        logprobs = _sft_session_logprobs(loaded, ids)
        write_adapter(loaded, moe_models / f"{name}-sft-lora")
        # the negative control: the same adapter without its expert pairs, written as the trainer writes it
        with _zeroed(_pair_groups(loaded.model)["without the expert pairs"]):
            write_adapter(loaded, moe_models / f"{name}-sft-lora-no-experts")
    finally:
        release(loaded)
    with safe_open(str(moe_models / f"{name}-sft-lora" / "adapter_model.safetensors"), "pt") as f:
        pairs = expert_pairs(f.keys())
    assert len(pairs) == 2 * WIDE["num_layers"], pairs  # each layer's gate/up stack and its down stack
    req = ExportRequest(
        targets=[ExportTarget.gguf("Q4_K_M")], adapter_path=f"{name}-sft-lora", base_model_path=name
    )
    (trained,) = run_export(req, model_root=moe_models, store=store)
    req = ExportRequest(
        targets=[ExportTarget.gguf("Q4_K_M")],
        adapter_path=f"{name}-sft-lora-no-experts",
        base_model_path=name,
    )
    (no_experts,) = run_export(req, model_root=moe_models, store=store)
    return KQuantExports(base, trained, no_experts, store, ids, logprobs)


def test_a_q4_k_m_gguf_of_an_moe_quantizes_the_expert_tensors_without_fallback(k_quant):
    """llama.cpp's quantizer on the stacked expert tensors (qwen3moe's, and Mixtral's under llama's arch), of the base
    and of the base with the trained adapter merged: nothing falls back; each file loads in llama.cpp and passes the
    export's verification gate (the base's against the base, the trained one's against the model as trained)."""
    for r in (k_quant.base, k_quant.trained):
        (rep,) = r.quantization
        assert rep.fallbacks == [], rep.summary
        types = {c.type: c.count for c in rep.tensor_types}
        assert set(types) <= {"Q4_K", "Q6_K", "F32"} and types.get("Q4_K", 0) >= 6, types
        assert r.verification is not None and r.verification.passed and r.verification.positions > 50


def test_a_q4_k_m_gguf_of_a_trained_moe_adapter_is_the_model_as_trained_not_the_base(k_quant):
    """The trained adapter (attention and every expert's gate/up/down) merged and quantized to Q4_K_M is the model as
    trained, in llama.cpp: judged on the trained text's next-token log-probs by the distance d(a, b) = mean |Δ log p|
    (a norm: the triangle inequality holds).

    Bounds. A file is the quantized form of the model nearest to it. For the trained file q: d_t = d(q, as trained);
    for X, a part of the adapter (all of it, the expert pairs, the attention pairs), gap_X = d(as trained, without X)
    and d_X = d(q, without X). If q were the quantized model without X, its error ε_X = d_X, and d_t ≥ gap_X − ε_X:
    nearer the model as trained (d_t < d_X) only if gap_X < 2 · ε_X. So "d_t < d_X" tells the two apart whenever the
    adapter's part moves the log-probs by more than twice the quantizer's error. That error is measured on three
    models: ε_b (the base's file against the base, llama.cpp's quantizer without any adapter), d_t, and the file of
    the adapter with its expert pairs zeroed against its own model (the negative control, exported the same way);
    for the base and the expert pairs (the MoE part) gap_X > 4 · their largest is asserted: twice what the rule needs.
    The attention pairs (the dense path's, whose K-quants test_trained_answer judges) are held to the rule alone. The
    negative control itself is told apart: it is nearer the model without its expert pairs than the model as trained.
    The gate (tokens and finite figures for a K-quant without a probe) passes for every file."""
    lp = k_quant.logprobs

    def d(q, label):
        return float(np.abs(q - lp[label]).mean())

    q = k_quant.gguf_logprobs(k_quant.trained)
    q_base = k_quant.gguf_logprobs(k_quant.base)
    q_x = k_quant.gguf_logprobs(k_quant.no_experts)
    d_t = d(q, "as trained")
    eps = {
        "base": d(q_base, "base"),
        "as trained": d_t,
        "without the expert pairs": d(q_x, "without the expert pairs"),
    }
    eps_q = max(eps.values())
    for label in ("base", "without the expert pairs", "without the attention pairs"):
        gap = d(lp["as trained"], label)
        if label != "without the attention pairs":
            assert gap > 4 * eps_q, (
                f"as trained vs {label}: log p moves by {gap:.3g}, not > 4·{eps_q:.3g} ({eps})"
            )
        assert d_t < d(q, label), (
            f"the file is nearer the model {label} ({d(q, label):.3g}) than as trained ({d_t:.3g})"
        )
    assert eps["without the expert pairs"] < d(q_x, "as trained"), "the negative control is told apart"
    for r in (k_quant.base, k_quant.trained, k_quant.no_experts):
        assert r.verification.passed and r.verification.tokens_match, r.verification
