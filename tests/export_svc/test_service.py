"""The export service over real gRPC on 127.0.0.1 (port 0), driven through the SDK."""

from __future__ import annotations

import hashlib
import threading
import time

import grpc
import pytest

from strop.client import errors as E
from strop.client.export import ExportClient, ExportRequest, ExportState, ExportTarget, VerifyOptions
from strop.common.artifacts import ArtifactStore
from strop.common.serde import to_proto
from strop.export_svc.core.jobs import ExportManager
from strop.export_svc.server import SERVICE_NAME, ExportConfig, start
from strop.v1 import export_pb2

from .conftest import ANSWER, QUESTION
from .test_bad_input import CASES

CLIENT_ERRORS = {
    "INVALID_ARGUMENT": E.InvalidArgumentError,
    "FAILED_PRECONDITION": E.FailedPreconditionError,
    "UNIMPLEMENTED": E.UnimplementedError,
}


@pytest.fixture
def server(export_models, tmp_path):
    srv = start(ExportConfig(export_models, tmp_path / "artifacts", tmp_path / "state"))
    yield srv
    srv.stop(grace=5.0)


@pytest.fixture
def client(server):
    with ExportClient(f"127.0.0.1:{server.port}") as c:
        yield c


def test_watch_export_replays_every_event_after_a_disconnect(client, server):
    exp = client.create_export(
        [ExportTarget.merged(), ExportTarget.gguf("Q8_0"), ExportTarget.gguf_lora()],
        adapter_path="trained-nf4-lora",  # base resolved from adapter_config's recorded path
        verify=VerifyOptions(question=QUESTION, answer=ANSWER),
    )
    assert exp.state in (ExportState.QUEUED, ExportState.RUNNING)
    assert [t.artifact_id for t in exp.request.targets if not t.artifact_id] == [], (
        "ids are assigned at creation"
    )
    first = []
    for ev in client.watch_export(exp.export_id):
        first.append(ev)
        if len(first) == 5:
            break  # the client goes away; the export goes on in the service
    rest = list(client.watch_export(exp.export_id, after_seq=first[-1].seq))
    events = first + rest
    assert [e.seq for e in events] == list(range(1, len(events) + 1)), "numbered 1..n, no gap, no repeat"
    assert events[-1].state is not None and events[-1].state.state is ExportState.SUCCEEDED
    replay = list(client.watch_export(exp.export_id))
    assert [e.seq for e in replay] == [e.seq for e in events], "a finished export replays in full"
    writes = [e.progress for e in events if e.progress is not None and e.progress.phase == "write"]
    merged_writes = [p for p in writes if p.target == "merged_safetensors:bfloat16"]
    assert len(merged_writes) == 21, "one progress event per tensor of the 2-layer model"
    assert merged_writes[-1].bytes_written == merged_writes[-1].bytes_total > 0
    results = [e.result for e in events if e.result is not None]
    assert len(results) == 3
    for r in results:
        v = r.verification
        assert v is not None and v.answer_checked and v.answer_reproduced, f"{r.target.kind}: {v.generated!r}"
        assert r.artifact.metadata["verify.answer_reproduced"] == "True"
    done = client.get_export(exp.export_id)
    assert done.state is ExportState.SUCCEEDED and len(done.results) == 3
    assert {a.artifact_id for a in client.list_artifacts()} == {r.artifact.artifact_id for r in done.results}


def test_cancel_over_grpc_stops_the_export_and_publishes_nothing(client, server):
    exp = client.create_export(
        [ExportTarget.merged(), ExportTarget.gguf("F16"), ExportTarget.gguf("Q4_K_M"), ExportTarget.peft()],
        adapter_path="llama-bpe-nf4-lora",
        base_model_path="llama-bpe-nf4",
    )
    for ev in client.watch_export(exp.export_id):
        if ev.progress is not None and ev.progress.phase in ("reference", "write"):
            break
    client.cancel_export(exp.export_id)
    final = client.wait_export(exp.export_id)
    assert final.state is ExportState.CANCELLED, final.error
    assert final.error_code == "CANCELLED"
    assert client.list_artifacts() == []
    assert not list((server.core.store.root / ".tmp").iterdir()), (
        "no pending directory or scratch file is left"
    )
    with pytest.raises(E.FailedPreconditionError, match="already CANCELLED"):
        client.cancel_export(exp.export_id)


