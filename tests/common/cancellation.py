"""A check shared by tests/common/test_aio.py and tests/router/test_job.py: a waiter cancelled
just as its result lands must raise CancelledError (asyncio.wait_for up to 3.11 returned the
result instead)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest


async def cancels_checked(
    start: Callable[[], Awaitable[tuple[asyncio.Future, Callable[[], None]]]], turns: int
) -> int:
    """20 times: `start()` a waiter (and how to deliver its result), let it wait, deliver, run
    the loop `turns` times, cancel it: it must raise CancelledError. How many were cancelled
    before they returned (the rest had returned already: nothing to check)."""
    checked = 0
    for _ in range(20):
        waiter, deliver = await start()
        await asyncio.sleep(0)  # now waiting
        deliver()
        for _ in range(turns):
            await asyncio.sleep(0)
        if waiter.done():
            continue
        waiter.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiter
        checked += 1
    return checked
