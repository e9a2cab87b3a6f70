"""A Hugging Face tokenizer as GGUF tokenizer metadata (``tokenizer.ggml.*``), for llama.cpp; no torch.

Byte-level BPE becomes ``tokenizer.ggml.model=gpt2`` with merges and ``tokenizer.ggml.pre`` naming the
pre-tokenizer llama.cpp should apply; SentencePiece becomes ``llama`` with scores and token types (pre
``default``). The name is predicted as llama.cpp's converter does it (hash of the ids on its test text) or
from the pre-tokenizer's structure (``strop.common.pretokenizers``), then confirmed with llama.cpp's own
tokenization of edge-case text (``strop.common.gguf_pretok``): a tokenizer no llama.cpp name reproduces is
refused. Special token ids, ``add_bos_token``/``add_eos_token``, ``add_space_prefix`` and the chat template
come along. The vocabulary is padded to the model's embedding rows.

:func:`build_vocab` is the one pre-tokenizer decision: the export writes its name into every GGUF, and the
trainer's LoadModel calls it on the session's tokenizer to report the same name before training.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import gguf

from strop.common import gguf_pretok
from strop.common.errors import InvalidArgument, Unimplemented
from strop.common.gguf_metadata import GgufVocab
from strop.common.pretokenizers import Identification, predict


def _looks_special(text: str) -> bool:
    return (text.startswith("<|") and text.endswith("|>")) or text in ("<s>", "</s>", "<unk>", "<pad>")


def _token_str(v: Any) -> str | None:
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) and v else None


def _special_ids(
    tc: dict[str, Any], stm: dict[str, Any], lookup: Callable[[str], int | None], config: dict[str, Any]
) -> dict[str, int]:
    """bos/eos/unk/pad/sep ids: the token named by tokenizer_config.json (else special_tokens_map.json),
    else the id the model config gives."""
    out = {}
    for role in ("bos", "eos", "unk", "pad", "sep"):
        text = _token_str(tc.get(f"{role}_token")) or _token_str(stm.get(f"{role}_token"))
        tid = lookup(text) if text else None
        if tid is None:
            v = config.get(f"{role}_token_id")
            tid = v[0] if isinstance(v, list) and v else v
        if isinstance(tid, int) and tid >= 0:
            out[role] = tid
    return out


def _post_processor_adds(tj: dict[str, Any], tc: dict[str, Any]) -> tuple[bool, bool]:
    """(add_bos, add_eos) as the HF tokenizer applies them."""
    pp = tj.get("post_processor") or {}
    single = []
    if pp.get("type") == "TemplateProcessing":
        single = pp.get("single") or []
    elif pp.get("type") == "Sequence":
        for p in pp.get("processors") or []:
            if p.get("type") == "TemplateProcessing":
                single = p.get("single") or []
    add_bos = bool(single) and "SpecialToken" in single[0]
    add_eos = bool(single) and "SpecialToken" in single[-1] and len(single) > 1
    if isinstance(tc.get("add_bos_token"), bool) and not single:
        add_bos = tc["add_bos_token"]
    if isinstance(tc.get("add_eos_token"), bool) and not single:
        add_eos = tc["add_eos_token"]
    return add_bos, add_eos


def runtime_pipeline(tokenizer: Any, tok_dir: Path) -> dict[str, Any]:
    """The tokenizer's pipeline as transformers runs it, serialized like tokenizer.json (not necessarily the file as
    saved: transformers 5 picks the tokenizer class from the model type and some classes rebuild parts of the
    pipeline); the file itself when the tokenizer has no fast backend."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return json.loads(backend.to_str())
    if (tok_dir / "tokenizer.json").is_file():
        return json.loads((tok_dir / "tokenizer.json").read_text(encoding="utf-8"))
    return {}


