"""What an export reads as its adapter: a PEFT LoRA adapter directory, opened and validated before anything is
written (config parsed, A/B paired, modules matched to the base's tensors with their shapes); ``Adapter.read``
fetches one tensor at a time. Only safetensors are read (no pickle).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from strop.export_svc.core import moe
from strop.export_svc.core.base_source import BaseModel, has_tokenizer, read_json
from strop.export_svc.core.errors import (
    BaseMismatch,
    CorruptInput,
    InvalidArgument,
    MissingTokenizer,
    UnsupportedModel,
)
from strop.export_svc.core.st_io import SafetensorsFile


@dataclass
class LoraModule:
    """One adapted base tensor: ``W' = W + scale · B @ A`` (embeddings: ``W' = W + scale · (B @ A)ᵀ``)."""

    module: str
    base_key: str
    a_key: str
    b_key: str
    r: int
    alpha: float
    scale: float
    kind: str = "linear"  # "linear" | "embedding"
    magnitude_key: str = ""  # DoRA
    # one expert of a fused experts LoRA (export_svc/core/moe.py): A's rows [a_rows), B's rows [b_rows) and its
    # columns b_cols[0]::b_cols[1]
    a_rows: tuple[int, int] | None = None
    b_rows: tuple[int, int] | None = None
    b_cols: tuple[int, int] | None = None

    def a_slice(self, a: torch.Tensor) -> torch.Tensor:
        return a if self.a_rows is None else a[self.a_rows[0] : self.a_rows[1]]

    def b_slice(self, b: torch.Tensor) -> torch.Tensor:
        if self.b_rows is not None:
            b = b[self.b_rows[0] : self.b_rows[1]]
        return b if self.b_cols is None else b[:, self.b_cols[0] :: self.b_cols[1]]


@dataclass
class Adapter:
    """A PEFT LoRA adapter directory (``adapter_config.json`` + ``adapter_model.safetensors``)."""

    path: Path
    label: str
    config: dict[str, Any]
    file: SafetensorsFile
    modules: dict[str, LoraModule] = field(default_factory=dict)
    replacements: dict[str, str] = field(default_factory=dict)  # base key → adapter key
    # LoRA pairs on fused experts, bound to a base's per-expert tensors by ``bind_experts``
    expert_pairs: dict[tuple[str, str], dict[str, str]] = field(default_factory=dict)

    @property
    def use_dora(self) -> bool:
        return bool(self.config.get("use_dora"))

    @property
    def use_rslora(self) -> bool:
        return bool(self.config.get("use_rslora"))

    @property
    def recorded_base(self) -> str:
        return str(self.config.get("base_model_name_or_path") or "")

    def read(self, key: str) -> torch.Tensor:
        return self.file.read(key)

    def read_a(self, m: LoraModule) -> torch.Tensor:
        return m.a_slice(self.file.read(m.a_key))

    def read_b(self, m: LoraModule) -> torch.Tensor:
        return m.b_slice(self.file.read(m.b_key))

    def tokenizer_dir(self) -> Path | None:
        return self.path if has_tokenizer(self.path) else None


def pattern_value(patterns: dict[str, Any], module: str) -> Any | None:
    """PEFT's rank/alpha pattern lookup: a key matches a module name or any dotted suffix of it."""
    for key, value in patterns.items():
        if re.fullmatch(rf"(.*\.)?(?:{key})", module):
            return value
    return None


def lora_scale(alpha: float, r: int, use_rslora: bool) -> float:
    """PEFT's (and vLLM's) LoRA scaling: ``alpha / r``, or ``alpha / sqrt(r)`` with rsLoRA."""
    return alpha / math.sqrt(r) if use_rslora else alpha / r


