"""What an export reads: a base model directory and (optionally) a PEFT LoRA adapter directory.

Both are opened and validated before anything is written: config and headers parsed, every
safetensors file checked against its size, the adapter's modules matched to base tensors with their
shapes. Weights stay on disk; ``BaseModel.read_fp32`` and ``Adapter.read`` fetch one tensor at a time.
Only safetensors are read (no pickle) and no remote code runs.
"""

from __future__ import annotations

import copy
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from strop.common.archs import ARCHS, MOE_ARCHS, Arch
from strop.export_svc.core import moe
from strop.export_svc.core.errors import (
    BaseMismatch,
    CorruptInput,
    InvalidArgument,
    MissingTokenizer,
    UnsupportedModel,
)
from strop.export_svc.core.st_io import SafetensorsFile
from strop.kernels.ops.nf4_format import nf4_digest

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
_BNB_SUFFIXES = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
_QS_PREFIX = "quant_state.bitsandbytes__"


# The dtypes a merged checkpoint is written in (and a 16-bit base is stored in).
DTYPES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float32": torch.float32,
}


def arch_of(config: dict[str, Any], *, where: str = "model") -> Arch:
    """The architecture of a config dict (``strop.common.archs``).

    Raises:
        UnsupportedModel: ``model_type`` is not in ``strop.common.archs.ARCHS`` (llama, mistral, qwen2, qwen3,
            gemma2, gemma3_text) or ``MOE_ARCHS`` with a per-expert checkpoint layout (qwen3_moe, mixtral).
    """
    model_type = config.get("model_type")
    arch = ARCHS.get(str(model_type)) or MOE_ARCHS.get(str(model_type))
    if arch is not None and arch.moe is not None and not arch.moe.checkpoint_experts:
        raise UnsupportedModel(
            f"{where}: {model_type!r} is not exported: its checkpoints hold the experts fused and transposed "
            "(released as MXFP4, which strop does not load), and a merge into that layout is not written yet"
        )
    if arch is None:
        archs = config.get("architectures") or []
        raise UnsupportedModel(
            f"{where}: architecture {model_type!r} {archs} is not supported for export; "
            f"supported: {sorted([*ARCHS, *(t for t, a in MOE_ARCHS.items() if a.moe.checkpoint_experts)])}"
        )
    return arch


def config_dtype(config: dict[str, Any]) -> str:
    """The dtype a checkpoint's config declares (``dtype``, older ``torch_dtype``, or bnb's compute dtype)."""
    for key in ("dtype", "torch_dtype"):
        v = config.get(key)
        if isinstance(v, str) and v in DTYPES:
            return v
    q = config.get("quantization_config") or {}
    v = q.get("bnb_4bit_compute_dtype")
    if isinstance(v, str) and v in DTYPES:
        return v
    return "bfloat16"