def build_vocab(
    tokenizer: Any,
    tok_dir: Path,
    config: dict[str, Any],
    *,
    tokenizer_json: dict[str, Any] | None = None,
    tokenizer_config: dict[str, Any] | None = None,
    special_tokens_map: dict[str, Any] | None = None,
    chat_template: str | None = None,
) -> GgufVocab:
    """``tokenizer`` (as transformers runs it) as GGUF tokenizer metadata, padded to the model's vocab size, with
    its pre-tokenizer named and proven with llama.cpp.

    Args:
        tokenizer: the loaded transformers tokenizer (duck-typed: ``encode``, ``backend_tokenizer``).
        tok_dir: its directory (``tokenizer.model`` for SentencePiece).
        config: the model's config.json (``vocab_size``, special token ids).
        tokenizer_json: :func:`runtime_pipeline` when the caller has it.
        tokenizer_config / special_tokens_map: those files' contents ({} when absent).

    Raises:
        Unimplemented: a tokenizer kind strop cannot write, or one no llama.cpp pre-tokenizer reproduces.
        InvalidArgument: the tokenizer has more tokens than the model's embedding rows.
        ImportError: llama-cpp-python is missing (the proof needs llama.cpp).
    """
    vocab_size = int(config["vocab_size"])
    tj = tokenizer_json if tokenizer_json is not None else runtime_pipeline(tokenizer, tok_dir)
    tc = tokenizer_config or {}
    added = {int(t["id"]): t for t in tj.get("added_tokens") or []}
    for tid, t in (tc.get("added_tokens_decoder") or {}).items():
        added.setdefault(int(tid), t)
    spm = (tok_dir / "tokenizer.model").is_file()
    guess = predict(tj, tokenizer.encode, sentencepiece_model=spm)
    if not guess.gguf_writable:  # not a byte-level BPE and no tokenizer.model
        raise Unimplemented(guess.note)
    if spm:
        v = _spm_vocab(tok_dir / "tokenizer.model", added, vocab_size)
    else:
        v = _bpe_vocab(tj, added, vocab_size)
    index = {t: i for i, t in enumerate(v.tokens)}
    v.special = _special_ids(tc, special_tokens_map or {}, index.get, config)
    v.add_bos, v.add_eos = _post_processor_adds(tj, tc)
    v.chat_template = chat_template
    specials = [t for t, kind in zip(v.tokens, v.types, strict=True) if kind == int(gguf.TokenType.CONTROL)]
    found = gguf_pretok.confirm(
        v, guess, lambda text: tokenizer.encode(text, add_special_tokens=False), special_tokens=specials[:8]
    )
    v.pre, v.pre_how, v.pre_notes = found.name, str(found.how), found.notes
    v.pre_note = _decision_note(found, guess.note)
    return v


def _decision_note(found: gguf_pretok.Confirmed, predicted: str) -> str:
    """The decision in one sentence for the user (LoadModel's ``gguf_pre_tokenizer_note``)."""
    if found.how is Identification.BEHAVIOUR:
        head = f"'{found.name}': llama.cpp reproduces HF's ids with it on every edge text"
    else:
        head = f"{predicted}; llama.cpp confirmed it on the edge texts"
    return "; ".join([head, *found.notes])


def _pad(tokens: list[str], types: list[int], scores: list[float] | None, vocab_size: int, what: str) -> None:
    if len(tokens) > vocab_size:
        raise InvalidArgument(
            f"the {what} tokenizer has {len(tokens)} tokens but the model only {vocab_size} embedding rows"
        )
    for i in range(len(tokens), vocab_size):
        tokens.append(f"[PAD{i}]")
        types.append(int(gguf.TokenType.UNUSED))
        if scores is not None:
            scores.append(-1000.0)


def _bpe_vocab(tj: dict[str, Any], added: dict[int, dict[str, Any]], vocab_size: int) -> GgufVocab:
    model = tj["model"]
    id_to_tok: dict[int, str] = {int(i): t for t, i in model["vocab"].items()}
    for i, t in added.items():
        id_to_tok[i] = t["content"]
    n = max(id_to_tok) + 1
    tokens, types = [], []
    for i in range(n):
        t = id_to_tok.get(i)
        if t is None:
            tokens.append(f"[PAD{i}]")
            types.append(int(gguf.TokenType.UNUSED))
        elif i in added:
            tokens.append(t)
            special = added[i].get("special", False) or _looks_special(t)
            types.append(int(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED))
        else:
            tokens.append(t)
            types.append(int(gguf.TokenType.NORMAL))
    _pad(tokens, types, None, vocab_size, "BPE")
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges") or []]
    # the pre-tokenizer is named once the whole vocabulary (with its special ids) can be tried in llama.cpp
    return GgufVocab("gpt2", "", tokens, types, merges=merges, add_space_prefix=False)


def _spm_vocab(path: Path, added: dict[int, dict[str, Any]], vocab_size: int) -> GgufVocab:
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    try:
        proto.ParseFromString(path.read_bytes())
    except Exception as exc:
        raise InvalidArgument(f"tokenizer.model is not a SentencePiece model: {exc}") from None
    if proto.trainer_spec.model_type not in (1, 2):  # UNIGRAM=1, BPE=2
        raise Unimplemented(f"SentencePiece model type {proto.trainer_spec.model_type} is not supported")
    tokens = [p.piece for p in proto.pieces]
    scores = [float(p.score) for p in proto.pieces]
    types = [int(p.type) for p in proto.pieces]  # sentencepiece's type numbers are gguf's TokenType
    for i, t in added.items():
        while i >= len(tokens):
            tokens.append(f"[PAD{len(tokens)}]")
            scores.append(-1000.0)
            types.append(int(gguf.TokenType.UNUSED))
        text = t["content"]
        if types[i] in (int(gguf.TokenType.CONTROL), int(gguf.TokenType.UNKNOWN), int(gguf.TokenType.BYTE)):
            continue  # <s>, </s>, <unk>, <0x..>: SentencePiece already typed them
        special = t.get("special", False) or _looks_special(text)
        tokens[i] = text
        scores[i] = -1000.0
        types[i] = int(gguf.TokenType.CONTROL if special else gguf.TokenType.USER_DEFINED)
    _pad(tokens, types, scores, vocab_size, "SentencePiece")
    return GgufVocab(
        "llama",
        "default",
        tokens,
        types,
        scores=scores,
        add_space_prefix=bool(proto.normalizer_spec.add_dummy_prefix),
    )
