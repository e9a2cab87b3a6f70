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

import enum
import hashlib
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from strop.client._base import LONG_TIMEOUT, BaseClient
from strop.client.errors import DataLossError, InvalidArgumentError, UnavailableError
from strop.common.serde import from_proto, to_proto
from strop.common.trainer_types import Artifact, ArtifactFile
from strop.v1 import common_pb2, export_pb2, export_pb2_grpc

__all__ = [
    "Artifact",
    "ArtifactFile",
    "Capabilities",
    "Export",
    "ExportClient",
    "ExportEvent",
    "ExportProgress",
    "ExportResult",
    "ExportState",
    "ExportStateChange",
    "ExportTarget",
    "ExportTargetKind",
    "Verification",
    "VerifyOptions",
]

UPLOAD_CHUNK = 1 << 20


class ExportTargetKind(enum.StrEnum):
    UNSPECIFIED = "UNSPECIFIED"
    MERGED_SAFETENSORS = "MERGED_SAFETENSORS"
    PEFT_ADAPTER = "PEFT_ADAPTER"
    GGUF = "GGUF"
    GGUF_LORA = "GGUF_LORA"


class ExportState(enum.StrEnum):
    UNSPECIFIED = "UNSPECIFIED"
    QUEUED = "QUEUED"
    RUNNING = "RUNNING"
    SUCCEEDED = "SUCCEEDED"
    FAILED = "FAILED"
    CANCELLED = "CANCELLED"
    INTERRUPTED = "INTERRUPTED"

    @property
    def terminal(self) -> bool:
        return self in (
            ExportState.SUCCEEDED,
            ExportState.FAILED,
            ExportState.CANCELLED,
            ExportState.INTERRUPTED,
        )


@dataclass
class ExportTarget:
    """One output of an export. Use the constructors: ``merged()``, ``peft()``, ``gguf()``, ``gguf_lora()``."""

    kind: ExportTargetKind = ExportTargetKind.UNSPECIFIED
    gguf_type: str = ""
    dtype: str = ""
    artifact_id: str = ""
    base_gguf_type: str = ""

    @classmethod
    def merged(cls, dtype: str = "", artifact_id: str = "") -> ExportTarget:
        """A merged safetensors directory vLLM and transformers load (dtype default: the base's)."""
        return cls(ExportTargetKind.MERGED_SAFETENSORS, dtype=dtype, artifact_id=artifact_id)

    @classmethod
    def peft(cls, artifact_id: str = "") -> ExportTarget:
        """A PEFT adapter directory vLLM's ``--enable-lora`` accepts."""
        return cls(ExportTargetKind.PEFT_ADAPTER, artifact_id=artifact_id)

    @classmethod
    def gguf(cls, gguf_type: str = "F16", artifact_id: str = "") -> ExportTarget:
        """A merged GGUF model: F32, F16, BF16, Q8_0 or a llama.cpp quantizer type (Q4_K_M, Q6_K, ...)."""
        return cls(ExportTargetKind.GGUF, gguf_type=gguf_type, artifact_id=artifact_id)

    @classmethod
    def gguf_lora(
        cls, lora_type: str = "F32", base_gguf_type: str = "F16", artifact_id: str = ""
    ) -> ExportTarget:
        """A GGUF LoRA adapter plus the GGUF of its unmerged base."""
        return cls(
            ExportTargetKind.GGUF_LORA,
            gguf_type=lora_type,
            base_gguf_type=base_gguf_type,
            artifact_id=artifact_id,
        )

    @classmethod
    def parse(cls, spec: str) -> ExportTarget:
        """``merged[:dtype]``, ``peft``, ``gguf[:TYPE]``, ``gguf-lora[:LORA_TYPE[:BASE_TYPE]]`` (CLI form)."""
        kind, _, rest = spec.partition(":")
        parts = [p for p in rest.split(":") if p]
        kind = kind.lower().replace("_", "-")
        if kind in ("merged", "merged-safetensors", "safetensors"):
            return cls.merged(*(parts[:1]))
        if kind in ("peft", "peft-adapter", "lora"):
            return cls.peft()
        if kind == "gguf":
            return cls.gguf(*(parts[:1] or ["F16"]))
        if kind == "gguf-lora":
            return cls.gguf_lora(*(parts[:2]))
        raise InvalidArgumentError(
            f"unknown target {spec!r}: use merged[:dtype], peft, gguf[:TYPE], gguf-lora[:TYPE[:BASE]]"
        )


@dataclass
class VerifyOptions:
    """How an export is verified. A question/answer the adapter was trained on makes the strongest check."""

    skip: bool = False
    prompts: list[str] = field(default_factory=list)
    heldout_texts: list[str] = field(default_factory=list)
    question: str = ""
    answer: str = ""
    raw_question: bool = False
    max_new_tokens: int = 0


