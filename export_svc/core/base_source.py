"""What an export reads as its base: a Hugging Face model directory (16-bit, or bitsandbytes 4-bit prequantized),
opened and validated before anything is written: config and headers parsed, every safetensors file checked against
its size. Weights stay on disk; ``BaseModel.read_fp32`` fetches one tensor at a time (a 16-bit base the trainer
quantized on load as its NF4 codes dequantized: ``quantized_on_load``). Only safetensors are read (no pickle) and no
remote code runs. The adapter an export reads: ``adapter_source``.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from strop.common.archs import ARCHS, MOE_ARCHS, Arch
from strop.export_svc.core.errors import BaseMismatch, CorruptInput, InvalidArgument, UnsupportedModel
from strop.export_svc.core.nf4_on_load import Nf4OnLoad
from strop.export_svc.core.st_io import SafetensorsFile
from strop.kernels.ops.nf4_format import nf4_digest

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
        self.expert_nf4 = None  # NF4 experts as the trainer held them (``moe.ExpertNf4``), set on a copy too

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
        if self.expert_nf4 is not None and self.expert_nf4.stack_of(name) is not None:
            return True
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
        if self.expert_nf4 is not None and self.expert_nf4.stack_of(name) is not None:
            return self.expert_nf4.read(self, name)
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
