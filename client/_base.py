"""Plumbing shared by the SDK's clients: timeouts, error mapping, stream iteration, and the artifact
RPCs of ``common.proto`` that both services serve."""

from __future__ import annotations

import hashlib
import json
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


def spread_config(health_service: str) -> str:
    """The channel's service config for a service any of whose replicas serves any call (the exporter).

    ``round_robin`` opens a connection to every address the target resolves to (a headless Service's name resolves
    to every ready pod) and sends each call to the next one, instead of gRPC's default of one connection to the
    first address; ``healthCheckConfig`` makes the channel watch each address's ``grpc.health.v1`` status for
    ``health_service`` and skip an address while it is not SERVING (a pod draining on SIGTERM still accepts
    connections, but would refuse new work). The resolver runs again whenever a connection ends, which the
    servers' ``--max-connection-age`` makes happen regularly, so pods added later are found.
    """
    return json.dumps(
        {"loadBalancingConfig": [{"round_robin": {}}], "healthCheckConfig": {"serviceName": health_service}}
    )


class _BearerToken(
    grpc.UnaryUnaryClientInterceptor,
    grpc.UnaryStreamClientInterceptor,
    grpc.StreamUnaryClientInterceptor,
    grpc.StreamStreamClientInterceptor,
):
    """Adds ``authorization: Bearer <token>`` to every call (over TLS or, on a trusted network, plaintext)."""

    def __init__(self, token: str) -> None:
        self._metadata = ("authorization", f"Bearer {token}")

    def _details(self, details):
        metadata = [*(details.metadata or ()), self._metadata]
        return (
            details._replace(metadata=metadata)
            if hasattr(details, "_replace")
            else _Details(details, metadata)
        )

    def intercept_unary_unary(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation, details, request):
        return continuation(self._details(details), request)

    def intercept_stream_unary(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)

    def intercept_stream_stream(self, continuation, details, request_iterator):
        return continuation(self._details(details), request_iterator)


class _Details(grpc.ClientCallDetails):
    def __init__(self, base, metadata) -> None:
        self.method, self.timeout, self.credentials = base.method, base.timeout, base.credentials
        self.wait_for_ready, self.compression = (
            getattr(base, "wait_for_ready", None),
            getattr(base, "compression", None),
        )
        self.metadata = metadata


def _pem(value: str | bytes | os.PathLike | None) -> bytes | None:
    if value is None or value == "":
        return None
    if isinstance(value, bytes):
        return value
    return Path(value).read_bytes()


def make_channel(
    target: str,
    *,
    token: str | None = None,
    tls_ca: str | bytes | os.PathLike | None = None,
    tls_cert: str | bytes | os.PathLike | None = None,
    tls_key: str | bytes | os.PathLike | None = None,
    tls: bool = False,
    spread_over: str | None = None,
) -> grpc.Channel:
    """A channel to a strop service: TLS when ``tls`` or a CA is given (``tls_cert``/``tls_key``: the client's own
    certificate, for mTLS), a bearer token on every call when ``token`` is given. Defaults come from the
    environment: ``STROP_TOKEN``, ``STROP_TLS_CA``, ``STROP_TLS_CERT``, ``STROP_TLS_KEY``.

    ``spread_over``: the full name of a service that any replica serves alike; calls then go round-robin over
    every address of ``target`` that reports it SERVING (:func:`spread_config`). None: one connection to the
    first address (a trainer pod holds its sessions: its calls must stay on it)."""
    env = os.environ.get
    token = token if token is not None else env("STROP_TOKEN") or None
    tls_ca = tls_ca if tls_ca is not None else env("STROP_TLS_CA") or None
    tls_cert = tls_cert if tls_cert is not None else env("STROP_TLS_CERT") or None
    tls_key = tls_key if tls_key is not None else env("STROP_TLS_KEY") or None
    options = list(CHANNEL_OPTIONS)
    if spread_over:
        options.append(("grpc.service_config", spread_config(spread_over)))
    if tls or tls_ca or tls_cert:
        creds = grpc.ssl_channel_credentials(
            root_certificates=_pem(tls_ca), private_key=_pem(tls_key), certificate_chain=_pem(tls_cert)
        )
        channel = grpc.secure_channel(target, creds, options=options)
    else:
        channel = grpc.insecure_channel(target, options=options)
    return grpc.intercept_channel(channel, _BearerToken(token)) if token else channel


class BaseClient:
    """Owns a channel (or borrows one) and wraps calls so that only SDK exceptions escape.

    Args:
        target: ``host:port``.
        channel: a channel to use instead of making one (the client then does not close it).
        timeout: the default deadline of unary calls, seconds.
        token, tls_ca, tls_cert, tls_key, tls: see :func:`make_channel`.
    """

    # a subclass whose service any replica serves alike names it (make_channel)
    _spread_over: str | None = None

    def __init__(
        self,
        target: str,
        *,
        channel: grpc.Channel | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        token: str | None = None,
        tls_ca: str | bytes | os.PathLike | None = None,
        tls_cert: str | bytes | os.PathLike | None = None,
        tls_key: str | bytes | os.PathLike | None = None,
        tls: bool = False,
    ):
        self.target = target
        self._owns_channel = channel is None
        self._channel = channel or make_channel(
            target,
            token=token,
            tls_ca=tls_ca,
            tls_cert=tls_cert,
            tls_key=tls_key,
            tls=tls,
            spread_over=self._spread_over,
        )
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

    def delete_artifact(self, artifact_id: str) -> Artifact:
        """Delete one of the caller's artifacts (an admin: anyone's, named ``<tenant>/<id>``); its id is free again.

        Published artifacts are immutable: deleting is the only way to reuse an id.
        """
        msg = self._call(
            self._stub.DeleteArtifact,
            common_pb2.DeleteArtifactRequest(artifact_id=artifact_id),
            name="DeleteArtifact",
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
