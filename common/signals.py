"""A change signal that threads and asyncio tasks can both wait on (the stores notify it on every write)."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any


class ChangeSignal:
    """``notify()`` from any thread wakes every waiter; ``generation`` counts notifications, so a waiter that
    read it before checking for new data never misses a change made in between."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self.generation = 0
        self._async_waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Future]] = set()

    def notify(self) -> None:
        with self._cond:
            self.generation += 1
            self._cond.notify_all()
            waiters = list(self._async_waiters)
        for loop, fut in waiters:
            with contextlib.suppress(RuntimeError):  # a loop that has closed
                loop.call_soon_threadsafe(_wake, fut)

    def wait(self, since: int, timeout: float) -> None:
        """Block until ``generation`` moves past ``since`` or ``timeout`` seconds pass."""
        with self._cond:
            if self.generation == since:
                self._cond.wait(timeout)

    async def wait_async(self, since: int, timeout: float) -> None:
        """The same, awaited: no thread is held while waiting."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        with self._cond:
            if self.generation != since:
                return
            self._async_waiters.add((loop, fut))
        try:
            await asyncio.wait_for(fut, timeout)
        except TimeoutError:
            pass
        finally:
            with self._cond:
                self._async_waiters.discard((loop, fut))


def follow_blocking(
    poll: Callable[[int], tuple[list[Any], bool]],
    signal: ChangeSignal,
    after_seq: int,
    poll_seconds: float = 1.0,
) -> Iterator[Any]:
    """Numbered events from ``poll(seq) -> (events after seq, done)`` until done, blocking on ``signal`` between
    polls (the thread form; ``strop.common.aio.follow`` is the same loop on an event loop)."""
    seq = after_seq
    while True:
        generation = signal.generation
        events, done = poll(seq)
        for e in events:
            yield e
            seq = e.seq
        if done:
            return
        if not events:
            signal.wait(generation, poll_seconds)


def _wake(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)
