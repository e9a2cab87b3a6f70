"""Template strings as OpenAI's graders define them: ``{{ namespace.variable }}`` substituted with the value.

OpenAI's graders guide (developers.openai.com/api/docs/guides/graders, "Templating"): the only namespaces are
``item`` (the dataset row) and ``sample`` (the model's output); nested values are reached "with JSON path like
syntax" (``{{ item.answer.value }}``, ``{{ sample.output_tools[0].function.name }}``). Whitespace inside the braces
is free. A string value is substituted as it is; any other value as its JSON text (``1.5``, ``true``,
``{"a": 1}``).

strop's sampler produces text, so the sample namespace holds ``output_text`` and ``output_json`` (the output parsed
as JSON, when it is JSON); OpenAI's ``output_tools``, ``choices`` and ``output_audio`` are refused when the spec is
parsed. Templates are parsed once, with the spec: a malformed one is a ``GraderSpecError`` naming its field.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from strop.graders.errors import GraderSpecError

NAMESPACES = ("item", "sample")
SAMPLE_VARIABLES = ("output_text", "output_json")
UNSUPPORTED_SAMPLE_VARIABLES = ("output_tools", "choices", "output_audio")

_TAG = re.compile(r"\{\{(.*?)\}\}", re.DOTALL)
# one path step: .name (any run of characters but separators), [index] or ["key"] / ['key']
_STEP = re.compile(r"""\.([^.\[\]\s{}]+)|\[\s*(-?\d+)\s*\]|\[\s*"([^"]*)"\s*\]|\[\s*'([^']*)'\s*\]""")


@dataclass(frozen=True)
class Reference:
    """One ``{{ … }}`` of a template: its namespace, the path under it, and the spec field holding it."""

    namespace: str
    path: tuple[str | int, ...]
    field: str

    @property
    def text(self) -> str:
        out = self.namespace
        for step in self.path:
            out += f"[{step}]" if isinstance(step, int) else f".{step}"
        return out


class Missing(LookupError):
    """A reference whose value the row or sample does not have."""

    def __init__(self, ref: Reference) -> None:
        super().__init__(ref.text)
        self.ref = ref


def _parse_reference(body: str, field: str) -> Reference:
    text = body.strip()
    m = re.match(r"([A-Za-z_]\w*)", text)
    if not m:
        raise GraderSpecError(field, f"template {{{{{body}}}}} must be {{{{ namespace.variable }}}}")
    namespace, pos, path = m.group(1), m.end(), []
    if namespace not in NAMESPACES:
        raise GraderSpecError(
            field, f"template namespace {namespace!r} is unknown: the namespaces are 'item' and 'sample'"
        )
    while pos < len(text):
        step = _STEP.match(text, pos)
        if not step:
            raise GraderSpecError(field, f"template {{{{{body}}}}}: cannot read the path at {text[pos:]!r}")
        name, index, dq, sq = step.groups()
        path.append(int(index) if index is not None else next(s for s in (name, dq, sq) if s is not None))
        pos = step.end()
    if not path:
        raise GraderSpecError(field, f"template {{{{{body}}}}} names a namespace but no variable")
    if namespace == "sample":
        var = path[0]
        if var in UNSUPPORTED_SAMPLE_VARIABLES:
            raise GraderSpecError(
                field,
                f"sample.{var} is not produced by strop's sampler (it samples text: output_text, output_json)",
            )
        if var not in SAMPLE_VARIABLES:
            raise GraderSpecError(
                field, f"sample.{var} is unknown: the sample has output_text and output_json"
            )
        if var == "output_text" and len(path) > 1:
            raise GraderSpecError(field, "sample.output_text is a string: it has no fields")
    return Reference(namespace, tuple(path), field)


@dataclass(frozen=True)
class Template:
    """A parsed template string: literal text between references."""

    source: str
    parts: tuple[str | Reference, ...]

    @classmethod
    def parse(cls, source: str, field: str) -> Template:
        parts: list[str | Reference] = []
        pos = 0
        for m in _TAG.finditer(source):
            if m.start() > pos:
                parts.append(source[pos : m.start()])
            parts.append(_parse_reference(m.group(1), field))
            pos = m.end()
        rest = source[pos:]
        if "{{" in rest:
            raise GraderSpecError(field, "a template opens '{{' without closing it with '}}'")
        if rest:
            parts.append(rest)
        return cls(source, tuple(parts))

    @property
    def references(self) -> tuple[Reference, ...]:
        return tuple(p for p in self.parts if isinstance(p, Reference))

    def render(self, context: dict[str, Any]) -> str:
        """The text with each reference replaced; ``Missing`` names the first reference without a value."""
        out = []
        for part in self.parts:
            out.append(part if isinstance(part, str) else to_text(resolve(part, context)))
        return "".join(out)


def resolve(ref: Reference, context: dict[str, Any]) -> Any:
    value = context.get(ref.namespace)
    if value is None:
        raise Missing(ref)
    for step in ref.path:
        if (isinstance(value, dict) and not isinstance(step, int) and step in value) or (
            isinstance(value, list) and isinstance(step, int) and -len(value) <= step < len(value)
        ):
            value = value[step]
        elif isinstance(value, list) and isinstance(step, str) and step.isdigit() and int(step) < len(value):
            value = value[int(step)]  # ``a.0.b`` reads like ``a[0].b``
        else:
            raise Missing(ref)
    return value


def to_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
