"""Acceptance: an adapter trained to give one answer gives it from every export.

The adapter (rsLoRA r=8 on all seven projections) was trained on the NF4 base (its fp32 dequantized
weights: the QLoRA objective) to answer QUESTION with ANSWER, and is handed over as the trainer hands
adapters over: an artifact of kind "adapter" naming its base relative to the model root. Greedy
generation must reproduce the answer from the merged directory (transformers), the F16 and Q8_0
GGUFs and the GGUF base + GGUF LoRA (llama.cpp); on the answer's tokens, teacher-forced, the K-quant
GGUFs must agree with the merged model's top-1 at least 95% of the time. The same holds of an adapter
trained the same way on the tiny Gemma 2 and Gemma 3 (SentencePiece, sliding window 16, tied embeddings;
Gemma 2's soft-caps, Gemma 3's q/k norms and RoPE per layer type).
"""

from __future__ import annotations

import shutil

import gguf
import pytest

from strop.common.export_types import ExportRequest, ExportTarget, VerifyOptions
from strop.export_svc.core.base_source import BaseModel
from strop.export_svc.core.pipeline import run_export

from .conftest import ANSWER, QUESTION

TARGETS = [
    ExportTarget.merged(),
    ExportTarget.peft(),
    ExportTarget.gguf("F16"),
    ExportTarget.gguf("Q8_0"),
    ExportTarget.gguf("Q4_K_M"),
    ExportTarget.gguf("Q5_K_M"),
    ExportTarget.gguf("Q6_K"),
    ExportTarget.gguf_lora("F32", "F16"),
]
EXACT = ("merged_safetensors:bfloat16", "peft_adapter", "gguf:F16", "gguf:Q8_0", "gguf_lora:F32+base:F16")
KQUANTS = {"gguf:Q4_K_M": 15, "gguf:Q5_K_M": 17, "gguf:Q6_K": 18}  # llama_ftype of each


def _trainer_style_artifact(store, adapter_dir, base_ref: str) -> str:
    with store.create(
        "adapter",
        owner="",
        artifact_id="adapter-trained",
        metadata={
            "base_model": base_ref,
            "base_quantization": "bnb-nf4-prequantized",
            "job_id": "job-1",
            "step": "120",
        },
    ) as pending:
        for p in adapter_dir.iterdir():
            shutil.copy2(p, pending.dir / p.name)
    return "adapter-trained"


@pytest.mark.parametrize(
    ("adapter_name", "base_name"),
    [
        ("trained-nf4-lora", "llama-bpe-nf4"),
        ("trained-spm-lora", "llama-spm"),
        ("trained-gemma2-lora", "gemma2-spm"),  # tied embeddings: token_embd is also the output layer
        ("trained-gemma3-lora", "gemma3-spm"),
    ],
)
def test_every_export_of_a_trained_adapter_reproduces_its_answer(
    export_models, store, adapter_name, base_name
):
    aid = _trainer_style_artifact(store, export_models / adapter_name, base_name)
    req = ExportRequest(
        targets=list(TARGETS),
        adapter_artifact_id=aid,  # no base given: resolved from the artifact's metadata
        verify=VerifyOptions(question=QUESTION, answer=ANSWER),
    )
    results = run_export(req, model_root=export_models, store=store)
    by = {r.target.label: r for r in results}
    assert len(by) == len(TARGETS)
    for label, r in by.items():
        v = r.verification
        assert (
            r.artifact.metadata["base_model"] == base_name and r.artifact.metadata["source.job_id"] == "job-1"
        )
        assert v.answer_tokens >= 8, "the answer and its end-of-turn token are compared"
        if label in EXACT:
            assert v.answer_reproduced, f"{label}: greedy generation gave {v.generated!r}, not {ANSWER!r}"
            assert v.answer_top1_agreement == 1.0
        if label.startswith("gguf"):
            assert v.tokens_match, f"{label}: HF and llama.cpp tokenize {v.token_mismatches} differently"
            assert v.chat_tokens_checked, "the chat-formatted question's tokenization is reported"
        assert v.passed, f"{label}: verification did not pass: {v}"
    for label, ftype in KQUANTS.items():
        v = by[label].verification
        assert v.answer_top1_agreement >= 0.95, (
            f"{label}: teacher-forced top-1 agreement on the answer is {v.answer_top1_agreement:.3f} (< 0.95)"
        )
        art = by[label].artifact
        r = gguf.GGUFReader(store.path_of(art.artifact_id) / art.metadata["gguf.file"])
        assert r.get_field("general.file_type").contents() == ftype, "llama.cpp quantized to the asked ftype"
        kinds = {t.tensor_type for t in r.tensors}
        assert gguf.GGMLQuantizationType.Q8_0 not in kinds or label == "gguf:Q8_0", (
            "not llama.cpp's default Q8_0"
        )
    q4 = {
        t.name: t.tensor_type
        for t in gguf.GGUFReader(
            store.path_of(by["gguf:Q4_K_M"].artifact.artifact_id)
            / by["gguf:Q4_K_M"].artifact.metadata["gguf.file"]
        ).tensors
    }
    assert q4["blk.0.attn_q.weight"] == gguf.GGMLQuantizationType.Q4_K
    # a tied model has no output.weight: llama.cpp's quantizer treats token_embd as the output layer
    tied = bool(BaseModel(export_models / base_name, base_name).config.get("tie_word_embeddings"))
    assert ("output.weight" in q4) != tied
    output = "token_embd.weight" if tied else "output.weight"
    assert q4[output] == gguf.GGMLQuantizationType.Q6_K, "Q4_K_M keeps the output layer at Q6_K"
