"""Gemma 2 and Gemma 3 (text) as GGUF: the layout llama.cpp's ``gemma2``/``gemma3`` archs expect, the settings
they hard-code refused, and verification that catches a file departing from either.

llama.cpp scales by ``w`` where HF's Gemma RMSNorm scales by ``1 + w``; it reads the sliding window and
Gemma 2's soft-caps from metadata, Gemma 3's sliding-layer RoPE base and layer pattern too, and fixes the
attention scale (and Gemma 2's layer pattern) in code (``strop.export_svc.core.gguf_arch.GemmaInLlamaCpp``).
The common matrix (every target, logits against the merged model) is ``test_targets``'; the trained answer
through K-quants is ``test_trained_answer``'s.
"""

from __future__ import annotations

import copy
import json
import shutil

import gguf
import numpy as np
import pytest
import torch

from strop.common.archs import ARCHS
from strop.common.export_types import ExportRequest, ExportTarget, VerifyOptions
from strop.export_svc.core import gguf_arch, gguf_out
from strop.export_svc.core import verify as V
from strop.export_svc.core.adapter_source import open_adapter
from strop.export_svc.core.base_source import BaseModel
from strop.export_svc.core.errors import TargetRefused
from strop.export_svc.core.gguf_out import write_gguf_model
from strop.export_svc.core.gguf_tokenizer import load_vocab
from strop.export_svc.core.peft_dir import refusals
from strop.export_svc.core.pipeline import run_export
from strop.fixtures.tiny_models import GEMMA_SLIDING_WINDOW

from .conftest import GEMMA_LAYERS, make_random_adapter, store_is_empty

GGUF_ARCH = {"gemma2-spm": "gemma2", "gemma3-spm": "gemma3"}
# F32 GGUF vs the fp32 reference: the same weights, llama.cpp's kernels (its GELU reads an fp16 table) and
# summation order; measured 7e-4 (Gemma 2) and 1.2e-3 (Gemma 3) with logits of O(1)
F32_BOUND = 3e-3


def _probe(base: BaseModel, options: VerifyOptions | None = None) -> V.Probe:
    probe = V.build_probe(
        options or VerifyOptions(), base.path, [2], sliding_window=V.sliding_window_of(base.config)
    )
    V.fill_reference(probe, V.reference_model(base, None))
    return probe


def _f32_gguf(base: BaseModel, path):
    write_gguf_model(path, base, None, load_vocab(base.path, base.config), gguf_type="F32", name="g")
    return path


