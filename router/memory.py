"""Giving the heap a large request freed back to the OS (router memory back near its baseline
after a large request).

glibc keeps what a large request freed (a 10 MB body read and parsed, a /detokenize of a million
tokens and its 10 MB answer) in its arenas, one per tokenizer thread, so the router's RSS stays at
each arena's high-water mark: three 1.5M-token /detokenize calls left it 200 MiB over its baseline
for good, and `malloc_trim(0)` brought it back below. `Trimmer.serve` runs an HTTP request counting
the bytes it reads and writes; once it is over, `request_done` runs `malloc_trim(0)` off the event
loop if they reach `LARGE_BYTES`, one trim at a time (a burst of large requests queues one more,
not one each). Without glibc it trims nothing. Called by `router.app`'s middleware for every
request.

`malloc_trim` returns the free chunks inside each arena, but not the free top of a tokenizer
thread's arena: that shrinks only when it exceeds glibc's trim threshold, which glibc raises to
twice the largest mmapped chunk freed (up to 64 MiB) after a large body. Rounds of 8 concurrent
/tokenize of 262k characters left the router 26-57 MiB over its baseline for good that way, whatever
the trims. `pin_malloc_thresholds`, called once at router start (`router.cli`), fixes both
thresholds at glibc's own starting values so they never grow: the same rounds then end 4-7 MiB
below the baseline (tests/e2e/test_router_edges.py: -9..+10 MiB in four runs).

`CollectionPacer` (the router's task while it serves, `--gc-interval-s`) runs the garbage
collector on a clock instead of CPython's allocation counts. Those count allocations minus
deallocations, so while requests start and end at a steady rate the youngest generation grows to
tens of thousands of objects (the in-flight requests' coroutines, transports, events) before a
collection walks them all at once: with 1,000 streams and 200 new ones a second, collections of
the youngest generation took 6-10 ms, of the middle one 5-48 ms, full ones 30-108 ms, each a stop
of every stream. The pacer collects the youngest generation every interval (what was made since
the last one, well under a millisecond), the middle one every `MIDDLE_EVERY_S`, and all of them
once a minute or as soon as the process grew `FULL_RSS_GROWTH` since the last full collection
(the bound on what cyclic garbage that outlived a second can hold meanwhile); while a tick finds
next to nothing young (an idle router, one stream) the next waits longer, up to 0.2 s. The middle
generation holds what the young collections found alive since its last collection: at 20,000
tokens a second over 1,000 streams (500 new a second) each 1 s collection walked about 56k
objects in 11-15 ms, a burst of 1,000 new streams 111k in 17-18 ms, each time the p99 of the
tokens' added latency (12-16 ms); every 0.2 s they took at most 3.8-6.6 ms, 250 ms in all over
30 s against 376-432 ms, and the p99 fell to 0.9-3.4 ms (benchmarks/README.md, router_scale).

`freeze_startup_heap`, also called once at router start, moves what starting up allocated (the
tokenizer, transformers' tokenizer classes, FastAPI: about 95k objects since the router loads no
torch, over a million before) out of the garbage collector's sight: otherwise every full
collection walks all of it, and the relay's allocations (a `TokenBatch`
decoded per worker step, an event per token) trigger one often enough to cost tens of
microseconds per relayed token.
"""

from __future__ import annotations

import asyncio
import ctypes
import gc
import logging
import os
import time
from collections.abc import Callable
from concurrent.futures import Executor

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from common.runtime.malloc import libc_function, set_thresholds

log = logging.getLogger(__name__)

MIDDLE_EVERY_S = 0.2  # CollectionPacer: the middle generation's collections
QUIET_YOUNG = 100  # a tick that found fewer young objects than this doubles the next wait ...
QUIET_MAX_S = MIDDLE_EVERY_S  # ... up to this
FULL_EVERY_S = 60.0  # and the full ones, at the latest
FULL_RSS_GROWTH = 64 * 2**20  # or once the process grew this much since the last full one
LARGE_BYTES = 256 * 1024  # body read + body sent (a 60k-token /tokenize is ~540 KB, kept 60 MiB)
TRIM_THRESHOLD = 128 * 1024  # glibc's defaults (M_TRIM_THRESHOLD, M_MMAP_THRESHOLD), pinned
MMAP_THRESHOLD = 128 * 1024


def _malloc_trim() -> ctypes._CFuncPtr | None:
    trim = libc_function("malloc_trim")
    if trim is not None:
        trim.argtypes, trim.restype = [ctypes.c_size_t], ctypes.c_int
    return trim


def pin_malloc_thresholds() -> bool:
    """Fix glibc's trim and mmap thresholds at its starting values (no dynamic growth): whether
    they were set (common.runtime.malloc.set_thresholds: not where the environment sets them,
    nor without glibc). Process-wide: call it in the router process only.
    """
    return set_thresholds(TRIM_THRESHOLD, MMAP_THRESHOLD)


def freeze_startup_heap() -> int:
    """Collect once, then exempt every object alive now from later collections (`gc.freeze`):
    how many objects that was. Call it once, when the router has loaded what it keeps."""
    gc.collect()
    gc.freeze()
    return gc.get_freeze_count()