@pytest.mark.parametrize("name", list(CASES))
def test_bad_input_gets_its_status_code_over_grpc_and_writes_nothing(export_models, tmp_path, name):
    case = CASES[name]
    root = tmp_path / "models"
    root.mkdir()
    req = case.build(export_models, root)
    srv = start(ExportConfig(root, tmp_path / "artifacts", tmp_path / "state"))
    try:
        with ExportClient(f"127.0.0.1:{srv.port}") as c:
            with pytest.raises(CLIENT_ERRORS[case.code], match=case.match):
                c._call(
                    c._stub.CreateExport, to_proto(export_pb2.CreateExportRequest, req), name="CreateExport"
                )
            assert c.list_exports() == [], "a refused request is not queued"
            assert c.list_artifacts() == []
    finally:
        srv.stop(grace=1.0)


def test_an_unknown_target_kind_number_is_refused_naming_the_valid_kinds(client):
    """A newer client's target kind (a number this build's enum lacks) is the request's fault, named."""
    req = export_pb2.CreateExportRequest(
        base_model_path="llama-bpe", targets=[export_pb2.ExportTarget(kind=9, gguf_type="F16")]
    )
    with pytest.raises(E.InvalidArgumentError) as err:
        client._call(client._stub.CreateExport, req, name="CreateExport")
    assert (
        "ExportTarget.kind: unknown ExportTargetKind value 9; "
        "valid: MERGED_SAFETENSORS (1), PEFT_ADAPTER (2), GGUF (3), GGUF_LORA (4)"
    ) in str(err.value)
    assert client.list_exports() == [], "a refused request is not queued"


def test_an_export_is_validated_once_and_the_worker_runs_what_create_validated(
    export_models, tmp_path, monkeypatch
):
    """The tokenizer is read into GGUF metadata by ``create`` only; the worker writes with that vocab."""
    from strop.export_svc.core import resolve

    loads = []
    real = resolve.load_vocab

    def counting_load_vocab(tok_dir, config):
        loads.append(tok_dir)
        return real(tok_dir, config)

    monkeypatch.setattr(resolve, "load_vocab", counting_load_vocab)
    manager = ExportManager(tmp_path / "state", export_models, ArtifactStore(tmp_path / "artifacts"))
    try:
        rec = manager.create(
            ExportRequest(
                adapter_path="llama-bpe-lora",
                targets=[ExportTarget.gguf("F16"), ExportTarget.gguf_lora(), ExportTarget.merged()],
                verify=VerifyOptions(skip=True),
            )
        )
        assert len(loads) == 1, "create loads the vocab once for both GGUF targets"
        assert [t.label for t in rec.request.targets] == [
            "gguf:F16",
            "gguf_lora:F32+base:F16",
            "merged_safetensors:bfloat16",
        ], "the stored request carries every default"
        assert rec.request.base_model_path == "", (
            "the request is kept as asked; the base resolved is recorded"
        )
        done = manager.wait(rec.export_id, timeout=300)
    finally:
        manager.shutdown()
    assert done.state is ExportState.SUCCEEDED, done.error
    assert len(loads) == 1, "the worker re-ran no validation"
    assert [r.artifact.artifact_id for r in done.results] == [t.artifact_id for t in rec.request.targets]
    assert {r.artifact.metadata["base_model"] for r in done.results} == {"llama-bpe"}


