"""Channel and call plumbing shared by the SDK's clients: timeouts, error mapping, stream iteration."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import grpc

from strop.client.errors import from_rpc_error

T = TypeVar("T")

DEFAULT_TIMEOUT = 60.0  # unary calls (LoadModel may take a while on big checkpoints)
LONG_TIMEOUT = 3600.0  # model loads, uploads
MAX_MESSAGE_BYTES = 64 << 20
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
]


class BaseClient:
    """Owns a channel (or borrows one) and wraps calls so that only SDK exceptions escape."""

    def __init__(self, target: str, *, channel: grpc.Channel | None = None, timeout: float = DEFAULT_TIMEOUT):
        self.target = target
        self._owns_channel = channel is None
        self._channel = channel or grpc.insecure_channel(target, options=CHANNEL_OPTIONS)
        self.timeout = timeout

    def close(self) -> None:
        if self._owns_channel:
            self._channel.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _call(self, fn: Callable[..., T], request: Any, *, timeout: float | None = None, name: str = "") -> T:
        try:
            return fn(request, timeout=timeout or self.timeout)
        except grpc.RpcError as err:
            raise from_rpc_error(err, name) from None

    def _stream(
        self, fn: Callable[..., Any], request: Any, *, timeout: float | None = None, name: str = ""
    ) -> Iterator[Any]:
        """Iterate a server stream; closing the iterator cancels the call (the server-side job goes on)."""
        call = fn(request, timeout=timeout)
        try:
            yield from call
        except grpc.RpcError as err:
            raise from_rpc_error(err, name) from None
        finally:
            call.cancel()

    def wait_ready(self, timeout: float = 30.0) -> None:
        """Block until the channel connects (raises UnavailableError on timeout)."""
        from strop.client.errors import UnavailableError

        try:
            grpc.channel_ready_future(self._channel).result(timeout=timeout)
        except grpc.FutureTimeoutError:
            raise UnavailableError(f"no server at {self.target} after {timeout:.0f}s") from None
