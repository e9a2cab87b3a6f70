"""The state database: today's rows round-trip exactly, and rows earlier versions wrote still load."""

from __future__ import annotations

import json
from pathlib import Path

from strop.common.artifacts import ArtifactStore
from strop.common.db import SqliteDatabase
from strop.common.export_types import (
    ExportProgress,
    ExportRequest,
    ExportResult,
    ExportState,
    ExportTarget,
    ExportTargetKind,
    Verification,
    VerifyOptions,
)
from strop.common.serde import from_dict, to_dict, to_proto
from strop.common.trainer_types import Artifact
from strop.export_svc.core.jobs import SCHEMA, ExportManager
from strop.export_svc.core.legacy_rows import upgrade_progress, upgrade_request, upgrade_result
from strop.v1 import export_pb2

OLD_ROWS = Path(__file__).with_name("old_export_db_rows.json")


def _old_state_dir(tmp_path: Path) -> Path:
    """A state directory holding the rows of two exports as the code of commit fe27371 stored them,
    plus a progress event as the first export service (commit 74b5221) stored it (``done``/``total``)."""
    rows = json.loads(OLD_ROWS.read_text())
    db = SqliteDatabase(tmp_path / "state" / "export.db", SCHEMA)
    stmts = []
    for e in rows["exports"]:
        cols = ", ".join(e)
        stmts.append((f"INSERT INTO exports ({cols}) VALUES ({', '.join('?' * len(e))})", tuple(e.values())))
    for ev in rows["export_events"]:
        cols = ", ".join(ev)
        stmts.append(
            (f"INSERT INTO export_events ({cols}) VALUES ({', '.join('?' * len(ev))})", tuple(ev.values()))
        )
    first = rows["exports"][0]["export_id"]
    oldest_progress = {"target": "gguf:F16", "phase": "write", "item": "w", "done": 3, "total": 21}
    stmts.append(
        (
            "INSERT INTO export_events (export_id, seq, time, kind, data) VALUES (?, ?, ?, ?, ?)",
            (first, 1000, 0.0, "progress", json.dumps(oldest_progress)),
        )
    )
    db.transaction(stmts)
    db.close()
    return tmp_path / "state"


def test_rows_stored_by_the_previous_request_types_still_load(tmp_path):
    manager = ExportManager(_old_state_dir(tmp_path), tmp_path, ArtifactStore(tmp_path / "artifacts"))
    try:
        verified, unverified = sorted(manager.list(), key=lambda e: e.created_at)
        assert verified.state is ExportState.SUCCEEDED and verified.name == "old-verified"

        req = verified.request
        assert (req.adapter_path, req.base_model_path) == ("llama-bpe-lora", "llama-bpe"), "base_path renamed"
        assert req.verify == VerifyOptions(
            skip=False,  # enabled: true
            prompts=["Hello there"],
            heldout_texts=["Some held out text."],  # heldout
            question="Q?",
            answer="A.",
            raw_question=True,  # chat: false
            max_new_tokens=4,
        )
        assert [t.kind for t in req.targets] == [ExportTargetKind.GGUF, ExportTargetKind.PEFT_ADAPTER]
        assert [t.label for t in req.targets] == ["gguf:F16", "peft_adapter"]

        gguf_result, peft_result = verified.results
        v = gguf_result.verification
        assert (v.consumer, v.tokens_checked, v.tokens_match) == ("llama.cpp", True, True)
        assert (v.chat_tokens_checked, v.chat_tokens_match) == (True, True)
        assert (v.answer_checked, v.answer_reproduced, v.answer_tokens) == (True, False, 2)
        assert v.max_abs_logit_delta == float(gguf_result.artifact.metadata["verify.max_abs_logit_delta"])
        p = peft_result.verification
        assert p.consumer == "transformers+peft"
        assert (p.tokens_checked, p.tokens_match, p.chat_tokens_checked, p.chat_tokens_match) == (
            False,
            None,
            False,
            None,
        ), "transformers runs HF's own tokenizer: None (not compared) stays None, with *_checked=False"
        assert p.answer_checked, "the probe question ran on the PEFT dir too"

        assert unverified.request.verify.skip, "enabled: false"
        assert [t.kind for t in unverified.request.targets] == [
            ExportTargetKind.MERGED_SAFETENSORS,
            ExportTargetKind.GGUF_LORA,
        ]
        assert [r.verification for r in unverified.results] == [None, None]
        assert unverified.results[0].artifact.artifact_id == "old-merged"

        events = manager.events(verified.export_id)
        results = [e.result for e in events if e.result is not None]
        assert results == verified.results, "result events decode like the results column"
        progress = [e.progress for e in events if e.progress is not None]
        assert progress[-1] == ExportProgress("gguf:F16", "write", "w", 3, 21), "done/total renamed"
        states = [e.state.state for e in events if e.state is not None]
        assert states == [ExportState.QUEUED, ExportState.RUNNING, ExportState.SUCCEEDED]
        for e in (verified, unverified):
            msg = to_proto(export_pb2.Export, e)  # what GetExport sends: every enum and field converts
            assert msg.request.targets[0].kind != export_pb2.EXPORT_TARGET_KIND_UNSPECIFIED
    finally:
        manager.shutdown()


def test_rows_written_today_pass_the_legacy_read_unchanged():
    req = ExportRequest(
        adapter_artifact_id="a",
        base_model_path="b",
        targets=[ExportTarget.gguf_lora("F16", "Q4_K_M", artifact_id="x"), ExportTarget.merged("float16")],
        overwrite=True,
        verify=VerifyOptions(skip=True, heldout_texts=["h"], raw_question=True, max_new_tokens=3),
        name="n",
        max_shard_bytes=7,
    )
    assert upgrade_request(to_dict(req)) == to_dict(req)
    assert from_dict(ExportRequest, upgrade_request(to_dict(req))) == req
    unchecked = Verification(consumer="llama.cpp", tokens_checked=False, answer_checked=True)
    res = ExportResult(ExportTarget.gguf("F16"), Artifact(artifact_id="x", kind="gguf"), unchecked)
    assert from_dict(ExportResult, upgrade_result(to_dict(res))) == res, (
        "a check that did not run stays unchecked; today's rows are not mistaken for old ones"
    )
    progress = ExportProgress("t", "write", "w", 1, 2, 3, 4)
    assert from_dict(ExportProgress, upgrade_progress(to_dict(progress))) == progress
