"""Confirm a pre-tokenizer name with llama.cpp itself: the name whose ids equal HF's on every edge text.

For each candidate (:func:`strop.common.pretokenizers.predict`'s, then one name per llama.cpp behaviour), the
vocabulary is written as a vocab-only GGUF (tokenizer metadata and the few hyperparameters llama.cpp's loader
reads; no tensors), loaded with ``vocab_only`` through llama-cpp-python's low-level API, and every text of
:func:`edge_texts` is tokenized with special tokens parsed and none added — as HF
tokenizes them with ``add_special_tokens=False``. The first name that reproduces HF token for token wins; a
name this llama.cpp does not know fails to load and is skipped. When none matches, the export is refused with
what was tried and, for each name, the first text on which it differs.

Shared by the export (which writes the name) and the trainer's LoadModel (which reports it before training):
one decision, :func:`strop.common.gguf_vocab.build_vocab`, proven the same way in both.
"""

from __future__ import annotations

import logging
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import gguf

from strop.common.errors import Unimplemented
from strop.common.gguf_metadata import GgufVocab
from strop.common.pretokenizer_table import BEHAVIOURS, CHKTXT
from strop.common.pretokenizers import Identification, PreTokenizerGuess

log = logging.getLogger("strop.pretokenizer")

# Edge cases llama.cpp and HF must tokenize alike (the GGUF verification's held-out text is ordinary prose).
EDGE_TEXTS: tuple[str, ...] = (
    "  42  ",
    "\n\n\t x",
    "a  b   c    d",
    "x\t\ty \t z",
    "   leading spaces",
    "trailing spaces   ",
    "\n \n\n \n\n\n \t \t\t \t\n  \n   \n",
    "3 33 333 3333 33333 333333 3333333 33333333",
    "1234567890123 and 3.14159, 2,718 or v1.2.3-rc4",
    "3.3 3..3 3...3 ------======= ''''''```````\"\"\"\"......!!!!!!??????",
    "I've been 'told he's there, 'RE you sure? 'M not sure I'll make it, 'D you like some tea? We'Ve a'lL",
    "Hello, world! How are you?? (fine) [ok] {yes} <no> #tag @user $5 50% a&b a|b ~x ^y",
    "café naïve résumé Ångström façade Übermaß",
    "我想在apple工作1314151天～ 日本語のテキスト",
    "нещо на Български, Ελληνικά κείμενα",
    "🚀 (normal) 😶\u200d🌫️ (multiple emojis concatenated) ✅ 🦙🦙 👍🏽",
    "def f(x):\n    return x ** 2  # square\n\n\nclass A:\n\tpass\n",
    'if (a && b) { return c[i]; }\n  console.log("hi");\r\n',
    "CamelCaseWord HTTPServer iPhone ALLCAPS lowercase",
    "path/to/file.txt https://example.com/a?b=c&d=e",
)


def edge_texts(special_tokens: Sequence[str] = ()) -> list[str]:
    """:data:`EDGE_TEXTS`, llama.cpp's test text (``pretokenizer_table.CHKTXT``), and for each of the tokenizer's
    special tokens a text that wraps it."""
    out = [*EDGE_TEXTS, CHKTXT]
    for s in special_tokens:
        out.append(f"{s}user\nWhat is 2+2?{s}\n {s} x")
    return out


@dataclass
class Trial:
    """One candidate name and what llama.cpp did with it."""

    name: str
    loaded: bool = True  # False: this llama.cpp does not know the name (or refused the vocabulary)
    mismatch: str | None = None  # the first text whose ids differ
    mismatches: list[str] = field(default_factory=list)  # every text whose ids differ
    hf_ids: list[int] = field(default_factory=list)
    llama_ids: list[int] = field(default_factory=list)

    @property
    def matches(self) -> bool:
        return self.loaded and self.mismatch is None

    def describe(self) -> str:
        if not self.loaded:
            return f"{self.name}: not known to this llama.cpp"
        if self.mismatch is None:
            return f"{self.name}: reproduces HF"
        return f"{self.name}: differs on {self.mismatch!r} (HF {self.hf_ids[:12]} vs llama.cpp {self.llama_ids[:12]})"


@dataclass
class Confirmed:
    """The name to write, how it was established, and every trial made."""

    name: str
    how: Identification
    trials: list[Trial]
    notes: list[str] = field(default_factory=list)


