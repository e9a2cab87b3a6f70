"""Shared pieces: the artifact store's atomicity and digests, path confinement, dataclass <-> proto."""

from __future__ import annotations

import hashlib
import os

import pytest

from strop.common.artifacts import ArtifactStore
from strop.common.errors import AlreadyExists, DataLoss, InvalidArgument, NotFound
from strop.common.paths import confine
from strop.common.serde import from_dict, from_proto, to_dict, to_proto
from strop.common.trainer_types import (
    Artifact,
    ArtifactFile,
    Checkpoint,
    DpoMetrics,
    JobEvent,
    JobInfo,
    JobState,
    StepMetrics,
    TrainConfig,
    TrainMethod,
)
from strop.v1 import trainer_pb2


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


def test_paths_are_confined_under_their_root(tmp_path):
    (tmp_path / "root" / "m").mkdir(parents=True)
    (tmp_path / "outside").mkdir()
    os.symlink(tmp_path / "outside", tmp_path / "root" / "link")
    assert confine(tmp_path / "root", "m") == (tmp_path / "root" / "m").resolve()
    for bad in ("../outside", str(tmp_path / "outside"), "link"):
        with pytest.raises(InvalidArgument, match="outside the allowed root"):
            confine(tmp_path / "root", bad)
    with pytest.raises(NotFound):
        confine(tmp_path / "root", "missing")


def test_dataclasses_round_trip_through_protobuf_and_json():
    job = JobInfo(
        job_id="j",
        state=JobState.CANCELLED,
        config=TrainConfig(method=TrainMethod.DPO, dpo_beta=0.2),
        last_checkpoint=Checkpoint(7, Artifact("c", files=[ArtifactFile("f", 1, "ab")], metadata={"k": "v"})),
    )
    msg = to_proto(trainer_pb2.Job, job)
    assert msg.state == trainer_pb2.JOB_STATE_CANCELLED and msg.config.method == trainer_pb2.TRAIN_METHOD_DPO
    assert from_proto(JobInfo, msg) == job
    assert from_dict(JobInfo, to_dict(job)) == job
    ev = JobEvent(job_id="j", seq=4, step=StepMetrics(step=2, loss=1.5, dpo=DpoMetrics(reward_margin=0.3)))
    msg = to_proto(trainer_pb2.JobEvent, ev)
    assert msg.WhichOneof("event") == "step"
    assert from_proto(JobEvent, msg) == ev


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


def test_paths_longer_than_a_filesystem_allows_are_invalid_argument_without_echoing_them(tmp_path):
    with pytest.raises(InvalidArgument, match="longer than a path can be") as err:
        confine(tmp_path, "m/" + "x" * 5000)
    assert len(str(err.value)) < 200 and str(tmp_path) not in str(err.value)
    with pytest.raises(InvalidArgument, match="is outside the allowed root") as err:
        confine(tmp_path, "/etc/passwd")
    assert str(tmp_path) not in str(err.value), "no absolute server path in what a client sees"
