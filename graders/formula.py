"""The ``multi`` grader's ``calculate_output``: a small arithmetic language, parsed and evaluated here (no eval()).

What OpenAI's graders guide ("Combined graders") documents: the keys of ``graders`` as variables, the operators
``+ - * /`` and ``^`` (power), and the functions ``min max abs floor ceil exp sqrt log``. Parentheses group, numbers
are decimal literals (``0.5``, ``1e-3``). Precedence, loosest first: ``+ -``; ``* /``; unary ``-``/``+``; ``^``
(right associative, so ``2^3^2`` = 2^9 and ``-2^2`` = -4, as in mathematics and Python's ``**``). ``log`` is the
natural logarithm; ``min``/``max`` take one or more arguments, the others exactly one.

A formula is checked when the spec is parsed (syntax, unknown names, argument counts, length, depth). Evaluating
it can still fail on values (division by zero, log of a non-positive number, overflow, a non-finite result): that
raises ``FormulaValueError`` and the multi grader scores the sample 0 (OpenAI's rule for a grader result that is
not a valid float).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

MAX_LENGTH = 2000
MAX_DEPTH = 64

FUNCTIONS = {
    "min": (min, 1, None),
    "max": (max, 1, None),
    "abs": (abs, 1, 1),
    "floor": (math.floor, 1, 1),
    "ceil": (math.ceil, 1, 1),
    "exp": (math.exp, 1, 1),
    "sqrt": (math.sqrt, 1, 1),
    "log": (math.log, 1, 1),
}

_TOKEN = re.compile(
    r"\s*(?:(?P<num>(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?)|(?P<name>[A-Za-z_]\w*)|(?P<op>[-+*/^(),]))"
)


class FormulaSyntaxError(ValueError):
    """The formula cannot be parsed or names something unknown (a spec error)."""


class FormulaValueError(ArithmeticError):
    """The formula has no finite value for these grader scores."""


@dataclass(frozen=True)
class _Num:
    value: float


@dataclass(frozen=True)
class _Var:
    name: str


@dataclass(frozen=True)
class _Unary:
    op: str
    arg: object


@dataclass(frozen=True)
class _Bin:
    op: str
    left: object
    right: object


@dataclass(frozen=True)
class _Call:
    name: str
    args: tuple


def _tokens(text: str) -> list[tuple[str, str, int]]:
    out, pos = [], 0
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            if text[pos:].strip() == "":
                break
            bad = text[pos:].lstrip()
            raise FormulaSyntaxError(f"unexpected character {bad[0]!r} at {len(text) - len(bad)}")
        kind = m.lastgroup
        out.append((kind, m.group(kind), m.start(kind)))
        pos = m.end()
    return out


class _Parser:
    def __init__(self, text: str, variables: frozenset[str]) -> None:
        self.toks = _tokens(text)
        self.i = 0
        self.variables = variables
        self.depth = 0

    def peek(self) -> tuple[str, str, int] | None:
        return self.toks[self.i] if self.i < len(self.toks) else None

    def take(self, value: str | None = None) -> tuple[str, str, int]:
        tok = self.peek()
        if tok is None:
            raise FormulaSyntaxError(
                "the formula ends too early" + (f": expected {value!r}" if value else "")
            )
        if value is not None and tok[1] != value:
            raise FormulaSyntaxError(f"expected {value!r} at {tok[2]}, got {tok[1]!r}")
        self.i += 1
        return tok

    def nest(self):
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise FormulaSyntaxError(f"the formula nests deeper than {MAX_DEPTH} levels")

    def expr(self):
        self.nest()
        node = self.term()
        while (tok := self.peek()) and tok[1] in "+-" and tok[0] == "op":
            self.i += 1
            node = _Bin(tok[1], node, self.term())
        self.depth -= 1
        return node

    def term(self):
        node = self.unary()
        while (tok := self.peek()) and tok[1] in "*/" and tok[0] == "op":
            self.i += 1
            node = _Bin(tok[1], node, self.unary())
        return node

    def unary(self):
        tok = self.peek()
        if tok and tok[0] == "op" and tok[1] in "+-":
            self.i += 1
            self.nest()
            node = _Unary(tok[1], self.unary())
            self.depth -= 1
            return node
        return self.power()

    def power(self):
        base = self.atom()
        tok = self.peek()
        if tok and tok[1] == "^":
            self.i += 1
            self.nest()
            exponent = self.unary()  # right associative; binds tighter than a unary minus on its left
            self.depth -= 1
            return _Bin("^", base, exponent)
        return base

    def atom(self):
        kind, value, at = self.take()
        if kind == "num":
            return _Num(float(value))
        if kind == "name":
            nxt = self.peek()
            if nxt and nxt[1] == "(":
                return self.call(value, at)
            if value in FUNCTIONS:
                raise FormulaSyntaxError(f"{value} at {at} is a function: call it as {value}(...)")
            if value not in self.variables:
                known = ", ".join(sorted(self.variables)) or "none"
                raise FormulaSyntaxError(f"unknown name {value!r} at {at} (the graders are: {known})")
            return _Var(value)
        if value == "(":
            node = self.expr()
            self.take(")")
            return node
        raise FormulaSyntaxError(f"unexpected {value!r} at {at}")

    def call(self, name: str, at: int):
        if name not in FUNCTIONS:
            raise FormulaSyntaxError(f"unknown function {name!r} at {at} (functions: {', '.join(FUNCTIONS)})")
        self.take("(")
        args = []
        if (tok := self.peek()) and tok[1] == ")":
            self.i += 1
        else:
            while True:
                args.append(self.expr())
                if self.take()[1] == ")":
                    break
                if self.toks[self.i - 1][1] != ",":
                    raise FormulaSyntaxError(f"expected ',' or ')' in the arguments of {name} at {at}")
        _, lo, hi = FUNCTIONS[name]
        if len(args) < lo or (hi is not None and len(args) > hi):
            want = f"{lo}" if lo == hi else f"at least {lo}"
            raise FormulaSyntaxError(f"{name} at {at} takes {want} argument(s), got {len(args)}")
        return _Call(name, tuple(args))


@dataclass(frozen=True)
class Formula:
    """A parsed ``calculate_output``; ``evaluate`` maps grader scores to the combined score."""

    source: str
    tree: object
    variables: frozenset[str]

    @classmethod
    def parse(cls, source: str, variables) -> Formula:
        if len(source) > MAX_LENGTH:
            raise FormulaSyntaxError(f"the formula is longer than {MAX_LENGTH} characters")
        if not source.strip():
            raise FormulaSyntaxError("the formula is empty")
        parser = _Parser(source, frozenset(variables))
        tree = parser.expr()
        if (tok := parser.peek()) is not None:
            raise FormulaSyntaxError(f"unexpected {tok[1]!r} at {tok[2]}")
        return cls(source, tree, frozenset(variables))

    def evaluate(self, values: dict[str, float]) -> float:
        try:
            out = _eval(self.tree, values)
        except (ZeroDivisionError, OverflowError, ValueError) as e:
            raise FormulaValueError(f"{self.source!r}: {e}") from None
        if not math.isfinite(out):
            raise FormulaValueError(f"{self.source!r} is {out} for {values}")
        return float(out)


def _eval(node, values: dict[str, float]) -> float:
    if isinstance(node, _Num):
        return node.value
    if isinstance(node, _Var):
        return float(values[node.name])
    if isinstance(node, _Unary):
        v = _eval(node.arg, values)
        return -v if node.op == "-" else v
    if isinstance(node, _Call):
        fn, args = FUNCTIONS[node.name][0], [_eval(a, values) for a in node.args]
        return float(fn(args) if node.name in ("min", "max") else fn(*args))
    a, b = _eval(node.left, values), _eval(node.right, values)
    if node.op == "+":
        return a + b
    if node.op == "-":
        return a - b
    if node.op == "*":
        return a * b
    if node.op == "/":
        return a / b
    if a < 0 and not float(b).is_integer():
        raise ValueError(f"{a} ^ {b} is not a real number")
    if a == 0 and b < 0:
        raise ZeroDivisionError(f"0 ^ {b}")
    return math.pow(a, b)