def open_adapter(path: Path, label: str) -> Adapter:
    """Open and validate a PEFT LoRA adapter directory.

    Raises:
        InvalidArgument: not an adapter directory.
        CorruptInput: malformed config, truncated weights, unpaired A/B, only pickle weights.
        UnsupportedModel: not LoRA, or LoRA features with no merge (fan_in_fan_out, lora_bias, DoRA on
            embeddings).
    """
    path = Path(path)
    if not (path / "adapter_config.json").is_file():
        raise InvalidArgument(f"adapter {label!r} is not a PEFT adapter directory (no adapter_config.json)")
    cfg = read_json(path / "adapter_config.json", f"{label}/adapter_config.json")
    if str(cfg.get("peft_type", "LORA")).upper() != "LORA":
        raise UnsupportedModel(
            f"adapter {label!r} is {cfg.get('peft_type')!r}; only LoRA adapters are exported"
        )
    if cfg.get("fan_in_fan_out"):
        raise UnsupportedModel(f"adapter {label!r} uses fan_in_fan_out, which Llama-family models never need")
    for key in ("r", "lora_alpha"):
        if not isinstance(cfg.get(key), int | float) or cfg[key] <= 0:
            raise CorruptInput(
                f"{label}/adapter_config.json: {key!r} must be a positive number, got {cfg.get(key)!r}"
            )
    wpath = path / "adapter_model.safetensors"
    if not wpath.is_file():
        if (path / "adapter_model.bin").is_file():
            raise CorruptInput(
                f"adapter {label!r} has only pickle weights (adapter_model.bin); strop loads safetensors only"
            )
        raise InvalidArgument(f"adapter {label!r} has no adapter_model.safetensors")
    f = SafetensorsFile(wpath, label=f"{label}/adapter_model.safetensors")
    ad = Adapter(path, label, cfg, f)
    parts: dict[str, dict[str, str]] = {}
    ad.expert_pairs = moe.expert_pairs(f.names())
    for key in f.names():
        if moe.is_expert_lora(key):
            continue
        k = key.removeprefix("base_model.model.")
        m = re.fullmatch(r"(.+)\.(lora_A|lora_B)\.weight", k) or re.fullmatch(
            r"(.+)\.(lora_embedding_A|lora_embedding_B)", k
        )
        if m:
            parts.setdefault(m.group(1), {})[m.group(2)] = key
            continue
        m = re.fullmatch(r"(.+)\.lora_magnitude_vector", k)
        if m:
            parts.setdefault(m.group(1), {})["magnitude"] = key
            continue
        if re.search(r"\.lora_[AB]\.bias$", k):
            raise UnsupportedModel(f"adapter {label!r} has LoRA biases (lora_bias); they are not supported")
        if ".lora_" in k:
            raise CorruptInput(f"adapter {label!r}: tensor {key!r} is not a LoRA tensor strop understands")
        ad.replacements[k.replace(".base_layer.", ".")] = key
    alpha_pattern = cfg.get("alpha_pattern") or {}
    for module, p in sorted(parts.items()):
        if "lora_A" in p and "lora_B" in p:
            kind, a_key, b_key = "linear", p["lora_A"], p["lora_B"]
        elif "lora_embedding_A" in p and "lora_embedding_B" in p:
            kind, a_key, b_key = "embedding", p["lora_embedding_A"], p["lora_embedding_B"]
        else:
            raise CorruptInput(f"adapter {label!r}: module {module!r} lacks its LoRA A or B tensor")
        a_shape, b_shape = f.entries[a_key].shape, f.entries[b_key].shape
        if len(a_shape) != 2 or len(b_shape) != 2 or a_shape[0] != b_shape[1]:
            raise CorruptInput(
                f"adapter {label!r}: module {module!r} has A {list(a_shape)} and B {list(b_shape)}, which do not pair"
            )
        r = int(a_shape[0])
        alpha = float(pattern_value(alpha_pattern, module) or cfg["lora_alpha"])
        if "magnitude" in p and kind == "embedding":
            raise UnsupportedModel(f"adapter {label!r}: DoRA on embeddings ({module!r}) is not supported")
        ad.modules[f"{module}.weight"] = LoraModule(
            module=module,
            base_key=f"{module}.weight",
            a_key=a_key,
            b_key=b_key,
            r=r,
            alpha=alpha,
            scale=lora_scale(alpha, r, bool(cfg.get("use_rslora"))),
            kind=kind,
            magnitude_key=p.get("magnitude", ""),
        )
    if not ad.modules and not ad.replacements and not ad.expert_pairs:
        raise CorruptInput(f"adapter {label!r} holds no LoRA tensors")
    return ad


def bind_experts(adapter: Adapter, base: BaseModel) -> None:
    """Turn the adapter's LoRA pairs on fused experts into one module per expert tensor of ``base``'s checkpoint
    (``export_svc/core/moe.py``); a trained router's copy is renamed as the checkpoint names it. Idempotent.

    Raises:
        BaseMismatch, CorruptInput: as ``moe.expert_slices``.
    """
    if adapter.expert_pairs:
        shapes = {
            k: tuple(adapter.file.entries[k].shape) for p in adapter.expert_pairs.values() for k in p.values()
        }
        slices = moe.expert_slices(
            adapter.expert_pairs, shapes, base.config, adapter_label=adapter.label, base_label=base.label
        )
        patterns = adapter.config.get("alpha_pattern") or {}
        for s in slices:
            alpha = float(pattern_value(patterns, s.pop("experts_module")) or adapter.config["lora_alpha"])
            adapter.modules[s["base_key"]] = LoraModule(
                **s, alpha=alpha, scale=lora_scale(alpha, s["r"], adapter.use_rslora)
            )
        adapter.expert_pairs = {}
    adapter.replacements = {moe.checkpoint_name(base.config, k): v for k, v in adapter.replacements.items()}


