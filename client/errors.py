"""The SDK's exceptions: one per gRPC status code, so callers never handle grpc types."""

from __future__ import annotations

import grpc


class StropClientError(Exception):
    """Base class. ``code`` is the gRPC status name, ``details`` the server's message."""

    code = "UNKNOWN"

    def __init__(self, details: str, *, method: str = ""):
        super().__init__(f"{method}: {details}" if method else details)
        self.details = details
        self.method = method


class InvalidArgumentError(StropClientError):
    code = "INVALID_ARGUMENT"


class NotFoundError(StropClientError):
    code = "NOT_FOUND"


class AlreadyExistsError(StropClientError):
    code = "ALREADY_EXISTS"


class FailedPreconditionError(StropClientError):
    code = "FAILED_PRECONDITION"


class ResourceExhaustedError(StropClientError):
    code = "RESOURCE_EXHAUSTED"


class UnavailableError(StropClientError):
    code = "UNAVAILABLE"


class DeadlineExceededError(StropClientError):
    code = "DEADLINE_EXCEEDED"


class CancelledError(StropClientError):
    code = "CANCELLED"


class UnimplementedError(StropClientError):
    code = "UNIMPLEMENTED"


class DataLossError(StropClientError):
    code = "DATA_LOSS"


class PermissionDeniedError(StropClientError):
    code = "PERMISSION_DENIED"


class UnauthenticatedError(StropClientError):
    code = "UNAUTHENTICATED"


class InternalError(StropClientError):
    code = "INTERNAL"


_BY_CODE: dict[grpc.StatusCode, type[StropClientError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExistsError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.OUT_OF_RANGE: InvalidArgumentError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.CANCELLED: CancelledError,
    grpc.StatusCode.UNIMPLEMENTED: UnimplementedError,
    grpc.StatusCode.DATA_LOSS: DataLossError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.INTERNAL: InternalError,
}


def from_rpc_error(err: grpc.RpcError, method: str = "") -> StropClientError:
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    return _BY_CODE.get(code, StropClientError)(details or str(code), method=method)


def error_for_code(code: str, details: str, method: str = "") -> StropClientError:
    """The exception of a gRPC status code name (a failed step future carries the name, not an RpcError)."""
    status = getattr(grpc.StatusCode, code, None)
    return _BY_CODE.get(status, StropClientError)(details or code, method=method)
