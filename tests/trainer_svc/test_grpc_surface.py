"""The trainer's gRPC surface against odd requests, over real gRPC: unknown enum numbers, odd strings and deep
JSON, user errors refused before a job exists, messages naming paths relative to their roots, aborted uploads,
reflection off, the loopback default, a reader that stops reading. Elsewhere: limits, the queue and streams
(test_limits_and_queue), auth and TLS (tests/common/test_auth.py), tenancy (tests/common/test_tenancy.py),
non-finite training (test_training_guards, test_failed_jobs), corrupted inputs
(tests/export_svc/test_bad_input.py), upload file names (tests/common/test_artifact_store.py)."""

from __future__ import annotations

import json

import grpc
import pytest

from strop.v1 import trainer_pb2, trainer_pb2_grpc


@pytest.fixture
def stub(trainer):
    running, _, _ = trainer
    with grpc.insecure_channel(f"127.0.0.1:{running.port}") as ch:
        yield trainer_pb2_grpc.TrainerServiceStub(ch)


def _code(call) -> tuple[grpc.StatusCode, str]:
    try:
        out = call()
        if hasattr(out, "__iter__") and not hasattr(out, "ListFields"):
            list(out)
    except grpc.RpcError as err:
        return err.code(), err.details() or ""
    return grpc.StatusCode.OK, ""


def _upload(stub, header: trainer_pb2.DatasetHeader, data: bytes):
    parts = [trainer_pb2.UploadDatasetRequest(header=header), trainer_pb2.UploadDatasetRequest(data=data)]
    return lambda: stub.UploadDataset(iter(parts), timeout=30)


# Finding 8: unknown enum values, odd strings and deep JSON were INTERNAL (a KeyError in conversion, a
# RecursionError, an OSError on a long path).
def test_unknown_enums_odd_strings_and_deep_json_are_invalid_argument(stub, ready_session, sft_dataset):
    deep = ("[" * 100_000 + "]" * 100_000).encode()
    calls = {
        "ListJobs(states=[7])": lambda: stub.ListJobs(trainer_pb2.ListJobsRequest(states=[7]), timeout=30),
        "LoadModel(quantization=3)": lambda: stub.LoadModel(
            trainer_pb2.LoadModelRequest(model_path="tiny-llama-4bit", quantization=3), timeout=30
        ),
        "Train(config.method=99)": lambda: stub.Train(
            trainer_pb2.TrainRequest(
                session_id=ready_session,
                dataset_id=sft_dataset.dataset_id,
                config=trainer_pb2.TrainConfig(method=99, max_steps=1),
            ),
            timeout=30,
        ),
        "RegisterDataset(header.format=99)": lambda: stub.RegisterDataset(
            trainer_pb2.RegisterDatasetRequest(path="x.jsonl", header=trainer_pb2.DatasetHeader(format=99)),
            timeout=30,
        ),
        "a 100,000-deep JSON row": _upload(
            stub, trainer_pb2.DatasetHeader(name="deep"), b'{"text": ' + deep + b"}\n"
        ),
        "a 300-character model path": lambda: stub.LoadModel(
            trainer_pb2.LoadModelRequest(model_path="m" * 300), timeout=30
        ),
    }
    got = {name: _code(call) for name, call in calls.items()}
    wrong = {name: c for name, c in got.items() if c[0] is not grpc.StatusCode.INVALID_ARGUMENT}
    assert not wrong, wrong
    assert "unknown JobState value 7" in got["ListJobs(states=[7])"][1]
    assert "m" * 300 not in got["a 300-character model path"][1], "the long path is not echoed whole"


# Finding 10: user errors accepted, then failing the job; no error code to tell "fix your input" from "retry".
@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_epochs", float("inf")),
        ("weight_decay", float("inf")),
        ("max_grad_norm", float("nan")),
        ("seed", -1),
    ],
)
def test_user_errors_are_refused_before_a_job_exists_naming_the_field(
    stub, client, ready_session, sft_dataset, field, value
):
    before = len(client.list_jobs())
    config = trainer_pb2.TrainConfig(method=trainer_pb2.TRAIN_METHOD_SFT, max_steps=1, **{field: value})
    code, details = _code(
        lambda: stub.Train(
            trainer_pb2.TrainRequest(
                session_id=ready_session, dataset_id=sft_dataset.dataset_id, config=config
            ),
            timeout=30,
        )
    )
    assert code is grpc.StatusCode.INVALID_ARGUMENT and field in details, details
    assert len(client.list_jobs()) == before, "no job was created"


# Finding 11: errors leaked absolute server paths and echoed a 1 MiB id into the trailers
# (RESOURCE_EXHAUSTED "metadata size exceeds hard limit", which clients retry).
def test_errors_name_paths_relative_to_their_root_and_truncate_echoed_ids(stub, trainer):
    _, _, config = trainer
    code, details = _code(
        lambda: stub.LoadModel(trainer_pb2.LoadModelRequest(model_path="no-such-model"), timeout=30)
    )
    assert code is grpc.StatusCode.NOT_FOUND
    assert str(config.model_root) not in details and "/tmp" not in details, details
    huge = "j" * (1 << 20)
    for call in (
        lambda: stub.GetJob(trainer_pb2.GetJobRequest(job_id=huge), timeout=30),
        lambda: stub.CancelJob(trainer_pb2.CancelJobRequest(job_id=huge), timeout=30),
        lambda: stub.WatchJob(trainer_pb2.WatchJobRequest(job_id=huge), timeout=30),
    ):
        code, details = _code(call)
        assert code is grpc.StatusCode.NOT_FOUND, code
        assert len(details) < 2100, len(details)


