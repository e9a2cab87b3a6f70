"""Every target, every architecture, both tokenizer kinds: written, checked as its consumer would, and
loaded by that consumer (transformers, PEFT, llama.cpp) with logits close to the merged fp32 model.

The Gemma bases (sliding window 16, tied embeddings, Gemma 2's soft-caps, Gemma 3's RoPE per layer type) run
the same matrix; what is particular to their GGUF is in ``test_gemma``."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import gguf
import pytest

from strop.common.archs import ARCHS
from strop.common.export_types import (
    ExportRequest,
    ExportTarget,
    ExportTargetKind,
    Verification,
    VerifyOptions,
)
from strop.export_svc.core import verify as V
from strop.export_svc.core.adapter_source import open_adapter
from strop.export_svc.core.base_source import BaseModel
from strop.export_svc.core.gguf_out import write_gguf_lora, write_gguf_model
from strop.export_svc.core.gguf_tokenizer import load_vocab
from strop.export_svc.core.hf_dir import check_vllm_model_dir
from strop.export_svc.core.peft_dir import check_vllm_lora_dir
from strop.export_svc.core.pipeline import run_export

from .conftest import make_random_adapter

ALL_TARGETS = [
    ExportTarget.merged(),
    ExportTarget.peft(),
    ExportTarget.gguf("F16"),
    ExportTarget.gguf("Q8_0"),
    ExportTarget.gguf_lora("F32", "F16"),
]

# Bounds on max |Δlogit| against the merged fp32 model (random tiny models' logits are O(1)):
# storage rounding of 2^-9 (bf16) or 2^-11 (f16) relative per weight moves logits by ~1e-3..1e-2;
# Q8_0 (8-bit blocks) by ~1e-1; the PEFT dir on a 16-bit base is the same fp32 function (~1e-6).
BOUNDS = {
    "merged_safetensors:bfloat16": 0.05,
    "gguf:F16": 0.01,
    "gguf:Q8_0": 0.15,
    "gguf_lora:F32+base:F16": 0.01,
}


@pytest.mark.parametrize(
    "base_name",
    [
        "llama-bpe",
        "mistral-bpe",
        "qwen2-bpe",
        "qwen3-bpe",
        "llama-spm",
        "llama-bpe-nf4",
        "gemma2-spm",
        "gemma3-spm",
    ],
)
def test_every_target_loads_in_its_consumer_and_matches_the_merged_model(export_models, store, base_name):
    req = ExportRequest(
        targets=list(ALL_TARGETS), adapter_path=f"{base_name}-lora", base_model_path=base_name
    )
    results = run_export(req, model_root=export_models, store=store)
    by = {r.target.label: r for r in results}
    assert set(by) == {
        "merged_safetensors:bfloat16",
        "peft_adapter",
        "gguf:F16",
        "gguf:Q8_0",
        "gguf_lora:F32+base:F16",
    }
    for label, r in by.items():
        v = r.verification
        assert v is not None and v.positions > 50
        assert r.artifact.metadata["verify.max_abs_logit_delta"] == str(v.max_abs_logit_delta), (
            "figures travel with the artifact"
        )
        if label in BOUNDS:
            assert v.max_abs_logit_delta < BOUNDS[label], (
                f"{base_name} {label}: max |Δlogit| {v.max_abs_logit_delta:.3g}"
            )
            assert abs(v.perplexity_delta) < 0.02 * v.perplexity_reference, (
                f"{label}: perplexity moved {v.perplexity_delta:.4g}"
            )
            # the model as trained (base + adapter unmerged, by PEFT) is the merged function in fp32
            assert v.as_trained.max_abs_logit_delta < BOUNDS[label], (
                f"{base_name} {label}: max |Δlogit| against HF+PEFT {v.as_trained.max_abs_logit_delta:.3g}"
            )
        if label.startswith("gguf"):
            assert v.tokens_match, (
                f"{base_name} {label}: llama.cpp tokenizes {v.token_mismatches} differently from HF"
            )
    peft = by["peft_adapter"].verification
    if base_name.endswith("nf4"):
        # transformers runs bnb's 4-bit layers in bf16: bf16-rounding-sized differences
        assert peft.max_abs_logit_delta < 0.05 and peft.top1_agreement >= 0.9
    else:
        assert peft.max_abs_logit_delta < 1e-4, (
            f"PEFT dir on a 16-bit base is the reference function in fp32: {peft.max_abs_logit_delta:.3g}"
        )
    merged_dir = store.path_of(by["merged_safetensors:bfloat16"].artifact.artifact_id)
    assert check_vllm_model_dir(merged_dir) == []
    config = json.loads((merged_dir / "config.json").read_text())
    assert config["architectures"] == [ARCHS[config["model_type"]].hf_class], "what vLLM's registry looks up"
    weight_map = json.loads((merged_dir / "model.safetensors.index.json").read_text())["weight_map"]
    assert ("lm_head.weight" in weight_map) != bool(config.get("tie_word_embeddings")), (
        "a tied model's output projection is its embedding table, written once"
    )
    base = BaseModel(export_models / base_name, base_name)
    problems, rank = check_vllm_lora_dir(store.path_of(by["peft_adapter"].artifact.artifact_id), base)
    assert problems == [] and rank == 8, "r=8 needs vLLM's --max-lora-rank 8"


def test_rank_and_alpha_patterns_are_folded_into_the_gguf_lora(export_models, store):
    """Different ranks and alphas per module cannot share llama.cpp's one alpha: the scale goes into B."""
    adir = make_random_adapter(
        export_models / "qwen3-bpe",
        store.root / "pattern-lora",
        use_rslora=True,
        rank_pattern={"o_proj": 4},
        alpha_pattern={"down_proj": 64},
        seed=7,
    )
    req = ExportRequest(
        targets=[ExportTarget.gguf_lora("F32", "F32"), ExportTarget.peft()],
        adapter_path=str(adir),
        base_model_path="qwen3-bpe",
    )
    results = {r.target.kind: r for r in run_export(req, model_root=export_models, store=store)}
    lora = results[ExportTargetKind.GGUF_LORA]
    reader = gguf.GGUFReader(
        store.path_of(lora.artifact.artifact_id) / lora.artifact.metadata["gguf.lora_file"]
    )
    alpha = reader.get_field(gguf.Keys.Adapter.LORA_ALPHA).contents()
    assert alpha == 0.0, "mixed scale·rank products are folded into B; alpha 0 makes llama.cpp apply none"
    assert lora.verification.max_abs_logit_delta < 2e-3, (
        "F32 base + F32 LoRA in llama.cpp is the fp32 reference"
    )
    cfg = results[ExportTargetKind.PEFT_ADAPTER]
    assert cfg.verification.max_abs_logit_delta < 1e-4


