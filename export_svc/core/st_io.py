"""Safetensors reading and streaming writing without mmap, so memory stays near one tensor.

``SafetensorsFile`` validates a file's header against its size before anything is read (a truncated
file is refused with its name) and reads one tensor at a time with ``pread`` into fresh memory: no
mapping of the whole file, so the resident set does not grow with the file.

``ShardedSafetensorsWriter`` writes a sharded checkpoint plus ``model.safetensors.index.json``.
The plan (every tensor's name, dtype and shape) is fixed up front, so each shard's header, with all
offsets, is written before its data, and tensor bytes are then streamed in plan order. The writer
is an explicit state machine (gguf-py style): out-of-order calls raise "expected X, got Y".
"""

from __future__ import annotations

import enum
import json
import math
import os
import struct
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from strop.export_svc.core.errors import CorruptInput, WriterStateError

ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
}
ST_NAMES: dict[torch.dtype, str] = {v: k for k, v in ST_DTYPES.items()}
_MAX_HEADER = 100 << 20


def dtype_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lies in a safetensors file."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    start: int  # absolute byte offset in the file
    nbytes: int


class SafetensorsFile:
    """A validated safetensors file; tensors are read one at a time, never mapped.

    Raises:
        CorruptInput: the file is shorter than its header says, or the header is malformed.
    """

    def __init__(self, path: str | os.PathLike, *, label: str | None = None):
        self.path = Path(path)
        self.label = label or self.path.name
        size = self.path.stat().st_size
        with open(self.path, "rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise CorruptInput(f"safetensors file {self.label!r} is truncated ({size} bytes, no header)")
            (n,) = struct.unpack("<Q", head)
            if n > _MAX_HEADER:
                raise CorruptInput(f"safetensors file {self.label!r} has an implausible header length {n}")
            if 8 + n > size:
                raise CorruptInput(
                    f"safetensors file {self.label!r} is truncated: header needs {8 + n} bytes, file has {size}"
                )
            raw = f.read(n)
        try:
            header = json.loads(raw)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise CorruptInput(f"safetensors file {self.label!r} has a malformed header: {exc}") from None
        if not isinstance(header, dict):
            raise CorruptInput(f"safetensors file {self.label!r} has a malformed header (not an object)")
        self.metadata: dict[str, str] = header.pop("__metadata__", None) or {}
        base = 8 + n
        self.entries: dict[str, TensorEntry] = {}
        end_max = 0
        for name, info in header.items():
            try:
                dtype = ST_DTYPES[info["dtype"]]
                shape = tuple(int(d) for d in info["shape"])
                b, e = (int(x) for x in info["data_offsets"])
            except (KeyError, TypeError, ValueError):
                raise CorruptInput(
                    f"safetensors file {self.label!r}: tensor {name!r} has a malformed or unsupported entry"
                ) from None
            expected = math.prod(shape) * dtype_size(dtype)
            if e - b != expected or b < 0:
                raise CorruptInput(
                    f"safetensors file {self.label!r}: tensor {name!r} spans {e - b} bytes, "
                    f"its shape {list(shape)} needs {expected}"
                )
            end_max = max(end_max, e)
            self.entries[name] = TensorEntry(name, dtype, shape, base + b, expected)
        if base + end_max > size:
            raise CorruptInput(
                f"safetensors file {self.label!r} is truncated: its tensors need {base + end_max} bytes, "
                f"the file has {size}"
            )

    def names(self) -> list[str]:
        """Tensor names in file order (by offset)."""
        return [e.name for e in sorted(self.entries.values(), key=lambda e: e.start)]

    def __contains__(self, name: str) -> bool:
        return name in self.entries

    def read(self, name: str) -> torch.Tensor:
        """Read one tensor into fresh (owned, writable) memory."""
        e = self.entries[name]
        buf = bytearray(e.nbytes)
        with open(self.path, "rb", buffering=0) as f:
            f.seek(e.start)
            view = memoryview(buf)
            got = 0
            while got < e.nbytes:
                k = f.readinto(view[got:])
                if not k:
                    raise CorruptInput(f"safetensors file {self.label!r} ended inside tensor {name!r}")
                got += k
        if e.nbytes == 0:
            return torch.empty(e.shape, dtype=e.dtype)
        return torch.frombuffer(buf, dtype=e.dtype).reshape(e.shape)


class WriterState(enum.Enum):
    """States of ``ShardedSafetensorsWriter``."""

    PLANNED = "planned"  # plan fixed, nothing written
    WRITING = "writing"  # a shard header written, tensors streaming
    FINISHED = "finished"  # every shard and the index written
    FAILED = "failed"


@dataclass(frozen=True)
class PlannedTensor:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * dtype_size(self.dtype)


def plan_shards(tensors: Iterable[PlannedTensor], max_shard_bytes: int) -> list[list[PlannedTensor]]:
    """Group tensors, in order, into shards of at most ``max_shard_bytes`` (a bigger tensor gets its own)."""
    shards: list[list[PlannedTensor]] = [[]]
    size = 0
    for t in tensors:
        if shards[-1] and size + t.nbytes > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(t)
        size += t.nbytes
    return [s for s in shards if s]


class ShardedSafetensorsWriter:
    """Streams tensors into ``model-0000i-of-0000N.safetensors`` shards plus the index.

    Usage: ``w = ShardedSafetensorsWriter(dir, plan, max_shard_bytes)``; ``w.write(name, tensor)`` for
    every planned tensor in plan order; ``w.finish()``.
    """

    def __init__(self, out_dir: str | os.PathLike, plan: list[PlannedTensor], max_shard_bytes: int):
        if not plan:
            raise WriterStateError("expected at least one tensor in the plan, got none")
        self.out_dir = Path(out_dir)
        self.shards = plan_shards(plan, max_shard_bytes)
        n = len(self.shards)
        self.file_names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
        self.state = WriterState.PLANNED
        self.bytes_total = sum(t.nbytes for t in plan)
        self.bytes_written = 0
        self._shard = -1
        self._pos = 0
        self._fh = None

    def _expect(self, *states: WriterState) -> None:
        if self.state not in states:
            raise WriterStateError(
                f"expected writer state {' or '.join(s.value for s in states)}, got {self.state.value}"
            )

    def _open_next(self) -> None:
        if self._fh is not None:
            self._fh.flush()
            os.fsync(self._fh.fileno())
            self._fh.close()
        self._shard += 1
        self._pos = 0
        header: dict[str, object] = {"__metadata__": {"format": "pt"}}
        offset = 0
        for t in self.shards[self._shard]:
            header[t.name] = {
                "dtype": ST_NAMES[t.dtype],
                "shape": list(t.shape),
                "data_offsets": [offset, offset + t.nbytes],
            }
            offset += t.nbytes
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)  # safetensors pads the header to an 8-byte boundary
        self._fh = open(self.out_dir / self.file_names[self._shard], "wb")
        self._fh.write(struct.pack("<Q", len(raw)))
        self._fh.write(raw)

    def write(self, name: str, tensor: torch.Tensor) -> int:
        """Write the next planned tensor; returns the bytes written."""
        self._expect(WriterState.PLANNED, WriterState.WRITING)
        if self.state is WriterState.PLANNED:
            self.out_dir.mkdir(parents=True, exist_ok=True)
            self._open_next()
            self.state = WriterState.WRITING
        if self._pos >= len(self.shards[self._shard]):
            if self._shard + 1 >= len(self.shards):
                raise WriterStateError(f"expected no more tensors (plan complete), got {name!r}")
            self._open_next()
        want = self.shards[self._shard][self._pos]
        if name != want.name:
            raise WriterStateError(f"expected tensor {want.name!r} next, got {name!r}")
        if tensor.dtype != want.dtype or tuple(tensor.shape) != want.shape:
            raise WriterStateError(
                f"expected {want.name!r} as {want.dtype} {list(want.shape)}, got {tensor.dtype} {list(tensor.shape)}"
            )
        data = tensor.contiguous().view(torch.uint8).numpy() if tensor.numel() else b""
        assert self._fh is not None
        self._fh.write(memoryview(data))
        self._pos += 1
        self.bytes_written += want.nbytes
        return want.nbytes

    def finish(self) -> list[str]:
        """Close the last shard, write the index; returns the written file names."""
        self._expect(WriterState.WRITING)
        if self._shard != len(self.shards) - 1 or self._pos != len(self.shards[-1]):
            want = self.shards[self._shard][self._pos] if self._pos < len(self.shards[self._shard]) else None
            raise WriterStateError(
                f"expected tensor {want.name if want else '(next shard)'!r} before finishing, got finish()"
            )
        assert self._fh is not None
        self._fh.flush()
        os.fsync(self._fh.fileno())
        self._fh.close()
        self._fh = None
        index = {
            "metadata": {"total_size": self.bytes_total},
            "weight_map": {t.name: self.file_names[i] for i, shard in enumerate(self.shards) for t in shard},
        }
        (self.out_dir / "model.safetensors.index.json").write_text(
            json.dumps(index, indent=2, sort_keys=True)
        )
        self.state = WriterState.FINISHED
        return [*self.file_names, "model.safetensors.index.json"]

    def abort(self) -> None:
        if self._fh is not None:
            self._fh.close()
            self._fh = None
        self.state = WriterState.FAILED
