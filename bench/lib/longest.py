"""The longest input a benchmark's step runs without running out of device memory: the search the benchmarks share.

The length doubles from ``start`` (or from twice a length known to fit) until a trial runs out of memory, then the
bracket is bisected to ``step``. Each trial is the caller's: one fresh worker process (an out-of-memory trial leaves
nothing behind) that prints its row as it ends. A trial starts only while ``budget`` seconds allow it (at least 10 s,
and no less than the last trial took); a search stopped early says so and gives the bracket to continue from.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

FITS, OOM, ERROR = "fits", "OOM", "error"


@dataclass
class Trial:
    """One trial's outcome (``FITS``, ``OOM`` or ``ERROR``), the worker's wall seconds and the caller's row."""

    outcome: str
    wall_s: float
    row: Any = None


@dataclass
class Search:
    """What a search found: the longest length that fit, the shortest that ran out of memory (0: none), why it
    stopped early ('' when the bracket was bisected to ``step``), the trials in order, and the flags to continue."""

    fits: int
    fails: int
    stopped: str
    step: int
    trials: list[tuple[int, Trial]] = field(default_factory=list)

    def continue_flags(self, start: int) -> str:
        if self.fails:
            return f"--find-fits {self.fits} --find-fails {self.fails}"
        return f"--find-start {max(self.fits * 2, start)}"

    def summary(self) -> str:
        oom = f"first out of memory at {self.fails:,}" if self.fails else "no trial ran out of memory"
        how = "stopped: " + self.stopped if self.stopped else f"bracket within {self.step}"
        return f"{oom} ({how})"

    def as_dict(self) -> dict:
        """The search for a --json file: the bracket, why it stopped, each trial's length and row (a dataclass)."""
        from dataclasses import asdict

        return {
            "fits": self.fits,
            "fails": self.fails,
            "stopped": self.stopped,
            "trials": [[n, asdict(t.row)] for n, t in self.trials],
        }


def find_longest(
    trial: Callable[[int, float], Trial],
    *,
    start: int,
    step: int,
    max_length: int,
    budget_s: float,
    fits: int = 0,
    fails: int = 0,
) -> Search:
    """Search with ``trial(length, timeout_s)``; ``fits``/``fails``: a bracket already known (0: unknown)."""
    end = time.perf_counter() + budget_s
    s = Search(fits, fails, "", step)

    def run(n: int) -> Trial | None:
        left = end - time.perf_counter()
        if left < 10 or (s.trials and left < s.trials[-1][1].wall_s):  # no trial that would not end in time
            return None
        t = trial(n, left)
        s.trials.append((n, t))
        return t

    def stop_reason(t: Trial | None) -> str:
        return "budget spent" if t is None else "a trial failed other than by memory"

    n = max(start, s.fits * 2)
    while not s.fails and not s.stopped:  # doubling
        t = run(n)
        if t is None or t.outcome == ERROR:
            s.stopped = stop_reason(t)
        elif t.outcome == FITS:
            s.fits, n = n, n * 2
            if n > max_length:
                s.stopped = f"the longest allowed, {max_length}, reached"
        else:
            s.fails = n
    while s.fails and not s.stopped and s.fails - s.fits > step:  # bisection
        n = max(s.fits + step, (s.fits + s.fails) // 2 // step * step)
        if n >= s.fails:
            break
        t = run(n)
        if t is None or t.outcome == ERROR:
            s.stopped = stop_reason(t)
        elif t.outcome == FITS:
            s.fits = n
        else:
            s.fails = n
    return s


def add_flags(p, *, unit: str, start: int, max_length: int) -> None:
    """The search's flags on a benchmark's parser (``unit``: what a length counts, e.g. "sequence tokens")."""
    p.add_argument("--find-longest", action="store_true", help=f"strop alone: the longest {unit} that fits")
    p.add_argument("--find-start", type=int, default=start, help=f"the first trial's {unit}")
    p.add_argument("--find-step", type=int, default=4096, help="bisect until the bracket is this many tokens")
    p.add_argument("--find-fits", type=int, default=0, help=f"{unit} already known to fit")
    p.add_argument("--find-fails", type=int, default=0, help=f"{unit} already known to run out of memory")
    p.add_argument("--find-max", type=int, default=max_length, help=f"no trial beyond this many {unit}")
    p.add_argument(
        "--budget", type=float, default=540, help="--find-longest: seconds after which no trial starts"
    )


def find_longest_from_flags(trial: Callable[[int, float], Trial], a) -> Search:
    """``find_longest`` with the flags ``add_flags`` put on the parser."""
    return find_longest(
        trial,
        start=a.find_start,
        step=a.find_step,
        max_length=a.find_max,
        budget_s=a.budget,
        fits=a.find_fits,
        fails=a.find_fails,
    )


def is_oom(exc: BaseException | str) -> bool:
    """Whether ``exc`` (an exception, or a worker's error text) is the device running out of memory: torch's
    error, or a kernel's launch failing for it."""
    if isinstance(exc, BaseException) and type(exc).__name__ == "OutOfMemoryError":
        return True
    return "out of memory" in str(exc).lower()


def extrapolated(points: list[tuple[int, float]], capacity: float) -> tuple[float, int] | None:
    """From the peaks of the two longest trials that fit (``(length, peak)`` pairs, any unit), the peak's growth per
    token and the length at which a straight line through them reaches ``capacity``: a derivation for the report
    (attention is linear in memory with a flash kernel; what else grows faster would make it an upper bound), not a
    measurement. None with fewer than two lengths or no growth."""
    lengths = sorted(dict(points).items())
    if len(lengths) < 2:
        return None
    (n0, p0), (n1, p1) = lengths[-2:]
    if p1 <= p0:
        return None
    per_token = (p1 - p0) / (n1 - n0)
    return per_token, int(n1 + (capacity - p1) / per_token)
