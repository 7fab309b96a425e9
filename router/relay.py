"""The token relay's buffers: each job's events waiting for its reader, and the router-wide bound.

Owns `EventBuffer`, where the dispatcher puts a job's events (the decode workers' `TokenOutput`s,
a flight's failure) and its reader (`router.streaming`) takes everything there at once: a batch of
tokens from one `TokenBatch` wakes the reader once, not once per token; or, when the reader set
`on_put`, each event is offered to it first and one it takes at once is never buffered (a stream
that writes its chunks from there). And `RelayBudget`, the
bound on what all buffers hold together: a reader that cannot keep up (a slow HTTP client, or a
router short of CPU) makes its buffer grow, so

- one job may hold at most `max_request_tokens` tokens: past that its buffer is emptied and the
  job is told (`on_overflow`: `router.job.Job` aborts its flights and fails the request);
- past `max_tokens` in all buffers together the budget is `overloaded` and `router.admission`
  answers new requests with a 429 until the buffers drain to half of it.

Tokens are counted per event (an event with no tokens, e.g. a failure, counts one). Used by
`router.job` (one buffer per job), `router.dispatch` (puts) and `router.admission` (the gate).
Single-threaded, on the router's event loop.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable
from typing import Any

MAX_BUFFERED_TOKENS = 1_000_000  # all jobs together (~300 MB of TokenOutputs at most)
MAX_REQUEST_BUFFERED_TOKENS = 16_384  # one job: minutes of a slow reader at a GPU's pace


class RelayBudget:
    """Tokens buffered across all jobs; `overloaded` from `max_tokens` until half drained."""

    def __init__(
        self,
        max_tokens: int = MAX_BUFFERED_TOKENS,
        max_request_tokens: int = MAX_REQUEST_BUFFERED_TOKENS,
    ) -> None:
        if max_tokens < 1 or max_request_tokens < 1:
            raise ValueError("buffered token limits must be >= 1")
        self.max_tokens = max_tokens
        self.max_request_tokens = max_request_tokens
        self.num_tokens = 0  # buffered now, all jobs
        self.overloaded = False
        self.num_overflows = 0  # requests failed because their reader fell too far behind

    def add(self, n: int) -> None:
        self.num_tokens += n
        if self.num_tokens >= self.max_tokens:
            self.overloaded = True

    def remove(self, n: int) -> None:
        self.num_tokens -= n
        if self.overloaded and self.num_tokens <= self.max_tokens // 2:
            self.overloaded = False


def num_tokens(event: tuple[int, Any]) -> int:
    return len(getattr(event[1], "token_ids", ())) or 1


class EventBuffer:
    """One job's events in arrival order; `take_all` hands out everything buffered."""

    def __init__(
        self,
        budget: RelayBudget | None = None,
        on_overflow: Callable[[], None] | None = None,
    ) -> None:
        self.budget = budget if budget is not None else RelayBudget()
        self.on_overflow = on_overflow
        self._events: deque[tuple[int, Any]] = deque()
        self.num_tokens = 0
        self.overflowed = False
        self._waiter: asyncio.Future[None] | None = None
        # The reader's: offered each event first; True when it took it at once (never buffered).
        self.on_put: Callable[[tuple[int, Any]], bool] | None = None

    def __len__(self) -> int:
        return len(self._events)

    def empty(self) -> bool:
        return not self._events

    def put_nowait(self, event: tuple[int, Any]) -> None:
        on_put = self.on_put
        if on_put is not None and on_put(event):
            return
        n = num_tokens(event)
        self._events.append(event)
        self.num_tokens += n
        self.budget.add(n)
        if self.num_tokens > self.budget.max_request_tokens and not self.overflowed:
            self.overflowed = True
            self.budget.num_overflows += 1
            self.clear()  # what the reader never read is dropped: its memory comes back now
            if self.on_overflow is not None:
                self.on_overflow()  # puts the failure: that put calls or wakes the reader
                return
        if on_put is not None:
            return  # it woke its reader itself
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    def get_nowait(self) -> tuple[int, Any]:
        event = self._events.popleft()
        n = num_tokens(event)
        self.num_tokens -= n
        self.budget.remove(n)
        return event

    def take_all(self) -> list[tuple[int, Any]]:
        events = list(self._events)
        self._events.clear()
        self.budget.remove(self.num_tokens)
        self.num_tokens = 0
        return events

    def clear(self) -> None:
        self.take_all()

    async def wait(self, timeout_s: float) -> None:
        """Until an event is buffered; TimeoutError after `timeout_s`. A plain future, not a task
        per wait: a stream waits once per decode step. A cancel is never lost (asyncio delivers
        it at the task's next step even when the event arrived first)."""
        if self._events:
            return
        loop = asyncio.get_running_loop()
        waiter = self._waiter = loop.create_future()
        timer = loop.call_later(max(timeout_s, 0.0), _expire, waiter)
        try:
            await waiter
        finally:
            timer.cancel()
            self._waiter = None


def _expire(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_exception(asyncio.TimeoutError())