@pytest.mark.parametrize("base_name", ["gemma2-spm", "gemma3-spm"])
def test_gemma_gguf_has_the_metadata_and_tensors_llama_cpp_expects(export_models, tmp_path, base_name):
    base = BaseModel(export_models / base_name, base_name)
    arch = GGUF_ARCH[base_name]
    r = gguf.GGUFReader(_f32_gguf(base, tmp_path / "g.gguf"))

    def key(k: str):
        f = r.get_field(k)
        return None if f is None else f.contents()

    assert key("general.architecture") == arch == ARCHS[base.config["model_type"]].gguf_arch
    assert key(f"{arch}.attention.sliding_window") == GEMMA_SLIDING_WINDOW
    assert key(f"{arch}.attention.key_length") == key(f"{arch}.attention.value_length") == 64
    assert key(f"{arch}.attention.layer_norm_rms_epsilon") == pytest.approx(1e-6)
    if arch == "gemma2":
        assert key("gemma2.attn_logit_softcapping") == 50.0 and key("gemma2.final_logit_softcapping") == 30.0
        assert key("gemma2.rope.freq_base") == 10000.0
        assert key("gemma2.attention.sliding_window_pattern") is None, "llama.cpp's gemma2 reads no pattern"
    else:
        assert key("gemma3.rope.freq_base") == 1_000_000.0, "rope.freq_base is the full-attention layers'"
        assert key("gemma3.rope.freq_base_swa") == 10000.0, "the sliding layers' own base"
        assert key("gemma3.attention.sliding_window_pattern") == [True] * 5 + [False], (
            "one flag per layer, True = sliding: transformers' default layer_types for six layers"
        )
        assert key("gemma3.final_logit_softcapping") is None and key("gemma3.attn_logit_softcapping") is None
    assert (key("tokenizer.ggml.model"), key("tokenizer.ggml.add_space_prefix")) == ("llama", True), (
        "SentencePiece, with the dummy prefix the fixture's tokenizer.model adds (real Gemmas add none)"
    )
    # every tensor gguf-py lists for the arch, but output: a tied model's output projection is token_embd
    n = GEMMA_LAYERS[base.config["model_type"]]
    want = set()
    for t in gguf.MODEL_TENSORS[getattr(gguf.MODEL_ARCH, arch.upper())]:
        name = gguf.TENSOR_NAMES[t]
        if t is not gguf.MODEL_TENSOR.OUTPUT:
            want |= (
                {name.format(bid=i) + ".weight" for i in range(n)} if "{bid}" in name else {name + ".weight"}
            )
    tensors = {t.name: t for t in r.tensors}
    assert set(tensors) == want
    # norms are HF's weight + 1 (llama.cpp multiplies by w, HF by 1 + w); matrices are HF's rows, unpermuted
    hf = {k: base.read_fp32(k) for k in base.tensors}
    norms = [k for k in hf if k.endswith("norm.weight")]
    assert len(norms) == (4 + 2 * (arch == "gemma3")) * n + 1
    name_map = gguf_arch.tensor_name_map(base)
    for k, w in hf.items():
        got = torch.from_numpy(np.array(tensors[gguf_arch.gguf_tensor_name(name_map, k)].data)).reshape(
            w.shape
        )
        expected = w + 1 if k in norms else w
        assert torch.equal(got, expected), k


def test_verification_catches_a_gemma_gguf_with_an_unshifted_norm_or_a_wrong_window_or_rope_base(
    export_models, tmp_path, monkeypatch
):
    """Gemma 3 (five sliding layers, one full): one norm left as HF stores it, a window llama.cpp would not
    slide at, or the sliding layers' RoPE base replaced by the full layers': each loads and runs, and is caught
    by the logits (the window only because the prompts reach past it)."""
    base = BaseModel(export_models / "gemma3-spm", "gemma3-spm")
    probe = _probe(base)
    longest = max(len(ids) for ids in probe.prompts)
    assert longest > GEMMA_SLIDING_WINDOW, "the default prompts reach past the window: sliding layers differ"
    good = V.verify_gguf(probe, _f32_gguf(base, tmp_path / "good.gguf"))
    assert good.max_abs_logit_delta < F32_BOUND and good.notes == []

    one = "model.layers.2.post_feedforward_layernorm.weight"
    with monkeypatch.context() as m:
        m.setattr(
            gguf_out, "norm_offset", lambda arch, n: 0.0 if n == one else gguf_arch.norm_offset(arch, n)
        )
        unshifted = V.verify_gguf(probe, _f32_gguf(base, tmp_path / "unshifted.gguf"))
    add_window = gguf.GGUFWriter.add_sliding_window
    with monkeypatch.context() as m:  # 4096: llama.cpp's default window, the released Gemma 2's
        m.setattr(gguf.GGUFWriter, "add_sliding_window", lambda w, n: add_window(w, 4096))
        wide = V.verify_gguf(probe, _f32_gguf(base, tmp_path / "wide.gguf"))
    add_base = gguf.GGUFWriter.add_rope_freq_base_swa
    with monkeypatch.context() as m:  # the full layers' base on the sliding ones too
        m.setattr(gguf.GGUFWriter, "add_rope_freq_base_swa", lambda w, b: add_base(w, 1e6))
        one_base = V.verify_gguf(probe, _f32_gguf(base, tmp_path / "one-base.gguf"))
    cases = (
        (unshifted, f"{one} not shifted by 1"),
        (wide, "a 4096-token window"),
        (one_base, "rope.freq_base_swa 1e6"),
    )
    for bad, what in cases:
        assert bad.max_abs_logit_delta > max(50 * good.max_abs_logit_delta, 0.1), (
            f"{what}: max |Δlogit| {bad.max_abs_logit_delta:.3g} vs {good.max_abs_logit_delta:.3g}"
        )


