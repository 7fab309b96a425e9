"""`Job`: the flights of one HTTP request (prompts x n choices) around one event buffer.

Starts them all through the `Dispatcher` (cancelling the rest if one fails to start), hands out
their events in arrival order with a timeout (`next_events`: everything buffered at once, so a
reader wakes once per batch of tokens), and releases them when a choice finishes or the request
ends. Its buffer (`router.relay.EventBuffer`) is bounded: a reader that falls too far behind gets
its flights aborted and the request failed. Used by `router.app` and `router.streaming`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from common.api.requests import RequestError
from common.sampling_params import SamplingParams
from router.dispatch import Dispatcher, Event, Flight, FlightFailed
from router.relay import EventBuffer, RelayBudget


class Job:
    """The flights of one HTTP request (prompts x n choices), all reporting to one queue."""

    def __init__(
        self,
        dispatcher: Dispatcher,
        request_id: str,
        inputs: Sequence[tuple[list[int], SamplingParams]],
        budget: RelayBudget | None = None,
    ) -> None:
        self.dispatcher = dispatcher
        self.events = EventBuffer(budget, self._overflow)
        self.flights = [
            Flight(f"{request_id}-{i}", i, ids, params, self.events)
            for i, (ids, params) in enumerate(inputs)
        ]

    async def start(self) -> None:
        """Dispatch every flight; on any failure the others are cancelled and it re-raises."""
        if len(self.flights) == 1:  # nothing to run beside it: no task
            await self.dispatcher.dispatch(self.flights[0])
            return
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

        A request whose client left (router.app cancels its collector) stops even when an event
        lands as it is cancelled (`EventBuffer.wait`).
        """
        await self._wait(timeout_s)
        return self.events.get_nowait()

    async def next_events(self, timeout_s: float) -> list[Event]:
        """Every event buffered now, in arrival order (waiting for the first as `next_event`)."""
        await self._wait(timeout_s)
        return self.events.take_all()

    async def _wait(self, timeout_s: float) -> None:
        try:
            await self.events.wait(timeout_s)
        except asyncio.TimeoutError:
            raise RequestError("the request timed out", code=504, type="timeout") from None

    def _overflow(self) -> None:
        """The reader fell `max_request_tokens` behind (a client not reading its stream): stop
        generating and fail the request, instead of buffering without bound."""
        for flight in self.flights:
            self.dispatcher.release(flight)
        limit = self.events.budget.max_request_tokens
        reason = f"the client read too slowly: over {limit} tokens waited for it; aborted"
        self.events.put_nowait((0, FlightFailed(reason, 503)))

    def finish(self, index: int) -> None:
        """Choice `index` needs nothing more (done, or cut by a stop string)."""
        self.dispatcher.release(self.flights[index])

    def close(self) -> None:
        """Abort whatever still runs (client gone, error, timeout) and forget every flight."""
        for flight in self.flights:
            self.dispatcher.release(flight)
        self.events.clear()  # unread tokens no longer count against the router's budget
        # the buffer's way back to this job (a bound method): a reference cycle that only the
        # garbage collector's full collections would free, with the flights hanging off it
        self.events.on_overflow = None
