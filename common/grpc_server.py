"""The services' gRPC server: built alike for both (interceptor, health, reflection, limits, connection age), and
stopped alike (graceful drain on SIGTERM, a watchdog on a stuck drain).

Beside it, one room per idea: ``common.interceptor`` (authentication, error mapping, undecodable requests),
``common.aio`` (blocking core calls from async handlers, event streams and their turns), ``common.server_cli``
(the flags both services share and their ``main``). Only the services' thin gRPC layers import these modules;
their ``core/`` packages never import grpc.
"""

from __future__ import annotations

import asyncio
import faulthandler
import logging
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterable, Mapping
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from strop.common.auth import TokenTable
from strop.common.errors import Unavailable
from strop.common.interceptor import ErrorInterceptor
from strop.common.metrics import MetricsServer

log = logging.getLogger("strop.grpc")

MAX_MESSAGE_BYTES = 64 << 20
# Open calls beyond this are refused (RESOURCE_EXHAUSTED) rather than queued: each costs memory, not a thread
MAX_CONCURRENT_RPCS = 10_000
SHUTDOWN_SLACK_S = 15.0  # beyond the two grace periods before the drain watchdog fires
SERVER_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # Long-lived event streams through load balancers: keep the connection alive.
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_pings_without_data", 0),
]


@dataclass(frozen=True)
class ConnectionAge:
    """How long a client connection lives before the server asks the client to reconnect (HTTP/2 GOAWAY).

    Behind a Kubernetes ClusterIP Service, gRPC is balanced per connection: a client keeps the pod it first
    reached for as long as its connection lives, so replicas an autoscaler adds get no calls from connected
    clients. A finite ``max_age_s`` makes every client reconnect (kube-proxy then picks a pod again) and makes
    round-robin clients of a headless Service re-resolve its DNS name (their resolver runs again only when a
    connection ends), so they find new pods. ``grace_s`` is how long calls still open on a closing connection may
    run; 0 (the default) lets them finish however long they take (a training job's event stream runs for hours).
    gRPC adds ±10% jitter to the age so that clients do not all reconnect at once.
    """

    max_age_s: float = 0.0  # 0: connections live until either side closes them
    grace_s: float = 0.0  # 0: no limit

    def options(self) -> list[tuple[str, int]]:
        if self.max_age_s <= 0:
            return []
        out = [("grpc.max_connection_age_ms", max(1, round(self.max_age_s * 1000)))]
        if self.grace_s > 0:
            out.append(("grpc.max_connection_age_grace_ms", max(1, round(self.grace_s * 1000))))
        return out


class Drain:
    """The draining flag: once set, requests that would start new work get UNAVAILABLE."""

    def __init__(self) -> None:
        self._event = threading.Event()

    @property
    def draining(self) -> bool:
        return self._event.is_set()

    def start(self) -> None:
        self._event.set()

    def check(self) -> None:
        if self._event.is_set():
            raise Unavailable("the service is shutting down; retry against another replica or later")


@dataclass
class ServiceBinding:
    """A servicer and how to register it: ``add_fn(servicer, server)`` and its full proto name."""

    add_fn: Callable[[object, grpc.Server], None]
    servicer: object
    full_name: str