def test_a_failed_jobs_error_names_no_server_path(client, trainer, ready_session):
    _, _, config = trainer
    ds = client.upload_dataset([{"text": "a short row"}] * 2)
    # lr so large that the adapters turn non-finite: the guard fails the job as a user error
    from strop.client import JobState

    from .conftest import sft_config

    job = client.wait_job(
        next(iter(client.train(ready_session, ds.dataset_id, sft_config(3, learning_rate=1e30)))).job_id
    )
    assert job.state is JobState.FAILED and job.error_code == "INVALID_ARGUMENT", (job.state, job.error)
    for root in (config.model_root, config.artifact_root, config.state_dir):
        assert str(root) not in job.error, job.error
    assert ".venv" not in job.error and "site-packages" not in job.error, job.error


# Finding 13: an aborted client upload logged an unhandled traceback; reflection was always on.
def test_an_aborted_upload_is_cancelled_quietly_and_leaves_no_dataset(stub, client, caplog):
    import threading
    import time

    before = {d.dataset_id for d in client.list_datasets()}
    row = json.dumps({"text": "half a dataset"}).encode() + b"\n"
    go_on = threading.Event()

    def parts():  # the SDK's header: the size of what follows; the client goes away after half of it
        yield trainer_pb2.UploadDatasetRequest(
            header=trainer_pb2.DatasetHeader(name="aborted", size_bytes=2 * len(row))
        )
        yield trainer_pb2.UploadDatasetRequest(data=row)
        go_on.wait(10)

    future = stub.UploadDataset.future(parts(), timeout=30)
    time.sleep(1.0)
    future.cancel()
    go_on.set()
    time.sleep(1.0)
    assert {d.dataset_id for d in client.list_datasets()} == before, "half an upload is not a dataset"
    assert not [r for r in caplog.records if r.exc_info], [
        r.getMessage() for r in caplog.records if r.exc_info
    ]
    # the same, finished short without a cancel, is DATA_LOSS; finished whole, a dataset
    parts_short = [
        trainer_pb2.UploadDatasetRequest(header=trainer_pb2.DatasetHeader(name="s", size_bytes=2 * len(row))),
        trainer_pb2.UploadDatasetRequest(data=row + row[:5]),
    ]
    code, details = _code(lambda: stub.UploadDataset(iter(parts_short), timeout=30))
    assert code is grpc.StatusCode.DATA_LOSS and "ended after" in details, details
    ds = client.upload_dataset(row * 2)
    assert ds.num_rows == 2 and ds.size_bytes == 2 * len(row)


def test_reflection_can_be_switched_off(model_root, tmp_path):
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    from strop.trainer_svc.core.trainer_core import TrainerConfig
    from strop.trainer_svc.server import start

    (tmp_path / "data").mkdir()
    config = TrainerConfig(
        model_root=model_root,
        artifact_root=tmp_path / "a",
        state_dir=tmp_path / "s",
        data_root=tmp_path / "data",
    )
    service = start(config, reflection=False)
    try:
        with grpc.insecure_channel(f"127.0.0.1:{service.running.port}") as ch:
            refl = reflection_pb2_grpc.ServerReflectionStub(ch)
            code, _ = _code(
                lambda: refl.ServerReflectionInfo(
                    iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=10
                )
            )
            assert code is grpc.StatusCode.UNIMPLEMENTED
    finally:
        service.stop(grace=5.0)


def test_both_services_bind_the_loopback_interface_unless_told_otherwise():
    from strop.export_svc.server import parse_args as export_args
    from strop.trainer_svc.server import parse_args as trainer_args

    for parse in (trainer_args, export_args):
        assert parse([]).address.startswith("127.0.0.1:")


# Fault: a slow client that stops reading its event stream holds back neither the job nor other calls, and
# gets every event, in order, once it reads again.
def test_a_reader_that_stops_reading_holds_back_nothing_and_misses_nothing(
    trainer, stub, client, ready_session, sft_dataset
):
    target = f"127.0.0.1:{trainer[0].port}"
    import time

    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from strop.client import JobState

    from .conftest import sft_config

    job_id = next(iter(client.train(ready_session, sft_dataset.dataset_id, sft_config(60)))).job_id
    stalled = stub.WatchJob(trainer_pb2.WatchJobRequest(job_id=job_id), timeout=600)
    first = next(stalled)  # reads one event, then nothing while the job runs
    assert first.seq == 1
    t0 = time.monotonic()
    while (job := client.get_job(job_id)).state is not JobState.SUCCEEDED:
        assert not job.state.terminal, (job.state, job.error)
        assert time.monotonic() - t0 < 300
        time.sleep(0.2)
        with grpc.insecure_channel(target) as ch:  # other calls answer while the reader sits on its stream
            assert (
                health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=5).status == 1
            )
    rest = list(stalled)
    seqs = [first.seq] + [e.seq for e in rest]
    assert seqs == list(range(1, len(seqs) + 1)), "no event dropped or reordered"
    steps = [e.step.step for e in rest if e.HasField("step")]
    assert steps == list(range(1, 61))
    assert rest[-1].state.state == trainer_pb2.JOB_STATE_SUCCEEDED
