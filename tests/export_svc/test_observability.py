"""Observability of the exporter: /metrics scraped over HTTP after a real export, and the JSON log format of a
service process started the way a pod starts it (``--log-format json --metrics-port N``).

The service keeps its state in the embedded SQLite file: the one query the metrics add (the exports by state) runs
on both backends in ``tests/common/test_state_store.py``, and PostgreSQL-backed exporters in ``test_replicas.py``."""

from __future__ import annotations

import json
import socket

import pytest

from strop.client.export import ExportClient, ExportState, ExportTarget, VerifyOptions
from strop.demo.services import start_service
from strop.export_svc.server import ExportConfig, start
from tests.trainer_svc.test_observability import scrape

from .conftest import make_random_adapter


@pytest.fixture(scope="module")
def small_models(tmp_path_factory):
    """One tiny llama and a random LoRA adapter for it: all a PEFT export needs."""
    from strop.fixtures import make_tiny_model

    root = tmp_path_factory.mktemp("models")
    make_tiny_model(root / "llama-bpe", arch="llama", tokenizer="bpe", seed=1)
    make_random_adapter(root / "llama-bpe", root / "llama-bpe-lora", seed=3)
    return root


def test_metrics_count_the_export_just_run_and_its_bytes(small_models, tmp_path):
    config = ExportConfig(
        small_models,
        tmp_path / "artifacts",
        tmp_path / "state",
        instance_id="exp-0",
    )
    svc = start(config, metrics="127.0.0.1:0")
    try:
        with ExportClient(f"127.0.0.1:{svc.port}") as client:
            exp = client.create_export(
                [ExportTarget.peft(), ExportTarget.merged("float16")],
                adapter_path="llama-bpe-lora",
                verify=VerifyOptions(skip=True),
            )
            done = client.wait_export(exp.export_id, timeout=300)
        assert done.state is ExportState.SUCCEEDED, done.error
        m = scrape(svc.metrics_port)
        by_state = {dict(k[1])["state"]: v for k, v in m.items() if k[0] == "strop_export_exports"}
        assert by_state["SUCCEEDED"] == 1 and sum(by_state.values()) == 1, by_state
        assert m[("strop_export_queue_length", ())] == 0
        assert m[("strop_export_duration_seconds_count", (("state", "SUCCEEDED"),))] == 1
        assert 0 < m[("strop_export_duration_seconds_sum", (("state", "SUCCEEDED"),))] < 300
        for r in done.results:
            kind = (("kind", r.target.kind.value),)
            assert m[("strop_export_bytes_written_total", kind)] == r.artifact.size_bytes > 0, (
                "bytes written are the published artifact's size"
            )
            assert m[("strop_export_artifacts_total", kind)] == 1
        assert m[("strop_device_memory_bytes", (("device", "cpu"), ("kind", "process_rss")))] > 0
    finally:
        svc.stop(grace=5.0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_json_logs_are_one_object_per_line_with_the_export_id(small_models, tmp_path):
    metrics_port = _free_port()
    args = [
        "--model-root",
        str(small_models),
        "--artifact-root",
        str(tmp_path / "artifacts"),
        "--state-dir",
        str(tmp_path / "state"),
        "--log-format",
        "json",
        "--metrics-port",
        str(metrics_port),
    ]
    svc = start_service("export", args, tmp_path / "logs")
    try:
        with ExportClient(svc.target) as client:
            exp = client.create_export(
                [ExportTarget.peft()], adapter_path="llama-bpe-lora", verify=VerifyOptions(skip=True)
            )
            assert client.wait_export(exp.export_id, timeout=300).state is ExportState.SUCCEEDED
        assert ("strop_export_exports", (("state", "SUCCEEDED"),)) in scrape(metrics_port), (
            "--metrics-port serves /metrics on --address's host"
        )
    finally:
        assert svc.stop() == 0
    lines = [ln for ln in svc.log_path.read_text().splitlines() if ln.strip()]
    records = [json.loads(ln) for ln in lines]  # every line is one JSON object
    assert all({"ts", "level", "logger", "message"} <= r.keys() for r in records)
    assert all(r["ts"].endswith("+00:00") for r in records), "UTC timestamps"
    mine = [r for r in records if r.get("export_id") == exp.export_id]
    assert [r["message"] for r in mine] == [
        f"export {exp.export_id}: running 1 target(s)",
        f"export {exp.export_id}: SUCCEEDED, 1 artifact(s) published",
    ], "the worker's lines carry the export id"
    assert any(r["message"].startswith("metrics on http://127.0.0.1:") for r in records)