def test_a_comparison_within_the_window_says_the_sliding_layers_were_not_exercised(export_models):
    base = BaseModel(export_models / "gemma2-spm", "gemma2-spm")
    assert V.sliding_window_of(base.config) == GEMMA_SLIDING_WINDOW
    assert V.sliding_window_of(BaseModel(export_models / "qwen2-bpe", "q").config) is None, "no sliding layer"
    probe = V.build_probe(VerifyOptions(prompts=["Hello, world!"]), base.path, [2], sliding_window=16)

    def flat(ids: list[int]) -> np.ndarray:
        return np.zeros((len(ids), 640), np.float32)

    probe.ref_prompts = [flat(ids) for ids in probe.prompts]
    probe.ref_heldout = [flat(ids) for ids in probe.heldout]
    short = V.compare(probe, "x", flat)
    assert len(short.notes) == 1 and "within their window only (16 tokens" in short.notes[0]
    probe.prompts = probe.heldout  # ordinary prose of more than 16 tokens: no note
    probe.ref_prompts = probe.ref_heldout
    assert V.compare(probe, "x", flat).notes == []


def _gemma_config(export_models, base_name: str, **change) -> dict:
    cfg = copy.deepcopy(BaseModel(export_models / base_name, base_name).config)
    cfg.update(change)
    return cfg


