"""Confining request paths under configured roots."""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

from strop.common.errors import InvalidArgument, NotFound

MAX_PATH_CHARS = 4096


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
    if len(user_path) > MAX_PATH_CHARS or any(len(part) > 255 for part in Path(user_path).parts):
        raise InvalidArgument(f"{what} is longer than a path can be ({len(user_path)} characters)")
    root_resolved = Path(root).resolve()
    candidate = Path(user_path)
    if not candidate.is_absolute():
        candidate = root_resolved / candidate
    try:
        resolved = candidate.resolve()
        exists = resolved.exists()
    except (OSError, RuntimeError) as exc:  # a symlink loop, an unreadable component
        raise InvalidArgument(
            f"{what} {_shown(user_path)} cannot be resolved: {type(exc).__name__}"
        ) from None
    if resolved != root_resolved and root_resolved not in resolved.parents:
        raise InvalidArgument(f"{what} {_shown(user_path)} is outside the allowed root")
    if must_exist and not exists:
        raise NotFound(f"{what} {_shown(user_path)} does not exist")
    return resolved


def _shown(user_path: str) -> str:
    """A request's path as error messages show it: quoted, and cut short (a message must not echo megabytes)."""
    return repr(user_path if len(user_path) <= 200 else user_path[:200] + "…")


def confine_files(root: str | os.PathLike, directory: Path, *, what: str = "directory") -> None:
    """Every file under ``directory`` (followed through symlinks) must lie under ``root`` too.

    ``confine`` resolves the directory itself; a symlinked *file* inside a confined directory (e.g.
    ``<model_root>/m/model.safetensors`` pointing elsewhere) would otherwise be read from outside the root.

    Raises:
        InvalidArgument: a file resolves outside ``root`` (named relative to the directory).
    """
    root_resolved = Path(root).resolve()
    for path in Path(directory).rglob("*"):
        if not path.is_symlink():
            continue
        target = path.resolve()
        if target != root_resolved and root_resolved not in target.parents:
            rel = path.relative_to(directory)
            raise InvalidArgument(f"{what}: {str(rel)!r} links outside the allowed root")


def private_paths(**roots: str | os.PathLike | None) -> dict[str, str]:
    """The server's own directories as ``{path: "<name>"}`` for :func:`scrub_paths` (each as given and resolved),
    with the interpreter's prefix (``<python>``): what a library's message may name and a client must not see."""
    out: dict[str, str] = {}
    for name, path in {**roots, "python": sys.prefix}.items():
        if path:
            out[str(path)] = f"<{name}>"
            out[str(Path(path).resolve())] = f"<{name}>"
    return out


def scrub_paths(message: str, paths: Mapping[str, str]) -> str:
    """``message`` with every server path of ``paths`` replaced by its name, longest first (so a root inside
    another root keeps its own name)."""
    for path in sorted(paths, key=len, reverse=True):
        if path and path != "/":
            message = message.replace(path, paths[path])
    return message
