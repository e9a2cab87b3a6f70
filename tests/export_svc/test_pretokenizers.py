"""Every llama.cpp pre-tokenizer shape of the supported families, checked token for token against llama.cpp.

Tokenizers are generated here (``strop.fixtures.tokenizers_pretok``, the SentencePiece one from
``tokenizers_tiny``); each is read by the export's ``load_vocab``, which names the pre-tokenizer, and the
name is then checked independently: a vocab-only GGUF with that name is tokenized by llama.cpp on every edge
text (whitespace runs, digits, punctuation, accents, CJK, emoji, code, special tokens, llama.cpp's own test
text) and must give HF's ids. A real checkpoint's hash cannot be produced offline, so the hash path is
tested with the hash of a generated tokenizer injected into the table.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest

from strop.common import gguf_pretok
from strop.common import pretokenizer_table as T
from strop.common import pretokenizers as P
from strop.export_svc.core.errors import UnsupportedModel
from strop.export_svc.core.gguf_tokenizer import load_vocab
from strop.fixtures.tokenizers_pretok import PreShape, make_pretok_tokenizer
from strop.fixtures.tokenizers_tiny import make_spm_tokenizer, save_tokenizer

NAMED_SHAPES = [s for s in PreShape if s is not PreShape.UNKNOWN]


@pytest.fixture(scope="module")
def tok_dirs(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("pretok")
    out = {}
    for shape in PreShape:
        out[shape.name] = root / shape.name
        save_tokenizer(make_pretok_tokenizer(shape), out[shape.name])
    out["SPM"] = root / "SPM"
    save_tokenizer(make_spm_tokenizer(), out["SPM"])
    return out


def _hf(tok_dir: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tok_dir))


def _config(tok_dir: Path) -> dict:
    return {"vocab_size": len(_hf(tok_dir)) + 5}  # embedding rows beyond the tokenizer are padded


def _control_tokens(vocab) -> list[str]:
    return [t for t, kind in zip(vocab.tokens, vocab.types, strict=True) if kind == 3]  # gguf CONTROL


def _llama_cpp_vs_hf(vocab, tok_dir: Path, name: str) -> list[gguf_pretok.Trial]:
    hf = _hf(tok_dir)
    texts = gguf_pretok.edge_texts(_control_tokens(vocab))
    hf_ids = [hf.encode(t, add_special_tokens=False) for t in texts]
    return gguf_pretok.try_names(vocab, [name], texts, hf_ids)


@pytest.mark.parametrize("shape", NAMED_SHAPES, ids=lambda s: s.value)
def test_each_pre_tokenizer_shape_gets_the_llama_cpp_name_that_reproduces_hf_token_for_token(tok_dirs, shape):
    v = load_vocab(tok_dirs[shape.name], _config(tok_dirs[shape.name]))
    assert (v.model, v.pre) == ("gpt2", shape.value), (
        f"{shape.name}'s pre-tokenizer is llama.cpp's {shape.value}"
    )
    assert v.pre_how == "structure", "a generated vocabulary's hash is in no table: the structure names it"
    assert v.pre_notes == [], "the predicted name was confirmed, nothing overruled"
    (trial,) = _llama_cpp_vs_hf(v, tok_dirs[shape.name], v.pre)
    assert trial.loaded, f"llama.cpp knows {v.pre!r}"
    assert trial.mismatches == [], (
        f"llama.cpp with {v.pre!r} must give HF's ids on every edge text: {trial.describe()}"
    )


@pytest.mark.parametrize(
    ("shape", "wrong", "text"),
    [
        # the case: a digit-splitting vocabulary written as gpt-2 merges " 42" where HF splits digits
        (PreShape.SMOLLM, "gpt-2", "  42  "),
        (PreShape.GPT2, "smollm", "  42  "),
        (PreShape.LLAMA3, "gpt-2", "3 33 333 3333 33333 333333 3333333 33333333"),
        (
            PreShape.QWEN2,
            "gpt-2",
            gguf_pretok.EDGE_TEXTS[10],
        ),  # contractions in upper case: (?i:'s|…) vs 's|…
        (
            PreShape.TEKKEN,
            "seed-coder",
            gguf_pretok.EDGE_TEXTS[16],
        ),  # code: seed-coder keeps \r\n out of punctuation runs
    ],
    ids=lambda x: x if isinstance(x, str) and len(x) < 12 else None,
)
def test_the_edge_texts_catch_a_name_that_tokenizes_differently(tok_dirs, shape, wrong, text):
    """A name that looks plausible but splits differently is caught on the edge text that shows it."""
    v = load_vocab(tok_dirs[shape.name], _config(tok_dirs[shape.name]))
    (trial,) = _llama_cpp_vs_hf(v, tok_dirs[shape.name], wrong)
    assert trial.loaded
    assert trial.mismatch == text, (
        f"{wrong} on a {shape.name} vocabulary first differs on {text!r}: {trial.describe()}"
    )


def test_sentencepiece_with_byte_fallback_is_llama_cpps_spm_vocabulary_and_matches_hf(tok_dirs):
    v = load_vocab(tok_dirs["SPM"], _config(tok_dirs["SPM"]))
    assert (v.model, v.pre, v.pre_how) == ("llama", "default", "sentencepiece")
    (trial,) = _llama_cpp_vs_hf(v, tok_dirs["SPM"], "default")
    specials = _control_tokens(v)
    # llama.cpp's SPM always adds the dummy-prefix "▁"; transformers' Metaspace skips it before leading
    # whitespace and after a special token. Those texts, and only those, differ, and the note lists them.
    for text in trial.mismatches:
        assert text[0].isspace() or any(s in text for s in specials), text
    assert v.pre_notes == [f"llama.cpp's SentencePiece tokenizer differs from HF on {trial.mismatches!r}"]
    same = set(gguf_pretok.edge_texts(specials)) - set(trial.mismatches)
    for text in (
        "3 33 333 3333 33333 333333 3333333 33333333",
        gguf_pretok.EDGE_TEXTS[13],
        gguf_pretok.EDGE_TEXTS[15],
        T.CHKTXT,
    ):
        assert text in same, f"digits, CJK and emoji (byte fallback) tokenize alike: {text!r}"


def test_a_tokenizer_no_llama_cpp_name_reproduces_is_refused_listing_what_was_tried(tok_dirs):
    d = tok_dirs["UNKNOWN"]
    with pytest.raises(UnsupportedModel) as err:
        load_vocab(d, _config(d))
    msg = str(err.value)
    assert "GGUF export is refused" in msg
    for name in T.BEHAVIOURS:
        assert f"{name}: " in msg, f"{name} was tried and its outcome reported"
    assert "gpt-2: differs on '  42  '" in msg, "each trial names the first text on which it differs"


def test_a_name_this_llama_cpp_does_not_know_is_skipped_and_the_next_candidate_confirmed(tok_dirs):
    d = tok_dirs["GPT2"]
    v = load_vocab(d, _config(d))
    hf = _hf(d)
    guess = P.PreTokenizerGuess("no-such-pre", P.Identification.STRUCTURE, ("no-such-pre", "gpt-2"))
    found = gguf_pretok.confirm(v, guess, lambda t: hf.encode(t, add_special_tokens=False), fallback=())
    assert [t.loaded for t in found.trials] == [False, True], (
        "llama.cpp refuses an unknown pre-tokenizer name"
    )
    assert (found.name, found.how) == ("gpt-2", P.Identification.BEHAVIOUR)
    assert found.notes and "no-such-pre" in found.notes[0]


def test_the_hash_is_llama_cpps_sha256_of_the_id_list_text():
    assert P.chkhsh([1, 22, 333]) == hashlib.sha256(b"[1, 22, 333]").hexdigest()
    assert T.CHKHSH["0ef9807a4087ebef797fc749390439009c3b9eda9ad1a097abbe738f486c01e5"] == "llama-bpe"
    assert T.CHKHSH["855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249"] == "smollm"
    assert T.CHKHSH["63b97e4253352e6f357cc59ea5b583e3a680eaeaf2632188c2b952de2588485e"] == "tekken"
    assert T.CHKHSH["e636dc30a262dcc0d8c323492e32ae2b70728f4df7dfe9737d9f920a282b8aea"] == "qwen2"
    # listed for mpt then olmo: the converter's chain of ifs keeps the last
    assert T.CHKHSH["b6dc8df998e1cfbdc4eac8243701a65afe638679230920b50d6f17d81c098166"] == "olmo"


def test_a_hash_in_the_table_names_the_pre_tokenizer_before_the_structure(tok_dirs, monkeypatch):
    """The table lookup, with the hash of a generated tokenizer injected (no real checkpoint offline)."""
    d = tok_dirs["LLAMA3"]
    hf = _hf(d)
    h = P.chkhsh(hf.encode(T.CHKTXT))
    assert P.predict_for_tokenizer(hf).how is P.Identification.STRUCTURE, "not in the table as shipped"
    monkeypatch.setitem(T.CHKHSH, h, "smaug-bpe")
    guess = P.predict_for_tokenizer(hf)
    assert (guess.name, guess.how, guess.chkhsh) == ("smaug-bpe", P.Identification.HASH, h)
    assert guess.candidates == ("smaug-bpe", "llama-bpe"), "the structure's candidates follow the hash's"
    v = load_vocab(d, _config(d))
    assert (v.pre, v.pre_how) == ("smaug-bpe", "hash"), (
        "llama.cpp confirms the hash's name on every edge text"
    )


def test_a_hash_entry_llama_cpp_contradicts_is_overruled_by_the_name_that_reproduces_hf(
    tok_dirs, monkeypatch
):
    d = tok_dirs["SMOLLM"]
    monkeypatch.setitem(T.CHKHSH, P.chkhsh(_hf(d).encode(T.CHKTXT)), "gpt-2")
    v = load_vocab(d, _config(d))
    assert (v.pre, v.pre_how) == ("smollm", "behaviour")
    assert v.pre_notes[0].startswith("predicted gpt-2; smollm: reproduces HF")


def test_the_structure_alone_predicts_each_family_shape(tok_dirs):
    for shape in NAMED_SHAPES:
        guess = P.predict_for_tokenizer(_hf(tok_dirs[shape.name]))
        assert (guess.name, guess.how) == (shape.value, P.Identification.STRUCTURE), shape
    unknown = P.predict_for_tokenizer(_hf(tok_dirs["UNKNOWN"]))
    assert (unknown.name, unknown.how, unknown.gguf_writable) == ("", P.Identification.NONE, True)
    assert "refused if none reproduces" in unknown.note
    unigram = P.predict({"model": {"type": "Unigram"}, "pre_tokenizer": {"type": "Metaspace"}})
    assert not unigram.gguf_writable and "will be refused" in unigram.note
    spm = P.predict({}, sentencepiece_model=True)
    assert (spm.name, spm.how) == ("default", P.Identification.SENTENCEPIECE)


def test_a_sentencepiece_style_bpe_without_tokenizer_model_is_refused_before_any_llama_cpp_trial(tmp_path):
    from strop.fixtures.tokenizers_pretok import make_spm_style_bpe

    tok = make_spm_style_bpe()
    save_tokenizer(tok, tmp_path)
    assert not (tmp_path / "tokenizer.model").exists()
    guess = P.predict_for_tokenizer(_hf(tmp_path))
    assert not guess.gguf_writable, "a '▁'-alphabet BPE is no gpt2 vocabulary for llama.cpp"
    with pytest.raises(UnsupportedModel, match=r"without a tokenizer\.model: GGUF export will be refused"):
        load_vocab(tmp_path, _config(tmp_path))
