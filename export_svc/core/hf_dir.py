"""The merged Hugging Face / vLLM directory, and the checks vLLM's loader would make on it.

Layout written: ``config.json`` (no ``quantization_config``; ``dtype`` set to what the shards hold),
``model-0000i-of-0000N.safetensors`` + ``model.safetensors.index.json``, the tokenizer files with the
chat template (also embedded in ``tokenizer_config.json`` for consumers that read it only there), and
``generation_config.json``.

vLLM cannot run on CPU-only hosts, so ``check_vllm_model_dir`` checks what its loader checks: a
registered architecture, no leftover quantization config, an index whose ``weight_map`` covers every
tensor of every shard (vLLM drops shards the index does not name), the tensor names and shapes its
model class loads, no bitsandbytes companions, tokenizer files and a chat template.
"""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from strop.common.adapter_base import TOKENIZER_FILES
from strop.common.archs import ARCHS, MOE_ARCHS, arch_of, expected_tensors
from strop.export_svc.core.adapter_source import Adapter
from strop.export_svc.core.base_source import DTYPES, BaseModel, read_json
from strop.export_svc.core.merge import iter_merged
from strop.export_svc.core.st_io import PlannedTensor, SafetensorsFile, ShardedSafetensorsWriter

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9


def clean_config(config: dict[str, Any], dtype: str) -> dict[str, Any]:
    """The config of a dense merged checkpoint: no quantization block, ``dtype`` = the shards' dtype."""
    out = {k: v for k, v in config.items() if k != "quantization_config"}
    out["dtype"] = dtype
    if "torch_dtype" in out:
        out["torch_dtype"] = dtype  # older readers (transformers < 4.56, older vLLM) use this key
    if not out.get("architectures"):
        out["architectures"] = [arch_of(out["model_type"]).hf_class]
    return out


def copy_tokenizer(src: Path, dst: Path) -> list[str]:
    """Copy the tokenizer files; embed the chat template in tokenizer_config.json when only the .jinja has it."""
    copied = []
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)
            copied.append(name)
    tc_path = dst / "tokenizer_config.json"
    jinja = dst / "chat_template.jinja"
    if tc_path.is_file() and jinja.is_file():
        tc = read_json(tc_path, "tokenizer_config.json")
        if not tc.get("chat_template"):
            tc["chat_template"] = jinja.read_text(encoding="utf-8")
            tc_path.write_text(json.dumps(tc, indent=2, ensure_ascii=False))
    return copied


def chat_template_of(tok_dir: Path, tokenizer_config: dict[str, Any] | None = None) -> str | None:
    """The chat template a tokenizer directory carries (tokenizer_config.json or chat_template.jinja).

    ``tokenizer_config``: the directory's tokenizer_config.json when the caller has already read it.
    """
    tc = tokenizer_config
    if tc is None and (tok_dir / "tokenizer_config.json").is_file():
        tc = read_json(tok_dir / "tokenizer_config.json", "tokenizer_config.json")
    t = (tc or {}).get("chat_template")
    if isinstance(t, str) and t:
        return t
    if isinstance(t, list):
        for item in t:
            if isinstance(item, dict) and item.get("name") == "default":
                return item.get("template")
    if (tok_dir / "chat_template.jinja").is_file():
        return (tok_dir / "chat_template.jinja").read_text(encoding="utf-8")
    return None


def generation_config_for(base: BaseModel) -> dict[str, Any]:
    """The base's generation_config.json, or one built from the config's special token ids."""
    p = base.path / "generation_config.json"
    if p.is_file():
        return read_json(p, f"{base.label}/generation_config.json")
    out: dict[str, Any] = {}
    for k in ("bos_token_id", "eos_token_id", "pad_token_id"):
        if base.config.get(k) is not None:
            out[k] = base.config[k]
    return out