class Trimmer:
    """`malloc_trim(0)` after large requests, at most one running and one queued."""

    def __init__(self) -> None:
        self._trim = _malloc_trim()
        self._running = False
        self._again = False  # a large request finished while a trim ran: trim once more
        self.num_trims = 0
        self._task: asyncio.Task | None = None  # held: the loop keeps only weak references

    async def serve(
        self, app: ASGIApp, scope: Scope, receive: Receive, send: Send, executor: Executor
    ) -> None:
        """`app(scope, receive, send)`, then `request_done` with the body bytes read and sent."""
        num_bytes = 0

        async def counted_receive() -> Message:
            nonlocal num_bytes
            message = await receive()
            num_bytes += len(message.get("body", b""))
            return message

        async def counted_send(message: Message) -> None:
            nonlocal num_bytes
            num_bytes += len(message.get("body", b""))
            await send(message)

        try:
            await app(scope, counted_receive, counted_send)
        finally:
            self.request_done(num_bytes, executor)

    def request_done(self, num_bytes: int, executor: Executor) -> None:
        """A request that read and wrote `num_bytes` finished (its objects already released)."""
        if self._trim is None or num_bytes < LARGE_BYTES:
            return
        if self._running:
            self._again = True
            return
        self._running = True
        self._task = asyncio.get_running_loop().create_task(self._run(executor))

    async def _run(self, executor: Executor) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                self._again = False
                await loop.run_in_executor(executor, self._trim, 0)
                self.num_trims += 1
                if not self._again:
                    return
        except Exception:  # a failed trim costs memory, never a request
            log.exception("malloc_trim failed")
        finally:
            self._running = False


def resident_bytes() -> int:
    """This process's resident set size (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


class CollectionPacer:
    """The garbage collector on a clock: `run` turns CPython's automatic collections off and
    collects the youngest generation every `interval_s`, the middle one every `middle_s`, all
    of them every `full_s` or once the RSS grew `full_rss_growth` bytes; on cancel it turns the
    automatic collections back on. `tick` is one turn (tests call it with their own clock).

    A quiet router makes almost nothing for the collector: idle, a tick finds no young objects,
    relaying one stream 0-5 (68-103 as a request arrives). There each tick that found fewer
    than `quiet_young` doubles the wait before the next, up to `quiet_max_s` (the middle
    generation's period), and the first busier one brings it back to `interval_s`. An idle
    router woke 50 times a second for this alone (half of its wakes, 8 of its 16 ms of CPU a
    second), each wake taken from whatever computes on its cores. The most a back-off lets pile
    up is what `quiet_max_s` of new load makes before the next tick."""

    def __init__(
        self,
        interval_s: float,
        middle_s: float = MIDDLE_EVERY_S,
        full_s: float = FULL_EVERY_S,
        full_rss_growth: int = FULL_RSS_GROWTH,
        clock: Callable[[], float] = time.monotonic,
        rss: Callable[[], int] = resident_bytes,
        collect: Callable[[int], int] = gc.collect,
        quiet_young: int = QUIET_YOUNG,
        quiet_max_s: float = QUIET_MAX_S,
    ) -> None:
        if not 0 < interval_s <= middle_s <= full_s:
            raise ValueError("--gc-interval-s must be > 0 and at most the middle generation's "
                             f"{middle_s} s (0: CPython's own collections)")  # fmt: skip
        self.interval_s, self.middle_s, self.full_s = interval_s, middle_s, full_s
        self.full_rss_growth = full_rss_growth
        self.clock, self.rss, self.collect = clock, rss, collect
        now = clock()
        self.next_middle_s, self.next_full_s = now + middle_s, now + full_s
        self.full_rss = rss()
        self.collections = [0, 0, 0]  # by generation, since start
        self.quiet_young, self.quiet_max_s = quiet_young, max(quiet_max_s, interval_s)
        self.wait_s = interval_s  # before the next tick

    async def run(self) -> None:
        """Pace collections until cancelled."""
        was_enabled = gc.isenabled()
        gc.disable()
        try:
            while True:
                await asyncio.sleep(self.wait_s)
                self.tick()
        finally:
            if was_enabled:
                gc.enable()

    def tick(self) -> int:
        """Collect what is due now: the generation collected (-1 when nothing was)."""
        now = self.clock()
        young = gc.get_count()[0]  # tracked since the last collection
        if young < self.quiet_young:
            self.wait_s = min(2 * self.wait_s, self.quiet_max_s)
        else:
            self.wait_s = self.interval_s
        generation = -1
        if now >= self.next_middle_s:
            self.next_middle_s = now + self.middle_s
            rss = self.rss()
            full = now >= self.next_full_s or rss - self.full_rss >= self.full_rss_growth
            generation = 2 if full else 1
        elif young > 0:  # anything tracked since the last collection
            generation = 0
        if generation < 0:
            return generation
        self.collect(generation)
        self.collections[generation] += 1
        if generation == 2:
            self.next_full_s, self.full_rss = now + self.full_s, self.rss()
        return generation
