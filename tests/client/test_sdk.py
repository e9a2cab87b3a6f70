"""The SDK: torch-free import, status codes mapped to exceptions, and the CLI driving a real service."""

from __future__ import annotations

import json
import subprocess
import sys

import grpc
import pytest

from strop.cli.main import main as cli_main
from strop.client import errors
from strop.demo.data import sft_rows


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


def test_cli_trains_through_the_service_and_lists_the_job(trainer, tmp_path, capsys):
    running, _, _ = trainer
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in sft_rows()))
    target = f"127.0.0.1:{running.port}"
    rc = cli_main(
        [
            "train",
            "--target",
            target,
            "--model",
            "tiny-llama-4bit",
            "--dataset",
            str(data),
            "--max-steps",
            "3",
            "--r",
            "4",
            "--lr",
            "1e-3",
        ]
    )
    out = capsys.readouterr()
    assert rc == 0
    job = json.loads(out.out)
    assert job["state"] == "SUCCEEDED" and job["step"] == 3
    assert "loss=" in out.err, "the progress bar shows the live loss"
    assert cli_main(["jobs", "--target", target, "list"]) == 0
    assert job["job_id"] in capsys.readouterr().out


def test_cli_reports_errors_with_their_code(trainer, tmp_path, capsys):
    running, _, _ = trainer
    data = tmp_path / "x.jsonl"
    data.write_text('{"text": "a"}\n')
    rc = cli_main(
        ["train", "--target", f"127.0.0.1:{running.port}", "--model", "missing", "--dataset", str(data)]
    )
    assert rc == 1
    assert "error (NOT_FOUND)" in capsys.readouterr().err


def test_cli_train_closes_its_session_on_success_and_failure_unless_kept(trainer, client, tmp_path, capsys):
    from strop.client import SessionState

    running, _, _ = trainer
    target = f"127.0.0.1:{running.port}"
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in sft_rows()))
    base = [
        "train",
        "--target",
        target,
        "--model",
        "tiny-llama-4bit",
        "--dataset",
        str(data),
        "--max-steps",
        "1",
    ]

    def open_sessions():
        return {s.session_id for s in client.list_sessions() if s.state is not SessionState.CLOSED}

    before = open_sessions()
    assert cli_main([*base, "--r", "4"]) == 0  # succeeds
    assert cli_main([*base, "--r", "0"]) == 1  # fails at AttachLora
    assert "error (INVALID_ARGUMENT)" in capsys.readouterr().err
    assert open_sessions() == before, "neither run leaves its session loaded"
    assert cli_main([*base, "--r", "4", "--keep-session"]) == 0
    kept = open_sessions() - before
    assert len(kept) == 1, "--keep-session leaves it for Generate or another job"
    client.close_session(kept.pop())


def test_cli_train_help_shows_every_default():
    out = subprocess.run(
        [sys.executable, "-m", "strop.cli.main", "train", "--help"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    flat = " ".join(out.split())
    from strop.common.trainer_types import TRAIN_DEFAULTS

    lr = TRAIN_DEFAULTS["learning_rate"]  # the table is the owner; the help must show what it says
    for shown in (
        f"{lr['SFT']:.0e} (SFT)",
        "auto: 300 rows' worth, 1 to 10 (SFT)",
        "(default: 32.0)",
        f"{lr['DPO']:.0e} (DPO)",
        "linear",
        "adamw_torch",
        "standard",
        "127.0.0.1:50051",
        "(default: 16)",
    ):
        assert shown in flat, shown
