"""strop's top-level folders never shadow another distribution, from any documented entry point.

The folders are mapped into the ``strop`` namespace (``strop.kernels`` = ``kernels/``), but a process started
in the repo root has the root on ``sys.path`` (``python -m``, pytest's rootdir), where a folder is importable
under its own name. bitsandbytes runs ``from kernels import get_kernel`` (Hugging Face's ``kernels``, which
transformers probes too), so ``kernels/`` is a namespace folder with no ``__init__.py``: a regular package of
that name anywhere on the path always wins over it. The dev install carries Hugging Face's ``kernels`` so
these tests can show it resolving.
"""

from __future__ import annotations

import importlib.metadata
import os
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent

# Every documented way to start something, run from the repo root (options that exit before real work).
ENTRY_POINTS = {
    "demo": [sys.executable, "-m", "strop.demo", "--help"],
    "trainer service": [sys.executable, "-m", "strop.trainer_svc", "--help"],
    "export service": [sys.executable, "-m", "strop.export_svc", "--help"],
    "tinker gateway": [sys.executable, "-m", "strop.gateways.tinker", "--help"],
    "openai gateway": [sys.executable, "-m", "strop.gateways.openai", "--help"],
    "strop CLI": [str(BIN / "strop"), "--help"],
    "strop-trainer": [str(BIN / "strop-trainer"), "--help"],
    "strop-export": [str(BIN / "strop-export"), "--help"],
    "pytest": [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "--collect-only",
        "-p",
        "no:cacheprovider",
        "tests/common",
    ],
}


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> Path:
    """A sitecustomize that reports, as the process exits, where ``import kernels`` resolves on its sys.path."""
    d = tmp_path_factory.mktemp("probe")
    code = textwrap.dedent(
        """
        import atexit, sys

        def _report():
            import importlib.util
            spec = importlib.util.find_spec("kernels")
            origin = spec.origin if spec is not None else None
            sys.stderr.write(f"\\nSTROP_PROBE kernels={origin} root_on_path={ROOT in sys.path}\\n")

        atexit.register(_report)
        """
    )
    (d / "sitecustomize.py").write_text(code.replace("ROOT", repr(str(ROOT))))
    return d


def test_hugging_face_kernels_is_installed_for_these_tests():
    dist = importlib.metadata.distribution("kernels")
    assert "kernels" in (dist.read_text("top_level.txt") or "kernels").split(), dist.metadata["Name"]


@pytest.fixture(scope="module")
def started(probe) -> dict[str, subprocess.CompletedProcess]:
    """Every entry point, run with the probe, as many at a time as there are CPUs: each is an interpreter start,
    mostly one thread, so side by side they take the time of the slowest few rather than of all of them."""
    env = {**os.environ, "PYTHONPATH": str(probe), "HF_HUB_OFFLINE": "1"}

    def run(argv: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)

    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1)) as pool:
        running = {name: pool.submit(run, argv) for name, argv in ENTRY_POINTS.items()}
        return {name: future.result() for name, future in running.items()}


@pytest.mark.parametrize("name", list(ENTRY_POINTS))
def test_import_kernels_resolves_to_hugging_face_from_the_repo_root(name, started):
    proc = started[name]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("STROP_PROBE")]
    assert lines, f"{name}: no probe line (rc {proc.returncode}): {proc.stderr[-2000:]}"
    report = lines[-1]
    hf_kernels = str(Path(importlib.metadata.distribution("kernels").locate_file("kernels")))
    assert f"kernels={hf_kernels}" in report, f"{name}: {report}"
    assert str(ROOT / "kernels") not in report, f"{name}: strop's kernels/ shadows Hugging Face's: {report}"
    if ENTRY_POINTS[name][0] == sys.executable:  # python -m puts the root first: the case that could shadow
        assert "root_on_path=True" in report, report


def test_no_top_level_folder_is_a_package_named_like_an_installed_distribution():
    # A regular package (with __init__.py) in the repo root would win over an installed one of that name
    # whenever the root is on sys.path; namespace folders (no __init__.py) never can.
    installed = importlib.metadata.packages_distributions()
    clashes = {
        d.name: installed[d.name]
        for d in ROOT.iterdir()
        if d.is_dir() and (d / "__init__.py").is_file() and d.name in installed
    }
    assert not clashes, f"top-level packages named like installed distributions: {clashes}"
    assert not (ROOT / "kernels" / "__init__.py").exists(), "kernels/ must stay a namespace folder"


def test_the_readme_and_docs_link_only_to_files_of_the_repository_that_exist():
    """The README is the front door and docs/ the rest: every relative link (and every ``docs/*.md`` named in
    code) resolves to a file of the checkout, and none leaves the repository; every test file the README and
    docs/ name (``tests/…/test_x.py``, which moves when tests/ is laid out anew) exists."""
    import re

    pages = [ROOT / "README.md", ROOT / "CHANGELOG.md", *sorted((ROOT / "docs").glob("*.md"))]
    broken = []
    for page in pages:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
                continue  # a URL or an anchor of the page itself
            path = (page.parent / target.split("#")[0]).resolve()
            if ROOT not in path.parents or not path.exists():
                broken.append(f"{page.relative_to(ROOT)}: ({target})")
        for named in re.findall(r"`(docs/[\w./-]+\.md)`", text):
            if not (ROOT / named).is_file():
                broken.append(f"{page.relative_to(ROOT)}: `{named}`")
        if page.name != "CHANGELOG.md":  # the changelog names files as they were then
            for named in re.findall(r"(?<![\w/])(tests/[\w/.-]+\.py)", text):
                if not (ROOT / named).is_file():
                    broken.append(f"{page.relative_to(ROOT)}: {named}")
    assert not broken, broken
