"""The artifact store: a directory tree shared by the trainer and the export service.

Layout: ``<root>/<artifact_id>/`` holds the artifact's files plus ``strop-artifact.json`` (kind,
metadata, every file's size and sha256). The directory is the source of truth, so any service that
mounts the root (a PVC on Kubernetes) can resolve an artifact id without the producer's database.

Artifacts appear atomically: files are written under ``<root>/.tmp/<id>``, fsynced, and renamed into
place; an exception or a cancelled producer leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from strop.common.errors import AlreadyExists, DataLoss, InvalidArgument, NotFound
from strop.common.serde import from_dict, to_dict
from strop.common.trainer_types import Artifact, ArtifactFile

MANIFEST = "strop-artifact.json"
_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")
_CHUNK = 1 << 20


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
    return h.hexdigest()


def digest_of(files: list[ArtifactFile]) -> str:
    """The artifact digest: sha256 over the sorted ``name\\0sha256\\n`` lines of its files."""
    h = hashlib.sha256()
    for f in sorted(files, key=lambda f: f.name):
        h.update(f"{f.name}\0{f.sha256}\n".encode())
    return h.hexdigest()


def scan_files(directory: Path) -> list[ArtifactFile]:
    files = []
    for p in sorted(directory.rglob("*")):
        if p.is_file() and p.name != MANIFEST:
            files.append(ArtifactFile(str(p.relative_to(directory)), p.stat().st_size, sha256_file(p)))
    return files


def fsync_tree(directory: Path) -> None:
    """fsync every file and directory under ``directory`` (data before the rename that publishes it)."""
    for p in sorted(directory.rglob("*"), reverse=True):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def check_artifact_id(artifact_id: str) -> str:
    if not isinstance(artifact_id, str) or not _ID_RE.match(artifact_id) or ".." in artifact_id:
        raise InvalidArgument(
            f"artifact id {artifact_id!r} is not valid (letters, digits, '.', '_', '-'; at most 128)"
        )
    return artifact_id


class PendingArtifact:
    """An artifact being written. Write files into ``dir``; the store publishes or discards it."""

    def __init__(self, store: ArtifactStore, artifact_id: str, kind: str, metadata: dict[str, str]):
        self.store = store
        self.artifact_id = artifact_id
        self.kind = kind
        self.metadata = dict(metadata)
        self.dir = store.root / ".tmp" / f"{artifact_id}.{uuid.uuid4().hex[:8]}"
        self.dir.mkdir(parents=True)


class ArtifactStore:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / ".tmp").mkdir(exist_ok=True)

    def new_id(self, kind: str) -> str:
        return f"{kind}-{uuid.uuid4().hex[:12]}"

    def path_of(self, artifact_id: str) -> Path:
        return self.root / check_artifact_id(artifact_id)

    def exists(self, artifact_id: str) -> bool:
        return (self.path_of(artifact_id) / MANIFEST).is_file()

    @contextlib.contextmanager
    def create(
        self,
        kind: str,
        *,
        artifact_id: str | None = None,
        metadata: dict[str, str] | None = None,
        overwrite: bool = False,
    ) -> Iterator[PendingArtifact]:
        """Write a new artifact. Published on normal exit of the ``with`` block, discarded on error.

        Raises:
            AlreadyExists: ``artifact_id`` is taken and ``overwrite`` is false (checked before and
                again at publication, so nothing is written over a concurrent producer's result).
        """
        artifact_id = check_artifact_id(artifact_id or self.new_id(kind))
        if self.exists(artifact_id) and not overwrite:
            raise AlreadyExists(f"artifact {artifact_id!r} already exists (ask to overwrite to replace it)")
        pending = PendingArtifact(self, artifact_id, kind, metadata or {})
        try:
            yield pending
            self._publish(pending, overwrite=overwrite)
        finally:
            shutil.rmtree(pending.dir, ignore_errors=True)

    def _publish(self, pending: PendingArtifact, *, overwrite: bool) -> None:
        files = scan_files(pending.dir)
        info = Artifact(
            artifact_id=pending.artifact_id,
            kind=pending.kind,
            path=pending.artifact_id,
            sha256=digest_of(files),
            size_bytes=sum(f.size_bytes for f in files),
            files=files,
            metadata={str(k): str(v) for k, v in pending.metadata.items()},
            created_at=time.time(),
        )
        (pending.dir / MANIFEST).write_text(json.dumps(to_dict(info), indent=1, sort_keys=True))
        fsync_tree(pending.dir)
        final = self.path_of(pending.artifact_id)
        trash = None
        if final.exists():
            if not overwrite:
                raise AlreadyExists(f"artifact {pending.artifact_id!r} already exists")
            trash = self.root / ".tmp" / f"{pending.artifact_id}.old.{uuid.uuid4().hex[:8]}"
            os.rename(final, trash)
        os.rename(pending.dir, final)
        if trash is not None:
            shutil.rmtree(trash, ignore_errors=True)
        fd = os.open(self.root, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def get(self, artifact_id: str) -> Artifact:
        manifest = self.path_of(artifact_id) / MANIFEST
        if not manifest.is_file():
            raise NotFound(f"artifact {artifact_id!r} not found")
        return from_dict(Artifact, json.loads(manifest.read_text()))

    def list(self, kind: str | None = None) -> list[Artifact]:
        out = []
        for p in self.root.iterdir():
            if p.name.startswith(".") or not (p / MANIFEST).is_file():
                continue
            info = self.get(p.name)
            if kind in (None, "", info.kind):
                out.append(info)
        return sorted(out, key=lambda a: (a.created_at, a.artifact_id))

    def verify(self, artifact_id: str) -> Artifact:
        """Recompute every file's digest. Raises DataLoss naming the first file that differs."""
        info = self.get(artifact_id)
        base = self.path_of(artifact_id)
        for f in info.files:
            p = base / f.name
            if not p.is_file() or p.stat().st_size != f.size_bytes or sha256_file(p) != f.sha256:
                raise DataLoss(f"artifact {artifact_id!r}: file {f.name!r} is missing or corrupted")
        return info

    def list_page(
        self,
        kind: str | None,
        page_size: int,
        page_token: str,
        *,
        keep: Callable[[Artifact], bool] | None = None,
    ) -> tuple[list[Artifact], str]:
        """One page of :meth:`list` (oldest first) and the token of the next ("" after the last page).

        Raises:
            InvalidArgument: a token this store did not hand out, or a negative page size.
        """
        if page_size < 0:
            raise InvalidArgument(f"page_size must be >= 0, got {page_size}")
        if page_token and not page_token.isdigit():
            raise InvalidArgument(f"page_token {page_token!r} is not one this service returned")
        items = [a for a in self.list(kind) if keep is None or keep(a)]
        start = int(page_token or 0)
        size = page_size or len(items) or 1
        end = start + size
        return items[start:end], (str(end) if end < len(items) else "")

    def iter_chunks(
        self, artifact_id: str, chunk_bytes: int = _CHUNK
    ) -> Iterator[tuple[str, int, bytes, str, bool]]:
        """Yield ``(name, offset, data, sha256_if_last, last)`` for every file, for streamed downloads.

        Every file is checked against its manifest entry as it is read: a missing, truncated, longer or
        altered file raises DataLoss before its last chunk is yielded, so a download never ends as complete
        with bytes the artifact was not published with.
        """
        info = self.get(artifact_id)
        base = self.path_of(artifact_id)
        chunk_bytes = max(1024, min(chunk_bytes or _CHUNK, (4 << 20) - 1024))
        for f in info.files:
            try:
                fh = open(base / f.name, "rb")
            except OSError:
                raise DataLoss(f"artifact {artifact_id!r}: file {f.name!r} is missing") from None
            with fh:
                digest, offset = hashlib.sha256(), 0
                while True:
                    data = fh.read(min(chunk_bytes, f.size_bytes - offset))
                    if not data and offset < f.size_bytes:
                        raise DataLoss(
                            f"artifact {artifact_id!r}: file {f.name!r} is truncated "
                            f"({offset} of {f.size_bytes} bytes)"
                        )
                    digest.update(data)
                    last = offset + len(data) >= f.size_bytes
                    if last and (fh.read(1) or digest.hexdigest() != f.sha256):
                        raise DataLoss(f"artifact {artifact_id!r}: file {f.name!r} does not match its sha256")
                    yield f.name, offset, data, (f.sha256 if last else ""), last
                    offset += len(data)
                    if last:
                        break

    def receive(
        self,
        kind: str,
        chunks: Iterator[tuple[str, int, bytes, str, bool]],
        *,
        artifact_id: str | None = None,
        metadata: dict[str, str] | None = None,
        max_bytes: int = 64 << 30,
        overwrite: bool = False,
    ) -> Artifact:
        """Store an artifact streamed as ``(name, offset, data, sha256_if_last, last)`` chunks.

        Every file's offsets must be contiguous and its digest must match the one sent with its last
        chunk; anything wrong discards the whole upload.
        """
        with self.create(kind, artifact_id=artifact_id, metadata=metadata, overwrite=overwrite) as pending:
            total = 0
            current: tuple[str, object, hashlib._Hash] | None = None
            for name, offset, data, sha, last in chunks:
                if current is None:
                    rel = Path(name)
                    if (
                        not name
                        or rel.is_absolute()
                        or ".." in rel.parts
                        or name == MANIFEST
                        or "\x00" in name
                        or len(name) > 1024
                        or any(len(part) > 255 for part in rel.parts)
                    ):
                        raise InvalidArgument(f"upload file name {name[:200]!r} is not a plain relative path")
                    target = pending.dir / rel
                    if target.exists():
                        raise InvalidArgument(f"upload sends file {name!r} twice")
                    target.parent.mkdir(parents=True, exist_ok=True)
                    current = (name, open(target, "wb"), hashlib.sha256())
                fname, fh, h = current
                if name and name != fname:
                    raise InvalidArgument(f"chunk for {name!r} arrived before {fname!r} was finished")
                if offset != fh.tell():
                    raise InvalidArgument(f"{fname!r}: chunk offset {offset} where {fh.tell()} was expected")
                total += len(data)
                if total > max_bytes:
                    raise InvalidArgument(f"upload exceeds the limit of {max_bytes} bytes")
                fh.write(data)
                h.update(data)
                if last:
                    fh.close()
                    if sha and sha != h.hexdigest():
                        raise InvalidArgument(
                            f"{fname!r}: sha256 mismatch (sent {sha}, received {h.hexdigest()})"
                        )
                    current = None
            if current is not None:
                current[1].close()
                raise InvalidArgument(f"upload ended in the middle of {current[0]!r}")
            if not any(pending.dir.iterdir()):
                raise InvalidArgument("upload carried no files")
            artifact_id = pending.artifact_id
        return self.get(artifact_id)
