"""The one server interceptor of both services: who is calling (bearer tokens), what a failed call answers (each
domain error's own status and message, the server's paths scrubbed; anything else INTERNAL with a logged
reference), and INVALID_ARGUMENT for request bytes that do not decode, on every method.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import grpc

from strop.common.auth import ANONYMOUS, Principal, TokenTable, reset_current, set_current
from strop.common.errors import InvalidArgument, StropError
from strop.common.paths import scrub_paths

log = logging.getLogger("strop.grpc")

MAX_DETAILS_CHARS = 2000


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

        @contextlib.contextmanager
        def as_caller(context):
            # the call's principal is auth.current() inside the handler (an unknown token raises here)
            token = set_current(principal_of(context, method))
            try:
                yield
            finally:
                reset_current(token)

        def wrap(fn):
            if inspect.isasyncgenfunction(fn):

                async def stream(request, context):
                    try:
                        with as_caller(context):
                            async for item in fn(check(request), context):
                                yield item
                    except Exception as exc:
                        if _already_aborted(context):
                            raise
                        await context.abort(*status(exc))

                return stream
            if inspect.iscoroutinefunction(fn):

                async def unary(request, context):
                    try:
                        with as_caller(context):
                            return await fn(check(request), context)
                    except Exception as exc:
                        if _already_aborted(context):
                            raise
                        await context.abort(*status(exc))

                return unary
            if inspect.isgeneratorfunction(fn):

                def sync_stream(request, context):
                    try:
                        with as_caller(context):
                            yield from fn(check(request), context)
                    except Exception as exc:
                        if _already_aborted(context):
                            raise
                        context.abort(*status(exc))

                return sync_stream

            def sync_unary(request, context):
                try:
                    with as_caller(context):
                        return fn(check(request), context)
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
