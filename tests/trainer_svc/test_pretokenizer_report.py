"""LoadModel tells the user, before training, what a GGUF export will write as llama.cpp's pre-tokenizer, or
that it may refuse: ``Session.gguf_pre_tokenizer`` and ``gguf_pre_tokenizer_note``, over real gRPC."""

from __future__ import annotations

import contextlib
import shutil

import pytest

from strop.client import FailedPreconditionError
from strop.fixtures.tokenizers_pretok import PreShape, make_pretok_tokenizer
from strop.fixtures.tokenizers_tiny import save_tokenizer

from .conftest import FAST_LORA

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model")


def _with_tokenizer(model_root, shape: PreShape) -> str:
    """tiny-llama's weights with a tokenizer of ``shape`` (640 tokens: the model's embedding rows)."""
    name = f"tiny-llama-pre-{shape.name.lower()}"
    dst = model_root / name
    if not dst.exists():
        shutil.copytree(model_root / "tiny-llama", dst)
        for f in TOKENIZER_FILES:
            (dst / f).unlink(missing_ok=True)
        save_tokenizer(make_pretok_tokenizer(shape, vocab_size=640), dst)
    return name


@contextlib.contextmanager
def _session(client, model: str):
    s = client.load_model(model)
    try:
        yield s
    finally:
        with contextlib.suppress(FailedPreconditionError):
            client.close_session(s.session_id)


def test_load_model_reports_the_gpt2_pre_tokenizer_of_the_tiny_llama(client):
    with _session(client, "tiny-llama") as s:
        assert s.gguf_pre_tokenizer == "gpt-2", "the fixture's tokenizer is ByteLevel with GPT-2's regex"
        assert "predicted from the structure" in s.gguf_pre_tokenizer_note


@pytest.mark.parametrize("shape", [PreShape.SMOLLM, PreShape.TEKKEN], ids=lambda s: s.value)
def test_load_model_names_a_pre_tokenizer_strop_used_to_refuse_after_training(client, model_root, shape):
    with _session(client, _with_tokenizer(model_root, shape)) as s:
        assert s.gguf_pre_tokenizer == shape.value
        ready = client.attach_lora(s.session_id, FAST_LORA)
        assert (ready.gguf_pre_tokenizer, ready.gguf_pre_tokenizer_note) == (
            s.gguf_pre_tokenizer,
            s.gguf_pre_tokenizer_note,
        ), "AttachLora's session carries the same report"
        stored = client.get_session(s.session_id)
        assert stored.gguf_pre_tokenizer == shape.value, "the report is part of the stored session"


def test_load_model_warns_before_training_when_no_pre_tokenizer_is_predicted(client, model_root):
    with _session(client, _with_tokenizer(model_root, PreShape.UNKNOWN)) as s:
        assert s.gguf_pre_tokenizer == ""
        note = s.gguf_pre_tokenizer_note
        assert "no llama.cpp pre-tokenizer predicted" in note and "refused if none reproduces" in note, note


def test_load_model_says_a_gguf_export_will_be_refused_for_a_tokenizer_strop_cannot_write(client, model_root):
    from strop.fixtures.tokenizers_pretok import make_spm_style_bpe

    dst = model_root / "tiny-llama-spm-style-json"
    if not dst.exists():
        shutil.copytree(model_root / "tiny-llama", dst)
        for f in TOKENIZER_FILES:
            (dst / f).unlink(missing_ok=True)
        save_tokenizer(make_spm_style_bpe(), dst)
    with _session(client, dst.name) as s:
        assert s.gguf_pre_tokenizer == ""
        assert "GGUF export will be refused" in s.gguf_pre_tokenizer_note, s.gguf_pre_tokenizer_note


def test_load_model_reports_the_name_the_export_writes_where_the_hash_and_llama_cpp_disagree(
    client, model_root, monkeypatch
):
    """The issue's case: SmolLM2's vocabulary under a plain GPT-2 ``ByteLevel`` pipeline hashes to llama.cpp's
    ``smollm`` entry, llama.cpp's ``smollm`` then splits digits where HF does not, and the export writes ``gpt-2``.
    Reproduced on a generated GPT-2-style tokenizer by injecting its hash into the table as ``smollm``: the
    session must report what the export writes, because both run one decision."""
    import json

    from strop.common import pretokenizer_table as T
    from strop.common import pretokenizers as P
    from strop.export_svc.core.gguf_tokenizer import load_vocab

    name = _with_tokenizer(model_root, PreShape.GPT2)
    tok_dir = model_root / name
    from transformers import AutoTokenizer

    monkeypatch.setitem(
        T.CHKHSH, P.chkhsh(AutoTokenizer.from_pretrained(str(tok_dir)).encode(T.CHKTXT)), "smollm"
    )
    assert P.predict_for_tokenizer(AutoTokenizer.from_pretrained(str(tok_dir))).name == "smollm", (
        "the hash says smollm"
    )
    written = load_vocab(tok_dir, json.loads((tok_dir / "config.json").read_text()))
    assert written.pre == "gpt-2", (
        "llama.cpp's smollm splits ' 42' differently from HF: the export writes gpt-2"
    )
    with _session(client, name) as s:
        assert s.gguf_pre_tokenizer == written.pre, s.gguf_pre_tokenizer_note
        assert "reproduces HF's ids" in s.gguf_pre_tokenizer_note and "smollm" in s.gguf_pre_tokenizer_note


def test_a_trainer_without_llama_cpp_reports_the_prediction_and_says_it_is_unproven(
    client, model_root, monkeypatch
):
    import sys

    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # as on the GPU image: importing it fails
    with _session(client, _with_tokenizer(model_root, PreShape.SMOLLM)) as s:
        assert s.gguf_pre_tokenizer == "smollm", "the structure still predicts the name"
        assert "predicted, not proven: llama_cpp is not installed" in s.gguf_pre_tokenizer_note, (
            s.gguf_pre_tokenizer_note
        )
