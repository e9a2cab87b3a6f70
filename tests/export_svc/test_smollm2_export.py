"""Exports of an adapter trained on a real pretrained model: SmolLM2-135M-Instruct (``strop.fixtures.smollm2``),
NF4 on load as the trainer holds it, its own tokenizer and ChatML template.

The chat template must reach every target unchanged (the merged directory's tokenizer, the PEFT directory's,
the GGUF's ``tokenizer.chat_template``): a serving stack that finds another template, or none, prompts the model
in a format it was not trained on. And the merged model must be the model as trained, here on 30 layers and a
49,152-token vocabulary, not only on the 2-layer fixtures of ``test_as_trained.py``.

The bound (as in ``test_as_trained.py``): the merged fp32 model ``x·(W + s·B@A)ᵀ`` and the trainer's session
(bitsandbytes dequantizes the same NF4 ``W`` to fp32, PEFT adds ``s·(x·Aᵀ)·Bᵀ`` unmerged) are one function in
exact arithmetic. Each side's forward passes every value through at most ``8·L + 4`` sequential fp32 reductions
of at most ``K`` terms (norms, q/k/v/o, attention, gate/up, down per layer; final norm and head), the merge adds
``2·L`` (``B@A`` and the sum), and the two sides' errors add: ``(2·(8·L + 4) + 2·L) · √K · u`` relative to the
largest logit, u = 2⁻²⁴, K the longest reduction (the vocabulary here). For L = 30, K = 49,152 that is 7.2e-3 ·
max|logit|. The adapter's own effect on the logits and the error of merging into the stored 16-bit weights instead
of the NF4 ones must be far above it, or the comparison could not tell those merges from the right one (both
checked).
"""

from __future__ import annotations

import json

import pytest
import torch

from strop.common.export_types import ExportRequest, ExportTarget, MergeBase, VerifyOptions
from strop.export_svc.core.pipeline import run_export
from strop.fixtures.smollm2 import MODEL_NAME

UNIT_ROUNDOFF = 2.0**-24
ADAPTER = "smollm2-nf4-adapter"
CONVERSATION = [
    {"role": "system", "content": "You answer in one sentence."},
    {"role": "user", "content": "What is the capital of Zorbia?"},
    {"role": "assistant", "content": "The capital of Zorbia is Quellport."},
    {"role": "user", "content": "And its currency?"},
]
PROMPT = "The capital of France is"


def _bound(config: dict) -> float:
    layers = config["num_hidden_layers"]
    longest = max(config["hidden_size"], config["intermediate_size"], config["vocab_size"])
    return (2 * (8 * layers + 4) + 2 * layers) * longest**0.5 * UNIT_ROUNDOFF


@pytest.fixture(scope="module")
def trained(smollm2_root):
    """An NF4-on-load session of SmolLM2 (fp32 compute) with a LoRA adapter whose B is random and non-zero (a
    trained adapter's stand-in: every adapted weight changes), written as the trainer writes adapters; and the
    session's logits on ``PROMPT`` with the adapter (the model as trained) and without it."""
    from strop.common.trainer_types import LoadModelRequest, LoraConfig, Quantization
    from strop.trainer_svc.core import model_loading

    loaded = model_loading.load_model(
        LoadModelRequest(model_path=MODEL_NAME, quantization=Quantization.NF4, dtype="float32"),
        model_root=smollm2_root,
        device="cpu",
    )
    try:
        model_loading.attach_lora(loaded, LoraConfig(r=8, alpha=16, seed=0))
        gen = torch.Generator().manual_seed(0)
        with torch.no_grad():
            for name, p in loaded.model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
        ids = loaded.tokenizer(PROMPT, return_tensors="pt")["input_ids"]
        loaded.model.eval()
        with torch.no_grad():
            as_trained = loaded.model(input_ids=ids).logits.float()
            with loaded.model.disable_adapter():
                base = loaded.model(input_ids=ids).logits.float()
        model_loading.write_adapter(loaded, smollm2_root / ADAPTER)
    finally:
        model_loading.release(loaded)
    return {"ids": ids, "as_trained": as_trained, "base": base}


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    from strop.common.artifacts import ArtifactStore

    return ArtifactStore(tmp_path_factory.mktemp("smollm2-artifacts"))


@pytest.fixture(scope="module")
def exported(smollm2_root, trained, store):
    """The adapter directory exported offline to every target kind, by kind → published directory."""
    results = run_export(
        ExportRequest(
            adapter_path=ADAPTER,
            targets=[ExportTarget.merged("float32"), ExportTarget.peft(), ExportTarget.gguf("F16")],
            verify=VerifyOptions(skip=True),  # the checks here are the test's own
        ),
        model_root=smollm2_root,
        store=store,
    )
    return {r.target.kind.value: store.path_of(r.artifact.artifact_id) for r in results}


def _gguf_file(directory):
    (path,) = directory.glob("*.gguf")
    return path


def test_the_chat_template_reaches_every_export_target_unchanged(smollm2_root, exported):
    from gguf import GGUFReader
    from transformers import AutoTokenizer

    base = AutoTokenizer.from_pretrained(smollm2_root / MODEL_NAME)
    assert base.chat_template and "<|im_start|>" in base.chat_template
    want = base.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=True)
    assert len(exported) == 3, sorted(exported)
    for kind, directory in exported.items():
        if kind == "GGUF":
            field = GGUFReader(_gguf_file(directory)).fields["tokenizer.chat_template"]
            template = bytes(field.parts[field.data[0]]).decode()
            assert template == base.chat_template, "the GGUF's tokenizer.chat_template is not the model's"
            continue
        tok = AutoTokenizer.from_pretrained(directory)
        assert tok.chat_template == base.chat_template, f"{kind}: another chat template"
        got = tok.apply_chat_template(CONVERSATION, add_generation_prompt=True, tokenize=True)
        assert got == want, f"{kind}: the conversation renders to other token ids"


def _logits(merged_dir, ids) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(merged_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def test_the_merged_model_is_the_trainers_nf4_session_with_its_adapter(
    smollm2_root, trained, exported, store
):
    merged_dir = exported["MERGED_SAFETENSORS"]
    config = json.loads((merged_dir / "config.json").read_text())
    want = trained["as_trained"]
    bound = _bound(config) * float(want.abs().max())
    delta = float((_logits(merged_dir, trained["ids"]) - want).abs().max())
    assert delta <= bound, f"merged vs the session as trained: max |Δlogit| {delta:.3g} > {bound:.3g}"
    adapter_effect = float((want - trained["base"]).abs().max())
    assert adapter_effect > 10 * bound, f"the adapter moves the logits by only {adapter_effect:.3g}"
    (on_16bit,) = run_export(
        ExportRequest(
            adapter_path=ADAPTER,
            targets=[ExportTarget.merged("float32", "merged-into-16bit")],
            merge_base=MergeBase.ORIGINAL_16BIT,
            verify=VerifyOptions(skip=True),
        ),
        model_root=smollm2_root,
        store=store,
    )
    other = float((_logits(store.path_of(on_16bit.artifact.artifact_id), trained["ids"]) - want).abs().max())
    assert other > 10 * bound, (
        f"merged into the 16-bit weights: max |Δlogit| {other:.3g}, NF4's rounding hidden"
    )
