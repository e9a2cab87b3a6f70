"""The artifact store: a directory tree shared by the trainer and the export service.

Layout: an artifact is a directory holding its files plus ``strop-artifact.json`` (kind, metadata, every
file's size and sha256). The directory is the source of truth, so any service that mounts the root (a PVC on
Kubernetes) can resolve an artifact id without the producer's database.

Ownership: every artifact belongs to one tenant, its owner (``metadata["tenant"]``), and each tenant has its
own id space: tenant ``T``'s artifact ``X`` lives in ``<root>/.tenants/T/X/``; with authentication off (the
one anonymous tenant ``""``) artifacts live in ``<root>/X/``. Two tenants may both have an ``X``; neither can
see, probe, replace or squat the other's. The store addresses an artifact by its *key*: ``X`` for the
anonymous tenant, ``T/X`` for tenant ``T`` (:func:`key_of`); :meth:`ArtifactStore.resolve` turns the id a
caller names into the key it may read.

Published artifacts are immutable: a write to a key that is taken is refused with ALREADY_EXISTS, whoever
asks and whatever ``overwrite`` says (one rule, applied in :meth:`ArtifactStore.create`, the one write path of
uploads, export targets, trainer adapters, checkpoints and loss curves). Nothing is ever replaced in place.

Artifacts appear atomically: files are written under ``<root>/.tmp/<id>.<random>``, fsynced, and renamed into
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

from strop.common import auth
from strop.common.errors import AlreadyExists, DataLoss, InvalidArgument, NotFound
from strop.common.serde import from_dict, to_dict
from strop.common.trainer_types import Artifact, ArtifactFile

MANIFEST = "strop-artifact.json"
TENANTS = ".tenants"  # <root>/.tenants/<tenant>/<id>: starts with a dot, so no artifact id can name it
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
            f"artifact id {artifact_id[:200] if isinstance(artifact_id, str) else artifact_id!r} is not valid "
            "(letters, digits, '.', '_', '-'; at most 128)"
        )
    return artifact_id


def key_of(owner: str, artifact_id: str) -> str:
    """The store key of ``owner``'s artifact ``artifact_id``: the id itself for the anonymous tenant."""
    return f"{auth.check_tenant_name(owner)}/{artifact_id}" if owner else artifact_id


def key_for(artifact: Artifact) -> str:
    """The store key of an artifact the store returned (its owner is its ``tenant`` metadata)."""
    return key_of(artifact.metadata.get("tenant", ""), artifact.artifact_id)


def _split(key: str) -> tuple[str, str]:
    """``(owner, id)`` of a key, both checked."""
    if not isinstance(key, str):
        raise InvalidArgument(f"artifact id {key!r} is not valid")
    owner, slash, artifact_id = key.rpartition("/")
    if slash and not owner:
        raise InvalidArgument(f"artifact id {key[:200]!r} is not valid (an empty tenant name)")
    return auth.check_tenant_name(owner), check_artifact_id(artifact_id)


class PendingArtifact:
    """An artifact being written. Write files into ``dir``; the store publishes or discards it."""

    def __init__(
        self, store: ArtifactStore, owner: str, artifact_id: str, kind: str, metadata: dict[str, str]
    ):
        self.store = store
        self.owner = owner
        self.artifact_id = artifact_id
        self.key = key_of(owner, artifact_id)
        self.kind = kind
        self.metadata = {**metadata, "tenant": owner}
        self.dir = store.root / ".tmp" / f"{artifact_id}.{uuid.uuid4().hex[:8]}"
        self.dir.mkdir(parents=True)


