"""Domain exceptions shared by strop's services.

Each exception names the gRPC status it maps to (``grpc_code``, a string so this module never imports
grpc). The services' interceptor turns them into statuses; the SDK maps statuses back to its own
exception hierarchy. Messages are shown to callers as they are: they must name the problem.
"""

from __future__ import annotations


class StropError(Exception):
    """Base class: anything unexpected maps to INTERNAL with a generic message."""

    grpc_code = "INTERNAL"


class InvalidArgument(StropError):
    """The request itself is wrong (bad value, malformed data, path outside its root)."""

    grpc_code = "INVALID_ARGUMENT"


class NotFound(StropError):
    """An id or path that does not exist."""

    grpc_code = "NOT_FOUND"


class AlreadyExists(StropError):
    """The target exists and the request did not ask to overwrite it."""

    grpc_code = "ALREADY_EXISTS"


class FailedPrecondition(StropError):
    """The object is in the wrong state for the request (closed session, busy session, ...)."""

    grpc_code = "FAILED_PRECONDITION"


class PermissionDenied(StropError):
    """The caller sees the object but its role does not allow the request (a shared session's owner-only calls)."""

    grpc_code = "PERMISSION_DENIED"


class ResourceExhausted(StropError):
    """Out of device memory, queue full, size limit exceeded."""

    grpc_code = "RESOURCE_EXHAUSTED"


class Unavailable(StropError):
    """The service is draining or restarting; retrying later is correct."""

    grpc_code = "UNAVAILABLE"


class Unimplemented(StropError):
    """A format, loss or architecture strop does not support."""

    grpc_code = "UNIMPLEMENTED"


class Cancelled(StropError):
    """The operation was cancelled by a client."""

    grpc_code = "CANCELLED"


class DeadlineExceeded(StropError):
    """The caller's deadline passed before the work finished (what was computed is discarded)."""

    grpc_code = "DEADLINE_EXCEEDED"


class DataLoss(StropError):
    """Stored data is corrupted (a digest does not match)."""

    grpc_code = "DATA_LOSS"
