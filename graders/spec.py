"""Readers for a grader spec's fields: each checks one field and names it by its dotted path when it is wrong."""

from __future__ import annotations

import math
from typing import Any

from strop.graders.errors import GraderSpecError
from strop.graders.template import Template


class Spec:
    """One grader object of a spec at ``path``; ``done()`` refuses the fields nobody read (typos, unknown ones)."""

    def __init__(self, raw: Any, path: str) -> None:
        if not isinstance(raw, dict):
            raise GraderSpecError(path, f"a grader is a JSON object, got {type(raw).__name__}")
        self.raw = raw
        self.path = path
        self.read: set[str] = set()

    def at(self, key: str) -> str:
        return f"{self.path}.{key}"

    def has(self, key: str) -> bool:
        return key in self.raw and self.raw[key] is not None

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        value = self.raw.get(key)
        return default if value is None else value

    def required(self, key: str) -> Any:
        self.read.add(key)
        if self.raw.get(key) is None:
            raise GraderSpecError(self.at(key), "is required")
        return self.raw[key]

    def string(self, key: str, default: str | None = None, *, nonempty: bool = False) -> str:
        value = self.required(key) if default is None else self.get(key, default)
        if not isinstance(value, str):
            raise GraderSpecError(self.at(key), f"must be a string, got {type(value).__name__}")
        if nonempty and not value.strip():
            raise GraderSpecError(self.at(key), "must not be empty")
        return value

    def template(self, key: str, default: str | None = None) -> Template:
        return Template.parse(self.string(key, default), self.at(key))

    def choice(self, key: str, options, default: str | None = None) -> str:
        value = self.string(key, default)
        if value not in options:
            raise GraderSpecError(self.at(key), f"{value!r} is not one of {', '.join(options)}")
        return value

    def number(self, key: str, default: float | None = None, *, lo: float | None = None) -> float:
        value = self.required(key) if default is None else self.get(key, default)
        return finite(value, self.at(key), lo=lo)

    def integer(self, key: str, default: int | None = None, *, lo: int = 0) -> int:
        value = self.required(key) if default is None else self.get(key, default)
        if isinstance(value, bool) or not isinstance(value, int):
            raise GraderSpecError(self.at(key), f"must be an integer, got {value!r}")
        if value < lo:
            raise GraderSpecError(self.at(key), f"must be ≥ {lo}, got {value}")
        return value

    def name(self) -> str:
        return self.string("name", nonempty=True)

    def done(self, implicit: tuple[str, ...] = ("type", "name")) -> None:
        unknown = sorted(set(self.raw) - self.read - set(implicit))
        if unknown:
            raise GraderSpecError(self.at(unknown[0]), "is not a field of this grader type")


def finite(value: Any, field: str, *, lo: float | None = None) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise GraderSpecError(field, f"must be a number, got {value!r}")
    if not math.isfinite(value):
        raise GraderSpecError(field, f"must be finite, got {value}")
    if lo is not None and value < lo:
        raise GraderSpecError(field, f"must be ≥ {lo}, got {value}")
    return float(value)
