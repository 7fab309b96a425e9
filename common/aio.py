"""asyncio waits whose cancellation is never lost, for the router's request paths.

Up to Python 3.11 `asyncio.wait_for` returns the inner result instead of raising CancelledError
when its caller is cancelled just as that result arrives (fixed in 3.12). In the router that
meant a request whose client had left kept running: a collector kept reading tokens, a flight
kept its place in the admission line or went on to prefill after a Reserve reply. `wait_for` here
has asyncio.wait_for's contract otherwise (the result, or TimeoutError after which the awaitable
is cancelled), and a cancel always propagates, dropping a result that arrived at the same moment.
Used by router.job, router.dispatch and router.admission.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def wait_for(awaitable: Awaitable[T], timeout_s: float) -> T:
    """`awaitable`'s result; TimeoutError if it takes over `timeout_s` (it is then cancelled).

    Cancelled while waiting, the awaitable is cancelled too (a no-op once done) and
    CancelledError propagates.
    """
    task = asyncio.ensure_future(awaitable)
    try:
        done, _ = await asyncio.wait({task}, timeout=max(timeout_s, 0.0))
    finally:
        task.cancel()  # a no-op once it is done
    if not done:
        raise asyncio.TimeoutError
    return task.result()
