"""router/job.py's `Job.next_event`: events in order, the timeout, and cancellation that is never
lost to an event arriving at the same moment (router.app cancels a non-streamed request's
collector when its client leaves; a swallowed cancel let the request run to its end)."""

from __future__ import annotations

import asyncio

import pytest

from common.api.requests import RequestError
from router.job import Job
from tests.common.cancellation import cancels_checked


def _job() -> Job:
    return Job(None, "req", [])  # no flights: only the event queue is used here


def test_events_come_in_order_then_the_timeout() -> None:
    async def run() -> None:
        job = _job()
        job.events.put_nowait((0, "a"))
        job.events.put_nowait((1, "b"))
        assert await job.next_event(1.0) == (0, "a")
        assert await job.next_event(1.0) == (1, "b")
        waiter = asyncio.ensure_future(job.next_event(5.0))
        await asyncio.sleep(0)
        job.events.put_nowait((0, "c"))  # arrives while it waits
        assert await waiter == (0, "c")
        with pytest.raises(RequestError) as e:
            await job.next_event(0.01)
        assert e.value.code == 504

    asyncio.run(run())


@pytest.mark.parametrize("turns", [0, 1, 2])
def test_cancel_as_an_event_arrives_is_not_swallowed(turns: int) -> None:
    """The event lands, the loop runs `turns` times, then the waiter is cancelled before it
    resumes: it must raise CancelledError (asyncio.wait_for up to 3.11 returned the event)."""

    async def start():
        job = _job()
        return asyncio.ensure_future(job.next_event(60.0)), lambda: job.events.put_nowait((0, "t"))

    checked = asyncio.run(cancels_checked(start, turns))
    # The buffer's waiter is a plain future: one loop turn after the event it has returned, so
    # only turns=0 leaves a waiter to cancel (any later one that did not return was checked).
    assert checked > 0 or turns > 0
