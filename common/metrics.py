"""Prometheus metrics of both services: every metric name lives here, the cores call the hooks.

Each core owns one :class:`TrainerMetrics` or :class:`ExportMetrics` (its own registry, so two services in one
process — the tests — never share a series); the server exposes it over HTTP with :func:`serve_metrics` when
``--metrics-port`` is set. Counts by state are read from the state database at scrape time, for this instance's
records only (``instance_id``): summed over pods they give the fleet's totals, and they survive restarts.
Per-job series (loss, tokens/s, step) are kept for the most recent ``PER_JOB_SERIES`` jobs, so a long-lived
trainer's scrape stays bounded.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import resource
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.exposition import start_http_server

log = logging.getLogger("strop.metrics")

PER_JOB_SERIES = 32
# Step times from a tiny CPU model (milliseconds) to a long-context 8B step on a GPU (minutes).
STEP_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)
# Exports from a LoRA adapter copy (well under a second) to an 8B merge + K-quant on CPU (tens of minutes).
EXPORT_BUCKETS = (0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1200, 1800, 3600)

MemoryReading = Iterable[tuple[str, str, float]]  # (device, kind, bytes)
IN_FLIGHT = ("QUEUED", "RUNNING")  # the export states that still hold a pod's worker or wait for it


def process_rss_bytes() -> float:
    """This process's resident set now (Linux ``/proc``), else its peak (``getrusage``)."""
    try:
        with open("/proc/self/statm") as f:
            return float(int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE"))
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return float(peak if sys.platform == "darwin" else peak * 1024)


def host_memory() -> MemoryReading:
    """The memory reading of a process without an accelerator: its resident set, labelled as such."""
    return [("cpu", "process_rss", process_rss_bytes())]


class _Collector:
    """Gauges computed at scrape time: counts by state and device memory (callbacks into the core)."""

    def __init__(
        self,
        name: str,
        doc: str,
        states: list[str],
        counts: Callable[[], Mapping[str, int]],
        memory: Callable[[], MemoryReading],
    ):
        self.name, self.doc, self.states, self.counts, self.memory = name, doc, states, counts, memory

    def collect(self):
        family = GaugeMetricFamily(self.name, self.doc, labels=["state"])
        try:
            counts = dict(self.counts())
        except Exception:  # a database outage: the scrape still answers, without this family's samples
            log.exception("metrics: reading %s failed", self.name)
        else:
            for state in self.states:
                family.add_metric([state], counts.get(state, 0))
        yield family
        memory = GaugeMetricFamily(
            "strop_device_memory_bytes",
            "Memory in use: per accelerator (kind allocated/reserved), or this process's resident set "
            "(device cpu, kind process_rss) on a host without one.",
            labels=["device", "kind"],
        )
        try:
            for device, kind, value in self.memory():
                memory.add_metric([device, kind], value)
        except Exception:
            log.exception("metrics: reading device memory failed")
        yield memory


@dataclass
class MetricsServer:
    """The HTTP ``/metrics`` endpoint (Prometheus' text format) on its own daemon thread."""

    httpd: Any
    thread: threading.Thread

    @property
    def port(self) -> int:
        return int(self.httpd.server_port)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(5)


def serve_metrics(registry: CollectorRegistry, address: str) -> MetricsServer:
    """Serve ``registry`` on ``host:port`` (port 0 binds a free one; read it from ``.port``)."""
    host, _, port = address.rpartition(":")
    host = host.strip("[]") or "0.0.0.0"
    httpd, thread = start_http_server(int(port), addr=host, registry=registry)
    return MetricsServer(httpd, thread)


class _PerJob:
    """Gauges labelled by job id, keeping the series of the most recent ``keep`` jobs only."""

    def __init__(self, gauges: list[Gauge], keep: int = PER_JOB_SERIES):
        self.gauges, self.keep = gauges, keep
        self._order: collections.OrderedDict[str, None] = collections.OrderedDict()
        self._lock = threading.Lock()

    def touch(self, job_id: str) -> None:
        with self._lock:
            if job_id in self._order:
                return
            self._order[job_id] = None
            while len(self._order) > self.keep:
                old, _ = self._order.popitem(last=False)
                for g in self.gauges:
                    with contextlib.suppress(KeyError):  # that job never reported this gauge
                        g.remove(old)


class TrainerMetrics:
    """The trainer's metrics.

    - ``strop_trainer_jobs{state}``: this instance's jobs by state;
    - ``strop_trainer_queue_length``: jobs waiting for the device;
    - ``strop_trainer_step_seconds`` (histogram), ``strop_trainer_steps_total``;
    - ``strop_trainer_job_loss{job_id}``, ``strop_trainer_job_tokens_per_second{job_id}``,
      ``strop_trainer_job_step{job_id}``, ``strop_trainer_job_peak_memory_bytes{job_id}``: each job's last step;
    - ``strop_trainer_jobs_finished_total{state}``: jobs that ended here, by final state;
    - ``strop_trainer_primitives_total{kind,state}``, ``strop_trainer_primitive_seconds{kind}`` (histogram, on the
      device), ``strop_trainer_primitive_tokens_total{kind}``: the step API's primitives (``core/runs.py``);
    - ``strop_trainer_training_runs``, ``strop_trainer_step_futures_pending``: runs held, futures not yet run;
    - ``strop_device_memory_bytes{device,kind}``.
    """

    def __init__(
        self,
        *,
        job_counts: Callable[[], Mapping[str, int]],
        queue_length: Callable[[], int],
        memory: Callable[[], MemoryReading] = host_memory,
        states: list[str],
    ):
        self.registry = CollectorRegistry()
        r = self.registry
        r.register(
            _Collector(
                "strop_trainer_jobs", "This instance's training jobs by state.", states, job_counts, memory
            )
        )
        self.queue = Gauge("strop_trainer_queue_length", "Jobs queued for this device.", registry=r)
        self.queue.set_function(lambda: float(queue_length()))
        self.step_seconds = Histogram(
            "strop_trainer_step_seconds", "Wall time of one optimizer step.", buckets=STEP_BUCKETS, registry=r
        )
        self.steps = Counter("strop_trainer_steps", "Optimizer steps run by this instance.", registry=r)
        self.loss = Gauge(
            "strop_trainer_job_loss", "The job's loss at its last step.", ["job_id"], registry=r
        )
        self.tokens_per_second = Gauge(
            "strop_trainer_job_tokens_per_second", "Tokens/s of the job's last step.", ["job_id"], registry=r
        )
        self.step = Gauge("strop_trainer_job_step", "The job's last step.", ["job_id"], registry=r)
        self.peak_memory = Gauge(
            "strop_trainer_job_peak_memory_bytes",
            "Peak device memory of the job's last step.",
            ["job_id"],
            registry=r,
        )
        self.finished = Counter(
            "strop_trainer_jobs_finished",
            "Jobs that ended on this instance, by state.",
            ["state"],
            registry=r,
        )
        self._per_job = _PerJob([self.loss, self.tokens_per_second, self.step, self.peak_memory])
        self.primitives = Counter(
            "strop_trainer_primitives",
            "Step-API primitives finished, by kind and state.",
            ["kind", "state"],
            registry=r,
        )
        self.primitive_seconds = Histogram(
            "strop_trainer_primitive_seconds",
            "Device time of one step-API primitive.",
            ["kind"],
            buckets=STEP_BUCKETS,
            registry=r,
        )
        self.primitive_tokens = Counter(
            "strop_trainer_primitive_tokens", "Tokens processed by step-API primitives.", ["kind"], registry=r
        )
        self.training_runs = Gauge(
            "strop_trainer_training_runs", "Training runs held by this instance.", registry=r
        )
        self.futures_pending = Gauge(
            "strop_trainer_step_futures_pending", "Step-API futures accepted and not yet run.", registry=r
        )

    def on_primitive(self, kind: str, state: str, seconds: float, tokens: int) -> None:
        self.primitives.labels(kind, state).inc()
        if seconds > 0:
            self.primitive_seconds.labels(kind).observe(seconds)
        if tokens:
            self.primitive_tokens.labels(kind).inc(tokens)

    def on_step(
        self,
        job_id: str,
        *,
        step: int,
        loss: float,
        tokens_per_second: float,
        seconds: float,
        peak_bytes: int,
    ) -> None:
        self._per_job.touch(job_id)
        self.steps.inc()
        if seconds > 0:
            self.step_seconds.observe(seconds)
        self.loss.labels(job_id).set(loss)
        self.tokens_per_second.labels(job_id).set(tokens_per_second)
        self.step.labels(job_id).set(step)
        self.peak_memory.labels(job_id).set(peak_bytes)

    def on_finished(self, state: str) -> None:
        self.finished.labels(state).inc()


class ExportMetrics:
    """The exporter's metrics.

    - ``strop_export_exports{state}``: this instance's exports by state;
    - ``strop_export_queue_length``: this instance's exports waiting for a worker;
    - ``strop_export_in_flight``: this instance's exports queued or running, the load the exporter's
      HorizontalPodAutoscaler scales on (deploy/k8s: one per ``--concurrent-exports`` slot);
    - ``strop_export_duration_seconds{state}`` (histogram): RUNNING to the end, by final state;
    - ``strop_export_bytes_written_total{kind}``, ``strop_export_artifacts_total{kind}``: published outputs by
      target kind;
    - ``strop_device_memory_bytes{device,kind}``: the process's resident set.
    """

    def __init__(self, *, export_counts: Callable[[], Mapping[str, int]], states: list[str]):
        self.registry = CollectorRegistry()
        r = self.registry
        r.register(
            _Collector(
                "strop_export_exports",
                "This instance's exports by state.",
                states,
                export_counts,
                host_memory,
            )
        )
        self.queue = Gauge("strop_export_queue_length", "Exports waiting for a worker here.", registry=r)
        self.queue.set_function(lambda: float(dict(export_counts()).get("QUEUED", 0)))
        self.in_flight = Gauge(
            "strop_export_in_flight",
            "Exports queued or running on this instance (the autoscaler's per-pod load).",
            registry=r,
        )
        self.in_flight.set_function(lambda: float(sum(dict(export_counts()).get(s, 0) for s in IN_FLIGHT)))
        self.duration = Histogram(
            "strop_export_duration_seconds",
            "Wall time of an export from RUNNING to its end.",
            ["state"],
            buckets=EXPORT_BUCKETS,
            registry=r,
        )
        self.bytes_written = Counter(
            "strop_export_bytes_written", "Bytes of published export artifacts.", ["kind"], registry=r
        )
        self.artifacts = Counter(
            "strop_export_artifacts", "Export artifacts published, by target kind.", ["kind"], registry=r
        )

    def on_finished(self, state: str, seconds: float) -> None:
        self.duration.labels(state).observe(max(0.0, seconds))

    def on_artifact(self, kind: str, size_bytes: int) -> None:
        self.bytes_written.labels(kind).inc(size_bytes)
        self.artifacts.labels(kind).inc()
