"""Print the part of the lock one install role needs: ``python3 lock_subset.py LOCK PYPROJECT --extra export``.

The images install from the same lock as the repo (``requirements/lock.txt``, pip-compile output with
sha256 hashes), but an image needs only its role's packages, not the dev tools (pytest, ruff,
grpcio-tools, …) or the other role's. pip-compile annotates each pin with the packages that required it
(``# via transformers``); those annotations are the resolved dependency graph, read backwards. This
script walks it: the seeds are strop's base dependencies, the requested extras (with ``strop[…]``
self-references expanded) and torch (installed before the lock, like ``make setup`` does, so the lock's
pins that exist only for torch stay in), then every pin required by a selected pin joins, until nothing
changes. ``via strop`` alone selects nothing: pip-compile strips the extra (``--strip-extras``), so a
direct dependency joins only when a requested extra names it.

The printed blocks are the lock's own lines (pins and hashes unchanged), for ``pip install --no-deps
--require-hashes -r``; ``pip check`` afterwards proves the subset complete. Standard library only: it
runs in the image's builder stage before anything is installed.
"""

from __future__ import annotations

import argparse
import re
import sys
import tomllib
from dataclasses import dataclass, field
from pathlib import Path

SELF = "strop"
# Installed before the lock (the CPU or CUDA build is chosen by the caller); its dependencies are locked.
ALWAYS = ("torch",)


def canonical(name: str) -> str:
    """PEP 503 normalised name."""
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(spec: str) -> tuple[str, set[str]]:
    """``"strop[kernels]"`` → (``"strop"``, {``"kernels"``}); ``"grpcio>=1.84,<2"`` → (``"grpcio"``, set())."""
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(?:\[([^\]]*)\])?", spec)
    if m is None:
        raise ValueError(f"expected a requirement, got {spec!r}")
    extras = {canonical(e) for e in (m.group(2) or "").split(",") if e.strip()}
    return canonical(m.group(1)), extras


@dataclass
class Pin:
    name: str
    lines: list[str] = field(default_factory=list)
    required_by: set[str] = field(default_factory=set)


def parse_lock(text: str) -> dict[str, Pin]:
    """The lock's pins by canonical name, each with its verbatim lines and the names in its ``# via``."""
    pins: dict[str, Pin] = {}
    current: Pin | None = None
    for line in text.splitlines():
        if not line.strip():
            continue
        if not line[0].isspace() and not line.startswith("#"):
            name, _ = requirement_name(line)
            current = pins[name] = Pin(name, [line])
            continue
        if current is None:
            continue  # the header comment
        stripped = line.strip()
        if stripped.startswith("--hash"):
            current.lines.append(line)
        elif stripped.startswith("#"):
            via = stripped.lstrip("#").strip()
            via = via.removeprefix("via").strip()
            for part in via.split(","):
                part = part.strip()
                if part and not part.startswith(("-r", "-c")):
                    current.required_by.add(requirement_name(part)[0])
    return pins


def seeds(pyproject: dict, extras: list[str]) -> set[str]:
    """strop's base dependencies plus those of ``extras``, following ``strop[…]`` self-references."""
    project = pyproject["project"]
    optional = {canonical(k): v for k, v in project.get("optional-dependencies", {}).items()}
    names: set[str] = set()
    todo = [None, *(canonical(e) for e in extras)]
    seen: set[str | None] = set()
    while todo:
        extra = todo.pop()
        if extra in seen:
            continue
        seen.add(extra)
        if extra is not None and extra not in optional:
            raise ValueError(f"expected one of the extras {sorted(optional)}, got {extra!r}")
        for spec in project["dependencies"] if extra is None else optional[extra]:
            name, sub = requirement_name(spec)
            if name == SELF:
                todo.extend(sub)
            else:
                names.add(name)
    return names


def select(pins: dict[str, Pin], wanted: set[str], installed_first: tuple[str, ...] = ALWAYS) -> list[Pin]:
    """The pins of ``wanted`` and, transitively, of everything they or ``installed_first`` require (as the
    lock's ``via`` says)."""
    chosen = {n for n in wanted if n in pins} | set(installed_first)
    changed = True
    while changed:
        changed = False
        for pin in pins.values():
            if pin.name not in chosen and pin.required_by & chosen:
                chosen.add(pin.name)
                changed = True
    missing = sorted(n for n in wanted if n not in pins and n not in installed_first)
    if missing:
        raise ValueError(f"the lock has no pin for {missing}: run `make lock`")
    return [p for p in pins.values() if p.name in chosen]


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("lock", type=Path)
    p.add_argument("pyproject", type=Path)
    p.add_argument("--extra", action="append", default=[], help="an extra of strop (repeatable)")
    p.add_argument("--names", action="store_true", help="print only the selected names")
    p.add_argument("--no-torch", action="store_true", help="an install without torch (the SDK and CLI)")
    p.add_argument(
        "--also",
        action="append",
        default=[],
        help="a pin to add with what it requires (repeatable): setuptools, strop's build backend, which "
        "only torch pulls in otherwise",
    )
    a = p.parse_args(argv)
    pins = parse_lock(a.lock.read_text())
    wanted = seeds(tomllib.loads(a.pyproject.read_text()), a.extra) | {canonical(n) for n in a.also}
    chosen = select(pins, wanted, () if a.no_torch else ALWAYS)
    out = [p.name for p in chosen] if a.names else ["\n".join(p.lines) for p in chosen]
    sys.stdout.write("\n".join(out) + "\n")


if __name__ == "__main__":
    main()
