"""``GgufStreamWriter``: gguf-py's writer as an explicit state machine, streaming tensors one at a time.

The tensor plan (names, shapes, types, byte sizes) is fixed first; ``begin`` writes the header,
metadata and tensor infos; tensors are then converted (``encode``) and written one by one, in plan
order, so memory stays near one tensor; ``finish`` fsyncs. Calls out of order raise
``WriterStateError("expected X, got Y")``.
"""

from __future__ import annotations

import enum
import math
import os
from dataclasses import dataclass
from pathlib import Path

import gguf
import numpy as np
import torch

from strop.export_svc.core.errors import WriterStateError
from strop.export_svc.core.gguf_types import QT


class GgufState(enum.Enum):
    """States of ``GgufStreamWriter``."""

    PLANNING = "planning"  # metadata and tensor infos being added
    WRITING = "writing"  # header, metadata and tensor infos on disk; tensor data streaming
    FINISHED = "finished"
    FAILED = "failed"


@dataclass(frozen=True)
class GgufTensorPlan:
    name: str
    shape: tuple[int, ...]  # numpy order (rows first), as HF stores it
    qtype: QT


def _nbytes(shape: tuple[int, ...], qtype: QT) -> int:
    block, type_size = gguf.GGML_QUANT_SIZES[qtype]
    return math.prod(shape) // block * type_size


class GgufStreamWriter:
    """gguf-py's writer driven as an explicit state machine, tensors streamed one by one.

    ``kv`` (the gguf-py writer) takes metadata while PLANNING; ``plan`` adds tensor infos; ``begin``
    writes header + metadata + tensor infos; ``write`` takes tensors in plan order; ``finish`` closes
    and fsyncs. Calls out of order raise WriterStateError("expected X, got Y").
    """

    def __init__(self, path: Path, arch: str):
        self.path = Path(path)
        self.kv = gguf.GGUFWriter(None, arch)
        self.state = GgufState.PLANNING
        self.planned: list[GgufTensorPlan] = []
        self._next = 0
        self.bytes_written = 0

    def _expect(self, state: GgufState) -> None:
        if self.state is not state:
            raise WriterStateError(f"expected GGUF writer state {state.value}, got {self.state.value}")

    @property
    def bytes_total(self) -> int:
        return sum(_nbytes(p.shape, p.qtype) for p in self.planned)

    def plan(self, name: str, shape: tuple[int, ...], qtype: QT) -> None:
        self._expect(GgufState.PLANNING)
        p = GgufTensorPlan(name, tuple(shape), qtype)
        nbytes = _nbytes(p.shape, qtype)
        if qtype in (QT.F32, QT.F16):
            self.kv.add_tensor_info(
                name, p.shape, np.dtype(np.float32 if qtype == QT.F32 else np.float16), nbytes
            )
        elif qtype == QT.BF16:
            self.kv.add_tensor_info(name, p.shape, np.dtype(np.int16), nbytes, raw_dtype=QT.BF16)
        else:
            byte_shape = gguf.quant_shape_to_byte_shape(p.shape, qtype)
            self.kv.add_tensor_info(name, byte_shape, np.dtype(np.uint8), nbytes, raw_dtype=qtype)
        self.planned.append(p)

    def begin(self) -> None:
        self._expect(GgufState.PLANNING)
        if not self.planned:
            raise WriterStateError("expected at least one planned tensor, got none")
        self.kv.write_header_to_file(self.path)
        self.kv.write_kv_data_to_file()
        self.kv.write_ti_data_to_file()
        self.state = GgufState.WRITING

    def write(self, name: str, data: np.ndarray) -> int:
        self._expect(GgufState.WRITING)
        if self._next >= len(self.planned):
            raise WriterStateError(f"expected no more tensors (plan complete), got {name!r}")
        p = self.planned[self._next]
        if name != p.name:
            raise WriterStateError(f"expected tensor {p.name!r} next, got {name!r}")
        nbytes = _nbytes(p.shape, p.qtype)
        if data.nbytes != nbytes:
            raise WriterStateError(
                f"expected {nbytes} bytes for {name!r} ({p.qtype.name}), got {data.nbytes}"
            )
        self.kv.write_tensor_data(np.ascontiguousarray(data))
        self._next += 1
        self.bytes_written += nbytes
        return nbytes

    def finish(self) -> None:
        self._expect(GgufState.WRITING)
        if self._next != len(self.planned):
            raise WriterStateError(
                f"expected tensor {self.planned[self._next].name!r} before finishing, got finish()"
            )
        assert self.kv.fout is not None
        for f in self.kv.fout:
            f.flush()
            os.fsync(f.fileno())
        self.kv.close()
        self.state = GgufState.FINISHED

    def abort(self) -> None:
        self.kv.close()
        self.state = GgufState.FAILED


def encode(t: torch.Tensor, qtype: QT) -> np.ndarray:
    """A tensor (fp32, or a 16-bit one as stored) as the bytes of ``qtype``, in one cast.

    Casting a bf16/fp16 tensor directly equals casting it through fp32 (the upcast is exact).
    """
    if qtype == QT.F32:
        return t.to(torch.float32).contiguous().numpy()
    if qtype == QT.F16:
        return t.to(torch.float16).contiguous().numpy()
    if qtype == QT.BF16:
        return t.to(torch.bfloat16).contiguous().view(torch.int16).numpy()
    return gguf.quants.quantize(t.to(torch.float32).contiguous().numpy(), qtype)