@pytest.mark.parametrize(
    ("base_name", "change", "named"),
    [
        ("gemma2-spm", {"query_pre_attn_scalar": 32}, "query_pre_attn_scalar 32"),
        ("gemma3-spm", {"query_pre_attn_scalar": 256}, "query_pre_attn_scalar 256"),
        ("gemma2-spm", {"layer_types": ["full_attention", "sliding_attention"]}, "layer_types"),
        ("gemma2-spm", {"final_logit_softcapping": None}, "final_logit_softcapping None"),
        ("gemma2-spm", {"tie_word_embeddings": False}, "tie_word_embeddings false"),
        ("gemma3-spm", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping 50.0"),
        ("gemma3-spm", {"hidden_activation": "gelu"}, "hidden_activation 'gelu'"),
        (
            "gemma3-spm",
            {
                "rope_parameters": {
                    "full_attention": {"rope_type": "default", "rope_theta": 1e6},
                    "sliding_attention": {"rope_type": "linear", "rope_theta": 1e4, "factor": 2.0},
                }
            },
            "sliding_attention rope_type 'linear'",
        ),
    ],
)
def test_a_setting_llama_cpp_hard_codes_otherwise_refuses_the_gguf_naming_it(
    export_models, base_name, change, named
):
    arch = ARCHS[_gemma_config(export_models, base_name)["model_type"]]
    assert gguf_arch.gguf_refusals(_gemma_config(export_models, base_name), arch) == [], (
        "the fixture converts"
    )
    why = gguf_arch.gguf_refusals(_gemma_config(export_models, base_name, **change), arch)
    assert len(why) == 1 and why[0].startswith(named), why


def test_gemma3_settings_llama_cpp_reads_are_written_not_refused(export_models, tmp_path):
    """llama.cpp's gemma3 reads sliding_window_pattern (one flag per layer), rope.freq_base_swa and, when
    present, final_logit_softcapping: another layer pattern, local base or final cap converts."""
    types = ["full_attention", "sliding_attention"] * 3
    rope = {
        "full_attention": {"rope_type": "linear", "rope_theta": 1e6, "factor": 8.0},
        "sliding_attention": {"rope_type": "default", "rope_theta": 5e4},
    }
    change = {"layer_types": types, "final_logit_softcapping": 30.0, "rope_parameters": rope}
    cfg = _gemma_config(export_models, "gemma3-spm", **change)
    assert gguf_arch.gguf_refusals(cfg, ARCHS["gemma3_text"]) == []
    w = gguf.GGUFWriter(str(tmp_path / "kv.gguf"), "gemma3")
    gguf_arch.add_model_metadata(w, cfg, ARCHS["gemma3_text"], "g")
    kv = {k: v.value for k, v in w.kv_data[0].items()}
    assert kv["gemma3.attention.sliding_window_pattern"] == [t == "sliding_attention" for t in types]
    assert (kv["gemma3.rope.freq_base"], kv["gemma3.rope.freq_base_swa"]) == (1e6, 5e4)
    assert (kv["gemma3.rope.scaling.type"], kv["gemma3.rope.scaling.factor"]) == ("linear", 8.0), (
        "the full layers' scaling; llama.cpp leaves the sliding layers unscaled, as HF does"
    )
    assert kv["gemma3.final_logit_softcapping"] == 30.0 and "gemma3.attn_logit_softcapping" not in kv


def test_a_refused_gemma_gguf_fails_before_anything_is_written_and_would_compute_otherwise(
    export_models, tmp_path, store, monkeypatch
):
    """Gemma 2 with query_pre_attn_scalar 32 (not its head_dim 64): llama.cpp would scale attention by 1/8,
    not 1/sqrt(32). The export is refused at validation; written anyway, the file computes another model."""
    root = tmp_path / "models"
    base_dir = shutil.copytree(export_models / "gemma2-spm", root / "gemma2-spm")
    cfg = json.loads((base_dir / "config.json").read_text())
    cfg["query_pre_attn_scalar"] = 32
    (base_dir / "config.json").write_text(json.dumps(cfg))
    req = ExportRequest(
        targets=[ExportTarget.merged(), ExportTarget.gguf("F16")], base_model_path="gemma2-spm"
    )
    with pytest.raises(TargetRefused, match=r"query_pre_attn_scalar 32: llama.cpp's gemma2 .* 1/sqrt\(64\)"):
        run_export(req, model_root=root, store=store)
    assert store_is_empty(store)
    right = BaseModel(export_models / "gemma2-spm", "gemma2-spm")
    good = V.verify_gguf(_probe(right), _f32_gguf(right, tmp_path / "good.gguf"))
    base = BaseModel(base_dir, "gemma2-spm")
    monkeypatch.setattr(gguf_out, "check_gguf_model", lambda config, arch: None)
    forced = V.verify_gguf(_probe(base), _f32_gguf(base, tmp_path / "forced.gguf"))
    assert forced.max_abs_logit_delta > 50 * good.max_abs_logit_delta, (
        f"the refusal is needed: llama.cpp's fixed scale gives max |Δlogit| {forced.max_abs_logit_delta:.3g}, "
        f"the right scale {good.max_abs_logit_delta:.3g}"
    )


def test_a_gemma_adapter_on_the_embeddings_is_refused_as_a_vllm_lora(export_models, tmp_path):
    """vLLM's Gemma2ForCausalLM/Gemma3ForCausalLM declare no embedding modules: an embedding LoRA, which its
    Llama classes serve, is refused for Gemma (merge it instead)."""
    adapter_dir = make_random_adapter(
        export_models / "gemma2-spm", tmp_path / "emb-lora", target_modules=["q_proj", "embed_tokens"], seed=5
    )
    adapter = open_adapter(adapter_dir, "emb-lora")
    assert not any("do not support" in why for why in refusals(adapter, "llama")), "Llama serves it"
    assert "it adapts modules vLLM's gemma2 classes do not support: ['embed_tokens']" in refusals(
        adapter, "gemma2"
    )
