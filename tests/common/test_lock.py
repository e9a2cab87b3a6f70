"""The locked install and the GPU image agree with pyproject's ranges.

``requirements/lock.txt`` is what ``make setup`` installs (exact versions and sha256 hashes, from pip-compile);
``requirements/gpu.txt`` the versions on the H200 machine's image plus the wheels carried there. pyproject keeps
ranges for library users; every pin in either file must satisfy them, or the lock is stale or the GPU path breaks.
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

ROOT = Path(__file__).resolve().parents[2]


def _pins(path: Path) -> dict[str, Version]:
    pins = {}
    for line in path.read_text().splitlines():
        m = re.match(r"^([A-Za-z0-9_.\-]+)==([^\s\\;]+)", line)
        if m:
            pins[canonicalize_name(m.group(1))] = Version(m.group(2))
    return pins


def _ranges() -> dict[str, list[Requirement]]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        reqs += [r for r in extra if not r.startswith("strop")]
    out: dict[str, list[Requirement]] = {}
    for r in map(Requirement, reqs):
        out.setdefault(canonicalize_name(r.name), []).append(r)
    return out


LOCK = _pins(ROOT / "requirements" / "lock.txt")
GPU = _pins(ROOT / "requirements" / "gpu.txt")


def test_the_lock_pins_every_dependency_with_hashes_and_leaves_torch_to_setup():
    text = (ROOT / "requirements" / "lock.txt").read_text()
    missing = sorted(set(_ranges()) - set(LOCK) - {"torch"})
    assert not missing, f"pyproject dependencies not in the lock: {missing} (run `make lock`)"
    assert "torch" not in LOCK, "torch is chosen by the setup step (CPU build on disk), not the lock"
    assert text.count("--hash=sha256:") >= len(LOCK), "every locked package carries its sha256"


@pytest.mark.parametrize(("name", "pins"), [("lock", LOCK), ("gpu", GPU)])
def test_every_pin_satisfies_pyprojects_ranges(name, pins):
    bad = [
        f"{pkg}=={pins[pkg]} vs {r}"
        for pkg, reqs in _ranges().items()
        if pkg in pins
        for r in reqs
        if not r.specifier.contains(pins[pkg], prereleases=True)
    ]
    assert not bad, f"requirements/{name}.txt pins outside pyproject's ranges: {bad}"


def test_the_gpu_image_has_what_the_kernels_and_the_trainer_need():
    assert {"torch", "triton", "transformers", "peft", "trl", "bitsandbytes", "grpcio"} <= set(GPU)


@pytest.mark.skipif(os.environ.get("STROP_ENV") == "latest", reason="make test-latest: the newest versions")
def test_the_installed_environment_is_the_lock():
    # `make setup` installs the lock; `make test-latest` runs the tier on the newest versions instead.
    differ = {
        pkg: (str(v), importlib.metadata.version(pkg))
        for pkg, v in LOCK.items()
        if Version(importlib.metadata.version(pkg)) != v
    }
    assert not differ, f"installed versions differ from the lock (run `make setup`): {differ}"
