"""The artifact store: atomic publication, digests on every read that serves bytes, ids and upload file names."""

from __future__ import annotations

import hashlib
import os

import pytest

from strop.common.artifacts import ArtifactStore
from strop.common.errors import AlreadyExists, DataLoss, InvalidArgument, NotFound


def test_artifact_is_published_atomically_with_digests(tmp_path):
    store = ArtifactStore(tmp_path)
    with store.create("adapter", owner="", artifact_id="a1", metadata={"step": 3}) as p:
        (p.dir / "w.bin").write_bytes(b"weights")
        (p.dir / "sub").mkdir()
        (p.dir / "sub" / "c.json").write_text("{}")
        assert not store.exists("a1"), "nothing is visible before the block ends"
    info = store.verify("a1")
    assert {f.name for f in info.files} == {"w.bin", "sub/c.json"}
    assert next(f for f in info.files if f.name == "w.bin").sha256 == hashlib.sha256(b"weights").hexdigest()
    assert (
        info.metadata == {"step": "3", "tenant": ""} and info.kind == "adapter"
    )  # every artifact has an owner


def test_failed_writer_leaves_nothing_and_existing_ids_are_not_overwritten(tmp_path):
    store = ArtifactStore(tmp_path)
    with pytest.raises(RuntimeError), store.create("x", owner="", artifact_id="a2") as p:
        (p.dir / "half").write_bytes(b"partial")
        raise RuntimeError("writer died")
    assert not store.exists("a2") and os.listdir(tmp_path / ".tmp") == []
    with store.create("x", owner="", artifact_id="a2") as p:
        (p.dir / "f").write_bytes(b"one")
    with pytest.raises(AlreadyExists, match="immutable"), store.create("x", owner="", artifact_id="a2") as p:
        (p.dir / "f").write_bytes(b"two")
    assert (tmp_path / "a2" / "f").read_bytes() == b"one"
    store.delete("a2")  # the only way to reuse an id
    with store.create("x", owner="", artifact_id="a2") as p:
        (p.dir / "f").write_bytes(b"two")
    assert (tmp_path / "a2" / "f").read_bytes() == b"two"


def test_corruption_is_detected_and_bad_ids_refused(tmp_path):
    store = ArtifactStore(tmp_path)
    with store.create("x", owner="", artifact_id="a3") as p:
        (p.dir / "f").write_bytes(b"data")
    (tmp_path / "a3" / "f").write_bytes(b"dat")
    with pytest.raises(DataLoss, match="'f'"):
        store.verify("a3")
    for bad in ("../a3", "a/b/c", "/a3", "", ".hidden", "../x/a3"):
        with pytest.raises(InvalidArgument):
            store.path_of(bad)
    with pytest.raises(NotFound):
        store.get("nope")


def test_upload_round_trip_checks_offsets_and_digests(tmp_path):
    src, dst = ArtifactStore(tmp_path / "src"), ArtifactStore(tmp_path / "dst")
    with src.create("x", owner="", artifact_id="a4") as p:
        (p.dir / "big").write_bytes(os.urandom(5000))
        (p.dir / "small").write_bytes(b"s")
    got = dst.receive("x", src.iter_chunks("a4", chunk_bytes=1024), owner="", artifact_id="a4")
    assert got.sha256 == src.get("a4").sha256
    chunks = list(src.iter_chunks("a4", chunk_bytes=1024))
    name, off, data, _sha, last = chunks[-1]
    chunks[-1] = (name, off, data, "0" * 64, last)
    with pytest.raises(InvalidArgument, match="sha256 mismatch"):
        dst.receive("x", iter(chunks), owner="", artifact_id="a5")
    assert not dst.exists("a5")
    with pytest.raises(InvalidArgument, match="not a plain relative path"):
        dst.receive("x", iter([("../evil", 0, b"x", "", True)]), owner="", artifact_id="a6")


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (lambda p: p.write_bytes(p.read_bytes()[:5000]), "truncated"),  # today: empty chunks forever
        (lambda p: p.write_bytes(p.read_bytes() + b"x"), "does not match its sha256"),
        (lambda p: p.write_bytes(b"y" * p.stat().st_size), "does not match its sha256"),
        (lambda p: p.unlink(), "missing"),
    ],
    ids=["truncated", "longer", "altered", "missing"],
)
def test_a_damaged_file_ends_the_download_with_data_loss_before_its_last_chunk(tmp_path, damage, message):
    store = ArtifactStore(tmp_path)
    with store.create("adapter", owner="", artifact_id="a1") as p:
        (p.dir / "w.bin").write_bytes(os.urandom(10_000))
    intact = [c for c in store.iter_chunks("a1", 4096)]
    assert [c[4] for c in intact] == [False, False, True] and intact[-1][3]  # last chunk carries the digest
    damage(store.path_of("a1") / "w.bin")
    chunks = []
    with pytest.raises(DataLoss, match=message):
        for c in store.iter_chunks("a1", 4096):
            chunks.append(c)
    assert not any(c[4] for c in chunks), "no chunk of a damaged file is marked last"
    assert len(chunks) <= 3


@pytest.mark.parametrize("name", ["a\x00b", "x" * 300, "d/" + "y" * 256], ids=["nul", "long", "long-part"])
def test_upload_file_names_that_no_filesystem_takes_are_invalid_argument(tmp_path, name):
    # today: ValueError (embedded null byte) or OSError (file name too long), reported as INTERNAL
    store = ArtifactStore(tmp_path)
    digest = hashlib.sha256(b"hi").hexdigest()
    with pytest.raises(InvalidArgument, match="is not a plain relative path"):
        store.receive("adapter", iter([(name, 0, b"hi", digest, True)]), owner="")
    assert store.list() == []