def test_gguf_lora_carries_the_metadata_and_tensor_names_llama_cpp_expects(export_models, tmp_path):
    base = BaseModel(export_models / "llama-bpe-nf4", "nf4")
    adapter = open_adapter(export_models / "trained-nf4-lora", "trained")
    path = tmp_path / "lora.gguf"
    write_gguf_lora(path, base, adapter, name="t")
    r = gguf.GGUFReader(path)
    assert r.get_field("general.type").contents() == "adapter"
    assert r.get_field("general.architecture").contents() == "llama"
    assert r.get_field("adapter.type").contents() == "lora"
    # rsLoRA r=8, alpha=16: llama.cpp scales by alpha_gguf / r, so alpha_gguf = 16 / sqrt(8) * 8
    assert r.get_field("adapter.lora.alpha").contents() == pytest.approx(16 * 8 / 8**0.5, rel=1e-6)
    names = {t.name: tuple(int(x) for x in t.shape) for t in r.tensors}
    assert names["blk.0.attn_q.weight.lora_a"] == (256, 8), "ggml shapes are reversed: A [r, in] → ne (in, r)"
    assert names["blk.1.ffn_down.weight.lora_b"] == (8, 256)
    assert len(names) == 2 * 14


def test_llama_gguf_without_the_qk_permutation_loads_but_computes_garbage(export_models, tmp_path):
    """The permutation is not cosmetic: skipping it gives a file llama.cpp loads and runs wrongly."""
    base = BaseModel(export_models / "llama-bpe", "llama")
    vocab = load_vocab(base.path, base.config)
    probe = V.build_probe(VerifyOptions(), base.path, [2])
    V.fill_reference(probe, V.reference_model(base, None))
    write_gguf_model(tmp_path / "good.gguf", base, None, vocab, gguf_type="F32", name="good")
    good = V.verify_gguf(probe, tmp_path / "good.gguf")
    base.arch = dataclasses.replace(base.arch, permute_qk=False)
    write_gguf_model(tmp_path / "bad.gguf", base, None, vocab, gguf_type="F32", name="bad")
    bad = V.verify_gguf(probe, tmp_path / "bad.gguf")
    assert good.max_abs_logit_delta < 2e-3
    assert bad.max_abs_logit_delta > 50 * good.max_abs_logit_delta, (
        f"without the permutation llama.cpp's RoPE pairs the wrong dimensions: {bad.max_abs_logit_delta:.3g} "
        f"vs {good.max_abs_logit_delta:.3g}"
    )


