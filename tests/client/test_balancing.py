"""Exports spread over exporter replicas: the SDK's ExportClient goes round-robin over every address its target
resolves to and skips a replica whose health is not SERVING (one draining on SIGTERM). Two real servers on
127.0.0.1 (``common.grpc_server.build_server``: the services' own health servicer and drain) stand in for two pods
behind a headless Service; the ``ipv4:`` target lists both addresses as a headless name's DNS answer would. The last
two tests resolve a real ``dns://`` target through gRPC's DNS resolver, against a small DNS server of their own that
answers the headless name with the pods' addresses (127.0.0.1 and 127.0.0.2: one port, one address per pod)."""

from __future__ import annotations

import socket
import struct
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from strop.client._base import CHANNEL_OPTIONS, spread_config
from strop.client.export import ExportClient
from strop.common.grpc_server import ConnectionAge, ServiceBinding, build_server
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


HEADLESS = "export-headless.strop.svc.cluster.local"


class HeadlessDns:
    """A DNS server on 127.0.0.1 (UDP) that answers every A query with ``addresses`` (a headless Service's answer:
    the ready pods' IPs; the test changes the list as pods come) and every other query with no record. gRPC's DNS
    resolver asks it when the target names it: ``dns://127.0.0.1:<port>/<name>:<grpc port>``."""

    def __init__(self, addresses: list[str]) -> None:
        self.addresses = addresses
        self.queries = 0
        self._sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.settimeout(0.1)
        self.port = self._sock.getsockname()[1]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def target(self, port: int) -> str:
        return f"dns://127.0.0.1:{self.port}/{HEADLESS}:{port}"

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                query, peer = self._sock.recvfrom(4096)
            except TimeoutError:
                continue
            # header (RFC 1035 4.1.1), then one question: QNAME's labels up to the zero byte, QTYPE, QCLASS
            qid, flags = struct.unpack(">HH", query[:4])
            end = 12
            while query[end]:
                end += 1 + query[end]
            qtype = struct.unpack(">H", query[end + 1 : end + 3])[0]
            question = query[12 : end + 5]
            # A (1) records, each naming the question's QNAME by a pointer to offset 12, class IN, TTL 0
            record = struct.pack(">HHHIH", 0xC00C, 1, 1, 0, 4)
            answers = [record + socket.inet_aton(a) for a in self.addresses] if qtype == 1 else []
            self.queries += 1
            # QR, the query's RD, RA; NOERROR; the question echoed; no authority or additional records
            header = struct.pack(">HHHHHH", qid, 0x8080 | (flags & 0x0100), 1, len(answers), 0, 0)
            self._sock.sendto(header + question + b"".join(answers), peer)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close()


def pods(age: ConnectionAge | None = None):
    """Two exporter pods on 127.0.0.1 and 127.0.0.2, one port (as a headless Service's pods share theirs)."""
    servicers = [Counting(), Counting()]
    first = build_server(
        [ServiceBinding(export_pb2_grpc.add_ExportServiceServicer_to_server, servicers[0], SERVICE)],
        address="127.0.0.1:0",
        max_workers=4,
        connection_age=age,
    )
    second = build_server(
        [ServiceBinding(export_pb2_grpc.add_ExportServiceServicer_to_server, servicers[1], SERVICE)],
        address=f"127.0.0.2:{first.port}",
        max_workers=4,
        connection_age=age,
    )
    return servicers, [first, second]


def test_a_dns_target_spreads_calls_over_every_address_of_a_headless_name():
    (a, b), servers = pods()
    dns = HeadlessDns(["127.0.0.1", "127.0.0.2"])
    try:
        # the SDK's own channel: the name resolves to two addresses, and round_robin uses both
        with ExportClient(dns.target(servers[0].port)) as client:
            call_until(client, lambda: a.calls and b.calls)
            a.calls = b.calls = 0
            for _ in range(20):
                client.capabilities()
            assert (a.calls, b.calls) == (10, 10)
        assert dns.queries >= 1
    finally:
        dns.close()
        for s in servers:
            s.stop(0)


@pytest.mark.parametrize("age", [None, ConnectionAge(max_age_s=0.3)], ids=["no-age", "max-age"])
def test_a_pod_added_later_gets_calls_once_the_servers_connections_age_out(age):
    # The HPA adds a pod while a client is connected: the headless name now has two addresses, but gRPC resolves
    # again only when a connection ends (it does not poll DNS). --max-connection-age ends them (GOAWAY), so the
    # round-robin channel re-resolves and reaches the new pod; without it the client keeps the pod it has.
    (a, b), servers = pods(age)
    dns = HeadlessDns(["127.0.0.1"])
    target = dns.target(servers[0].port)
    # the SDK's service config on a channel whose DNS re-resolution may follow a GOAWAY within 0.1 s (gRPC's
    # default spaces resolutions 30 s apart; a server's connection age is minutes)
    options = [
        *CHANNEL_OPTIONS,
        ("grpc.service_config", spread_config(SERVICE)),
        ("grpc.dns_min_time_between_resolutions_ms", 100),
    ]
    try:
        with grpc.insecure_channel(target, options=options) as channel:
            client = ExportClient(target, channel=channel)
            call_until(client, lambda: a.calls >= 5)
            assert b.calls == 0
            dns.addresses = ["127.0.0.1", "127.0.0.2"]  # the new pod is ready
            end = time.monotonic() + 2.0
            while time.monotonic() < end and not b.calls:
                client.capabilities()
                time.sleep(0.01)
            if age is None:
                assert b.calls == 0, "without a connection age the client was expected to keep its one pod"
            else:
                assert b.calls > 0, "the new pod got no call after the connections aged out"
    finally:
        dns.close()
        for s in servers:
            s.stop(0)
