"""``--max-connection-age``: the server asks each client to reconnect after that long, so a plain gRPC client
behind a Kubernetes ClusterIP Service (balanced per connection) is balanced again on every reconnect, and a
round-robin client re-resolves and finds pods added since. A real server on 127.0.0.1 and a plain channel (gRPC's
default pick_first, as any client outside the SDK has); the server sees each connection as its own peer port."""

from __future__ import annotations

import threading
import time

import grpc

from strop.common.grpc_server import ConnectionAge, ServiceBinding, build_server
from strop.common.server_cli import service_parser
from strop.v1 import export_pb2, export_pb2_grpc

SERVICE = export_pb2.DESCRIPTOR.services_by_name["ExportService"].full_name


class Peers(export_pb2_grpc.ExportServiceServicer):
    """Records the client address (``ipv4:127.0.0.1:<port>``: one per connection) of every call."""

    def __init__(self) -> None:
        self.peers: list[str] = []
        self._lock = threading.Lock()

    def GetCapabilities(self, request, context):
        with self._lock:
            self.peers.append(context.peer())
        return export_pb2.Capabilities()


def connections_over(age: ConnectionAge, seconds: float) -> int:
    """How many connections one plain client used for a call every 50 ms over ``seconds``."""
    servicer = Peers()
    server = build_server(
        [ServiceBinding(export_pb2_grpc.add_ExportServiceServicer_to_server, servicer, SERVICE)],
        connection_age=age,
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = export_pb2_grpc.ExportServiceStub(channel)
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                # wait_for_ready: a call made while the channel reconnects waits for it rather than failing
                stub.GetCapabilities(export_pb2.GetCapabilitiesRequest(), timeout=5, wait_for_ready=True)
                time.sleep(0.05)
    finally:
        server.stop(0)
    return len(set(servicer.peers))


def test_connections_are_replaced_after_the_maximum_age():
    # 0.3 s (±10% jitter) over 1.5 s: at least 4 connections; without an age, one connection for the whole run
    assert connections_over(ConnectionAge(max_age_s=0.3), 1.5) >= 4
    assert connections_over(ConnectionAge(), 1.0) == 1


def test_connection_age_flags_have_environment_defaults(monkeypatch):
    monkeypatch.setenv("STROP_MAX_CONNECTION_AGE", "300")
    args = service_parser("t", "t", name="export", port=50052).parse_args(["--max-connection-age-grace=60"])
    assert (args.max_connection_age, args.max_connection_age_grace) == (300.0, 60.0)
    assert ConnectionAge(300, 60).options() == [
        ("grpc.max_connection_age_ms", 300_000),
        ("grpc.max_connection_age_grace_ms", 60_000),
    ]
    # grace 0: calls open on an old connection run to their end (a training job's stream lasts hours)
    assert ConnectionAge(300, 0).options() == [("grpc.max_connection_age_ms", 300_000)]
    assert ConnectionAge().options() == []


class Slow(export_pb2_grpc.ExportServiceServicer):
    """A call that outlasts the connection's age (an export's WatchExport stream, a long upload)."""

    def GetCapabilities(self, request, context):
        time.sleep(1.0)
        return export_pb2.Capabilities(targets=["merged"])


def slow_call(age: ConnectionAge) -> grpc.StatusCode:
    server = build_server(
        [ServiceBinding(export_pb2_grpc.add_ExportServiceServicer_to_server, Slow(), SERVICE)],
        connection_age=age,
    )
    try:
        with grpc.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            stub = export_pb2_grpc.ExportServiceStub(channel)
            try:
                stub.GetCapabilities(export_pb2.GetCapabilitiesRequest(), timeout=5)
            except grpc.RpcError as e:
                return e.code()
            return grpc.StatusCode.OK
    finally:
        server.stop(0)


def test_a_call_open_when_its_connection_ages_out_runs_to_its_end_unless_a_grace_is_set():
    # 1 s call, 0.2 s age: the GOAWAY comes mid-call. Grace 0 (the manifests'): gRPC's unlimited grace, the call
    # ends normally on the old connection; a 0.2 s grace closes the connection under it.
    assert slow_call(ConnectionAge(max_age_s=0.2)) == grpc.StatusCode.OK
    assert slow_call(ConnectionAge(max_age_s=0.2, grace_s=0.2)) == grpc.StatusCode.UNAVAILABLE
