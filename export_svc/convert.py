"""Protobuf ⇄ core dataclass conversions for the export service (the only place both meet)."""

from __future__ import annotations

from strop.common.artifacts import ArtifactInfo
from strop.export_svc.core.jobs import ExportEvent, ExportRecord, ExportState
from strop.export_svc.core.pipeline import ExportRequest, TargetKind, TargetResult, TargetSpec
from strop.export_svc.core.verify import Verification, VerifySpec
from strop.v1 import common_pb2, export_pb2

KIND_TO_PB = {
    TargetKind.MERGED_SAFETENSORS: export_pb2.EXPORT_TARGET_KIND_MERGED_SAFETENSORS,
    TargetKind.PEFT_ADAPTER: export_pb2.EXPORT_TARGET_KIND_PEFT_ADAPTER,
    TargetKind.GGUF: export_pb2.EXPORT_TARGET_KIND_GGUF,
    TargetKind.GGUF_LORA: export_pb2.EXPORT_TARGET_KIND_GGUF_LORA,
}
PB_TO_KIND = {v: k for k, v in KIND_TO_PB.items()}
STATE_TO_PB = {s: getattr(export_pb2, f"EXPORT_STATE_{s.value}") for s in ExportState}
PB_TO_STATE = {v: k for k, v in STATE_TO_PB.items()}


def target_from_pb(t: export_pb2.ExportTarget) -> TargetSpec:
    # an unspecified or unknown kind is passed on as a string; normalize_targets refuses it by name
    kind = PB_TO_KIND.get(t.kind) or f"target kind {t.kind}"
    return TargetSpec(kind, t.gguf_type, t.dtype, t.artifact_id, t.base_gguf_type)  # type: ignore[arg-type]


def target_to_pb(t: TargetSpec) -> export_pb2.ExportTarget:
    return export_pb2.ExportTarget(
        kind=KIND_TO_PB[TargetKind(t.kind)],
        gguf_type=t.gguf_type,
        dtype=t.dtype,
        artifact_id=t.artifact_id,
        base_gguf_type=t.base_gguf_type,
    )


def request_from_pb(r: export_pb2.CreateExportRequest) -> ExportRequest:
    v = r.verify
    return ExportRequest(
        targets=[target_from_pb(t) for t in r.targets],
        adapter_artifact_id=r.adapter_artifact_id,
        adapter_path=r.adapter_path,
        base_path=r.base_model_path,
        base_artifact_id=r.base_artifact_id,
        overwrite=r.overwrite,
        verify=VerifySpec(
            enabled=not v.skip,
            prompts=list(v.prompts),
            heldout=list(v.heldout_texts),
            question=v.question,
            answer=v.answer,
            chat=not v.raw_question,
            max_new_tokens=v.max_new_tokens,
        ),
        name=r.name,
        max_shard_bytes=r.max_shard_bytes,
    )


def request_to_pb(r: ExportRequest) -> export_pb2.CreateExportRequest:
    v = r.verify
    return export_pb2.CreateExportRequest(
        adapter_artifact_id=r.adapter_artifact_id,
        adapter_path=r.adapter_path,
        base_model_path=r.base_path,
        base_artifact_id=r.base_artifact_id,
        targets=[target_to_pb(t) for t in r.targets],
        overwrite=r.overwrite,
        verify=export_pb2.VerifyOptions(
            skip=not v.enabled,
            prompts=v.prompts,
            heldout_texts=v.heldout,
            question=v.question,
            answer=v.answer,
            raw_question=not v.chat,
            max_new_tokens=v.max_new_tokens,
        ),
        name=r.name,
        max_shard_bytes=r.max_shard_bytes,
    )


def artifact_to_pb(a: ArtifactInfo) -> common_pb2.Artifact:
    return common_pb2.Artifact(
        artifact_id=a.artifact_id,
        kind=a.kind,
        path=a.path,
        sha256=a.sha256,
        size_bytes=a.size_bytes,
        files=[
            common_pb2.ArtifactFile(name=f.name, size_bytes=f.size_bytes, sha256=f.sha256) for f in a.files
        ],
        metadata=a.metadata,
        created_at=a.created_at,
    )


def verification_to_pb(v: Verification) -> export_pb2.Verification:
    return export_pb2.Verification(
        consumer=v.consumer,
        positions=v.positions,
        max_abs_logit_delta=v.max_abs_logit_delta,
        mean_abs_logit_delta=v.mean_abs_logit_delta,
        top1_agreement=v.top1_agreement,
        perplexity_reference=v.perplexity_reference,
        perplexity=v.perplexity,
        perplexity_delta=v.perplexity_delta,
        tokens_checked=v.tokens_match is not None,
        tokens_match=bool(v.tokens_match),
        token_mismatches=v.token_mismatches,
        chat_tokens_checked=v.chat_tokens_match is not None,
        chat_tokens_match=bool(v.chat_tokens_match),
        generated=v.generated,
        answer_checked=v.answer_reproduced is not None,
        answer_reproduced=bool(v.answer_reproduced),
        answer_top1_agreement=v.answer_top1_agreement or 0.0,
        answer_tokens=v.answer_tokens,
        problems=v.problems,
        passed=v.passed,
        notes=v.notes,
    )


def result_to_pb(r: TargetResult) -> export_pb2.ExportResult:
    out = export_pb2.ExportResult(target=target_to_pb(r.target), artifact=artifact_to_pb(r.artifact))
    if r.verification is not None:
        out.verification.CopyFrom(verification_to_pb(r.verification))
    return out


def export_to_pb(rec: ExportRecord) -> export_pb2.Export:
    return export_pb2.Export(
        export_id=rec.export_id,
        name=rec.name,
        state=STATE_TO_PB[rec.state],
        request=request_to_pb(rec.request),
        results=[result_to_pb(r) for r in rec.results],
        error=rec.error,
        error_code=rec.error_code,
        created_at=rec.created_at,
        started_at=rec.started_at,
        finished_at=rec.finished_at,
        last_seq=rec.last_seq,
    )


def event_to_pb(ev: ExportEvent) -> export_pb2.ExportEvent:
    out = export_pb2.ExportEvent(export_id=ev.export_id, seq=ev.seq, time=ev.time)
    if ev.kind == "state":
        out.state.CopyFrom(
            export_pb2.ExportStateChange(
                state=STATE_TO_PB[ExportState(ev.data["state"])], message=ev.data.get("message", "")
            )
        )
    elif ev.kind == "progress":
        p = ev.progress
        assert p is not None
        out.progress.CopyFrom(
            export_pb2.ExportProgress(
                target=p.target,
                phase=p.phase,
                item=p.item,
                items_done=p.done,
                items_total=p.total,
                bytes_written=p.bytes_written,
                bytes_total=p.bytes_total,
            )
        )
    elif ev.kind == "result":
        r = ev.result
        assert r is not None
        out.result.CopyFrom(result_to_pb(r))
    return out
