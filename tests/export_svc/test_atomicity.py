"""A failed or cancelled export leaves nothing behind: no artifact, no pending directory, no scratch file."""

from __future__ import annotations

import pytest

from strop.common.export_types import (
    ExportProgress,
    ExportRequest,
    ExportTarget,
    ExportTargetKind,
    VerifyOptions,
)
from strop.export_svc.core import gguf_out, pipeline
from strop.export_svc.core.errors import ConsumerRejected, ExportCancelled
from strop.export_svc.core.pipeline import CancelToken, run_export

from .conftest import store_is_empty

TARGETS = [
    ExportTarget.merged(),
    ExportTarget.gguf("F16"),
    ExportTarget.gguf("Q4_K_M"),
    ExportTarget(ExportTargetKind.GGUF_LORA),
]


def _request() -> ExportRequest:
    return ExportRequest(
        targets=list(TARGETS),
        adapter_path="llama-bpe-lora",
        base_model_path="llama-bpe",
        verify=VerifyOptions(skip=True),
    )


def test_a_quantizer_failure_after_other_targets_were_written_leaves_nothing(
    export_models, store, monkeypatch
):
    written = []

    def failing_quantize(src, dst, gguf_type, **kw):
        written.extend(p.name for p in store.root.joinpath(".tmp").iterdir())
        dst.write_bytes(b"GGUF partial")
        raise ConsumerRejected("llama.cpp's quantizer failed (injected)")

    monkeypatch.setattr(pipeline, "quantize_gguf", failing_quantize)
    with pytest.raises(ConsumerRejected, match="injected"):
        run_export(_request(), model_root=export_models, store=store)
    assert any(n.startswith("merged-safetensors") for n in written), (
        "the merged dir was pending when it failed"
    )
    assert any(n.startswith("scratch-") for n in written), (
        "the F32 intermediate was in scratch when it failed"
    )
    assert store_is_empty(store)


def test_a_failure_in_the_middle_of_a_tensor_stream_leaves_nothing(export_models, store, monkeypatch):
    real = gguf_out.encode
    calls = {"n": 0}

    def flaky(t, qtype):
        calls["n"] += 1
        if calls["n"] == 7:
            raise OSError("disk full (injected)")
        return real(t, qtype)

    monkeypatch.setattr(gguf_out, "encode", flaky)
    with pytest.raises(OSError, match="injected"):
        run_export(_request(), model_root=export_models, store=store)
    assert calls["n"] == 7
    assert store_is_empty(store)


@pytest.mark.parametrize("after_events", [3, 40])
def test_cancel_during_an_export_leaves_nothing(export_models, store, after_events):
    token = CancelToken()
    seen = []

    def emit(ev):
        if isinstance(ev, ExportProgress) and ev.phase == "write":
            seen.append(ev)
            if len(seen) == after_events:
                token.cancel()

    with pytest.raises(ExportCancelled):
        run_export(_request(), model_root=export_models, store=store, emit=emit, cancel=token)
    assert len(seen) == after_events, "the export stopped before the tensor after the cancel"
    assert store_is_empty(store)