def write_vocab_only(path: Path, vocab: GgufVocab) -> None:
    """A GGUF holding only ``vocab``'s tokenizer metadata and the hyperparameters a ``llama`` loader requires."""
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(64)
    w.add_embedding_length(8)
    w.add_block_count(1)
    w.add_feed_forward_length(8)
    w.add_head_count(1)
    w.add_head_count_kv(1)
    w.add_layer_norm_rms_eps(1e-5)
    vocab.add_to(w)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def llama_cpp_tokenize(path: Path, texts: Sequence[str]) -> list[list[int]] | None:
    """llama.cpp's ids for each text (special tokens parsed, none added), or None if it refuses the file."""
    import llama_cpp
    from llama_cpp._utils import suppress_stdout_stderr

    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    with suppress_stdout_stderr(disable=False):  # llama.cpp logs every load to stderr
        model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        return None
    try:
        vocab = llama_cpp.llama_model_get_vocab(model)
        out = []
        for text in texts:
            raw = text.encode("utf-8")
            cap = len(raw) + 16
            buf = (llama_cpp.llama_token * cap)()
            n = llama_cpp.llama_tokenize(vocab, raw, len(raw), buf, cap, False, True)
            if n < 0:  # more tokens than bytes + 16 cannot happen for these vocabularies; say so if it does
                raise RuntimeError(f"llama.cpp wants {-n} tokens for {text!r}")
            out.append([int(t) for t in buf[:n]])
        return out
    finally:
        llama_cpp.llama_model_free(model)


def try_names(
    vocab: GgufVocab,
    names: Sequence[str],
    texts: Sequence[str],
    hf_ids: Sequence[list[int]],
    *,
    stop_at_match: bool = True,
) -> list[Trial]:
    """Write ``vocab`` under each name and compare llama.cpp's ids with HF's text by text."""
    trials = []
    with tempfile.TemporaryDirectory(prefix="strop-pretok-") as tmp:
        for name in names:
            path = Path(tmp) / f"{len(trials)}.gguf"
            write_vocab_only(path, replace(vocab, pre=name))
            got = llama_cpp_tokenize(path, texts)
            trial = Trial(name, loaded=got is not None)
            if got is not None:
                for text, want, have in zip(texts, hf_ids, got, strict=True):
                    if list(want) != have:
                        if trial.mismatch is None:
                            trial.mismatch, trial.hf_ids, trial.llama_ids = text, list(want), have
                        trial.mismatches.append(text)
            trials.append(trial)
            path.unlink(missing_ok=True)
            if stop_at_match and trial.matches:
                break
    return trials


def confirm(
    vocab: GgufVocab,
    guess: PreTokenizerGuess,
    hf_encode: Callable[[str], list[int]],
    *,
    special_tokens: Sequence[str] = (),
    fallback: Sequence[str] = BEHAVIOURS,
) -> Confirmed:
    """The llama.cpp name that reproduces HF's ids for ``vocab``.

    Candidates are ``guess.candidates`` first, then ``fallback``'s names not yet tried. Two cases write a
    name that differs on some edge text, with a note listing those texts, because no name can do better:

    - a SentencePiece vocabulary: llama.cpp's SPM tokenizer has no pre-tokenizer choice (``default``); it
      always adds the dummy-prefix space, where transformers' Metaspace skips it before leading whitespace;
    - a name found by hash that llama.cpp loads, when no other name reproduces HF: it is what llama.cpp's
      own converter writes for that checkpoint.

    Raises:
        Unimplemented: no name reproduces HF's ids (the message lists each name tried and where it differs).
        ImportError: llama-cpp-python is not installed (the trainer's image may lack it).
    """
    texts = edge_texts(special_tokens)
    hf_ids = [list(hf_encode(t)) for t in texts]
    spm = vocab.model == "llama"
    names = list(guess.candidates)
    if not spm:
        names += [n for n in fallback if n not in names]
    trials = try_names(vocab, names, texts, hf_ids)
    if spm and trials[0].loaded:
        t = trials[0]
        notes = (
            [] if t.matches else [f"llama.cpp's SentencePiece tokenizer differs from HF on {t.mismatches!r}"]
        )
        return Confirmed(guess.name or "default", Identification.SENTENCEPIECE, trials, notes)
    hit = next((t for t in trials if t.matches), None)
    if hit is not None:
        how = (
            guess.how
            if hit.name == guess.name and guess.how is not Identification.NONE
            else Identification.BEHAVIOUR
        )
        notes = [] if hit.name == guess.name else [f"predicted {guess.name or 'nothing'}; {hit.describe()}"]
        log.info("pre-tokenizer %s (%s) after %d trial(s)", hit.name, how, len(trials))
        return Confirmed(hit.name, how, trials, notes)
    by_hash = next((t for t in trials if t.name == guess.name and t.loaded), None)
    if guess.how is Identification.HASH and by_hash is not None:
        return Confirmed(
            guess.name,
            Identification.HASH,
            trials,
            [
                f"llama.cpp's converter names this tokenizer {guess.name!r} (hash); it differs from HF on "
                f"{by_hash.mismatches!r}"
            ],
        )
    tried = "; ".join(t.describe() for t in trials)
    kind = "SentencePiece" if spm else "byte-level BPE"
    raise Unimplemented(
        f"no llama.cpp pre-tokenizer reproduces this {kind} tokenizer's ids, so GGUF export is refused "
        f"({guess.note}). Tried: {tried}"
    )
