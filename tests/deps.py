"""Dependencies the lock pins, imported by tests: a missing one fails the CPU tier instead of skipping it.

``make test`` (and CI, which sets ``CI``) installs every package of ``requirements/lock.txt``, so a test that needs
one of them and cannot import it shows a broken install, never a reason to skip. Elsewhere (the GPU image, which
carries only the wheels its tests need, ``bench/gpu_wheels.sh``) such a test skips, saying which module is missing.
"""

from __future__ import annotations

import importlib
import os
from types import ModuleType

import pytest


def locked(name: str) -> ModuleType:
    """``import name``; in CI a failure fails the test (or its module), elsewhere it skips."""
    try:
        return importlib.import_module(name)
    except ImportError as exc:
        if os.environ.get("CI"):
            pytest.fail(
                f"{name} is pinned in requirements/lock.txt but does not import: {exc}", pytrace=False
            )
        pytest.skip(f"{name} is not installed here ({exc})", allow_module_level=True)
