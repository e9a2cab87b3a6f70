"""The base an adapter was trained on, recorded in the adapter's own directory (``strop_base.json``).

An adapter trained on a base the trainer quantized to NF4 on load learned against those NF4 weights, not the
16-bit ones stored: merged into (or served on) the 16-bit weights it is another model. The artifact store's
metadata says so for artifacts, but an adapter directory travels without it (downloaded, copied to a model root,
re-exported as a PEFT dir, handed to vLLM). So every adapter directory strop writes carries this record beside
``adapter_config.json``: the trainer's adapters and checkpoints, and the export's PEFT dirs. Its keys are the
artifact metadata's own (``base_model``, ``base_quantization``, ``base_architecture``, ``base_quant.*`` with the
settings and the digest of the trainer's codes) and, when the trainer's scale statistics travel too, the file that
holds them (``base_quant.stats_file``, :data:`NF4_STATS_FILE`). The exporter reads it for every adapter it is
given, by artifact id or by path, and re-creates the model as trained from it.

Torch-free and grpc-free: the trainer writes it, the exporter reads and writes it (the services share no code but
``strop.common``).
"""

from __future__ import annotations

import json
from pathlib import Path

from strop.common.errors import InvalidArgument

BASE_RECORD_FILE = "strop_base.json"
# A Hugging Face tokenizer's files: what an adapter directory carries of its base's (the trainer's adapters and
# checkpoints, the export's PEFT dirs) and what a merged export copies, so each directory loads on its own
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "vocab.json",
    "merges.txt",
)
NF4_STATS_FILE = "base_quant_stats.safetensors"  # the trainer's NF4 scale statistics, by base weight name
FORMAT = "strop.adapter_base/1"
_KEYS = ("base_model", "base_quantization", "base_architecture")
_PREFIX = "base_quant."


def base_record(metadata: dict[str, str]) -> dict[str, str]:
    """The base's part of an adapter's metadata: the keys :data:`BASE_RECORD_FILE` holds."""
    return {k: str(v) for k, v in metadata.items() if k in _KEYS or k.startswith(_PREFIX)}


def write_base_record(adapter_dir: Path, metadata: dict[str, str]) -> None:
    """Write ``adapter_dir/strop_base.json`` from ``metadata`` (the base's keys only); names the stats file when
    ``adapter_dir`` holds one."""
    record = base_record(metadata)
    record.pop(_PREFIX + "stats_file", None)
    if (Path(adapter_dir) / NF4_STATS_FILE).is_file():
        record[_PREFIX + "stats_file"] = NF4_STATS_FILE
    (Path(adapter_dir) / BASE_RECORD_FILE).write_text(
        json.dumps({"format": FORMAT, **dict(sorted(record.items()))}, indent=2) + "\n", encoding="utf-8"
    )


def read_base_record(adapter_dir: Path) -> dict[str, str]:
    """The record ``adapter_dir`` carries ({} when it has none, as any adapter strop did not write).

    Raises:
        InvalidArgument: the file is not a JSON object of strings, or of another format.
    """
    path = Path(adapter_dir) / BASE_RECORD_FILE
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidArgument(f"{BASE_RECORD_FILE} is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or not all(isinstance(v, str) for v in data.values()):
        raise InvalidArgument(f"{BASE_RECORD_FILE} is not a JSON object of strings")
    if data.get("format") != FORMAT:
        raise InvalidArgument(
            f"{BASE_RECORD_FILE} has format {data.get('format')!r}, this strop reads {FORMAT!r}"
        )
    return base_record(data)
