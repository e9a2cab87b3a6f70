"""``strop train`` and ``strop jobs`` driving a real trainer service: a job trained and listed, errors with their
code, the session closed unless kept, and every default in ``strop train --help``."""

from __future__ import annotations

import json
import subprocess
import sys

from strop.cli.main import main as cli_main
from strop.demo.data import sft_rows


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
