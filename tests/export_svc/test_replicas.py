"""Two export pods on one PostgreSQL state database (a real server), as a Deployment with an HPA runs them:
either pod lists and cancels any export, and the exports of a pod whose heartbeat stopped are recovered by a live
one."""

from __future__ import annotations

import time

from strop.common.artifacts import ArtifactStore
from strop.common.db import open_database
from strop.common.export_types import ExportRequest, ExportState, ExportTarget, VerifyOptions
from strop.export_svc.core.jobs import ExportManager
from tests.export_svc.test_observability import small_models  # noqa: F401  (a fixture)


def _runner_until_cancelled(job, *, cancel, **kw):
    """A worker that writes nothing and runs until it is cancelled (``cancel.check`` raises then)."""
    while not cancel.cancelled:
        time.sleep(0.02)
    cancel.check()


def _running(manager: ExportManager, export_id: str) -> None:
    deadline = time.monotonic() + 10
    while manager.get(export_id).state is not ExportState.RUNNING:
        assert time.monotonic() < deadline, "the export never started"
        time.sleep(0.02)


def test_any_pod_cancels_an_export_and_a_dead_pods_exports_are_recovered(small_models, tmp_path, postgres):  # noqa: F811
    url = postgres.new_database()
    store = ArtifactStore(tmp_path / "artifacts")  # one ReadWriteMany volume

    def pod(name: str) -> ExportManager:
        return ExportManager(
            tmp_path / name,
            small_models,
            store,
            database_url=url,
            instance_id=name,
            runner=_runner_until_cancelled,
        )

    a, b = pod("export-a"), pod("export-b")
    request = ExportRequest(
        targets=[ExportTarget.peft()], adapter_path="llama-bpe-lora", verify=VerifyOptions(skip=True)
    )
    try:
        first = b.create(request).export_id
        _running(b, first)
        assert [e.export_id for e in a.list()] == [first], "pod a lists pod b's export"

        a.cancel(first)  # the client's call reached pod a; pod b runs the export
        assert a.get(first).state is ExportState.RUNNING
        b._sweep(b.liveness.others_alive() | {b.instance_id})  # pod b's next heartbeat
        assert a.wait(first, timeout=10).state is ExportState.CANCELLED

        second = b.create(request).export_id
        _running(b, second)
        b.liveness.stop(retire=False)  # pod b dies: no more heartbeats, its row goes stale
        a.liveness.stale_after = 0.5
        assert a.liveness.others_alive() == {"export-b"}, "still fresh"
        time.sleep(0.7)
        a._sweep(a.liveness.others_alive() | {a.instance_id})  # pod a's next heartbeat
        done = a.get(second)
        assert (done.state, done.error_code) == (ExportState.INTERRUPTED, "ABORTED")
        states = [e.state.state for e in a.events(second) if e.state]
        assert states == [ExportState.QUEUED, ExportState.RUNNING, ExportState.INTERRUPTED]
    finally:
        a.shutdown()
        b.shutdown()  # its worker stops at last
    db = open_database(url, sqlite_path="unused", schema="")
    assert db.query_one("SELECT state FROM exports WHERE export_id = ?", (second,)) == {
        "state": "INTERRUPTED"
    }, "the recorded end stays: the worker that stopped later cannot overwrite it"
    db.close()
