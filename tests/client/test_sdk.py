"""The SDK: torch-free import and status codes mapped to exceptions (the CLI over it: ``tests/cli``)."""

from __future__ import annotations

import subprocess
import sys

import grpc
import pytest

from strop.client import errors


def test_importing_the_sdk_never_imports_torch():
    code = "import sys, strop.client, strop.cli.main; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0, "pipelines must not pay for torch"


class _FakeRpcError(grpc.RpcError):
    def __init__(self, code, details):
        self._code, self._details = code, details

    def code(self):
        return self._code

    def details(self):
        return self._details


@pytest.mark.parametrize(
    ("code", "cls"),
    [
        (grpc.StatusCode.INVALID_ARGUMENT, errors.InvalidArgumentError),
        (grpc.StatusCode.NOT_FOUND, errors.NotFoundError),
        (grpc.StatusCode.FAILED_PRECONDITION, errors.FailedPreconditionError),
        (grpc.StatusCode.RESOURCE_EXHAUSTED, errors.ResourceExhaustedError),
        (grpc.StatusCode.UNAVAILABLE, errors.UnavailableError),
        (grpc.StatusCode.ALREADY_EXISTS, errors.AlreadyExistsError),
        (grpc.StatusCode.DATA_LOSS, errors.DataLossError),
        (grpc.StatusCode.INTERNAL, errors.InternalError),
    ],
)
def test_each_status_code_maps_to_its_exception(code, cls):
    exc = errors.from_rpc_error(_FakeRpcError(code, "the details"), "Method")
    assert type(exc) is cls and exc.details == "the details" and exc.code == code.name
