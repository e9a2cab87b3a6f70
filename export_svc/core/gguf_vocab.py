"""A Hugging Face tokenizer as GGUF tokenizer metadata (``tokenizer.ggml.*``), for llama.cpp.

Byte-level BPE becomes ``tokenizer.ggml.model=gpt2`` with merges and ``tokenizer.ggml.pre`` naming the
pre-tokenizer llama.cpp should apply (GPT-2's regex is ``gpt-2``; Llama 3's ``llama-bpe``; Qwen2's
``qwen2``); SentencePiece becomes ``llama`` with scores and token types. Special token ids,
``add_bos_token``/``add_eos_token``, ``add_space_prefix`` and the chat template come along. The
vocabulary is padded to the model's embedding rows.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import gguf

from strop.export_svc.core.errors import CorruptInput, UnsupportedModel
from strop.export_svc.core.hf_dir import chat_template_of
from strop.export_svc.core.sources import read_json

# Pre-tokenizer regexes (tokenizer.json `Split` patterns) → llama.cpp's `tokenizer.ggml.pre` names.
_LLAMA3_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_QWEN2_REGEX = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
_SPLIT_PRE = {_LLAMA3_REGEX: "llama-bpe", _QWEN2_REGEX: "qwen2"}


@dataclass
class GgufVocab:
    """Everything GGUF stores about a tokenizer."""

    model: str  # "gpt2" (byte-level BPE) or "llama" (SentencePiece)
    pre: str
    tokens: list[str]
    types: list[int]
    scores: list[float] | None = None
    merges: list[str] | None = None
    special: dict[str, int] = field(default_factory=dict)  # bos, eos, unk, pad, sep → id
    add_bos: bool = False
    add_eos: bool = False
    add_space_prefix: bool | None = None
    chat_template: str | None = None

    def add_to(self, w: gguf.GGUFWriter) -> None:
        w.add_tokenizer_model(self.model)
        w.add_tokenizer_pre(self.pre)
        w.add_token_list(self.tokens)
        if self.scores is not None:
            w.add_token_scores(self.scores)
        w.add_token_types(self.types)
        if self.merges is not None:
            w.add_token_merges(self.merges)
        for role, tid in self.special.items():
            getattr(w, f"add_{role}_token_id")(tid)
        w.add_add_bos_token(self.add_bos)
        w.add_add_eos_token(self.add_eos)
        if self.add_space_prefix is not None:
            w.add_add_space_prefix(self.add_space_prefix)
        if self.chat_template:
            w.add_chat_template(self.chat_template)


def _looks_special(text: str) -> bool:
    return (text.startswith("<|") and text.endswith("|>")) or text in ("<s>", "</s>", "<unk>", "<pad>")


def _token_str(v: Any) -> str | None:
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) and v else None


def detect_pre_tokenizer(tj: dict[str, Any]) -> str:
    """llama.cpp's name for a byte-level BPE's pre-tokenizer, read from tokenizer.json.

    Raises:
        UnsupportedModel: a pre-tokenizer strop cannot name for llama.cpp.
    """
    pt = tj.get("pre_tokenizer") or {}
    if pt.get("type") == "ByteLevel" and pt.get("use_regex", True) and not pt.get("add_prefix_space", False):
        return "gpt-2"
    if pt.get("type") == "Sequence":
        items = pt.get("pretokenizers") or []
        splits = [p for p in items if p.get("type") == "Split"]
        byte_level = [p for p in items if p.get("type") == "ByteLevel"]
        if len(splits) == 1 and len(byte_level) == 1 and not byte_level[0].get("use_regex", True):
            regex = (splits[0].get("pattern") or {}).get("Regex")
            if regex in _SPLIT_PRE:
                return _SPLIT_PRE[regex]
    summary = json.dumps(pt)[:200]
    raise UnsupportedModel(
        f"tokenizer pre-tokenizer {summary} has no llama.cpp name strop knows (known: gpt-2, llama-bpe, qwen2)"
    )


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


def _read_optional(tok_dir: Path, name: str) -> dict[str, Any]:
    return read_json(tok_dir / name, name) if (tok_dir / name).is_file() else {}


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


def _runtime_tokenizer_json(tok_dir: Path) -> dict[str, Any]:
    """The tokenizer as transformers actually runs it, serialized like tokenizer.json.

    Not the file as saved: transformers 5 picks the tokenizer class from the model type and some
    classes rebuild parts of the pipeline (its Qwen2 tokenizer applies Qwen2's digit-splitting regex
    whatever tokenizer.json says). llama.cpp must be told what HF does at run time.
    """
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(tok_dir), trust_remote_code=False)
        backend = getattr(tok, "backend_tokenizer", None)
        if backend is not None:
            return json.loads(backend.to_str())
    except (OSError, ValueError) as exc:
        raise CorruptInput(f"transformers cannot load the tokenizer: {exc}") from None
    if (tok_dir / "tokenizer.json").is_file():
        return read_json(tok_dir / "tokenizer.json", "tokenizer.json")
    return {}


def load_vocab(tok_dir: Path, config: dict[str, Any]) -> GgufVocab:
    """Read a HF tokenizer directory into GGUF tokenizer metadata, padded to the model's vocab size.

    Each file is read once: tokenizer_config.json feeds the added tokens, the special ids, the
    bos/eos flags and the chat template.

    Raises:
        UnsupportedModel: a tokenizer kind or pre-tokenizer llama.cpp cannot be told about.
        CorruptInput: the tokenizer has more tokens than the model's embedding rows.
    """
    vocab_size = int(config["vocab_size"])
    tj = _runtime_tokenizer_json(tok_dir)
    tc = _read_optional(tok_dir, "tokenizer_config.json")
    added = {int(t["id"]): t for t in tj.get("added_tokens") or []}
    for tid, t in (tc.get("added_tokens_decoder") or {}).items():
        added.setdefault(int(tid), t)
    if (tok_dir / "tokenizer.model").is_file():
        v = _spm_vocab(tok_dir / "tokenizer.model", added, vocab_size)
    elif (tj.get("model") or {}).get("type") == "BPE":
        v = _bpe_vocab(tj, added, vocab_size)
    else:
        kind = (tj.get("model") or {}).get("type")
        raise UnsupportedModel(
            f"tokenizer model {kind!r} cannot be written to GGUF (BPE or SentencePiece only)"
        )
    index = {t: i for i, t in enumerate(v.tokens)}
    v.special = _special_ids(tc, _read_optional(tok_dir, "special_tokens_map.json"), index.get, config)
    v.add_bos, v.add_eos = _post_processor_adds(tj, tc)
    v.chat_template = chat_template_of(tok_dir, tc)
    return v


def _pad(tokens: list[str], types: list[int], scores: list[float] | None, vocab_size: int, what: str) -> None:
    if len(tokens) > vocab_size:
        raise CorruptInput(
            f"the {what} tokenizer has {len(tokens)} tokens but the model only {vocab_size} embedding rows"
        )
    for i in range(len(tokens), vocab_size):
        tokens.append(f"[PAD{i}]")
        types.append(int(gguf.TokenType.UNUSED))
        if scores is not None:
            scores.append(-1000.0)


def _bpe_vocab(tj: dict[str, Any], added: dict[int, dict[str, Any]], vocab_size: int) -> GgufVocab:
    pre = detect_pre_tokenizer(tj)
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
    return GgufVocab("gpt2", pre, tokens, types, merges=merges, add_space_prefix=False)


def _spm_vocab(path: Path, added: dict[int, dict[str, Any]], vocab_size: int) -> GgufVocab:
    from sentencepiece import sentencepiece_model_pb2

    proto = sentencepiece_model_pb2.ModelProto()
    try:
        proto.ParseFromString(path.read_bytes())
    except Exception as exc:
        raise CorruptInput(f"tokenizer.model is not a SentencePiece model: {exc}") from None
    if proto.trainer_spec.model_type not in (1, 2):  # UNIGRAM=1, BPE=2
        raise UnsupportedModel(f"SentencePiece model type {proto.trainer_spec.model_type} is not supported")
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
