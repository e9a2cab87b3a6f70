"""Numbers in model answers: strop's parser for the ``numeric_check`` grader (exact, as fractions).

Why not math-verify: it bounds its sympy work with ``signal.alarm``, which works only on a process's main thread
(its own error message says so), and the trainer grades on worker threads; without the alarm, sympy can be kept
busy indefinitely by an output such as ``9^9^9^9``, inside the training job. This parser is linear-time regular
expressions over the text and exact rational arithmetic, so a grade costs microseconds whatever the model writes.
What it reads, and what it does not (symbolic answers such as ``\\sqrt{2}/2``, intervals, sets): docs/graders.md.

Read as a number, after dropping ``$``, ``\\$``, ``\\%``/``%``, ``\\!``, ``\\,`` and the LaTeX spacing commands:
- a decimal with an optional sign (``-``, ``+``, or U+2212 ``−``), optional thousands separators in groups of three
  (``1,234,567.5``), and an optional exponent (``1e-3``, ``2.5E+4``);
- a fraction of two such numbers, ``a/b``, or LaTeX ``\\frac{a}{b}`` (``\\dfrac``, ``\\tfrac``), signed;
- ``extract="auto"`` reads the last ``\\boxed{…}`` of the text when there is one (its content must be a number),
  else the last number in the text; ``extract="exact"`` requires the whole text (stripped) to be one number.
Infinity and NaN are never numbers here, nor numbers of more than ``MAX_DIGITS`` digits or exponents beyond
``±MAX_EXPONENT`` (reading ``1e999999999`` exactly would take minutes).
"""

from __future__ import annotations

import re
from fractions import Fraction

_SIGN = r"[-+\u2212]?"
_UNSIGNED = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?|\.\d+(?:[eE][-+]?\d+)?"
_PLAIN = rf"{_SIGN}(?:{_UNSIGNED})"
_FRAC_TEX = rf"({_SIGN})\\[dt]?frac\s*\{{\s*({_PLAIN})\s*\}}\s*\{{\s*({_PLAIN})\s*\}}"
_FRAC_SLASH = rf"({_PLAIN})\s*/\s*({_PLAIN})"
_ANY = re.compile(rf"{_FRAC_TEX}|(?<![\w.]){_FRAC_SLASH}(?![\w.])|(?<![\w.])({_PLAIN})(?![\w])")
_NOISE = re.compile(r"\\[$%!,;: ]|\\(?:quad|qquad)\b|[$%]|\\left|\\right")
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")


MAX_DIGITS = (
    1000  # longer numbers, or exponents beyond ±MAX_EXPONENT, are not read (10**10**9 would take minutes)
)
MAX_EXPONENT = 1000
_EXP = re.compile(r"[eE]([-+]?\d+)$")


def _plain(text: str) -> Fraction:
    t = text.replace("\u2212", "-").replace(",", "")
    exp = _EXP.search(t)
    if sum(c.isdigit() for c in t[: exp.start() if exp else None]) > MAX_DIGITS or (
        exp and (len(exp.group(1).lstrip("+-")) > 5 or abs(int(exp.group(1))) > MAX_EXPONENT)
    ):
        raise OverflowError(f"{t[:40]}… is too long to read")
    return Fraction(t)


def _value(m: re.Match) -> Fraction | None:
    sign, num, den, s_num, s_den, plain = m.groups()
    try:
        if num is not None:
            out = _plain(num) / _plain(den)
            return -out if sign in ("-", "\u2212") else out
        if s_num is not None:
            return _plain(s_num) / _plain(s_den)
        return _plain(plain)
    except (ZeroDivisionError, OverflowError):
        return None


def _boxed(text: str) -> str | None:
    """The content of the last ``\\boxed{…}`` (braces balanced), or None."""
    starts = [m.end() for m in _BOXED.finditer(text)]
    if not starts:
        return None
    start, depth = starts[-1], 1
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
    return None


def parse_number(text: str, extract: str = "exact") -> Fraction | None:
    """The number ``text`` states (see the module docstring), or None when it states none."""
    if extract == "auto":
        boxed = _boxed(text)
        if boxed is not None:
            return parse_number(boxed, "exact")
    clean = _NOISE.sub("", text).strip()
    if extract == "exact":
        m = _ANY.fullmatch(clean)
        return _value(m) if m else None
    last = None
    for m in _ANY.finditer(clean):
        last = m
    return _value(last) if last else None


def within(value: Fraction, reference: Fraction, abs_tol: float, rel_tol: float) -> bool:
    """``|value − reference| ≤ max(abs_tol, rel_tol·|reference|)``, exactly (tolerances as their binary values).

    Relative to the reference only (not ``math.isclose``'s larger of the two magnitudes): a wrong answer of huge
    size must not widen its own tolerance.
    """
    bound = max(Fraction(abs_tol), Fraction(rel_tol) * abs(reference))
    return abs(value - reference) <= bound
