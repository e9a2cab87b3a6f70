"""A tokenizer as GGUF stores it (``tokenizer.ggml.*``): the record ``gguf_vocab`` builds from a Hugging Face
tokenizer and ``gguf_pretok`` proves with llama.cpp, and how it is written into a GGUF file."""

from __future__ import annotations

from dataclasses import dataclass, field

import gguf


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
    pre_how: str = ""  # how ``pre`` was established (``strop.common.pretokenizers.Identification``)
    # where the prediction was overruled, or the texts on which llama.cpp still differs from HF
    pre_notes: list[str] = field(default_factory=list)
    pre_note: str = ""  # the decision in one sentence (what LoadModel reports)

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