def check_compatible(adapter: Adapter, base: BaseModel) -> None:
    """Every adapted module must exist in the base with matching shapes (expert LoRA bound to the base first:
    ``bind_experts``).

    Raises:
        BaseMismatch: naming the first mismatches (module, adapter shapes, base shape).
    """
    bind_experts(adapter, base)
    problems = []
    for key, m in adapter.modules.items():
        bt = base.tensors.get(key)
        a = tuple(m.a_slice(torch.empty(adapter.file.entries[m.a_key].shape, device="meta")).shape)
        b = tuple(m.b_slice(torch.empty(adapter.file.entries[m.b_key].shape, device="meta")).shape)
        if bt is None:
            problems.append(f"module {m.module!r} has no tensor {key!r} in the base")
            continue
        if len(bt.shape) != 2:
            problems.append(f"{key!r} is {len(bt.shape)}-D in the base, not a matrix")
            continue
        out_f, in_f = bt.shape if m.kind == "linear" else (bt.shape[1], bt.shape[0])
        if a[1] != in_f or b[0] != out_f:
            problems.append(
                f"{m.module!r}: adapter A {list(a)} / B {list(b)} need a base weight of "
                f"{[b[0], a[1]] if m.kind == 'linear' else [a[1], b[0]]}, base has {list(bt.shape)}"
            )
    for key, akey in adapter.replacements.items():
        bt = base.tensors.get(key)
        shape = adapter.file.entries[akey].shape
        if bt is None:
            problems.append(f"adapter tensor {akey!r} replaces {key!r}, which the base lacks")
        elif tuple(bt.shape) != tuple(shape):
            problems.append(f"adapter tensor {akey!r} is {list(shape)}, base {key!r} is {list(bt.shape)}")
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise BaseMismatch(
            f"adapter {adapter.label!r} does not fit base {base.label!r} "
            f"({base.arch.model_type}, hidden {base.config.get('hidden_size')}, "
            f"{base.num_layers} layers): " + "; ".join(problems[:3]) + more
        )


_ARCH_KEYS = (
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "vocab_size",
)


def check_same_family(trained_on: dict[str, Any], trained_label: str, base: BaseModel) -> None:
    """The base must have the architecture and shapes of the model the adapter was trained on.

    Raises:
        BaseMismatch: naming the differing fields.
    """
    diffs = []
    if trained_on.get("model_type") != base.config.get("model_type"):
        diffs.append(f"model_type {trained_on.get('model_type')!r} vs {base.config.get('model_type')!r}")
    for k in _ARCH_KEYS:
        if k in trained_on and k in base.config and trained_on[k] != base.config[k]:
            diffs.append(f"{k} {trained_on[k]} vs {base.config[k]}")
    if diffs:
        raise BaseMismatch(
            f"the adapter was trained on {trained_label!r}, which differs from base {base.label!r}: "
            + ", ".join(diffs)
        )


def tokenizer_source(adapter: Adapter | None, base: BaseModel) -> Path:
    """Where the tokenizer comes from: the adapter's files (what training used), else the base's.

    One exception: an adapter directory saved by ``save_pretrained`` of a SentencePiece tokenizer
    lacks ``tokenizer.model`` (transformers 5 keeps only tokenizer.json), which GGUF needs for the
    scores; if the base has it, the base's complete set is used.

    Raises:
        MissingTokenizer: neither directory has tokenizer.json or tokenizer.model.
    """
    a = adapter.tokenizer_dir() if adapter else None
    b = base.tokenizer_dir()
    if (
        a is not None
        and b is not None
        and not (a / "tokenizer.model").is_file()
        and (b / "tokenizer.model").is_file()
    ):
        return b
    if a is not None:
        return a
    if b is not None:
        return b
    where = (
        f"adapter {adapter.label!r} nor base {base.label!r} has" if adapter else f"base {base.label!r} has"
    )
    raise MissingTokenizer(f"no tokenizer: neither {where} tokenizer.json or tokenizer.model")
