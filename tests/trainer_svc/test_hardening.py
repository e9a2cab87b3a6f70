"""Service hardening on the trainer's core: the session cap under concurrency, confinement of linked files,
and downloads of damaged artifacts over gRPC."""

from __future__ import annotations

import shutil
import threading
import time

import pytest

from strop.client import DataLossError
from strop.common.errors import InvalidArgument, ResourceExhausted
from strop.common.trainer_types import LoadModelRequest
from strop.trainer_svc.core.trainer_core import TrainerConfig, TrainerCore


def test_concurrent_loads_never_pass_the_session_cap(model_root, tmp_path):
    # today: every load checks the cap before any of them registers, so 6 concurrent loads open 6 of 2
    core = TrainerCore(
        TrainerConfig(
            model_root=model_root, artifact_root=tmp_path / "a", state_dir=tmp_path / "s", max_sessions=2
        )
    )
    results, barrier = [], threading.Barrier(6)

    def load():
        barrier.wait()
        try:
            results.append(core.sessions.load(LoadModelRequest(model_path="tiny-llama")).session_id)
        except ResourceExhausted as exc:
            results.append(exc)

    threads = [threading.Thread(target=load) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    opened = [r for r in results if isinstance(r, str)]
    assert len(opened) == 2, results
    assert all("limit 2" in str(r) for r in results if not isinstance(r, str))
    core.close()


def test_a_weight_file_linked_outside_the_model_root_is_refused(model_root, tmp_path):
    outside = tmp_path / "outside"
    shutil.copytree(model_root / "tiny-llama", outside)
    linked = model_root / "linked-weights"
    linked.mkdir()
    for f in (model_root / "tiny-llama").iterdir():
        (linked / f.name).symlink_to(outside / f.name if f.suffix == ".safetensors" else f)
    core = TrainerCore(
        TrainerConfig(model_root=model_root, artifact_root=tmp_path / "a", state_dir=tmp_path / "s")
    )
    try:
        with pytest.raises(InvalidArgument, match=r"model\.safetensors.*links outside the allowed root"):
            core.sessions.load(LoadModelRequest(model_path="linked-weights"))
    finally:
        core.close()
        shutil.rmtree(linked)


def test_downloading_a_truncated_artifact_ends_with_data_loss_at_once(
    client, ready_session, tmp_path, trainer
):
    _, core, _ = trainer
    art = client.save_adapter(ready_session, "to-truncate")
    weights = core.artifacts.path_of(art.artifact_id) / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    t0 = time.monotonic()
    with pytest.raises(DataLossError, match="truncated"):
        client.download_artifact(art.artifact_id, tmp_path / "dl")
    assert time.monotonic() - t0 < 10, "the stream ends instead of sending empty chunks"
    assert not (tmp_path / "dl").exists(), "a failed download leaves nothing behind"