def test_exports_running_when_the_service_stops_are_interrupted_after_restart(export_models, tmp_path):
    store = ArtifactStore(tmp_path / "artifacts")
    release = threading.Event()

    def blocking_runner(job, *, store, **kw):
        (store.root / ".tmp" / f"{job.request.targets[0].artifact_id}.deadbeef").mkdir()  # a pending dir
        release.wait(30)
        return []

    crashed = ExportManager(tmp_path / "state", export_models, store, runner=blocking_runner)
    rec = crashed.create(ExportRequest(targets=[ExportTarget.gguf("F16")], base_model_path="llama-bpe"))
    deadline = time.monotonic() + 10
    while crashed.get(rec.export_id).state.value != "RUNNING" and time.monotonic() < deadline:
        time.sleep(0.05)
    # the process "dies" here: a new service starts on the same state directory
    srv = start(ExportConfig(export_models, tmp_path / "artifacts", tmp_path / "state"))
    try:
        with ExportClient(f"127.0.0.1:{srv.port}") as c:
            e = c.get_export(rec.export_id)
            assert e.state is ExportState.INTERRUPTED and "restart" in e.error
            states = [ev.state.state for ev in c.watch_export(rec.export_id) if ev.state is not None]
            assert states == [ExportState.QUEUED, ExportState.RUNNING, ExportState.INTERRUPTED]
        assert not list((store.root / ".tmp").glob("*.deadbeef")), "its pending output was removed"
    finally:
        release.set()
        srv.stop(grace=1.0)


def test_upload_export_download_round_trip_checks_every_sha256(client, export_models, tmp_path):
    src = export_models / "trained-spm-lora"
    up = client.upload_artifact(src, metadata={"base_model": "llama-spm"}, artifact_id="uploaded-adapter")
    assert up.kind == "adapter" and {f.name for f in up.files} == {p.name for p in src.iterdir()}
    back = client.download_artifact("uploaded-adapter", tmp_path / "back")
    for p in src.iterdir():
        assert (back / p.name).read_bytes() == p.read_bytes(), f"{p.name} changed in the round trip"
    exp = client.create_export(
        [ExportTarget.gguf("Q8_0")], adapter_artifact_id="uploaded-adapter", verify=VerifyOptions(skip=True)
    )
    done = client.wait_export(exp.export_id)
    assert done.state is ExportState.SUCCEEDED, done.error
    art = done.results[0].artifact
    dl = client.download_artifact(art.artifact_id, tmp_path / "gguf", chunk_bytes=64 * 1024)
    for f in art.files:
        assert hashlib.sha256((dl / f.name).read_bytes()).hexdigest() == f.sha256
    with pytest.raises(E.InvalidArgumentError, match="exists"):
        client.download_artifact(art.artifact_id, tmp_path / "gguf")
    with pytest.raises(E.NotFoundError):
        client.download_artifact("no-such-artifact", tmp_path / "missing")
    assert not (tmp_path / "missing").exists(), "a failed download leaves nothing at the destination"


def test_health_reflection_capabilities_and_listing(client, server):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with grpc.insecure_channel(f"127.0.0.1:{server.port}") as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME))
        assert resp.status == health_pb2.HealthCheckResponse.SERVING
        refl = reflection_pb2_grpc.ServerReflectionStub(ch)
        (answer,) = refl.ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")])
        )
        assert SERVICE_NAME in {s.name for s in answer.list_services_response.service}
    caps = client.capabilities()
    assert {"Q4_K_M", "Q5_K_M", "Q6_K", "F16", "Q8_0"} <= set(caps.gguf_types)
    assert caps.architectures == ["gemma2", "gemma3_text", "llama", "mistral", "qwen2", "qwen3"]
    with pytest.raises(E.NotFoundError, match="not found"):
        client.get_export("exp-missing")
    assert client.list_exports() == []


def test_a_client_without_shared_storage_uploads_base_and_adapter_and_exports(client, export_models):
    base = client.upload_artifact(export_models / "qwen3-bpe", kind="base_model", artifact_id="my-base")
    adapter = client.upload_artifact(export_models / "qwen3-bpe-lora", artifact_id="my-lora")
    assert (base.kind, adapter.kind) == ("base_model", "adapter")
    exp = client.create_export(
        [ExportTarget.gguf_lora(), ExportTarget.merged("float16")],
        adapter_artifact_id=adapter.artifact_id,
        base_artifact_id=base.artifact_id,
    )
    done = client.wait_export(exp.export_id)
    assert done.state is ExportState.SUCCEEDED, done.error
    for r in done.results:
        assert r.artifact.metadata["base_model"] == "artifact:my-base"
        assert r.verification.max_abs_logit_delta < 0.05, (
            f"{r.target.kind}: {r.verification.max_abs_logit_delta}"
        )
    merged = next(r for r in done.results if r.target.kind.value == "MERGED_SAFETENSORS")
    assert merged.artifact.metadata["dtype"] == "float16"
