"""common/aio.py's `wait_for`: the result, the timeout (the awaitable then cancelled), and a cancel
that lands as the result arrives always propagating, for the three kinds of wait the router uses
(a Reserve reply future, a queue of token events, the admission line's turn event)."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import pytest

from common.aio import wait_for
from tests.common.cancellation import cancels_checked


def test_the_result_and_the_timeout() -> None:
    async def run() -> None:
        loop = asyncio.get_running_loop()
        future = loop.create_future()
        loop.call_later(0.01, future.set_result, "reply")
        assert await wait_for(future, 5.0) == "reply"
        late = loop.create_future()
        with pytest.raises(asyncio.TimeoutError):
            await wait_for(late, 0.01)
        assert late.cancelled()  # as asyncio.wait_for: given up, then cancelled
        queue: asyncio.Queue[int] = asyncio.Queue()
        with pytest.raises(asyncio.TimeoutError):
            await wait_for(queue.get(), 0.0)
        await asyncio.sleep(0)
        queue.put_nowait(7)
        assert queue.get_nowait() == 7  # the cancelled get took nothing

    asyncio.run(run())


def _future() -> tuple[Awaitable[str], Callable[[], None]]:
    future = asyncio.get_running_loop().create_future()
    return future, lambda: future.set_result("reply")


def _queue() -> tuple[Awaitable[str], Callable[[], None]]:
    queue: asyncio.Queue[str] = asyncio.Queue()
    return queue.get(), lambda: queue.put_nowait("token")


def _event() -> tuple[Awaitable[bool], Callable[[], None]]:
    event = asyncio.Event()
    return event.wait(), event.set


@pytest.mark.parametrize(
    "make, turns",  # a future wakes its waiter in 2 turns, a queue or event (a task) in 3
    [
        (_future, 0),
        (_future, 1),
        (_queue, 0),
        (_queue, 1),
        (_queue, 2),
        (_event, 0),
        (_event, 1),
        (_event, 2),
    ],
)
def test_a_cancel_as_the_result_arrives_propagates(make, turns: int) -> None:
    """The result lands, the loop runs `turns` times, then the waiter is cancelled before it
    resumes: CancelledError (asyncio.wait_for up to 3.11 returned the result instead)."""

    async def start() -> tuple[asyncio.Future, Callable[[], None]]:
        awaitable, deliver = make()
        return asyncio.ensure_future(wait_for(awaitable, 60.0)), deliver

    assert asyncio.run(cancels_checked(start, turns)) > 0
