"""The GGUF model types strop writes, in one table, and the tensor type each tensor of a file gets.

A type is written either directly by the ``gguf`` package (F32, F16, BF16, Q8_0: its 2-D weights in
that tensor type) or by llama.cpp's quantizer from an exact GGUF (the K-quants and friends, which
gguf-py cannot produce). ``file_type`` is ``general.file_type`` and, for quantizer types, the
``llama_ftype`` llama.cpp is asked for (they are the same numbers: gguf-py's ``LlamaFileType`` is
llama.h's enum).
"""

from __future__ import annotations

from dataclasses import dataclass

import gguf
import torch

QT = gguf.GGMLQuantizationType


@dataclass(frozen=True)
class GgufType:
    """One GGUF model type."""

    name: str
    file_type: int  # general.file_type; for quantizer types also the llama_ftype asked of llama.cpp
    qtype: QT | None  # the tensor type gguf-py writes 2-D weights as; None: llama.cpp's quantizer makes it

    @property
    def direct(self) -> bool:
        """Written by gguf-py itself (no quantizer pass)."""
        return self.qtype is not None

    @property
    def lossy(self) -> bool:
        """A 2–6 bit quantization: verification judges it on teacher-forced answer agreement."""
        return not self.direct


def _gguf_type(name: str, qtype: QT | None) -> GgufType:
    ft = gguf.LlamaFileType.ALL_F32 if name == "F32" else gguf.LlamaFileType[f"MOSTLY_{name}"]
    return GgufType(name, int(ft), qtype)


_DIRECT = {"F32": QT.F32, "F16": QT.F16, "BF16": QT.BF16, "Q8_0": QT.Q8_0}
# llama.cpp's quantizer: the types it makes without an importance matrix
_QUANTIZER = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_K_S", "Q4_K_M")
_QUANTIZER += ("Q5_K_S", "Q5_K_M", "Q6_K", "Q2_K_S", "IQ4_NL", "IQ4_XS")
GGUF_TYPES: dict[str, GgufType] = {n: _gguf_type(n, _DIRECT.get(n)) for n in (*_DIRECT, *_QUANTIZER)}
# The tensor types of a GGUF LoRA adapter (llama.cpp applies them to a base of any type).
LORA_TYPES: dict[str, QT] = {name: QT[name] for name in ("F32", "F16", "BF16")}
# The type that holds a 16-bit base's own weights exactly (llama.cpp's quantizer reads it at half F32's size).
EXACT_TYPE_OF: dict[torch.dtype, str] = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32"}


def tensor_type(gname: str, shape: tuple[int, ...], model_type: QT) -> QT:
    """Norms, biases and other 1-D tensors stay F32; Q8_0 needs rows that are multiples of 32 (else F16)."""
    if len(shape) < 2 or gname.endswith("_norm.weight") or model_type == QT.F32:
        return QT.F32
    if model_type == QT.Q8_0 and shape[-1] % gguf.GGML_QUANT_SIZES[QT.Q8_0][0] != 0:
        return QT.F16
    return model_type
