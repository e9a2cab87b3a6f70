"""gRPC plumbing shared by the services: error mapping, health, reflection, limits, graceful drain.

Only the services' thin gRPC layers import this module; their ``core/`` packages never import grpc.
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import faulthandler
import functools
import heapq
import inspect
import itertools
import logging
import os
import signal
import sys
import threading
import uuid
import weakref
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn

import grpc
from grpc_health.v1 import _async as health_aio
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from strop.common import log_noise, logs
from strop.common.auth import ANONYMOUS, Principal, TokenTable, reset_current, set_current
from strop.common.db import default_instance_id
from strop.common.errors import InvalidArgument, StropError, Unavailable
from strop.common.metrics import MetricsServer
from strop.common.paths import scrub_paths
from strop.common.signals import ChangeSignal

log = logging.getLogger("strop.grpc")

MAX_MESSAGE_BYTES = 64 << 20
# Open calls beyond this are refused (RESOURCE_EXHAUSTED) rather than queued: each costs memory, not a thread
MAX_CONCURRENT_RPCS = 10_000
MAX_DETAILS_CHARS = 2000
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


def _status(
    exc: BaseException, method: str, paths: Mapping[str, str] | None = None
) -> tuple[grpc.StatusCode, str]:
    """The status a failed call ends with: a domain error's own code and message (the server's own paths named,
    never shown: a library's message passed through may hold them), else INTERNAL with a reference."""
    if isinstance(exc, StropError):
        code = getattr(grpc.StatusCode, exc.grpc_code, grpc.StatusCode.INTERNAL)
        if code is not grpc.StatusCode.INTERNAL:
            message = scrub_paths(str(exc), paths or {})
            if len(message) > MAX_DETAILS_CHARS:  # an echoed megabyte id would exceed gRPC's metadata limit
                message = message[:MAX_DETAILS_CHARS] + "… (truncated)"
            return code, message
    if isinstance(exc, grpc.RpcError):  # reading the request stream failed: the client aborted its upload
        log.info("%s: the client went away mid-stream", method)
        return grpc.StatusCode.CANCELLED, "the request stream ended early"
    ref = uuid.uuid4().hex[:12]
    log.error("internal error in %s (ref %s)", method, ref, exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error (ref {ref})"


def _already_aborted(context) -> bool:
    try:
        return context.code() is not None and context.code() != grpc.StatusCode.OK
    except (AttributeError, NotImplementedError):
        return False


UNAUTHENTICATED_METHODS = ("/grpc.health.v1.Health/", "/grpc.reflection.")  # probes need no token


@dataclass(frozen=True)
class _Undecodable:
    """What a request message that does not parse deserializes to: the handler's wrapper answers INVALID_ARGUMENT
    (gRPC itself would answer UNKNOWN for a unary call and INTERNAL, with a logged traceback, for a stream)."""

    why: str

    def error(self) -> InvalidArgument:
        return InvalidArgument(
            f"the request message is not a valid protobuf message of this method ({self.why})"
        )


def _tolerant(deserializer: Callable[[bytes], Any] | None) -> Callable[[bytes], Any] | None:
    if deserializer is None:
        return None

    def deserialize(data: bytes) -> Any:
        try:
            return deserializer(data)
        except Exception as exc:  # protobuf's DecodeError, or a message nested past its recursion limit
            return _Undecodable(type(exc).__name__)

    return deserialize


def _checked(request: Any) -> Any:
    """A unary request that decoded, or InvalidArgument."""
    if isinstance(request, _Undecodable):
        raise request.error()
    return request


def _checked_stream(requests: Any) -> Any:
    """A request stream whose undecodable message raises InvalidArgument where the handler reads it."""
    if hasattr(requests, "__aiter__"):

        async def checked_async():
            async for r in requests:
                yield _checked(r)

        return checked_async()
    return (_checked(r) for r in requests)


class ErrorInterceptor(grpc.aio.ServerInterceptor):
    """Authenticates each call and maps domain exceptions to status codes; anything else becomes INTERNAL
    with a logged traceback.

    With a :class:`~strop.common.auth.TokenTable` every call but the health checks and reflection must carry
    ``authorization: Bearer <token>`` (UNAUTHENTICATED otherwise); its principal is the handler's
    :func:`strop.common.auth.current`. Handlers may be plain functions (run in the server's thread pool) or
    coroutines/async generators (run on the event loop, holding no thread while they wait); each keeps its
    kind through the wrapping. A request message that does not decode is INVALID_ARGUMENT, on every method
    and either side of a stream; messages never show the server's own directories (``paths``,
    :func:`strop.common.paths.private_paths`).
    """

    def __init__(self, tokens: TokenTable | None = None, paths: Mapping[str, str] | None = None) -> None:
        self.tokens = tokens
        self.paths = dict(paths or {})

    def _principal(self, context, method: str) -> Principal:
        if self.tokens is None or method.startswith(UNAUTHENTICATED_METHODS):
            return ANONYMOUS
        metadata = dict(context.invocation_metadata() or ())
        return self.tokens.principal(metadata.get("authorization"))

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        principal_of = self._principal
        status = functools.partial(_status, method=method, paths=self.paths)
        check = _checked_stream if handler.request_streaming else _checked

        def wrap(fn):
            if inspect.isasyncgenfunction(fn):

                async def stream(request, context):
                    try:
                        token = set_current(principal_of(context, method))
                        try:
                            async for item in fn(check(request), context):
                                yield item
                        finally:
                            reset_current(token)
                    except Exception as exc:
                        if _already_aborted(context):
                            raise
                        await context.abort(*status(exc))

                return stream
            if inspect.iscoroutinefunction(fn):

                async def unary(request, context):
                    try:
                        token = set_current(principal_of(context, method))
                        try:
                            return await fn(check(request), context)
                        finally:
                            reset_current(token)
                    except Exception as exc:
                        if _already_aborted(context):
                            raise
                        await context.abort(*status(exc))

                return unary
            if inspect.isgeneratorfunction(fn):

                def sync_stream(request, context):
                    try:
                        token = set_current(principal_of(context, method))
                        try:
                            yield from fn(check(request), context)
                        finally:
                            reset_current(token)
                    except Exception as exc:
                        if _already_aborted(context):
                            raise
                        context.abort(*status(exc))

                return sync_stream

            def sync_unary(request, context):
                try:
                    token = set_current(principal_of(context, method))
                    try:
                        return fn(check(request), context)
                    finally:
                        reset_current(token)
                except Exception as exc:
                    if _already_aborted(context):
                        raise
                    context.abort(*status(exc))

            return sync_unary

        kw = dict(
            request_deserializer=_tolerant(handler.request_deserializer),
            response_serializer=handler.response_serializer,
        )
        if handler.unary_unary:
            return grpc.unary_unary_rpc_method_handler(wrap(handler.unary_unary), **kw)
        if handler.unary_stream:
            return grpc.unary_stream_rpc_method_handler(wrap(handler.unary_stream), **kw)
        if handler.stream_unary:
            return grpc.stream_unary_rpc_method_handler(wrap(handler.stream_unary), **kw)
        return grpc.stream_stream_rpc_method_handler(wrap(handler.stream_stream), **kw)


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


async def in_pool(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run a blocking core call from an async handler without blocking the event loop (in the caller's
    context, so the call's principal goes with it)."""
    ctx = contextvars.copy_context()
    return await asyncio.get_running_loop().run_in_executor(
        None, functools.partial(ctx.run, fn, *args, **kwargs)
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


class _FairGate:
    """At most ``slots`` event polls at once on a server's loop, served in order of (rank, arrival).

    Why. A replay (``after_seq=0`` on a job with a thousand events) reads, decodes and converts a page of events
    on a pool thread; five hundred of them at once filled the pool and held the GIL, so health checks and GetJob
    waited seconds and some streams had no event after 40 s. Through the gate the replays take turns a page at a
    time, a stream's first page goes before any stream's later pages (rank 0), and everything else on the
    server (unary calls, health) finds the interpreter free between pages.
    """

    def __init__(self, slots: int) -> None:
        self.free = slots
        self.waiting: list[tuple[int, int, asyncio.Future]] = []
        self._arrivals = itertools.count()

    async def acquire(self, rank: int) -> None:
        if self.free > 0 and not self.waiting:
            self.free -= 1
            return
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self.waiting, (rank, next(self._arrivals), fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # the slot was handed over as the caller went away
                self.release()
            raise

    def release(self) -> None:
        while self.waiting:
            _, _, fut = heapq.heappop(self.waiting)
            if not fut.done():  # a waiter that went away is skipped
                fut.set_result(None)
                return
        self.free += 1


POLL_SLOTS = 8  # streams polling or sending a page at once per server: more only contend for the GIL
SEND_TURN_S = 0.05  # a stream still sending its page after this gives its turn up
_gates: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _FairGate] = weakref.WeakKeyDictionary()


def _gate() -> _FairGate:
    loop = asyncio.get_running_loop()
    gate = _gates.get(loop)
    if gate is None:
        gate = _gates[loop] = _FairGate(POLL_SLOTS)
    return gate


async def follow(
    poll: Callable[[int, int], tuple[list[Any], bool]],
    signal: ChangeSignal,
    after_seq: int,
    *,
    context: Any = None,
    heartbeat: float = 5.0,
    convert: Callable[[Any], Any] | None = None,
    page_size: int = 100,
) -> AsyncIterator[Any]:
    """Stream numbered events: ``poll(seq, limit) -> (at most limit events after seq, done)`` until done,
    waiting on ``signal`` between polls without holding a thread. Each poll is one short call into the core, in
    the pool, with ``convert`` applied to its events there (so the loop only sends them), and takes its turn at
    the server's :class:`_FairGate`: a stream's first poll, of one event, goes before every later page of any
    stream, so hundreds of streams replaying at once each get an event before any gets its second page."""

    def page(seq: int, limit: int) -> tuple[list[Any], bool]:
        events, done = poll(seq, limit)
        return ([convert(e) for e in events] if convert else events), done

    gate, seq, pages = _gate(), after_seq, 0
    loop = asyncio.get_running_loop()
    while True:
        generation = signal.generation
        await gate.acquire(min(pages, 1))
        held = True
        try:
            events, done = await in_pool(page, seq, page_size if pages else 1)
            # the turn lasts while the page is sent too (a few ms), so only a few streams send at once and the
            # loop stays free for new calls; a client slow to read gives the turn up after SEND_TURN_S
            started = loop.time()
            for e in events:
                yield e
                seq = e.seq
                if held and loop.time() - started > SEND_TURN_S:
                    gate.release()
                    held = False
        finally:
            if held:
                gate.release()
        pages += bool(events)
        if done:
            return
        if context is not None and getattr(context, "done", lambda: False)():
            return
        if not events:
            await signal.wait_async(generation, timeout=heartbeat)


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


def service_parser(prog: str, description: str, *, name: str, port: int) -> argparse.ArgumentParser:
    """The flags both services share, each with a ``STROP_*`` environment default (what a pod sets).

    ``--address`` defaults to 127.0.0.1: a service listens on every interface only when asked to.
    """
    env = os.environ.get
    p = argparse.ArgumentParser(
        prog=prog, description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument(
        "--address",
        default=env(f"STROP_{name.upper()}_ADDRESS", f"127.0.0.1:{port}"),
        help=f"host:port to bind (port 0 picks a free one; env STROP_{name.upper()}_ADDRESS)",
    )
    p.add_argument("--model-root", default=env("STROP_MODEL_ROOT", "./models"), help="env STROP_MODEL_ROOT")
    p.add_argument(
        "--artifact-root", default=env("STROP_ARTIFACT_ROOT", "./artifacts"), help="env STROP_ARTIFACT_ROOT"
    )
    p.add_argument(
        "--state-dir",
        default=env(f"STROP_{name.upper()}_STATE_DIR", f"./state/{name}"),
        help=f"work files, and the SQLite state unless --database-url is set (env STROP_{name.upper()}_STATE_DIR)",
    )
    p.add_argument(
        "--database-url",
        default=env("STROP_DATABASE_URL", ""),
        help="state database: empty for SQLite in --state-dir, or postgresql://user:pass@host:5432/db, shared "
        "by every pod of a replicated service (env STROP_DATABASE_URL)",
    )
    p.add_argument(
        "--instance-id",
        default=default_instance_id(),
        help="this process among the pods sharing --database-url; the jobs it runs carry it, and a restart "
        "recovers only its own (env STROP_INSTANCE_ID; default the host name, i.e. the pod's name)",
    )
    p.add_argument(
        "--rpc-threads", type=int, default=int(env("STROP_RPC_THREADS", "32")), help="gRPC worker threads"
    )
    p.add_argument(
        "--grace",
        type=float,
        default=float(env("STROP_GRACE", "30")),
        help="seconds running work gets on SIGTERM",
    )
    p.add_argument("--port-file", default="", help="write the bound port here once serving (for port 0)")
    p.add_argument("--log-level", default=env("STROP_LOG_LEVEL", "INFO"))
    p.add_argument(
        "--log-format",
        default=env("STROP_LOG_FORMAT", logs.LogFormat.TEXT.value),
        choices=[f.value for f in logs.LogFormat],
        help="text, or json: one object per line with ts, level, logger, message, job/export ids "
        "(env STROP_LOG_FORMAT)",
    )
    p.add_argument(
        "--metrics-port",
        type=int,
        default=int(env("STROP_METRICS_PORT", "0")),
        help="serve Prometheus /metrics on this port, on --address's host (0: off; env STROP_METRICS_PORT)",
    )
    p.add_argument("--auth-tokens", default=env("STROP_AUTH_TOKENS", ""), help="bearer-token file (JSON)")
    p.add_argument("--tls-cert", default=env("STROP_TLS_CERT", ""), help="PEM server certificate (TLS)")
    p.add_argument("--tls-key", default=env("STROP_TLS_KEY", ""), help="PEM server key (TLS)")
    p.add_argument(
        "--tls-client-ca",
        default=env("STROP_TLS_CLIENT_CA", ""),
        help="PEM CA for client certificates (mTLS)",
    )
    p.add_argument(
        "--health-port",
        type=int,
        default=int(env("STROP_HEALTH_PORT", "0")),
        help="also serve grpc.health.v1 alone, in plaintext, on --address's host at this port: the probe port "
        "under mTLS, whose client certificates the kubelet cannot present (0: off; env STROP_HEALTH_PORT)",
    )
    p.add_argument(
        "--max-connection-age",
        type=float,
        default=float(env("STROP_MAX_CONNECTION_AGE", "0")),
        help="seconds a client connection lives before the server asks the client to reconnect, so that clients "
        "spread over replicas added later (0: unlimited; env STROP_MAX_CONNECTION_AGE)",
    )
    p.add_argument(
        "--max-connection-age-grace",
        type=float,
        default=float(env("STROP_MAX_CONNECTION_AGE_GRACE", "0")),
        help="seconds calls still open on a connection past --max-connection-age may run (0: until they end; "
        "env STROP_MAX_CONNECTION_AGE_GRACE)",
    )
    p.add_argument(
        "--reflection",
        default=env("STROP_REFLECTION", "on"),
        choices=("on", "off"),
        help="gRPC server reflection (env STROP_REFLECTION)",
    )
    return p


def security_from_args(args: argparse.Namespace) -> Security:
    """The :class:`Security` the shared flags (``--auth-tokens``, ``--tls-*``) ask for; errors exit with status 2."""
    try:
        return Security.from_files(
            tokens=args.auth_tokens,
            tls_cert=args.tls_cert,
            tls_key=args.tls_key,
            tls_client_ca=args.tls_client_ca,
        )
    except (ValueError, OSError, StropError) as exc:
        raise SystemExit(f"strop: {exc}") from None


def connection_age_from_args(args: argparse.Namespace) -> ConnectionAge:
    """The :class:`ConnectionAge` ``--max-connection-age`` and ``--max-connection-age-grace`` ask for."""
    if args.max_connection_age < 0 or args.max_connection_age_grace < 0:
        raise SystemExit("strop: --max-connection-age and --max-connection-age-grace must be >= 0")
    return ConnectionAge(args.max_connection_age, args.max_connection_age_grace)


def metrics_address(args: argparse.Namespace) -> str | None:
    """Where ``--metrics-port`` asks ``/metrics`` to listen: ``--address``'s host on that port; None when off."""
    return _side_address(args, args.metrics_port)


def health_address(args: argparse.Namespace) -> str | None:
    """Where ``--health-port`` asks the plaintext health listener to be: ``--address``'s host; None when off."""
    return _side_address(args, args.health_port)


def _side_address(args: argparse.Namespace, port: int) -> str | None:
    if port <= 0:
        return None
    host = args.address.rpartition(":")[0] or "127.0.0.1"
    return f"{host}:{port}"


def run_main(args: argparse.Namespace, start: Callable[[], Service]) -> NoReturn:
    """What each service's ``main`` does after parsing: log, stay offline, start, publish the port, serve."""
    logs.configure(args.log_level, args.log_format)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # strop never downloads at run time (models come from disk)
    log_noise.install()
    service = start()
    if args.port_file:
        tmp = args.port_file + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(service.port))
        os.replace(tmp, args.port_file)  # readers never see a half-written port
    service.serve_forever(args.grace)
