"""Which llama.cpp pre-tokenizer (``tokenizer.ggml.pre``) reproduces a Hugging Face tokenizer (no torch).

llama.cpp splits text before BPE with a fixed set of regexes chosen by a name in the GGUF; the HF tokenizer
says what it does in its ``pre_tokenizer`` JSON. Two ways to find the name, both here and pure Python (the
trainer predicts the export's outcome at LoadModel with them, the export service starts from them):

- **by hash**, as llama.cpp's converter does: the token ids HF gives on :data:`~strop.common.pretokenizer_table.CHKTXT` (with the
  tokenizer's own special tokens), ``sha256(str(ids))``, looked up in :data:`~strop.common.pretokenizer_table.CHKHSH` — exact for the real
  checkpoints llama.cpp lists, silent for anything else (every fine-tune with a retrained vocabulary);
- **by structure**: the pre-tokenizer JSON's shape (``ByteLevel`` alone, ``Digits`` + ``ByteLevel``, a
  ``Split`` with a family's regex + ``ByteLevel``, a SentencePiece ``tokenizer.model``) → the candidate names
  whose llama.cpp regexes do the same, best first.

Neither is proof: the export service writes a vocab-only GGUF per candidate, tokenizes :func:`strop.common.gguf_pretok.edge_texts`
with llama.cpp and keeps the first name whose ids equal HF's token for token
(``strop.common.gguf_pretok``; ``strop.common.gguf_vocab.build_vocab`` is the one decision the export and
LoadModel share). The table's ``BEHAVIOURS`` lists one name per distinct llama.cpp behaviour, the candidates
tried when the structure names none.

llama.cpp's facts (the test text, the hash table, the names and which regex each selects) are
:mod:`strop.common.pretokenizer_table`'s; the edge texts of the proof are :mod:`strop.common.gguf_pretok`'s.
"""

from __future__ import annotations

import enum
import hashlib
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from strop.common.pretokenizer_table import CHKHSH, CHKTXT, SPLIT_REGEX_NAMES, SPM_PRE


class Identification(enum.StrEnum):
    """How a pre-tokenizer name was found."""

    NONE = "none"  # no name: GGUF export is refused unless llama.cpp reproduces HF with a name tried by behaviour
    HASH = "hash"  # the ids on CHKTXT hash to an entry of llama.cpp's table (a checkpoint llama.cpp lists)
    STRUCTURE = "structure"  # predicted from the pre-tokenizer JSON; the export confirms it with llama.cpp
    SENTENCEPIECE = (
        "sentencepiece"  # a SentencePiece tokenizer.model: llama.cpp's SPM vocabulary, pre "default"
    )
    BEHAVIOUR = "behaviour"  # llama.cpp's ids equal HF's on every edge text (set by the export service only)


@dataclass(frozen=True)
class PreTokenizerGuess:
    """What the pure-Python identification says, before (or without) llama.cpp.

    Attributes:
        name: the name to write (empty when none is predicted).
        how: how it was found.
        candidates: every name worth confirming with llama.cpp, best first (``name`` first when set).
        chkhsh: the hash of HF's ids on :data:`CHKTXT` (empty when not computed).
        note: a sentence for the user: what was found, or why GGUF export may be refused.
        gguf_writable: False when strop cannot write this tokenizer to GGUF at all (not BPE, no tokenizer.model).
    """

    name: str = ""
    how: Identification = Identification.NONE
    candidates: tuple[str, ...] = ()
    chkhsh: str = ""
    note: str = ""
    gguf_writable: bool = True


def chkhsh(ids: Sequence[int]) -> str:
    """llama.cpp's converter hash of a token id list: sha256 of its Python ``str`` (``"[1, 2, 3]"``)."""
    return hashlib.sha256(str([int(i) for i in ids]).encode()).hexdigest()


def _items(pt: dict[str, Any] | None) -> list[dict[str, Any]]:
    if not pt:
        return []
    if pt.get("type") == "Sequence":
        return [p for p in pt.get("pretokenizers") or [] if isinstance(p, dict)]
    return [pt]


def _split_regex(p: dict[str, Any]) -> str | None:
    pattern = p.get("pattern") or {}
    return pattern.get("Regex") if isinstance(pattern, dict) else None


