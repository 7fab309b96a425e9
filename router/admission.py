"""Admission control: how many generation requests may wait in the router at once.

Owns `Admission`, the count of requests between arrival and dispatch (reading the body,
tokenizing, waiting in the dispatcher's queue for a decode worker) and the refusal beyond
`--max-waiting-requests`: a 429 with `Retry-After`, decided before the body is even read, so an
overloaded router sheds load cheaply instead of queueing without bound. The same 429 answers new
work while the token relay is overloaded (`router.relay.RelayBudget`: more tokens buffered for
readers that cannot keep up than `--max-buffered-tokens`), until it drains. Also `WaitingLine`, the
first-come-first-served order in which `router.dispatch` lets waiting flights pick a decode worker.
The counts are shown by `router.metrics`. `Admission` is called by `router.app` around each
generation request.

And `LoopLag`, the router's own CPU shortage as the event loop sees it: a timer due every
`interval_s` (up to four intervals apart while it runs on time) notes how late it runs. Every
stream's tokens, every heartbeat and every new request wait that long too (a loop short of CPU
queues its work in the sockets, where no buffer of ours counts it), so while the smoothed lag is
over `--max-loop-lag-s` the same 429 answers new work: a router that cannot keep up sheds load
instead of taking more. Started by `router.server`.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import math
from collections.abc import Iterator
from contextlib import contextmanager

from common.aio import wait_for
from common.api.requests import RequestError
from router.relay import RelayBudget

RETRY_AFTER_S = 1  # what a refused client is told to wait: the queue moves in well under that


class Admission:
    """Counts waiting requests; `admit` refuses beyond `max_waiting` (0 = no limit)."""

    def __init__(
        self,
        max_waiting: int = 0,
        relay: RelayBudget | None = None,
        loop_lag: LoopLag | None = None,
    ) -> None:
        if max_waiting < 0:
            raise ValueError("--max-waiting-requests must be >= 0 (0 = no limit)")
        self.max_waiting = max_waiting
        self.relay = relay if relay is not None else RelayBudget()
        self.loop_lag = loop_lag if loop_lag is not None else LoopLag(0.0)
        self.num_waiting = 0  # admitted requests not yet dispatched to a worker
        self.num_rejected = 0  # requests refused with a 429, since start

    @contextmanager
    def admit(self) -> Iterator[None]:
        """Count the request as waiting while the block runs; RequestError 429 when full, or
        while the relay is overloaded."""
        if self.max_waiting and self.num_waiting >= self.max_waiting:
            raise self._refuse(
                f"the server has {self.num_waiting} requests waiting (--max-waiting-requests "
                f"{self.max_waiting})"
            )
        if self.relay.overloaded:
            raise self._refuse(
                f"the server holds {self.relay.num_tokens} tokens its clients have not read yet "
                f"(--max-buffered-tokens {self.relay.max_tokens})"
            )
        if self.loop_lag.overloaded:
            raise self._refuse(
                f"the router is short of CPU: its event loop runs {1e3 * self.loop_lag.lag_s:.0f} "
                f"ms late (--max-loop-lag-s {self.loop_lag.max_lag_s:g})"
            )
        self.num_waiting += 1
        try:
            yield
        finally:
            self.num_waiting -= 1

    def _refuse(self, why: str) -> RequestError:
        self.num_rejected += 1
        return RequestError(
            f"{why}; retry after {RETRY_AFTER_S} s",
            code=429,
            type="rate_limit_exceeded",
            headers={"Retry-After": str(RETRY_AFTER_S)},
        )


class LoopLag:
    """How late the event loop runs its timers, smoothed; `overloaded` from `max_lag_s` (0:
    never) until the lag falls to half of it. `run` is the timer's task; `note` takes one
    measurement (tests call it directly).

    The timer is due every `interval_s` while the loop runs late or is overloaded; each punctual
    tick (less than a tenth of `interval_s` late) doubles the wait before the next, up to
    `QUIET_TICKS` intervals. A stall long enough to matter (the lag is smoothed over a second)
    still makes the next tick late, which brings the interval back; an idle router no longer
    wakes 20 times a second for this."""

    TAU_S = 1.0  # smoothing time constant: one stall of the loop counts for about this long
    QUIET_TICKS = 4  # the longest wait between punctual ticks, in intervals

    def __init__(self, max_lag_s: float = 0.5, interval_s: float = 0.05) -> None:
        if max_lag_s < 0 or interval_s <= 0:
            raise ValueError("--max-loop-lag-s must be >= 0 (0 = never refuse)")
        self.max_lag_s = max_lag_s
        self.interval_s = interval_s
        self.wait_s = interval_s  # before the next tick
        self.lag_s = 0.0  # smoothed over about TAU_S
        self.max_seen_s = 0.0  # the largest single lag, since start
        self.overloaded = False

    async def run(self) -> None:
        """Measure until cancelled."""
        loop = asyncio.get_running_loop()
        while True:
            wait = self.wait_s
            due = loop.time() + wait
            await asyncio.sleep(wait)
            now = loop.time()
            self.note(now - due, now - due + wait)

    def _pace(self, late_s: float) -> None:
        if late_s < self.interval_s / 10 and not self.overloaded:
            self.wait_s = min(2 * self.wait_s, self.QUIET_TICKS * self.interval_s)
        else:
            self.wait_s = self.interval_s

    def note(self, late_s: float, elapsed_s: float) -> None:
        """One timer `late_s` late, `elapsed_s` after the previous one was set: averaged in by
        time, so a loop one second late counts as much in one late tick as in twenty."""
        late_s = max(late_s, 0.0)
        self.max_seen_s = max(self.max_seen_s, late_s)
        weight = 1.0 - math.exp(-max(elapsed_s, 0.0) / self.TAU_S)
        self.lag_s += weight * (late_s - self.lag_s)
        if self.max_lag_s:
            if self.lag_s > self.max_lag_s:
                self.overloaded = True
            elif self.lag_s <= self.max_lag_s / 2:
                self.overloaded = False
        self._pace(late_s)


class WaitingLine:
    """Places in a line by arrival: only the first may act, the others sleep until their turn.

    A place is its arrival number. `leave` takes a place out (the flight is trying a worker, or
    is done); `rejoin` puts it back where it was, ahead of everyone who came later. Every call
    is O(log n) amortized at most: a place that leaves stays in the heap as a stale entry until
    it reaches the top (or a rebuild, once stale entries outnumber the places in line), so the
    heap's first entry is always the first place in line.
    """

    def __init__(self) -> None:
        self._heap: list[int] = []  # places in line, and stale entries of places that left
        self._members: set[int] = set()  # the places in line
        self._arrivals = itertools.count()
        self._turns: dict[int, asyncio.Event] = {}  # set when the sleeping place becomes first

    def __len__(self) -> int:
        return len(self._members)

    def __contains__(self, place: int) -> bool:
        return place in self._members

    def join(self) -> int:
        place = next(self._arrivals)
        self.rejoin(place)
        return place

    def rejoin(self, place: int) -> None:
        """Back in line at `place` (a place already in line stays as it is)."""
        if place in self._members:
            return
        self._members.add(place)
        heapq.heappush(self._heap, place)
        self._compact()
        self._wake_first()

    def leave(self, place: int) -> None:
        if place not in self._members:
            return
        self._members.discard(place)
        heap, members = self._heap, self._members
        while heap and heap[0] not in members:  # the first entry stays a place in line
            heapq.heappop(heap)
        self._compact()
        self._wake_first()

    def _compact(self) -> None:
        if len(self._heap) > 2 * len(self._members) + 64:  # mostly stale: start afresh
            self._heap = sorted(self._members)  # a sorted list is a heap

    def first(self, place: int) -> bool:
        return bool(self._heap) and self._heap[0] == place

    async def wait_turn(self, place: int, poll_s: float) -> None:
        """The first sleeps poll_s (workers free up without telling); the others until first."""
        if self.first(place):
            await asyncio.sleep(poll_s)
            return
        turn = self._turns[place] = asyncio.Event()
        try:
            # Bounded, so that a waiting flight still sees its deadline pass.
            await wait_for(turn.wait(), poll_s * 20)
        except asyncio.TimeoutError:
            pass
        finally:
            del self._turns[place]

    def _wake_first(self) -> None:
        if self._heap:
            turn = self._turns.get(self._heap[0])
            if turn is not None:
                turn.set()
