"""Exports spread over exporter replicas: the SDK's ExportClient goes round-robin over every address its target
resolves to and skips a replica whose health is not SERVING (one draining on SIGTERM). Two real servers on
127.0.0.1 (``common.grpc_server.build_server``: the services' own health servicer and drain) stand in for two pods
behind a headless Service; the ``ipv4:`` target lists both addresses as a headless name's DNS answer would."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from strop.client.export import ExportClient
from strop.common.grpc_server import ServiceBinding, build_server
from strop.v1 import export_pb2, export_pb2_grpc

SERVICE = export_pb2.DESCRIPTOR.services_by_name["ExportService"].full_name
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


class Counting(export_pb2_grpc.ExportServiceServicer):
    """An exporter that only answers GetCapabilities, counting the calls it served."""

    def __init__(self) -> None:
        self.calls = 0
        self._lock = threading.Lock()

    def GetCapabilities(self, request, context):
        with self._lock:
            self.calls += 1
        return export_pb2.Capabilities(targets=["merged"])


@pytest.fixture
def two_replicas():
    servicers = [Counting(), Counting()]
    servers = [
        build_server(
            [ServiceBinding(export_pb2_grpc.add_ExportServiceServicer_to_server, s, SERVICE)],
            address="127.0.0.1:0",
            max_workers=4,
        )
        for s in servicers
    ]
    yield servicers, servers
    for s in servers:
        if s._loop.thread.is_alive():
            s.stop(0)


def call_until(client: ExportClient, done, deadline_s: float = 10.0) -> None:
    """Call until ``done()``: round-robin sends calls only to connected replicas, and a fresh channel connects to
    its addresses one after another."""
    end = time.monotonic() + deadline_s
    while True:
        client.capabilities()
        if done():
            return
        assert time.monotonic() < end, "the condition did not hold within the deadline"
        time.sleep(0.01)


def test_export_calls_alternate_over_every_replica(two_replicas):
    (a, b), servers = two_replicas
    target = "ipv4:" + ",".join(f"127.0.0.1:{s.port}" for s in servers)
    with ExportClient(target) as client:
        # gRPC's default (pick_first) would send every call to the first address and never reach b
        call_until(client, lambda: a.calls and b.calls)
        a.calls = b.calls = 0
        for _ in range(20):
            client.capabilities()
        # round_robin over two ready replicas: each gets every other call
        assert (a.calls, b.calls) == (10, 10)


def test_a_draining_replica_gets_no_new_calls(two_replicas):
    (a, b), servers = two_replicas
    target = "ipv4:" + ",".join(f"127.0.0.1:{s.port}" for s in servers)
    release = threading.Event()
    with ExportClient(target) as client:
        call_until(client, lambda: a.calls and b.calls)
        # b drains as on SIGTERM: health NOT_SERVING, then it waits for its running exports (held here) while its
        # port still accepts connections; without client-side health checks every other call would still reach it
        # and be refused (UNAVAILABLE) for the whole drain (minutes for an exporter)
        stopping = threading.Thread(target=servers[1].stop, args=(0,), kwargs={"on_drain": release.wait})
        stopping.start()
        try:
            with grpc.insecure_channel(f"127.0.0.1:{servers[1].port}") as ch:
                health = health_pb2_grpc.HealthStub(ch)
                end = time.monotonic() + 10
                while health.Check(health_pb2.HealthCheckRequest(service=SERVICE)).status != NOT_SERVING:
                    assert time.monotonic() < end, "b never reported NOT_SERVING"
                    time.sleep(0.01)
            # the channel learns b's status over its own health watch: wait for ten calls in a row that reach a
            end, streak = time.monotonic() + 10, 0
            while streak < 10:
                assert time.monotonic() < end, "calls kept reaching the draining replica"
                before = a.calls
                client.capabilities()
                streak = streak + 1 if a.calls > before else 0
            a.calls, b_before = 0, b.calls
            for _ in range(20):
                client.capabilities()
            assert (a.calls, b.calls - b_before) == (20, 0), (
                "expected every call on the replica still serving"
            )
        finally:
            release.set()
            stopping.join(10)