def structural_candidates(tj: dict[str, Any]) -> tuple[tuple[str, ...], str]:
    """Candidate names for a byte-level BPE's pre-tokenizer JSON, best first, and a phrase saying why.

    An empty tuple: no shape strop recognises (the export then tries every name of the table's ``BEHAVIOURS``).
    """
    model = tj.get("model") or {}
    items = _items(tj.get("pre_tokenizer"))
    types = [p.get("type") for p in items]
    byte_level = [p for p in items if p.get("type") == "ByteLevel"]
    if len(byte_level) != 1 or types[-1] != "ByteLevel" or byte_level[0].get("add_prefix_space", False):
        return (
            (),
            f"pre-tokenizer {_summary(tj.get('pre_tokenizer'))} is not a byte-level BPE shape strop recognises",
        )
    bl_regex = byte_level[0].get("use_regex", True)
    rest = items[:-1]
    ignore_merges = bool(model.get("ignore_merges", False))
    if not rest and bl_regex:
        return ("gpt-2",), "ByteLevel with GPT-2's regex"
    if (
        len(rest) == 1
        and rest[0].get("type") == "Digits"
        and rest[0].get("individual_digits", False)
        and bl_regex
    ):
        return ("smollm",), "Digits (one by one) then ByteLevel with GPT-2's regex"
    if len(rest) == 1 and rest[0].get("type") == "Split" and not bl_regex:
        regex = _split_regex(rest[0])
        names = SPLIT_REGEX_NAMES.get(regex or "")
        if names:
            if names == ("llama-bpe", "smaug-bpe") and not ignore_merges:
                names = ("smaug-bpe", "llama-bpe")
            return names, "Split with a known family regex then ByteLevel"
        return (), f"Split regex {regex!r} is none of the family regexes strop knows"
    return (), f"pre-tokenizer {_summary(tj.get('pre_tokenizer'))} is not a shape strop recognises"


def _sentencepiece_style(tj: dict[str, Any]) -> bool:
    """A BPE that works on '▁'-joined text with byte fallback (Llama 2 / Mistral v0.1 converted to
    tokenizer.json), not on GPT-2's byte-level alphabet: llama.cpp reads those as SPM, not gpt2."""
    if (tj.get("model") or {}).get("byte_fallback"):
        return True
    if any(p.get("type") == "Metaspace" for p in _items(tj.get("pre_tokenizer"))):
        return True
    norm = tj.get("normalizer") or {}
    parts = (norm.get("normalizers") or []) if norm.get("type") == "Sequence" else [norm]
    return any(
        p.get("type") in ("Prepend", "Replace") and "▁" in json.dumps(p, ensure_ascii=False) for p in parts
    )


def _summary(pt: Any) -> str:
    return json.dumps(pt)[:160] if pt else "none"


def predict(
    tokenizer_json: dict[str, Any],
    encode: Callable[[str], list[int]] | None = None,
    *,
    sentencepiece_model: bool = False,
) -> PreTokenizerGuess:
    """The pre-tokenizer name llama.cpp should get for a tokenizer, without llama.cpp.

    Args:
        tokenizer_json: the tokenizer as transformers runs it (``backend_tokenizer.to_str()``), not
            necessarily the file as saved.
        encode: HF's ``tokenizer.encode`` (with its default special tokens, as llama.cpp's converter calls
            it), for the hash lookup; None skips it.
        sentencepiece_model: the directory has a ``tokenizer.model`` (strop writes llama.cpp's SPM vocabulary
            from it, where the pre-tokenizer is always ``default``).
    """
    if sentencepiece_model:
        return PreTokenizerGuess(
            SPM_PRE,
            Identification.SENTENCEPIECE,
            (SPM_PRE,),
            note="SentencePiece tokenizer.model: llama.cpp's SPM vocabulary (pre-tokenizer 'default')",
        )
    kind = (tokenizer_json.get("model") or {}).get("type")
    if kind != "BPE":
        return PreTokenizerGuess(
            note=f"tokenizer model {kind!r} without a tokenizer.model: GGUF export will be refused "
            "(strop writes byte-level BPE or SentencePiece vocabularies)",
            gguf_writable=False,
        )
    if _sentencepiece_style(tokenizer_json):
        return PreTokenizerGuess(
            note="SentencePiece-style BPE (byte fallback, '▁' for spaces) without a tokenizer.model: GGUF export "
            "will be refused (strop writes llama.cpp's SentencePiece vocabulary from tokenizer.model)",
            gguf_writable=False,
        )
    h = chkhsh(encode(CHKTXT)) if encode is not None else ""
    structural, why = structural_candidates(tokenizer_json)
    if h in CHKHSH:
        name = CHKHSH[h]
        rest = tuple(c for c in structural if c != name)
        return PreTokenizerGuess(
            name,
            Identification.HASH,
            (name, *rest),
            h,
            note=f"'{name}': its ids on llama.cpp's test text hash to llama.cpp's entry for that name",
        )
    if structural:
        return PreTokenizerGuess(
            structural[0],
            Identification.STRUCTURE,
            structural,
            h,
            note=f"'{structural[0]}' predicted from the structure ({why}); the export confirms it with "
            "llama.cpp's own tokenization before writing GGUF",
        )
    return PreTokenizerGuess(
        chkhsh=h,
        note=f"no llama.cpp pre-tokenizer predicted ({why}; its test-text hash {h[:12] or '-'}… is not in "
        "llama.cpp's table): the GGUF export tries each of llama.cpp's pre-tokenizers on edge-case text and is "
        "refused if none reproduces HF's token ids",
    )


def predict_for_tokenizer(tokenizer: Any, *, sentencepiece_model: bool = False) -> PreTokenizerGuess:
    """:func:`predict` for a loaded transformers tokenizer (duck-typed: ``backend_tokenizer``, ``encode``)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    tj = json.loads(backend.to_str()) if backend is not None else {}
    return predict(tj, tokenizer.encode, sentencepiece_model=sentencepiece_model)
