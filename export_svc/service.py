"""The ExportService servicer: protobuf in, core call, protobuf out (errors mapped by the interceptor).

Every message converts to and from the export API's dataclasses by field name (``strop.common.serde``),
here and nowhere else; an enum number this build does not know is INVALID_ARGUMENT, naming the valid ones.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator

from strop.common import auth
from strop.common.aio import follow
from strop.common.artifact_service import ArtifactServicer
from strop.common.artifacts import ArtifactStore
from strop.common.export_types import ExportRequest, ExportState, ExportStateChange
from strop.common.grpc_server import Drain
from strop.common.serde import from_proto, to_proto
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


class ExportServicer(ArtifactServicer, export_pb2_grpc.ExportServiceServicer):
    """Export RPCs over the job manager; the artifact RPCs (Get/List/Download/Delete) are ``ArtifactServicer``'s."""

    def __init__(self, manager: ExportManager, store: ArtifactStore, drain: Drain):
        self.manager, self.store, self.drain = manager, store, drain
        self.artifacts = store

    def CreateExport(self, request, context):
        self.drain.check()
        return to_proto(export_pb2.Export, self.manager.create(from_proto(ExportRequest, request)))

    async def WatchExport(self, request, context):
        # on the event loop: an open stream holds no thread while it waits for the next event
        poll = functools.partial(self.manager.poll, request.export_id)
        convert = functools.partial(to_proto, export_pb2.ExportEvent)
        async for ev in follow(
            poll, self.manager.changed, request.after_seq, context=context, convert=convert
        ):
            yield ev

    def GetExport(self, request, context):
        return to_proto(export_pb2.Export, self.manager.get(request.export_id))

    def ListExports(self, request, context):
        states = [
            from_proto(ExportStateChange, export_pb2.ExportStateChange(state=s)).state for s in request.states
        ]
        exports = self.manager.list([s for s in states if s is not ExportState.UNSPECIFIED], request.limit)
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
            owner=auth.current().tenant,
            artifact_id=h.artifact_id or None,
            metadata={**dict(h.metadata), "source": "upload"},
        )
        return to_proto(common_pb2.Artifact, info)
