"""``strop_export_in_flight``: the per-pod load the exporter's HorizontalPodAutoscaler scales on
(deploy/k8s/base/export.yaml). Read from the state database's counts at scrape time, like the other gauges."""

from __future__ import annotations

from prometheus_client import generate_latest

from strop.common.export_types import ExportState
from strop.common.metrics import ExportMetrics


def test_in_flight_counts_queued_and_running_exports_only():
    counts = {"QUEUED": 2, "RUNNING": 1, "SUCCEEDED": 7, "FAILED": 1, "INTERRUPTED": 3}
    metrics = ExportMetrics(export_counts=lambda: counts, states=[s.value for s in ExportState])
    # a pod running one export with two waiting carries three exports' load; finished ones carry none
    assert metrics.registry.get_sample_value("strop_export_in_flight") == 3
    assert metrics.registry.get_sample_value("strop_export_queue_length") == 2
    counts.clear()
    assert metrics.registry.get_sample_value("strop_export_in_flight") == 0
    # the name the HPA's Pods metric (and the Prometheus adapter rule in deploy/README.md) asks for
    assert b"\nstrop_export_in_flight 0.0\n" in generate_latest(metrics.registry)


def test_in_flight_states_are_export_states():
    from strop.common.metrics import IN_FLIGHT

    assert {ExportState(s) for s in IN_FLIGHT} == {ExportState.QUEUED, ExportState.RUNNING}
