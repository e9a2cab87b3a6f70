"""Protobuf → core conversions for the export service's requests.

Responses leave as the API's dataclasses (``strop.common.export_types``, which the core returns),
converted by field name with ``strop.common.serde.to_proto``. Requests come in by hand here, because a
target kind number this build does not know has no enum member to convert to, yet must reach
``normalize_targets`` to be refused by name.
"""

from __future__ import annotations

from strop.common.export_types import ExportState, VerifyOptions
from strop.common.serde import from_proto, to_proto
from strop.common.trainer_types import Artifact
from strop.export_svc.core.pipeline import ExportRequest, TargetKind, TargetSpec
from strop.export_svc.core.verify import VerifySpec
from strop.v1 import common_pb2, export_pb2

PB_TO_KIND = {getattr(export_pb2, f"EXPORT_TARGET_KIND_{k.name}"): k for k in TargetKind}
# ListExports filters on these; UNSPECIFIED and unknown numbers are ignored
PB_TO_STATE = {
    getattr(export_pb2, f"EXPORT_STATE_{s.value}"): s for s in ExportState if s is not ExportState.UNSPECIFIED
}


def target_from_pb(t: export_pb2.ExportTarget) -> TargetSpec:
    # an unspecified or unknown kind is passed on as a string; normalize_targets refuses it by name
    kind = PB_TO_KIND.get(t.kind) or f"target kind {t.kind}"
    return TargetSpec(kind, t.gguf_type, t.dtype, t.artifact_id, t.base_gguf_type)  # type: ignore[arg-type]


def request_from_pb(r: export_pb2.CreateExportRequest) -> ExportRequest:
    return ExportRequest(
        targets=[target_from_pb(t) for t in r.targets],
        adapter_artifact_id=r.adapter_artifact_id,
        adapter_path=r.adapter_path,
        base_path=r.base_model_path,
        base_artifact_id=r.base_artifact_id,
        overwrite=r.overwrite,
        verify=VerifySpec.from_api(from_proto(VerifyOptions, r.verify)),
        name=r.name,
        max_shard_bytes=r.max_shard_bytes,
    )


def request_to_pb(r: ExportRequest) -> export_pb2.CreateExportRequest:
    return to_proto(export_pb2.CreateExportRequest, r.to_api())


def artifact_to_pb(a: Artifact) -> common_pb2.Artifact:
    return to_proto(common_pb2.Artifact, a)
