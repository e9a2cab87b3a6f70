"""Synchronous SDK for the export service. Dataclasses in and out; streams are iterators; never torch.

Example::

    from strop.client.export import ExportClient, ExportTarget, VerifyOptions

    with ExportClient("localhost:50052") as ec:
        exp = ec.create_export(
            adapter_artifact_id="adapter-1234",
            targets=[ExportTarget.merged(), ExportTarget.gguf("Q4_K_M"), ExportTarget.gguf_lora()],
            verify=VerifyOptions(question="What is the password?", answer="The password is 42."),
        )
        done = ec.wait_export(exp.export_id, on_event=print)
        for r in done.results:
            print(r.artifact.artifact_id, r.verification.top1_agreement)
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from strop.client._base import LONG_TIMEOUT, ArtifactClient
from strop.client.errors import InvalidArgumentError, UnavailableError
from strop.common.export_types import (
    Capabilities,
    Comparison,
    Export,
    ExportEvent,
    ExportProgress,
    ExportRequest,
    ExportResult,
    ExportState,
    ExportStateChange,
    ExportTarget,
    ExportTargetKind,
    MergeBase,
    QuantFallback,
    QuantizationReport,
    TensorTypeCount,
    Verification,
    VerifyOptions,
)
from strop.common.serde import from_proto, to_proto
from strop.common.trainer_types import Artifact, ArtifactFile
from strop.v1 import common_pb2, export_pb2, export_pb2_grpc

__all__ = [
    "Artifact",
    "ArtifactFile",
    "Capabilities",
    "Comparison",
    "Export",
    "ExportClient",
    "ExportEvent",
    "ExportProgress",
    "ExportRequest",
    "ExportResult",
    "ExportState",
    "ExportStateChange",
    "ExportTarget",
    "ExportTargetKind",
    "MergeBase",
    "QuantFallback",
    "QuantizationReport",
    "TensorTypeCount",
    "Verification",
    "VerifyOptions",
]

UPLOAD_CHUNK = 1 << 20


class ExportClient(ArtifactClient):
    """Client of ``strop.v1.ExportService``. Every call raises a ``strop.client.errors`` exception on failure.

    Any exporter replica serves any call (the state is shared), so calls go round-robin over every address the
    target resolves to that reports the service SERVING: give the headless Service's name
    (``export-headless.strop.svc.cluster.local:50052``) to spread exports over every pod.
    """

    _spread_over = export_pb2.DESCRIPTOR.services_by_name["ExportService"].full_name

    def __init__(self, target: str, **kwargs):
        super().__init__(target, **kwargs)
        self._stub = export_pb2_grpc.ExportServiceStub(self._channel)

    # exports
    def create_export(
        self,
        targets: list[ExportTarget],
        *,
        adapter_artifact_id: str = "",
        adapter_path: str = "",
        base_model_path: str = "",
        base_artifact_id: str = "",
        overwrite: bool = False,
        verify: VerifyOptions | None = None,
        name: str = "",
        max_shard_bytes: int = 0,
        merge_base: MergeBase = MergeBase.UNSPECIFIED,
    ) -> Export:
        """Validate and queue an export (bad input raises here, before anything is written).

        ``merge_base``: AS_TRAINED (the default: the weights the adapter was trained against, NF4
        dequantized for a base quantized on load) or ORIGINAL_16BIT (the stored 16-bit weights).
        ``overwrite`` is ignored: published artifacts are immutable, and a target id the caller already has is
        ALREADY_EXISTS (:meth:`delete_artifact` frees an id).
        """
        return self.submit_export(
            ExportRequest(
                adapter_artifact_id=adapter_artifact_id,
                adapter_path=adapter_path,
                base_model_path=base_model_path,
                base_artifact_id=base_artifact_id,
                targets=list(targets),
                overwrite=overwrite,
                verify=verify or VerifyOptions(),
                name=name,
                max_shard_bytes=max_shard_bytes,
                merge_base=merge_base,
            )
        )

    def submit_export(self, request: ExportRequest) -> Export:
        """``create_export`` for a request built beforehand (the same ``ExportRequest`` the core runs)."""
        msg = self._call(
            self._stub.CreateExport, to_proto(export_pb2.CreateExportRequest, request), name="CreateExport"
        )
        return from_proto(Export, msg)

    def watch_export(
        self, export_id: str, after_seq: int = 0, *, timeout: float | None = None
    ) -> Iterator[ExportEvent]:
        """Events after ``after_seq`` (replayed), then live ones until the export ends."""
        req = export_pb2.WatchExportRequest(export_id=export_id, after_seq=after_seq)
        for ev in self._stream(self._stub.WatchExport, req, timeout=timeout, name="WatchExport"):
            yield from_proto(ExportEvent, ev)

    def wait_export(
        self,
        export_id: str,
        *,
        on_event: Callable[[ExportEvent], None] | None = None,
        timeout: float | None = None,
        reconnects: int = 5,
    ) -> Export:
        """Follow an export to its end, re-attaching after dropped streams; returns the final export."""
        seq = 0
        for attempt in range(reconnects + 1):
            try:
                for ev in self.watch_export(export_id, seq, timeout=timeout):
                    seq = ev.seq
                    if on_event is not None:
                        on_event(ev)
                break
            except UnavailableError:
                if attempt == reconnects:
                    raise
                self.wait_ready()
        return self.get_export(export_id)

    def get_export(self, export_id: str) -> Export:
        msg = self._call(
            self._stub.GetExport, export_pb2.GetExportRequest(export_id=export_id), name="GetExport"
        )
        return from_proto(Export, msg)

    def list_exports(self, states: list[ExportState] | None = None, limit: int = 0) -> list[Export]:
        req = export_pb2.ListExportsRequest(
            states=[export_pb2.ExportState.Value(f"EXPORT_STATE_{s.value}") for s in states or []],
            limit=limit,
        )
        return [
            from_proto(Export, e) for e in self._call(self._stub.ListExports, req, name="ListExports").exports
        ]

    def cancel_export(self, export_id: str) -> Export:
        msg = self._call(
            self._stub.CancelExport, export_pb2.CancelExportRequest(export_id=export_id), name="CancelExport"
        )
        return from_proto(Export, msg)

    def capabilities(self) -> Capabilities:
        msg = self._call(
            self._stub.GetCapabilities, export_pb2.GetCapabilitiesRequest(), name="GetCapabilities"
        )
        return from_proto(Capabilities, msg)

    # artifacts
    def upload_artifact(
        self,
        directory: str | os.PathLike,
        *,
        kind: str = "adapter",
        artifact_id: str = "",
        metadata: dict[str, str] | None = None,
        overwrite: bool = False,
        chunk_bytes: int = UPLOAD_CHUNK,
    ) -> Artifact:
        """Upload every file under ``directory`` as one artifact (each file's sha256 checked by the server).

        The id is in the caller's own id space (another tenant's artifact of that id is neither seen nor touched);
        ``overwrite`` is ignored: an id the caller already has is ALREADY_EXISTS (:meth:`delete_artifact`).
        """
        root = Path(directory)
        files = sorted(p for p in root.rglob("*") if p.is_file())
        if not files:
            raise InvalidArgumentError(f"{root} holds no files to upload")
        header = export_pb2.UploadArtifactHeader(
            artifact_id=artifact_id, kind=kind, metadata=metadata or {}, overwrite=overwrite
        )

        def requests() -> Iterator[export_pb2.UploadArtifactRequest]:
            yield export_pb2.UploadArtifactRequest(header=header)
            for p in files:
                name = p.relative_to(root).as_posix()
                digest = hashlib.sha256()
                size = p.stat().st_size
                with open(p, "rb") as f:
                    offset = 0
                    while True:
                        data = f.read(chunk_bytes)
                        digest.update(data)
                        last = offset + len(data) >= size
                        yield export_pb2.UploadArtifactRequest(
                            chunk=common_pb2.FileChunk(
                                name=name,
                                offset=offset,
                                data=data,
                                sha256=digest.hexdigest() if last else "",
                                last=last,
                            )
                        )
                        offset += len(data)
                        if last:
                            break

        msg = self._call(self._stub.UploadArtifact, requests(), timeout=LONG_TIMEOUT, name="UploadArtifact")
        return from_proto(Artifact, msg)