def read_json(path: Path, label: str) -> dict[str, Any]:
    """Parse a JSON object file; malformed content raises CorruptInput naming ``label``."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CorruptInput(f"{label} is not valid JSON: {exc}") from None
    if not isinstance(data, dict):
        raise CorruptInput(f"{label} is not a JSON object")
    return data


def has_tokenizer(d: Path) -> bool:
    return (d / "tokenizer.json").is_file() or (d / "tokenizer.model").is_file()


# The leaf modules transformers' bitsandbytes integration turns into Linear4bit in the families strop
# supports (every nn.Linear but lm_head): what an older trainer artifact, which records no module list,
# had quantized on load.
_LINEAR4BIT_MODULES = ("down_proj", "gate_proj", "k_proj", "o_proj", "q_proj", "up_proj", "v_proj")
# the trainer's scale statistics in an adapter artifact (trainer_svc/core/models.py writes the same name)
NF4_STATS_FILE = "base_quant_stats.safetensors"
QUANT_META_PREFIX = "base_quant."  # the trainer's adapter-artifact metadata keys of the 4-bit settings


@dataclass(frozen=True)
class Nf4OnLoad:
    """How the trainer quantized a 16-bit base when it loaded it (bitsandbytes ``Linear4bit``).

    Read from the adapter artifact's ``base_quant.*`` metadata (the trainer writes it from its
    layers' quant states); with those settings bitsandbytes' ``quantize_4bit`` re-creates the exact
    codes and absmax the adapter was trained against (``tests/export_svc/test_as_trained.py`` checks
    it bitwise against the trainer's own ``Linear4bit`` weights).
    """

    quant_type: str = "nf4"
    blocksize: int = 64
    double_quant: bool = True
    nested_blocksize: int = 256  # the absmax's own 8-bit quantization (bitsandbytes' fixed choice)
    quant_storage: str = "uint8"
    quantized_from: str = "float32"  # the dtype the weights had when they were quantized
    compute_dtype: str = "float32"
    modules: tuple[str, ...] = _LINEAR4BIT_MODULES  # leaf names of the Linear4bit layers
    tensors: int = 0  # how many weights were quantized (0: not recorded)
    assumed: bool = False  # an older artifact: the trainer's fixed on-load settings, not read from it
    digest_tensor: str = ""  # one weight whose codes and absmax the trainer hashed ...
    digest: str = ""  # ... and their sha256 (see ``nf4_digest``)
    # the trainer's recorded scale statistics (absmax, and the double quantization's offset, nested absmax and
    # code) by weight name: the codes re-create exactly on any device, the double-quantized scales do not
    # (trainer_svc/core/models.py ``write_nf4_stats``); "" for artifacts written before they were recorded
    stats_file: str = ""

    @classmethod
    def from_metadata(cls, meta: dict[str, str]) -> Nf4OnLoad | None:
        """The settings an adapter artifact records, or None when its base was not quantized on load.

        Raises:
            CorruptInput: recorded settings that do not parse.
        """
        if meta.get("base_quantization") != "bnb-nf4-on-load":
            return None
        q = {k.removeprefix(QUANT_META_PREFIX): v for k, v in meta.items() if k.startswith(QUANT_META_PREFIX)}
        if not q:  # written before the trainer recorded them: its settings were fixed (models.load_model)
            return cls(assumed=True)
        try:
            spec = cls(
                quant_type=q.get("type", "nf4"),
                blocksize=int(q.get("blocksize", "64")),
                double_quant=q.get("double_quant", "true") == "true",
                nested_blocksize=int(q.get("nested_blocksize", "256")),
                quant_storage=q.get("quant_storage", "uint8"),
                quantized_from=q.get("quantized_from", "float32"),
                compute_dtype=q.get("compute_dtype", "float32"),
                modules=tuple(sorted(m for m in q.get("modules", "").split(",") if m)) or _LINEAR4BIT_MODULES,
                tensors=int(q.get("tensors", "0")),
                digest_tensor=q.get("digest_tensor", ""),
                digest=q.get("digest", ""),
            )
        except ValueError as exc:
            raise CorruptInput(f"the adapter's base_quant.* metadata does not parse: {exc}") from None
        if spec.quant_type not in ("nf4", "fp4") or spec.quantized_from not in DTYPES:
            raise CorruptInput(
                f"the adapter records an on-load quantization strop cannot re-create: {spec.quant_type} "
                f"from {spec.quantized_from}"
            )
        return spec

    def covers(self, name: str, shape: tuple[int, ...]) -> bool:
        """Whether the base tensor ``name`` was a Linear4bit weight in the trainer."""
        return (
            len(shape) == 2
            and name.endswith(".weight")
            and name[: -len(".weight")].rsplit(".", 1)[-1] in self.modules
        )

    def describe(self) -> str:
        dq = ", double quant" if self.double_quant else ""
        scales = ", the trainer's recorded scales" if self.stats_file else ", scales re-computed"
        return f"bnb-{self.quant_type} (blocksize {self.blocksize}{dq}, quantized from {self.quantized_from}{scales})"

    def recorded_scales(self, name: str, qs) -> None:
        """Replace ``qs``'s scale statistics with those the trainer recorded for weight ``name`` (no-op
        without a stats file). Raises CorruptInput when the file lacks the weight or disagrees in shape."""
        if not self.stats_file:
            return
        from safetensors import safe_open

        with safe_open(self.stats_file, framework="pt") as f:
            keys = set(f.keys())
            want = [name + ".absmax"] + (
                [name + s for s in (".offset", ".nested_absmax", ".nested_code")] if qs.nested else []
            )
            missing = [k for k in want if k not in keys]
            if missing:
                raise CorruptInput(f"the adapter's recorded NF4 statistics lack {missing[0]!r}")
            absmax = f.get_tensor(name + ".absmax")
            if absmax.shape != qs.absmax.shape or absmax.dtype != qs.absmax.dtype:
                raise CorruptInput(
                    f"the adapter's recorded NF4 statistics of {name!r} do not fit its base weight"
                )
            qs.absmax = absmax
            if qs.nested:
                qs.offset = f.get_tensor(name + ".offset").reshape(qs.offset.shape).to(qs.offset.dtype)
                qs.state2.absmax = f.get_tensor(name + ".nested_absmax")
                qs.state2.code = f.get_tensor(name + ".nested_code")


@dataclass(frozen=True)
class BaseTensor:
    """A logical base tensor: a plain tensor, or a bnb 4-bit weight with its quant state."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype  # stored dtype (uint8 for 4-bit weights)
    file: str
    quant: str = ""  # "", "nf4" or "fp4"


