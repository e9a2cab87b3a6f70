"""Confining request paths under configured roots."""

from __future__ import annotations

import os
from pathlib import Path

from strop.common.errors import InvalidArgument, NotFound


def confine(root: str | os.PathLike, user_path: str, *, what: str = "path", must_exist: bool = True) -> Path:
    """Resolve ``user_path`` (relative to ``root``, or absolute) and require it to lie under ``root``.

    Symlinks are resolved before the check, so a link pointing outside the root is refused too.

    Raises:
        InvalidArgument: empty path, or the resolved path escapes ``root``.
        NotFound: ``must_exist`` and nothing is there.
    """
    if not user_path or not user_path.strip():
        raise InvalidArgument(f"{what} is empty")
    if "\x00" in user_path:
        raise InvalidArgument(f"{what} contains a NUL byte")
    root_resolved = Path(root).resolve()
    candidate = Path(user_path)
    if not candidate.is_absolute():
        candidate = root_resolved / candidate
    resolved = candidate.resolve()
    if resolved != root_resolved and root_resolved not in resolved.parents:
        raise InvalidArgument(f"{what} {user_path!r} is outside the allowed root {str(root_resolved)!r}")
    if must_exist and not resolved.exists():
        raise NotFound(f"{what} {user_path!r} does not exist under {str(root_resolved)!r}")
    return resolved
