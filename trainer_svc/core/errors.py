"""The trainer's domain exceptions (shared hierarchy in strop.common.errors)."""

from strop.common.errors import (
    AlreadyExists,
    Cancelled,
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    StropError,
    Unavailable,
    Unimplemented,
)

__all__ = [
    "AlreadyExists",
    "Cancelled",
    "DataLoss",
    "FailedPrecondition",
    "InvalidArgument",
    "NotFound",
    "ResourceExhausted",
    "StropError",
    "Unavailable",
    "Unimplemented",
]