class _Loop:
    """An asyncio event loop on its own thread: the gRPC server lives there, sync callers submit to it."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="strop-grpc-loop", daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float | None = None):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@dataclass
class RunningServer:
    server: grpc.aio.Server
    health: Any
    port: int
    drain: Drain
    service_names: list[str]
    pool: futures.ThreadPoolExecutor
    _loop: _Loop
    probe_server: grpc.aio.Server | None = None  # the plaintext health-only listener (``health_address``)
    health_port: int = 0

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop.loop

    def stop(self, grace: float | None = 5.0, on_drain: Callable[[], bool | None] | None = None) -> bool:
        """Graceful stop: NOT_SERVING for health probes, refuse new work, let calls finish, stop.

        Returns:
            False when ``on_drain`` reported work it could not stop (it returned False), else True.
        """
        self.drain.start()
        self._loop.run(self.health.enter_graceful_shutdown())
        clean = on_drain() is not False if on_drain is not None else True
        self._loop.run(self.server.stop(grace))
        if self.probe_server is not None:
            self._loop.run(self.probe_server.stop(0))
        self.pool.shutdown(wait=False, cancel_futures=True)
        self._loop.close()
        return clean


def build_server(
    bindings: Iterable[ServiceBinding],
    *,
    address: str = "127.0.0.1:0",
    max_workers: int = 32,
    drain: Drain | None = None,
    reflection_on: bool = True,
    security: Security | None = None,
    health_address: str | None = None,
    connection_age: ConnectionAge | None = None,
    private_paths: Mapping[str, str] | None = None,
) -> RunningServer:
    """Create and start a server with error mapping, health (per service and overall) and reflection.

    ``health_address``: also serve grpc.health.v1, and nothing else, in plaintext there (the same statuses).
    Kubernetes' gRPC probes present no client certificate, so under mTLS they reach the service only this way;
    a health answer reveals no tenant's data. ``connection_age``: see :class:`ConnectionAge` (None: unlimited).

    The server is grpc.aio on its own event-loop thread: async handlers (the event streams) wait without
    holding a thread, so health and unary calls answer with hundreds of streams open; plain handlers run in a
    pool of ``max_workers`` threads. ``address`` with port 0 binds a free port; the bound port is returned.
    """
    bindings = list(bindings)
    loop = _Loop()
    pool = futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="strop-rpc")

    async def create():
        server = grpc.aio.server(
            migration_thread_pool=pool,
            interceptors=[ErrorInterceptor(security.tokens if security else None, private_paths)],
            options=SERVER_OPTIONS + (connection_age or ConnectionAge()).options(),
            maximum_concurrent_rpcs=MAX_CONCURRENT_RPCS,
        )
        health_servicer = health_aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
        names = []
        for b in bindings:
            b.add_fn(b.servicer, server)
            names.append(b.full_name)
            await health_servicer.set(b.full_name, health_pb2.HealthCheckResponse.SERVING)
        await health_servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        if reflection_on:
            reflection.enable_server_reflection(
                [*names, health.SERVICE_NAME, reflection.SERVICE_NAME], server
            )
        if security is not None and security.credentials is not None:
            port = server.add_secure_port(address, security.credentials)
        else:
            port = server.add_insecure_port(address)
        if port == 0:
            raise OSError(f"could not bind {address}")
        await server.start()
        probe, health_port = None, 0
        if health_address:
            probe = grpc.aio.server(options=SERVER_OPTIONS)
            health_pb2_grpc.add_HealthServicer_to_server(health_servicer, probe)
            health_port = probe.add_insecure_port(health_address)
            if health_port == 0:
                await server.stop(0)
                raise OSError(f"could not bind {health_address}")
            await probe.start()
        return server, health_servicer, port, names, probe, health_port

    try:
        server, health_servicer, port, names, probe, health_port = loop.run(create())
    except BaseException:
        loop.close()
        pool.shutdown(wait=False)
        raise
    return RunningServer(
        server,
        health_servicer,
        port,
        drain or Drain(),
        names,
        pool,
        loop,
        probe_server=probe,
        health_port=health_port,
    )


@dataclass
class Security:
    """Who may call and over what: bearer tokens (None: authentication off) and TLS credentials (None: plaintext)."""

    tokens: TokenTable | None = None
    credentials: grpc.ServerCredentials | None = None

    @classmethod
    def from_files(
        cls, *, tokens: str = "", tls_cert: str = "", tls_key: str = "", tls_client_ca: str = ""
    ) -> Security:
        """TLS from a PEM certificate and key; mTLS when a client CA is given (clients must present a certificate
        it signed); tokens from a token file (see :mod:`strop.common.auth`)."""
        if bool(tls_cert) != bool(tls_key):
            raise ValueError("TLS needs both --tls-cert and --tls-key")
        if tls_client_ca and not tls_cert:
            raise ValueError("mTLS (--tls-client-ca) needs --tls-cert and --tls-key")
        credentials = None
        if tls_cert:
            credentials = grpc.ssl_server_credentials(
                [(Path(tls_key).read_bytes(), Path(tls_cert).read_bytes())],
                root_certificates=Path(tls_client_ca).read_bytes() if tls_client_ca else None,
                require_client_auth=bool(tls_client_ca),
            )
        return cls(TokenTable.load(tokens) if tokens else None, credentials)


def serve_forever(
    running: RunningServer,
    *,
    grace: float,
    on_drain: Callable[[], bool | None] | None = None,
    on_close: Callable[[], None] | None = None,
    slack: float = SHUTDOWN_SLACK_S,
) -> NoReturn:
    """Block until SIGTERM/SIGINT, drain gracefully, close, and end the process (for the services' ``main``).

    The drain is bounded: the jobs get ``grace`` seconds, the in-flight calls another ``grace``, and if the
    process is still here ``slack`` seconds after that, a watchdog writes every thread's stack to stderr
    (the service log) and exits with status 1 — a stuck drain is reported, never silent until SIGKILL.
    ``on_drain`` returning False (work that did not stop within the grace) also ends in status 1, without
    ``on_close``. After a clean drain the process ends with ``os._exit(0)``: every job has been checkpointed
    and recorded by then, and interpreter finalisation with native daemon threads still alive (gRPC pollers,
    torch's pools) is a known source of hangs at exit that would turn a clean drain into a SIGKILL. Under
    Kubernetes, give the pod a ``terminationGracePeriodSeconds`` above ``2 × grace + slack``.
    """
    stop = threading.Event()

    def handle(signum, _frame):
        log.info("signal %s: draining (grace %.0fs)", signum, grace)
        stop.set()

    signal.signal(signal.SIGTERM, handle)
    signal.signal(signal.SIGINT, handle)
    log.info("serving %s on port %d", ", ".join(running.service_names), running.port)
    stop.wait()
    faulthandler.dump_traceback_later(2 * grace + slack, exit=True)
    clean = running.stop(grace, on_drain=on_drain)
    if clean:
        if on_close is not None:
            on_close()
        log.info("stopped")
    else:  # work still running: leave the store to the restart's recovery rather than close it under them
        log.error("stopped with work still running after the %.0fs grace: exiting 1", grace)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0 if clean else 1)


@dataclass
class Service:
    """A running service as its ``main`` and the tests hold it: the server, its core, and how to drain and close.

    Both services are built the same way (``start(config, address=..., rpc_threads=...) -> Service``).
    """

    running: RunningServer
    core: Any
    drain_work: Callable[[float], bool | None]  # stop running work within the grace; False: some did not stop
    close: Callable[[], None]
    metrics: MetricsServer | None = None  # the /metrics endpoint, when one was asked for

    @property
    def port(self) -> int:
        return self.running.port

    @property
    def metrics_port(self) -> int:
        """The bound port of ``/metrics`` (0: metrics are off)."""
        return self.metrics.port if self.metrics is not None else 0

    def stop(self, grace: float = 5.0) -> bool:
        """Drain (refuse new work, let running work stop within ``grace``), stop the server, close the core."""
        clean = self.running.stop(grace, on_drain=lambda: self.drain_work(grace))
        if clean:
            self.close()
        if self.metrics is not None:
            self.metrics.close()
        return clean

    def serve_forever(self, grace: float) -> NoReturn:
        if self.metrics is not None:
            log.info(
                "metrics on http://%s:%d/metrics", self.metrics.httpd.server_address[0], self.metrics_port
            )
        serve_forever(self.running, grace=grace, on_drain=lambda: self.drain_work(grace), on_close=self.close)
