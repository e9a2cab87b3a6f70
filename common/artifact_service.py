"""The artifact RPCs of ``common.proto`` (GetArtifact, ListArtifacts, DownloadArtifact, DeleteArtifact), served alike by both
services: a mixin for their servicers over an :class:`~strop.common.artifacts.ArtifactStore` (``self.artifacts``).

Only the services' gRPC layers import this module (it imports the generated protobuf code).
"""

from __future__ import annotations

from strop.common import auth
from strop.common.artifacts import ArtifactStore
from strop.common.serde import to_proto
from strop.v1 import common_pb2

DEFAULT_CHUNK_BYTES = 1 << 20
MAX_CHUNK_BYTES = 16 << 20  # well under the 64 MiB message limit


def visible_key(store: ArtifactStore, artifact_id: str) -> str:
    """The store key of the artifact the caller names, if it may see it; NOT_FOUND as for a missing one otherwise
    (the caller's own id space first, see :meth:`ArtifactStore.resolve`)."""
    return store.resolve(artifact_id, auth.current())


class ArtifactServicer:
    """Mixed into a servicer that sets ``self.artifacts``."""

    artifacts: ArtifactStore

    def GetArtifact(self, request, context):
        return to_proto(
            common_pb2.Artifact, self.artifacts.get(visible_key(self.artifacts, request.artifact_id))
        )

    def DeleteArtifact(self, request, context):
        key = visible_key(self.artifacts, request.artifact_id)
        return to_proto(common_pb2.Artifact, self.artifacts.delete(key))

    def ListArtifacts(self, request, context):
        me = auth.current()
        page, token = self.artifacts.list_page(
            request.kind or None,
            request.page_size,
            request.page_token,
            keep=lambda a: me.can_see(a.metadata.get("tenant", "")),
        )
        return common_pb2.ListArtifactsResponse(
            artifacts=[to_proto(common_pb2.Artifact, a) for a in page], next_page_token=token
        )

    def DownloadArtifact(self, request, context):
        key = visible_key(self.artifacts, request.artifact_id)
        chunk = min(request.chunk_bytes or DEFAULT_CHUNK_BYTES, MAX_CHUNK_BYTES)
        for name, offset, data, sha, last in self.artifacts.iter_chunks(key, chunk):
            yield common_pb2.FileChunk(name=name, offset=offset, data=data, sha256=sha, last=last)
