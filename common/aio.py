"""Asyncio helpers of the services' gRPC layers: a blocking core call from an async handler (``in_pool``), and
event streams that follow a job or an export without holding a thread (``follow``), taking turns so that many
streams replaying at once never starve the rest of the server.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
import heapq
import itertools
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any

from strop.common.signals import ChangeSignal


async def in_pool(fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
    """Run a blocking core call from an async handler without blocking the event loop (in the caller's
    context, so the call's principal goes with it)."""
    ctx = contextvars.copy_context()
    return await asyncio.get_running_loop().run_in_executor(
        None, functools.partial(ctx.run, fn, *args, **kwargs)
    )


class _FairGate:
    """At most ``slots`` event polls at once on a server's loop, served in order of (rank, arrival).

    Why. A replay (``after_seq=0`` on a job with a thousand events) reads, decodes and converts a page of events
    on a pool thread; five hundred of them at once filled the pool and held the GIL, so health checks and GetJob
    waited seconds and some streams had no event after 40 s. Through the gate the replays take turns a page at a
    time, a stream's first page goes before any stream's later pages (rank 0), and everything else on the
    server (unary calls, health) finds the interpreter free between pages.
    """

    def __init__(self, slots: int) -> None:
        self.free = slots
        self.waiting: list[tuple[int, int, asyncio.Future]] = []
        self._arrivals = itertools.count()

    async def acquire(self, rank: int) -> None:
        if self.free > 0 and not self.waiting:
            self.free -= 1
            return
        fut = asyncio.get_running_loop().create_future()
        heapq.heappush(self.waiting, (rank, next(self._arrivals), fut))
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # the slot was handed over as the caller went away
                self.release()
            raise

    def release(self) -> None:
        while self.waiting:
            _, _, fut = heapq.heappop(self.waiting)
            if not fut.done():  # a waiter that went away is skipped
                fut.set_result(None)
                return
        self.free += 1


POLL_SLOTS = 8  # streams polling or sending a page at once per server: more only contend for the GIL
SEND_TURN_S = 0.05  # a stream still sending its page after this gives its turn up
_gates: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _FairGate] = weakref.WeakKeyDictionary()


def _gate() -> _FairGate:
    loop = asyncio.get_running_loop()
    gate = _gates.get(loop)
    if gate is None:
        gate = _gates[loop] = _FairGate(POLL_SLOTS)
    return gate


async def follow(
    poll: Callable[[int, int], tuple[list[Any], bool]],
    signal: ChangeSignal,
    after_seq: int,
    *,
    context: Any = None,
    heartbeat: float = 5.0,
    convert: Callable[[Any], Any] | None = None,
    page_size: int = 100,
) -> AsyncIterator[Any]:
    """Stream numbered events: ``poll(seq, limit) -> (at most limit events after seq, done)`` until done,
    waiting on ``signal`` between polls without holding a thread. Each poll is one short call into the core, in
    the pool, with ``convert`` applied to its events there (so the loop only sends them), and takes its turn at
    the server's :class:`_FairGate`: a stream's first poll, of one event, goes before every later page of any
    stream, so hundreds of streams replaying at once each get an event before any gets its second page."""

    def page(seq: int, limit: int) -> tuple[list[Any], bool]:
        events, done = poll(seq, limit)
        return ([convert(e) for e in events] if convert else events), done

    gate, seq, pages = _gate(), after_seq, 0
    loop = asyncio.get_running_loop()
    while True:
        generation = signal.generation
        await gate.acquire(min(pages, 1))
        held = True
        try:
            events, done = await in_pool(page, seq, page_size if pages else 1)
            # the turn lasts while the page is sent too (a few ms), so only a few streams send at once and the
            # loop stays free for new calls; a client slow to read gives the turn up after SEND_TURN_S
            started = loop.time()
            for e in events:
                yield e
                seq = e.seq
                if held and loop.time() - started > SEND_TURN_S:
                    gate.release()
                    held = False
        finally:
            if held:
                gate.release()
        pages += bool(events)
        if done:
            return
        if context is not None and getattr(context, "done", lambda: False)():
            return
        if not events:
            await signal.wait_async(generation, timeout=heartbeat)
