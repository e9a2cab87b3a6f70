"""The writers are explicit state machines; the quantizer's ftype table is llama.cpp's; inputs are validated."""

from __future__ import annotations

import json
import struct

import numpy as np
import pytest
import torch

from strop.export_svc.core.errors import CorruptInput, WriterStateError
from strop.export_svc.core.gguf_types import GGUF_TYPES, QT
from strop.export_svc.core.gguf_writer import GgufStreamWriter
from strop.export_svc.core.st_io import PlannedTensor, SafetensorsFile, ShardedSafetensorsWriter


def test_sharded_writer_refuses_tensors_out_of_plan_order(tmp_path):
    plan = [PlannedTensor("a", torch.float32, (4, 4)), PlannedTensor("b", torch.bfloat16, (8,))]
    w = ShardedSafetensorsWriter(tmp_path, plan, max_shard_bytes=64)
    with pytest.raises(WriterStateError, match="expected writer state writing, got planned"):
        w.finish()
    with pytest.raises(WriterStateError, match="expected tensor 'a' next, got 'b'"):
        w.write("b", torch.zeros(8, dtype=torch.bfloat16))
    w.write("a", torch.ones(4, 4))
    with pytest.raises(
        WriterStateError, match=r"expected 'b' as torch.bfloat16 \[8\], got torch.float32 \[8\]"
    ):
        w.write("b", torch.zeros(8))
    with pytest.raises(WriterStateError, match="expected tensor 'b' before finishing, got finish"):
        w.finish()
    w.write("b", torch.arange(8, dtype=torch.bfloat16))
    files = w.finish()
    assert files == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
        "model.safetensors.index.json",
    ]
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    assert index == {"metadata": {"total_size": 64 + 16}, "weight_map": {"a": files[0], "b": files[1]}}
    assert torch.equal(SafetensorsFile(tmp_path / files[1]).read("b"), torch.arange(8, dtype=torch.bfloat16))


def test_gguf_writer_refuses_calls_out_of_order(tmp_path):
    w = GgufStreamWriter(tmp_path / "x.gguf", "llama")
    with pytest.raises(WriterStateError, match="expected GGUF writer state writing, got planning"):
        w.write("t", np.zeros(4, np.float32))
    w.plan("t", (4,), QT.F32)
    w.plan("u", (2, 32), QT.Q8_0)
    w.begin()
    with pytest.raises(WriterStateError, match="expected GGUF writer state planning, got writing"):
        w.plan("v", (4,), QT.F32)
    with pytest.raises(WriterStateError, match="expected tensor 't' next, got 'u'"):
        w.write("u", np.zeros((2, 34), np.uint8))
    w.write("t", np.zeros(4, np.float32))
    with pytest.raises(WriterStateError, match=r"expected 68 bytes for 'u' \(Q8_0\), got 64"):
        w.write("u", np.zeros((2, 32), np.uint8))
    with pytest.raises(WriterStateError, match="expected tensor 'u' before finishing"):
        w.finish()


def test_safetensors_reader_names_the_file_and_the_problem(tmp_path):
    header = json.dumps({"w": {"dtype": "F32", "shape": [4, 4], "data_offsets": [0, 60]}}).encode()
    p = tmp_path / "bad.safetensors"
    p.write_bytes(struct.pack("<Q", len(header)) + header + b"\0" * 60)
    with pytest.raises(
        CorruptInput, match=r"'bad.safetensors': tensor 'w' spans 60 bytes, its shape \[4, 4\] needs 64"
    ):
        SafetensorsFile(p)
    p.write_bytes(struct.pack("<Q", 10**6) + b"{}")
    with pytest.raises(
        CorruptInput, match=r"'bad.safetensors' is truncated: header needs 1000008 bytes, file has 10"
    ):
        SafetensorsFile(p)


def test_gguf_file_types_are_llama_cpps_own_constants():
    """general.file_type, and the ftype llama.cpp's quantizer is asked for, are llama.h's numbers."""
    import llama_cpp

    for name, t in GGUF_TYPES.items():
        constant = "LLAMA_FTYPE_ALL_F32" if name == "F32" else f"LLAMA_FTYPE_MOSTLY_{name}"
        assert getattr(llama_cpp, constant) == t.file_type, name
    assert [n for n, t in GGUF_TYPES.items() if t.direct] == ["F32", "F16", "BF16", "Q8_0"], (
        "gguf-py writes these itself; every other type goes through llama.cpp's quantizer"
    )
    default = llama_cpp.llama_model_quantize_default_params().ftype
    assert default == llama_cpp.LLAMA_FTYPE_MOSTLY_Q8_0, (
        "llama.cpp's default is Q8_0: strop must always set the ftype"
    )
