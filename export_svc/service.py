"""The ExportService servicer: protobuf in, core call, protobuf out (errors mapped by the interceptor)."""

from __future__ import annotations

from collections.abc import Iterator

from strop.common.artifacts import ArtifactStore
from strop.common.grpc_server import Drain
from strop.common.serde import to_proto
from strop.export_svc import convert as C
from strop.export_svc.core.errors import InvalidArgument
from strop.export_svc.core.jobs import ExportManager
from strop.export_svc.core.pipeline import capabilities
from strop.v1 import common_pb2, export_pb2, export_pb2_grpc

UPLOAD_KINDS = ("adapter", "base_model")


def upload_parts(requests: Iterator[export_pb2.UploadArtifactRequest]):
    """Split an upload stream into its header and a ``(name, offset, data, sha256, last)`` iterator."""
    first = next(requests, None)
    if first is None or not first.HasField("header"):
        raise InvalidArgument("an upload starts with a header message")
    header = first.header
    if (header.kind or "adapter") not in UPLOAD_KINDS:
        raise InvalidArgument(f"upload kind {header.kind!r} is not one of {list(UPLOAD_KINDS)}")

    def chunks():
        for r in requests:
            if not r.HasField("chunk"):
                raise InvalidArgument("only file chunks may follow the upload header")
            c = r.chunk
            yield c.name, c.offset, c.data, c.sha256, c.last

    return header, chunks()


class ExportServicer(export_pb2_grpc.ExportServiceServicer):
    def __init__(self, manager: ExportManager, store: ArtifactStore, drain: Drain):
        self.manager, self.store, self.drain = manager, store, drain

    def CreateExport(self, request, context):
        self.drain.check()
        return to_proto(export_pb2.Export, self.manager.create(C.request_from_pb(request)))

    def WatchExport(self, request, context):
        for ev in self.manager.watch(request.export_id, request.after_seq, alive=context.is_active):
            yield to_proto(export_pb2.ExportEvent, ev)

    def GetExport(self, request, context):
        return to_proto(export_pb2.Export, self.manager.get(request.export_id))

    def ListExports(self, request, context):
        states = [C.PB_TO_STATE[s] for s in request.states if s in C.PB_TO_STATE]
        exports = self.manager.list(states, request.limit)
        return export_pb2.ListExportsResponse(exports=[to_proto(export_pb2.Export, e) for e in exports])

    def CancelExport(self, request, context):
        return to_proto(export_pb2.Export, self.manager.cancel(request.export_id))

    def GetCapabilities(self, request, context):
        return to_proto(export_pb2.Capabilities, capabilities())

    def UploadArtifact(self, request_iterator, context):
        self.drain.check()
        h, chunks = upload_parts(request_iterator)
        info = self.store.receive(
            h.kind or "adapter",
            chunks,
            artifact_id=h.artifact_id or None,
            metadata=dict(h.metadata),
            overwrite=h.overwrite,
        )
        return C.artifact_to_pb(info)

    def GetArtifact(self, request, context):
        return C.artifact_to_pb(self.store.get(request.artifact_id))

    def ListArtifacts(self, request, context):
        items = self.store.list(request.kind or None)
        start = int(request.page_token) if request.page_token.isdigit() else 0
        size = request.page_size if request.page_size > 0 else len(items)
        page = items[start : start + size]
        token = str(start + size) if start + size < len(items) else ""
        return common_pb2.ListArtifactsResponse(
            artifacts=[C.artifact_to_pb(a) for a in page], next_page_token=token
        )

    def DownloadArtifact(self, request, context):
        for name, offset, data, sha, last in self.store.iter_chunks(request.artifact_id, request.chunk_bytes):
            yield common_pb2.FileChunk(name=name, offset=offset, data=data, sha256=sha, last=last)
