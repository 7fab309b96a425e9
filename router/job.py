"""`Job`: the flights of one HTTP request (prompts x n choices) around one event queue.

Starts them all through the `Dispatcher` (cancelling the rest if one fails to start), hands out
their events in arrival order with a timeout, and releases them when a choice finishes or the
request ends. Used by `router.app` and `router.streaming`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from common.aio import wait_for
from common.api.requests import RequestError
from common.sampling_params import SamplingParams
from router.dispatch import Dispatcher, Event, Flight


class Job:
    """The flights of one HTTP request (prompts x n choices), all reporting to one queue."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        request_id: str,
        inputs: Sequence[tuple[list[int], SamplingParams]],
    ) -> None:
        self.dispatcher = dispatcher
        self.events: asyncio.Queue[Event] = asyncio.Queue()
        self.flights = [
            Flight(f"{request_id}-{i}", i, ids, params, self.events)
            for i, (ids, params) in enumerate(inputs)
        ]

    async def start(self) -> None:
        """Dispatch every flight; on any failure the others are cancelled and it re-raises."""
        tasks = [asyncio.ensure_future(self.dispatcher.dispatch(f)) for f in self.flights]
        try:
            await asyncio.gather(*tasks)
        except BaseException:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            raise

    async def next_event(self, timeout_s: float) -> Event:
        """The next event of any flight; RequestError(504) if none comes within timeout_s.

        `common.aio.wait_for`, not asyncio's: a request whose client left (router.app cancels its
        collector) must stop even when an event lands as it is cancelled.
        """
        if not self.events.empty():
            return self.events.get_nowait()
        try:
            return await wait_for(self.events.get(), timeout_s)
        except asyncio.TimeoutError:
            raise RequestError("the request timed out", code=504, type="timeout") from None

    def finish(self, index: int) -> None:
        """Choice `index` needs nothing more (done, or cut by a stop string)."""
        self.dispatcher.release(self.flights[index])

    def close(self) -> None:
        """Abort whatever still runs (client gone, error, timeout) and forget every flight."""
        for flight in self.flights:
            self.dispatcher.release(flight)