class ArtifactStore:
    def __init__(self, root: str | os.PathLike):
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / ".tmp").mkdir(exist_ok=True)

    def new_id(self, kind: str) -> str:
        return f"{kind}-{uuid.uuid4().hex[:12]}"

    def _dir(self, key: str) -> Path:
        owner, artifact_id = _split(key)
        return self.root / TENANTS / owner / artifact_id if owner else self.root / artifact_id

    def path_of(self, key: str) -> Path:
        """The directory of the artifact with this key (see the module docstring)."""
        found = self._dir(key)
        owner, artifact_id = _split(key)
        if owner and not (found / MANIFEST).is_file():
            # written before tenants had id spaces: <root>/<id>, owned by its manifest's tenant (read-only)
            old = self.root / artifact_id
            if (old / MANIFEST).is_file() and self._owner_of(old) == owner:
                return old
        return found

    def _owner_of(self, directory: Path) -> str:
        try:
            return str(json.loads((directory / MANIFEST).read_text()).get("metadata", {}).get("tenant", ""))
        except (OSError, ValueError):
            return ""

    def key_at(self, directory: Path) -> str:
        """The key of the artifact stored in ``directory`` (the inverse of :meth:`path_of`)."""
        parts = Path(directory).resolve().relative_to(self.root).parts
        if len(parts) == 3 and parts[0] == TENANTS:
            return key_of(parts[1], parts[2])
        if len(parts) == 1:
            return check_artifact_id(parts[0])
        raise InvalidArgument(f"{directory} is not an artifact directory of this store")

    def exists(self, key: str) -> bool:
        return (self.path_of(key) / MANIFEST).is_file()

    def resolve(self, artifact_id: str, principal: auth.Principal | None = None) -> str:
        """The key of the artifact a caller names: ``<id>`` in its own id space, or ``<tenant>/<id>``.

        An admin naming a plain id that is not its own gets the one tenant's artifact of that id, if exactly one
        tenant has it. Another tenant's artifact is NOT_FOUND, exactly as an id that does not exist.

        Raises:
            NotFound: nothing the caller may see has that id.
            InvalidArgument: a malformed id, or (admins) a plain id that several tenants have.
        """
        me = principal or auth.current()
        if isinstance(artifact_id, str) and "/" in artifact_id:
            owner, plain = _split(artifact_id)
            if me.can_see(owner) and self.exists(artifact_id):
                return key_of(owner, plain)
            raise NotFound(f"artifact {artifact_id!r} not found")
        check_artifact_id(artifact_id)
        own = key_of(me.tenant, artifact_id)
        if self.exists(own):
            return own
        if me.admin:
            keys = [key_for(a) for a in self.list() if a.artifact_id == artifact_id]
            if len(keys) == 1:
                return keys[0]
            if keys:
                raise InvalidArgument(
                    f"artifact id {artifact_id!r} is used by several tenants; name one as <tenant>/<id>: "
                    + ", ".join(sorted(keys))
                )
        raise NotFound(f"artifact {artifact_id!r} not found")

    @contextlib.contextmanager
    def create(
        self,
        kind: str,
        *,
        owner: str,
        artifact_id: str | None = None,
        metadata: dict[str, str] | None = None,
    ) -> Iterator[PendingArtifact]:
        """Write a new artifact of ``owner``'s (its ``tenant`` metadata). Published on normal exit of the
        ``with`` block, discarded on error. The one write path of the store: artifacts are immutable.

        Raises:
            AlreadyExists: ``owner`` already has ``artifact_id`` (checked before and again at publication, so
                nothing is written over a concurrent producer's result).
        """
        artifact_id = check_artifact_id(artifact_id or self.new_id(kind))
        self._refuse_taken(key_of(owner, artifact_id))
        pending = PendingArtifact(self, owner, artifact_id, kind, metadata or {})
        try:
            yield pending
            self._publish(pending)
        finally:
            shutil.rmtree(pending.dir, ignore_errors=True)

    def _refuse_taken(self, key: str) -> None:
        if self.exists(key):
            raise AlreadyExists(
                f"artifact {_split(key)[1]!r} already exists; published artifacts are immutable: choose another id"
            )

    def _publish(self, pending: PendingArtifact) -> None:
        files = scan_files(pending.dir)
        info = Artifact(
            artifact_id=pending.artifact_id,
            kind=pending.kind,
            path=str(self._dir(pending.key).relative_to(self.root)),
            sha256=digest_of(files),
            size_bytes=sum(f.size_bytes for f in files),
            files=files,
            metadata={str(k): str(v) for k, v in pending.metadata.items()},
            created_at=time.time(),
        )
        (pending.dir / MANIFEST).write_text(json.dumps(to_dict(info), indent=1, sort_keys=True))
        fsync_tree(pending.dir)
        final = self._dir(pending.key)
        final.parent.mkdir(parents=True, exist_ok=True)
        self._refuse_taken(pending.key)
        try:
            # rename(2) replaces only an empty directory: a concurrent producer's published one stays
            os.rename(pending.dir, final)
        except OSError:
            self._refuse_taken(pending.key)
            raise
        fd = os.open(final.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def delete(self, key: str) -> Artifact:
        """Remove an artifact (its owner's or an admin's call, checked by the caller through :meth:`resolve`):
        it leaves the store at once (a rename), its files after."""
        info = self.get(key)
        trash = self.root / ".tmp" / f"{info.artifact_id}.deleted.{uuid.uuid4().hex[:8]}"
        try:
            os.rename(self.path_of(key), trash)
        except FileNotFoundError:
            raise NotFound(f"artifact {info.artifact_id!r} not found") from None
        shutil.rmtree(trash, ignore_errors=True)
        return info

    def get(self, key: str) -> Artifact:
        manifest = self.path_of(key) / MANIFEST
        if not manifest.is_file():
            raise NotFound(f"artifact {_split(key)[1]!r} not found")
        return from_dict(Artifact, json.loads(manifest.read_text()))

    def list(self, kind: str | None = None) -> list[Artifact]:
        """Every tenant's artifacts (callers filter what a principal may see), oldest first."""
        dirs = [p for p in self.root.iterdir() if not p.name.startswith(".")]
        tenants = self.root / TENANTS
        if tenants.is_dir():
            dirs += [p for t in tenants.iterdir() if t.is_dir() for p in t.iterdir()]
        out = []
        for p in dirs:
            if not (p / MANIFEST).is_file():
                continue
            try:
                info = from_dict(Artifact, json.loads((p / MANIFEST).read_text()))
            except (OSError, ValueError):
                continue  # deleted while listed
            if kind in (None, "", info.kind):
                out.append(info)
        return sorted(out, key=lambda a: (a.created_at, a.metadata.get("tenant", ""), a.artifact_id))

    def verify(self, key: str) -> Artifact:
        """Recompute every file's digest. Raises DataLoss naming the first file that differs."""
        info = self.get(key)
        artifact_id = info.artifact_id
        base = self.path_of(key)
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

    def iter_chunks(self, key: str, chunk_bytes: int = _CHUNK) -> Iterator[tuple[str, int, bytes, str, bool]]:
        """Yield ``(name, offset, data, sha256_if_last, last)`` for every file, for streamed downloads.

        Every file is checked against its manifest entry as it is read: a missing, truncated, longer or
        altered file raises DataLoss before its last chunk is yielded, so a download never ends as complete
        with bytes the artifact was not published with.
        """
        info = self.get(key)
        artifact_id, base = info.artifact_id, self.path_of(key)
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
        owner: str,
        artifact_id: str | None = None,
        metadata: dict[str, str] | None = None,
        max_bytes: int = 64 << 30,
    ) -> Artifact:
        """Store an artifact streamed as ``(name, offset, data, sha256_if_last, last)`` chunks.

        Every file's offsets must be contiguous and its digest must match the one sent with its last
        chunk; anything wrong discards the whole upload.
        """
        with self.create(kind, owner=owner, artifact_id=artifact_id, metadata=metadata) as pending:
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
        return self.get(pending.key)
