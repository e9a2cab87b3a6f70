"""What a saved adapter directory carries of its base's tokenizer: every file the exporter copies too (one list,
``strop.common.adapter_base.TOKENIZER_FILES``), so the directory loads its tokenizer on its own."""

from __future__ import annotations

import json

from transformers import AutoTokenizer

from strop.common.adapter_base import TOKENIZER_FILES
from strop.trainer_svc.core.adapter_files import copy_tokenizer_files


def test_an_adapter_carries_a_slow_bpe_tokenizers_vocab_and_merges(tmp_path):
    # a byte-level BPE tokenizer saved without tokenizer.json: vocab.json and merges.txt are all of it
    base, adapter = tmp_path / "base", tmp_path / "adapter"
    base.mkdir(), adapter.mkdir()
    vocab = {"<|endoftext|>": 0, "a": 1, "b": 2, "ab": 3, "Ġ": 4}
    (base / "vocab.json").write_text(json.dumps(vocab))
    (base / "merges.txt").write_text("#version: 0.2\na b\n")
    (base / "tokenizer_config.json").write_text(
        '{"tokenizer_class": "GPT2Tokenizer", "model_max_length": 64}'
    )
    (base / "model.safetensors").write_bytes(b"not a tokenizer file")
    copy_tokenizer_files(base, adapter)
    assert {p.name for p in adapter.iterdir()} == {"vocab.json", "merges.txt", "tokenizer_config.json"}
    assert {p.name for p in adapter.iterdir()} <= set(TOKENIZER_FILES)
    from_adapter = AutoTokenizer.from_pretrained(adapter, use_fast=False)
    from_base = AutoTokenizer.from_pretrained(base, use_fast=False)
    assert from_adapter("ab ab")["input_ids"] == from_base("ab ab")["input_ids"] != []
