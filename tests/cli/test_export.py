"""``strop export …``: offline (core in-process) and against a running service; the SDK stays torch-free."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from strop.cli import main as cli
from strop.cli.main import main as strop_main
from strop.common.artifacts import ArtifactStore
from strop.export_svc.server import ExportConfig, start
from tests.export_svc.conftest import ANSWER, QUESTION


def test_offline_export_runs_the_core_in_process_and_prints_the_figures(export_models, tmp_path, capsys):
    rc = strop_main(
        [
            "export",
            "run",
            "--offline",
            "--model-root",
            str(export_models),
            "--artifact-root",
            str(tmp_path / "arts"),
            "--adapter-path",
            "trained-nf4-lora",
            "--to",
            "merged",
            "--to",
            "gguf:Q4_K_M",
            "--question",
            QUESTION,
            "--answer",
            ANSWER,
        ]
    )
    out = capsys.readouterr().out
    assert rc == 0
    assert "| gguf:Q4_K_M |" in out and "| merged_safetensors:bfloat16 |" in out
    assert out.count("reproduced") == 2, out
    kinds = sorted(a.kind for a in ArtifactStore(tmp_path / "arts").list())
    assert kinds == ["gguf", "merged_safetensors"]


def test_strop_export_against_the_service(export_models, tmp_path, capsys):
    srv = start(ExportConfig(export_models, tmp_path / "arts", tmp_path / "state"))
    target = f"127.0.0.1:{srv.port}"
    try:
        rc = cli.main(
            [
                "export",
                "--target",
                target,
                "run",
                "--adapter-path",
                "llama-bpe-lora",
                "--base",
                "llama-bpe",
                "--to",
                "gguf:F16",
                "--to",
                "peft",
                "--json",
            ]
        )
        done = json.loads(capsys.readouterr().out)
        assert rc == 0 and done["state"] == "SUCCEEDED"
        assert [r["target"]["kind"] for r in done["results"]] == ["GGUF", "PEFT_ADAPTER"]
        assert cli.main(["export", "--target", target, "list"]) == 0
        assert done["export_id"] in capsys.readouterr().out
        rc = cli.main(["export", "--target", target, "run", "--base", "llama-bpe", "--to", "gguf:Q4_K_XL"])
        assert rc == 1
        assert "unknown GGUF type 'Q4_K_XL'" in capsys.readouterr().err
    finally:
        srv.stop(grace=1.0)


@pytest.mark.parametrize("module", ["strop.client.export", "strop.cli.main"])
def test_the_export_sdk_and_cli_never_import_torch(module):
    code = f"import sys, {module}; sys.exit(1 if 'torch' in sys.modules else 0)"
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0, f"importing {module} pulled in torch"