def test_gguf_names_the_pretokenizer_transformers_actually_runs(export_models):
    llama = BaseModel(export_models / "llama-bpe", "llama")
    assert load_vocab(llama.path, llama.config).pre == "gpt-2", "llama.cpp's name for the GPT-2 regex"
    qwen2 = BaseModel(export_models / "qwen2-bpe", "qwen2")
    # transformers 5 loads a qwen2 model's tokenizer as Qwen2Tokenizer, which splits digits one by
    # one whatever tokenizer.json says; llama.cpp must do the same, so the pre-tokenizer is qwen2's
    assert load_vocab(qwen2.path, qwen2.config).pre == "qwen2"
    spm = BaseModel(export_models / "llama-spm", "spm")
    v = load_vocab(spm.path, spm.config)
    assert (v.model, v.pre, v.add_bos, v.add_space_prefix) == ("llama", "default", True, True)
    assert v.types[v.tokens.index("<|im_start|>")] == gguf.TokenType.CONTROL


def test_gguf_metadata_carries_arch_tokenizer_and_chat_template(export_models, store):
    req = ExportRequest(
        targets=[ExportTarget.gguf("BF16")], base_model_path="qwen2-bpe", verify=VerifyOptions(skip=True)
    )
    (res,) = run_export(req, model_root=export_models, store=store)
    r = gguf.GGUFReader(Path(store.path_of(res.artifact.artifact_id)) / res.artifact.metadata["gguf.file"])
    assert r.get_field("general.architecture").contents() == "qwen2"
    assert r.get_field("tokenizer.ggml.model").contents() == "gpt2"
    assert "<|im_start|>" in r.get_field("tokenizer.chat_template").contents()
    assert len(r.get_field("tokenizer.ggml.merges").contents()) > 100
    assert r.get_field("general.file_type").contents() == int(gguf.LlamaFileType.MOSTLY_BF16)
    types = {t.name: t.tensor_type for t in r.tensors}
    assert types["blk.0.attn_q.bias"] == gguf.GGMLQuantizationType.F32, "qwen2's q/k/v biases are kept in F32"
    assert types["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.BF16


def test_artifact_metadata_carries_the_figures_of_the_checks_that_ran_only():
    ran = Verification(
        consumer="llama.cpp",
        max_abs_logit_delta=0.25,
        tokens_checked=True,
        tokens_match=False,
        token_mismatches=["a b", "c"],
        answer_checked=False,
        answer_reproduced=False,
        passed=False,
    )
    meta = V.verification_metadata(ran)
    assert meta["verify.max_abs_logit_delta"] == "0.25"
    assert (meta["verify.tokens_match"], meta["verify.token_mismatches"]) == ("False", "a b; c")
    assert "verify.answer_reproduced" not in meta, "no probe question: no answer figures, not a False"
    assert "verify.chat_tokens_match" not in meta
    assert not any(k.endswith("_checked") for k in meta), "a check that ran is one whose figures are present"