def write_merged_dir(
    out_dir: Path,
    base: BaseModel,
    adapter: Adapter | None,
    tokenizer_dir: Path,
    *,
    dtype: str,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    before_tensor: Callable[[str], None] | None = None,
    after_tensor: Callable[[str, int, int, int], None] | None = None,
) -> list[str]:
    """Merge and write a vLLM-ready directory; returns the files written.

    ``after_tensor(name, index, bytes_written, bytes_total)`` reports progress after each tensor.
    """
    target = DTYPES[dtype]
    names = list(base.tensors)
    if base.config.get("tie_word_embeddings") and not (adapter and "lm_head.weight" in adapter.modules):
        names = [n for n in names if n != "lm_head.weight"]  # a copy of the table vLLM and transformers tie
    plan = [PlannedTensor(n, target, base.tensors[n].shape) for n in names]
    writer = ShardedSafetensorsWriter(out_dir, plan, max_shard_bytes)
    try:
        for i, (name, w) in enumerate(iter_merged(base, adapter, names=names, before_tensor=before_tensor)):
            writer.write(name, w.to(target))
            del w
            if after_tensor is not None:
                after_tensor(name, i, writer.bytes_written, writer.bytes_total)
        files = writer.finish()
    except BaseException:
        writer.abort()
        raise
    (out_dir / "config.json").write_text(
        json.dumps(clean_config(base.config, dtype), indent=2, sort_keys=True)
    )
    (out_dir / "generation_config.json").write_text(json.dumps(generation_config_for(base), indent=2))
    files += ["config.json", "generation_config.json", *copy_tokenizer(tokenizer_dir, out_dir)]
    return files


def check_vllm_model_dir(d: Path) -> list[str]:
    """What vLLM's loader would object to in a merged directory; empty when it would load it."""
    problems: list[str] = []
    try:
        config = read_json(d / "config.json", "config.json")
    except (OSError, ValueError) as exc:
        return [f"config.json unreadable: {exc}"]
    archs = config.get("architectures") or []
    known = {
        a.hf_class
        for a in (*ARCHS.values(), *MOE_ARCHS.values())
        if a.moe is None or a.moe.checkpoint_experts
    }
    if not archs or archs[0] not in known:
        problems.append(f"architectures {archs} is not one of {sorted(known)}")
    if "quantization_config" in config:
        problems.append("config.json still has quantization_config (vLLM would try bitsandbytes loading)")
    if config.get("dtype", config.get("torch_dtype")) not in DTYPES:
        problems.append(f"config dtype {config.get('dtype')!r} is not one of {sorted(DTYPES)}")
    index_path = d / "model.safetensors.index.json"
    if not index_path.is_file():
        return [*problems, "model.safetensors.index.json is missing"]
    index = read_json(index_path, "model.safetensors.index.json")
    wm: dict[str, str] = index.get("weight_map") or {}
    seen: dict[str, tuple[int, ...]] = {}
    total = 0
    for fname in sorted(set(wm.values())):
        if not (d / fname).is_file():
            problems.append(f"index names {fname!r}, which is missing")
            continue
        f = SafetensorsFile(d / fname)
        for k, e in f.entries.items():
            seen[k] = e.shape
            total += e.nbytes
            if wm.get(k) != fname:
                problems.append(f"tensor {k!r} in {fname!r} is not mapped to it in the index")
            if str(e.dtype).removeprefix("torch.") != config.get("dtype", config.get("torch_dtype")):
                problems.append(f"tensor {k!r} is {e.dtype}, config says {config.get('dtype')}")
    stray = sorted(p.name for p in d.glob("*.safetensors") if p.name not in set(wm.values()))
    if stray:
        problems.append(f"shards not in the index (vLLM ignores them): {stray}")
    if index.get("metadata", {}).get("total_size") != total:
        problems.append(
            f"index total_size {index.get('metadata', {}).get('total_size')} != {total} bytes of tensors"
        )
    missing_in_files = sorted(set(wm) - set(seen))
    if missing_in_files:
        problems.append(
            f"index maps {len(missing_in_files)} tensors no shard holds, e.g. {missing_in_files[0]!r}"
        )
    if not problems or archs:
        try:
            want = expected_tensors(config)
        except Exception as exc:  # an unsupported config is already reported above
            want = {}
            problems.append(f"cannot derive the expected tensors: {exc}")
        for k, shape in want.items():
            if k not in seen:
                problems.append(f"tensor {k!r} that vLLM's {archs[0] if archs else '?'} loads is missing")
            elif tuple(seen[k]) != shape:
                problems.append(f"tensor {k!r} is {list(seen[k])}, the config implies {list(shape)}")
        extra = [k for k in seen if k not in want and "rotary_emb.inv_freq" not in k]
        if extra:
            problems.append(f"{len(extra)} tensors vLLM would not know, e.g. {extra[0]!r}")
    if not (d / "tokenizer.json").is_file() and not (d / "tokenizer.model").is_file():
        problems.append("no tokenizer.json or tokenizer.model")
    if chat_template_of(d) is None:
        problems.append("no chat template (tokenizer_config.json chat_template or chat_template.jinja)")
    if not (d / "generation_config.json").is_file():
        problems.append("generation_config.json is missing")
    return problems