class BaseModel:
    """A Hugging Face model directory (16-bit, or bitsandbytes 4-bit prequantized).

    Raises:
        InvalidArgument: not a model directory.
        CorruptInput: malformed config/index, truncated safetensors, or only pickle weights.
        UnsupportedModel: architecture or quantization method the exporter does not handle.
    """

    def __init__(self, path: Path, label: str):
        self.path = Path(path)
        self.label = label
        if not (self.path / "config.json").is_file():
            raise InvalidArgument(f"base {label!r} is not a model directory (no config.json)")
        self.config = read_json(self.path / "config.json", f"{label}/config.json")
        self.arch: Arch = arch_of(self.config, where=f"base {label!r}")
        self.quantization = self._quantization()
        self.dtype = config_dtype(self.config)
        self.files = self._open_files()
        self.tensors: dict[str, BaseTensor] = self._logical_tensors()
        self.on_load: Nf4OnLoad | None = None  # set on the copy ``quantized_on_load`` returns

    def quantized_on_load(self, spec: Nf4OnLoad) -> BaseModel:
        """This 16-bit base as the trainer held it: the weights ``spec`` covers read as their NF4 codes,
        re-created with ``spec``'s settings and dequantized to fp32 (a copy; ``self`` is unchanged).

        Raises:
            BaseMismatch: the base is already 4-bit, or holds another number of such weights than the
                trainer quantized.
        """
        if self.quantization != "none":
            raise BaseMismatch(
                f"the adapter was trained on a 16-bit base quantized on load, but base {self.label!r} is "
                f"{self.quantization}"
            )
        n = sum(spec.covers(k, t.shape) for k, t in self.tensors.items())
        if spec.tensors and n != spec.tensors:
            raise BaseMismatch(
                f"the trainer quantized {spec.tensors} weights of the adapter's base on load; base "
                f"{self.label!r} has {n} such weights ({', '.join(spec.modules)})"
            )
        view = copy.copy(self)
        view.on_load = spec
        return view

    def is_dequantized(self, name: str) -> bool:
        """Whether ``read_fp32(name)`` dequantizes 4-bit codes (stored ones, or re-created on load)."""
        t = self.tensors[name]
        return bool(t.quant) or (self.on_load is not None and self.on_load.covers(name, t.shape))

    def _quantization(self) -> str:
        q = self.config.get("quantization_config")
        if not q:
            return "none"
        method = q.get("quant_method")
        if method == "bitsandbytes" and (q.get("load_in_4bit") or q.get("_load_in_4bit")):
            qt = q.get("bnb_4bit_quant_type", "nf4")
            if qt not in ("nf4", "fp4"):
                raise UnsupportedModel(
                    f"base {self.label!r}: bitsandbytes 4-bit type {qt!r} is not supported"
                )
            return f"bnb-{qt}"
        if method == "bitsandbytes":
            raise UnsupportedModel(
                f"base {self.label!r}: bitsandbytes 8-bit bases are not supported (4-bit only)"
            )
        raise UnsupportedModel(
            f"base {self.label!r}: quantization method {method!r} is not supported "
            "(16-bit or bitsandbytes 4-bit bases only)"
        )

    def _open_files(self) -> dict[str, SafetensorsFile]:
        index = self.path / "model.safetensors.index.json"
        if index.is_file():
            wm = read_json(index, f"{self.label}/model.safetensors.index.json").get("weight_map")
            if not isinstance(wm, dict) or not wm:
                raise CorruptInput(f"{self.label}/model.safetensors.index.json has no weight_map")
            names = sorted(set(wm.values()))
            for n in names:
                if Path(n).name != n or not (self.path / n).is_file():
                    raise CorruptInput(f"{self.label}: index names shard {n!r}, which is missing")
        else:
            names = sorted(p.name for p in self.path.glob("*.safetensors"))
        if not names:
            if any(self.path.glob("*.bin")) or any(self.path.glob("*.pt")):
                raise CorruptInput(
                    f"base {self.label!r} has only pickle weights (*.bin); strop loads safetensors only"
                )
            raise InvalidArgument(f"base {self.label!r} has no safetensors weights")
        return {n: SafetensorsFile(self.path / n, label=f"{self.label}/{n}") for n in names}

    def _logical_tensors(self) -> dict[str, BaseTensor]:
        where: dict[str, str] = {}
        for fname, f in self.files.items():
            for k in f.names():
                where[k] = fname
        out: dict[str, BaseTensor] = {}
        companions = set()
        for k in where:
            for qt in ("nf4", "fp4"):
                stem = k[: -len(_QS_PREFIX + qt) - 1] if k.endswith("." + _QS_PREFIX + qt) else None
                if stem is None:
                    continue
                if stem not in where:
                    raise CorruptInput(f"base {self.label!r}: quant state {k!r} without its weight {stem!r}")
                qs = self._quant_state_dict(stem, where)
                meta = json.loads(bytes(qs[_QS_PREFIX + qt].tolist()).decode())
                companions.update(f"{stem}.{s}" for s in qs)
                out[stem] = BaseTensor(
                    stem, tuple(int(x) for x in meta["shape"]), torch.uint8, where[stem], qt
                )
        if any(t.quant for t in out.values()) and self.quantization == "none":
            raise CorruptInput(
                f"base {self.label!r} holds 4-bit tensors but its config has no quantization_config"
            )
        for fname, f in self.files.items():
            for k in f.names():
                if k in companions or k in out:
                    continue
                e = f.entries[k]
                out[k] = BaseTensor(k, e.shape, e.dtype, fname)
        # keep the on-disk order (file by file, offset by offset): streaming reads each shard once
        order = {k: i for i, k in enumerate(k for f in self.files.values() for k in f.names())}
        return dict(sorted(out.items(), key=lambda kv: (list(self.files).index(kv[1].file), order[kv[0]])))

    def _quant_state_dict(self, stem: str, where: dict[str, str]) -> dict[str, torch.Tensor]:
        qs = {}
        for k, fname in where.items():
            if k.startswith(stem + ".") and (k[len(stem) + 1 :] in _BNB_SUFFIXES or _QS_PREFIX in k):
                qs[k[len(stem) + 1 :]] = self.files[fname].read(k)
        return qs

    @property
    def num_layers(self) -> int:
        return int(self.config["num_hidden_layers"])

    @property
    def nbytes_16bit(self) -> int:
        return sum(math.prod(t.shape) * 2 for t in self.tensors.values())

    def read_raw(self, name: str) -> torch.Tensor:
        """One plain (not 4-bit) tensor as stored."""
        t = self.tensors[name]
        if t.quant:
            raise ValueError(f"{name!r} is a 4-bit tensor; use read_fp32")
        return self.files[t.file].read(name)

    def read_fp32(self, name: str) -> torch.Tensor:
        """One logical tensor as float32; 4-bit weights dequantized in fp32 (bitsandbytes, on the CPU)."""
        t = self.tensors[name]
        if not t.quant and self.is_dequantized(name):
            return self._requantized_fp32(name)
        if not t.quant:
            return self.files[t.file].read(name).to(torch.float32)
        from bitsandbytes.functional import QuantState, dequantize_4bit

        where = {k: fname for fname, f in self.files.items() for k in f.entries if k.startswith(name + ".")}
        qs = QuantState.from_dict(self._quant_state_dict(name, where), device=torch.device("cpu"))
        qs.dtype = torch.float32  # dequantize straight to fp32: no rounding through the compute dtype
        packed = self.files[t.file].read(name)
        return dequantize_4bit(packed, qs).reshape(t.shape)

    def check_codes(self) -> str:
        """Whether the NF4 codes re-created here are the trainer's: ``"bit-identical"``, ``"differ"``, or
        ``"not recorded"`` (compares the sha256 of one weight's codes and absmax with the trainer's)."""
        spec = self.on_load
        if spec is None or not spec.digest or spec.digest_tensor not in self.tensors:
            return "not recorded"
        packed, qs = self._quantize(spec.digest_tensor)
        return "bit-identical" if nf4_digest(packed, qs) == spec.digest else "differ"

    def _quantize(self, name: str):
        from bitsandbytes.functional import quantize_4bit

        spec = self.on_load
        assert spec is not None
        t = self.tensors[name]
        w = self.files[t.file].read(name).to(DTYPES[spec.quantized_from])
        packed, qs = quantize_4bit(
            w,
            blocksize=spec.blocksize,
            compress_statistics=spec.double_quant,
            quant_type=spec.quant_type,
            quant_storage=getattr(torch, spec.quant_storage),
        )
        spec.recorded_scales(name, qs)
        return packed, qs

    def _requantized_fp32(self, name: str) -> torch.Tensor:
        """The NF4 weights the trainer's ``Linear4bit`` held for ``name``, dequantized to fp32.

        bitsandbytes' own ``quantize_4bit`` (the call ``Params4bit`` makes on load) with the recorded
        settings, on the weight cast to the dtype it had then: the same codes and absmax; the
        dequantization goes straight to fp32, with no rounding through the compute dtype.
        """
        from bitsandbytes.functional import dequantize_4bit

        spec = self.on_load
        assert spec is not None
        t = self.tensors[name]
        packed, qs = self._quantize(name)
        if spec.double_quant and qs.state2.blocksize != spec.nested_blocksize:
            raise CorruptInput(
                f"bitsandbytes quantizes the absmax of {name!r} in blocks of {qs.state2.blocksize}; the trainer "
                f"recorded {spec.nested_blocksize}: this bitsandbytes cannot re-create the trained weights"
            )
        qs.dtype = torch.float32
        return dequantize_4bit(packed, qs).reshape(t.shape)

    def tokenizer_dir(self) -> Path | None:
        return self.path if has_tokenizer(self.path) else None


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
