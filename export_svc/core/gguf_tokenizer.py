"""The export's GGUF tokenizer metadata: a tokenizer directory read as transformers runs it, into
:class:`strop.common.gguf_metadata.GgufVocab` by ``strop.common.gguf_vocab``'s builders (which hold the
pre-tokenizer decision, shared with the trainer's LoadModel report).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from strop.common.errors import InvalidArgument, Unimplemented
from strop.common.gguf_metadata import GgufVocab
from strop.common.gguf_vocab import build_vocab, runtime_pipeline
from strop.export_svc.core.base_source import read_json
from strop.export_svc.core.errors import CorruptInput, UnsupportedModel
from strop.export_svc.core.hf_dir import chat_template_of

__all__ = ["load_vocab"]


def _read_optional(tok_dir: Path, name: str) -> dict[str, Any]:
    return read_json(tok_dir / name, name) if (tok_dir / name).is_file() else {}


def _runtime_tokenizer(tok_dir: Path) -> tuple[Any, dict[str, Any]]:
    """The tokenizer as transformers actually runs it, and its pipeline serialized like tokenizer.json.

    Not the file as saved: transformers 5 picks the tokenizer class from the model type and some
    classes rebuild parts of the pipeline (its Qwen2 tokenizer applies Qwen2's digit-splitting regex
    whatever tokenizer.json says). llama.cpp must be told what HF does at run time.
    """
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(tok_dir), trust_remote_code=False)
        return tok, runtime_pipeline(tok, tok_dir)
    except (OSError, ValueError) as exc:
        raise CorruptInput(f"transformers cannot load the tokenizer: {exc}") from None


def load_vocab(tok_dir: Path, config: dict[str, Any]) -> GgufVocab:
    """Read a HF tokenizer directory into GGUF tokenizer metadata, padded to the model's vocab size
    (:func:`strop.common.gguf_vocab.build_vocab` on the tokenizer transformers loads from ``tok_dir``).

    Each file is read once: tokenizer_config.json feeds the added tokens, the special ids, the
    bos/eos flags and the chat template.

    Raises:
        UnsupportedModel: a tokenizer kind strop cannot write, or one no llama.cpp pre-tokenizer reproduces.
        CorruptInput: the tokenizer has more tokens than the model's embedding rows.
    """
    tok, tj = _runtime_tokenizer(tok_dir)
    tc = _read_optional(tok_dir, "tokenizer_config.json")
    try:
        return build_vocab(
            tok,
            tok_dir,
            config,
            tokenizer_json=tj,
            tokenizer_config=tc,
            special_tokens_map=_read_optional(tok_dir, "special_tokens_map.json"),
            chat_template=chat_template_of(tok_dir, tc),
        )
    except Unimplemented as exc:
        raise UnsupportedModel(str(exc)) from None
    except InvalidArgument as exc:
        raise CorruptInput(str(exc)) from None
