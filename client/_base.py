"""Plumbing shared by the SDK's clients: timeouts, error mapping, stream iteration, and the artifact
RPCs of ``common.proto`` that both services serve."""

from __future__ import annotations

import hashlib
import os
import shutil
import uuid
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, TypeVar

import grpc

from strop.client.errors import DataLossError, InvalidArgumentError, from_rpc_error
from strop.common.serde import from_proto
from strop.common.trainer_types import Artifact
from strop.v1 import common_pb2

T = TypeVar("T")

DEFAULT_TIMEOUT = 60.0  # unary calls (LoadModel may take a while on big checkpoints)
LONG_TIMEOUT = 3600.0  # model loads, uploads
MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
]


class BaseClient:
    """Owns a channel (or borrows one) and wraps calls so that only SDK exceptions escape."""

    def __init__(self, target: str, *, channel: grpc.Channel | None = None, timeout: float = DEFAULT_TIMEOUT):
        self.target = target
        self._owns_channel = channel is None
        self._channel = channel or grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        self.timeout = timeout

    def close(self) -> None:
        if self._owns_channel:
            self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, fn: Callable[..., T], request: Any, *, timeout: float | None = None, name: str = "") -> T:
        try:
            return fn(request, timeout=timeout or self.timeout)
        except grpc.RpcError as err:
            raise from_rpc_error(err, name) from None

    def _stream(
        self, fn: Callable[..., Any], request: Any, *, timeout: float | None = None, name: str = ""
    ) -> Iterator[Any]:
        """Iterate a server stream; closing the iterator cancels the call (the server-side job goes on)."""
        call = fn(request, timeout=timeout)
        try:
            yield from call
        except grpc.RpcError as err:
            raise from_rpc_error(err, name) from None
        finally:
            call.cancel()

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Block until the channel connects (raises UnavailableError on timeout)."""
        from strop.client.errors import UnavailableError

        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise UnavailableError(f"no server at {self.target} after {timeout:.0f}s") from None


class ArtifactClient(BaseClient):
    """A client of a service that serves ``common.proto``'s artifact RPCs; subclasses set ``_stub``."""

    _stub: Any

    def get_artifact(self, artifact_id: str) -> Artifact:
        msg = self._call(
            self._stub.GetArtifact, common_pb2.GetArtifactRequest(artifact_id=artifact_id), name="GetArtifact"
        )
        return from_proto(Artifact, msg)

    def list_artifacts(self, kind: str = "") -> list[Artifact]:
        out, token = [], ""
        while True:
            req = common_pb2.ListArtifactsRequest(kind=kind, page_size=100, page_token=token)
            resp = self._call(self._stub.ListArtifacts, req, name="ListArtifacts")
            out += [from_proto(Artifact, a) for a in resp.artifacts]
            token = resp.next_page_token
            if not token:
                return out

    def download_artifact(self, artifact_id: str, dest: str | os.PathLike, *, chunk_bytes: int = 0) -> Path:
        """Stream an artifact into the new directory ``dest``, checking every file's sha256.

        The files land in a temporary sibling directory renamed to ``dest`` at the end, so a failed
        download leaves nothing at ``dest``.

        Raises:
            InvalidArgumentError: ``dest`` exists.
            DataLossError: a file's digest does not match the server's.
        """
        dest = Path(dest)
        if dest.exists():
            raise InvalidArgumentError(f"{dest} exists; download into a new directory")
        tmp = dest.with_name(f".{dest.name}.partial-{uuid.uuid4().hex[:8]}")
        tmp.mkdir(parents=True)
        try:
            req = common_pb2.DownloadArtifactRequest(artifact_id=artifact_id, chunk_bytes=chunk_bytes)
            chunks = self._stream(
                self._stub.DownloadArtifact, req, timeout=LONG_TIMEOUT, name="DownloadArtifact"
            )
            receive_files(chunks, tmp, method="DownloadArtifact")
            os.rename(tmp, dest)
            return dest
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


def receive_files(chunks: Iterable[Any], directory: Path, *, method: str) -> None:
    """Write a stream of ``FileChunk`` messages (each file's chunks in a row) under ``directory``.

    Raises:
        DataLossError: a file name that would land outside ``directory``, or a file whose sha256 does
            not match the one sent with its last chunk.
    """
    fh, digest = None, None
    try:
        for chunk in chunks:
            if fh is None:
                rel = Path(chunk.name)
                if rel.is_absolute() or ".." in rel.parts:
                    raise DataLossError(f"server sent an unsafe file name {chunk.name!r}", method=method)
                (directory / rel).parent.mkdir(parents=True, exist_ok=True)
                fh, digest = open(directory / rel, "wb"), hashlib.sha256()
            fh.write(chunk.data)
            digest.update(chunk.data)
            if chunk.last:
                fh.close()
                fh = None
                if chunk.sha256 != digest.hexdigest():
                    raise DataLossError(f"{chunk.name}: sha256 mismatch after download", method=method)
    finally:
        if fh is not None:
            fh.close()