@dataclass
class Verification:
    consumer: str = ""
    positions: int = 0
    max_abs_logit_delta: float = 0.0
    mean_abs_logit_delta: float = 0.0
    top1_agreement: float = 0.0
    perplexity_reference: float = 0.0
    perplexity: float = 0.0
    perplexity_delta: float = 0.0
    tokens_checked: bool = False
    tokens_match: bool = False
    token_mismatches: list[str] = field(default_factory=list)
    chat_tokens_checked: bool = False
    chat_tokens_match: bool = False
    generated: str = ""
    answer_checked: bool = False
    answer_reproduced: bool = False
    answer_top1_agreement: float = 0.0
    answer_tokens: int = 0
    problems: list[str] = field(default_factory=list)
    passed: bool = False
    notes: list[str] = field(default_factory=list)


@dataclass
class ExportResult:
    target: ExportTarget = field(default_factory=ExportTarget)
    artifact: Artifact = field(default_factory=Artifact)
    verification: Verification | None = None


@dataclass
class ExportRequestInfo:
    adapter_artifact_id: str = ""
    adapter_path: str = ""
    base_model_path: str = ""
    base_artifact_id: str = ""
    targets: list[ExportTarget] = field(default_factory=list)
    overwrite: bool = False
    verify: VerifyOptions = field(default_factory=VerifyOptions)
    name: str = ""
    max_shard_bytes: int = 0


@dataclass
class Export:
    export_id: str = ""
    name: str = ""
    state: ExportState = ExportState.UNSPECIFIED
    request: ExportRequestInfo | None = None
    results: list[ExportResult] = field(default_factory=list)
    error: str = ""
    error_code: str = ""
    created_at: float = 0.0
    started_at: float = 0.0
    finished_at: float = 0.0
    last_seq: int = 0


@dataclass
class ExportStateChange:
    state: ExportState = ExportState.UNSPECIFIED
    message: str = ""


@dataclass
class ExportProgress:
    target: str = ""
    phase: str = ""
    item: str = ""
    items_done: int = 0
    items_total: int = 0
    bytes_written: int = 0
    bytes_total: int = 0


@dataclass
class ExportEvent:
    """One numbered event; exactly one of ``state``, ``progress``, ``result`` is set."""

    export_id: str = ""
    seq: int = 0
    time: float = 0.0
    state: ExportStateChange | None = None
    progress: ExportProgress | None = None
    result: ExportResult | None = None


@dataclass
class Capabilities:
    targets: list[str] = field(default_factory=list)
    gguf_types: list[str] = field(default_factory=list)
    gguf_lora_types: list[str] = field(default_factory=list)
    dtypes: list[str] = field(default_factory=list)
    architectures: list[str] = field(default_factory=list)
    base_quantizations: list[str] = field(default_factory=list)


class ExportClient(BaseClient):
    """Client of ``strop.v1.ExportService``. Every call raises a ``strop.client.errors`` exception on failure."""

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
    ) -> Export:
        """Validate and queue an export (bad input raises here, before anything is written)."""
        info = ExportRequestInfo(
            adapter_artifact_id,
            adapter_path,
            base_model_path,
            base_artifact_id,
            list(targets),
            overwrite,
            verify or VerifyOptions(),
            name,
            max_shard_bytes,
        )
        msg = self._call(
            self._stub.CreateExport, to_proto(export_pb2.CreateExportRequest, info), name="CreateExport"
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
        """Upload every file under ``directory`` as one artifact (each file's sha256 checked by the server)."""
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
        fh, digest = None, None
        try:
            req = common_pb2.DownloadArtifactRequest(artifact_id=artifact_id, chunk_bytes=chunk_bytes)
            for chunk in self._stream(
                self._stub.DownloadArtifact, req, timeout=LONG_TIMEOUT, name="DownloadArtifact"
            ):
                if fh is None:
                    rel = Path(chunk.name)
                    if rel.is_absolute() or ".." in rel.parts:
                        raise DataLossError(
                            f"server sent an unsafe file name {chunk.name!r}", method="DownloadArtifact"
                        )
                    (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
                    fh, digest = open(tmp / rel, "wb"), hashlib.sha256()
                fh.write(chunk.data)
                digest.update(chunk.data)
                if chunk.last:
                    fh.close()
                    fh = None
                    if chunk.sha256 != digest.hexdigest():
                        raise DataLossError(
                            f"{chunk.name}: sha256 mismatch after download", method="DownloadArtifact"
                        )
            os.rename(tmp, dest)
            return dest
        finally:
            if fh is not None:
                fh.close()
            shutil.rmtree(tmp, ignore_errors=True)
