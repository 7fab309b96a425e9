"""A job's events applied to its choices: the router side of generation, before any HTTP.

Owns `ChoiceFeed`, which applies a job's events (the decode workers' `TokenOutput`s, or a
flight's failure) to its choices: timing tokens into the request's metrics, releasing each choice
on the worker once it is done (which aborts it there when a stop string cut it short), and
turning a failure into a `RequestError`; and `collect`, the loop over it for a whole
(non-streamed) response, everything buffered at each wake-up at once. The
choices are `common.api.choice.Choice`s. Used by `router.generate` (whole responses) and
`router.streaming` (streamed ones).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from common.api.choice import Choice, Delta
from common.api.requests import RequestError
from router.flight import Event, FlightFailed
from router.job import Job
from router.metrics import RequestTimer

T = TypeVar("T")


def _pair(choice: Choice, delta: Delta) -> tuple[Choice, Delta]:
    return choice, delta


class ChoiceFeed:
    """A job's events applied to its choices, until every choice is done."""

    def __init__(self, job: Job, choices: Sequence[Choice], timer: RequestTimer) -> None:
        self.job = job
        self.choices = choices
        self.timer = timer
        self.remaining = sum(not c.done for c in choices)

    @property
    def done(self) -> bool:
        return not self.remaining

    def apply(
        self, events: list[Event], render: Callable[[Choice, Delta], T]
    ) -> tuple[list[T], RequestError | None]:
        """`render(choice, delta)` of each event's delta, and the failure that ended them if one
        did. `render` runs right after its delta is applied (a chunk's logprobs are the choice's
        tokens from the delta's first on: later tokens must not be there yet)."""
        rendered = []
        for event in events:
            if self.done:
                break
            shown, error = self.apply_one(event, render)
            if error is not None:  # what came before it is shown first, as it came
                return rendered, error
            if shown is not None:
                rendered.append(shown)
        return rendered, None

    def apply_one(
        self, event: Event, render: Callable[[Choice, Delta], T]
    ) -> tuple[T | None, RequestError | None]:
        """`render(choice, delta)` of one event (None for tokens of a choice already done), or
        the failure it reports."""
        index, out = event
        if type(out) is FlightFailed:
            return None, RequestError(out.reason, code=out.code, type="service_unavailable")
        choice = self.choices[index]
        if choice.finish_reason is not None:  # done
            return None, None  # tokens a worker sent before it saw the abort of a stopped choice
        token_ids = out.token_ids
        self.timer.tokens(index, len(token_ids))
        delta = choice.add(
            token_ids, out.logprobs, out.top_logprobs, out.finished, out.finish_reason,
            out.prompt_logprobs,
        )  # fmt: skip
        if choice.finish_reason is not None:
            self.remaining -= 1
            self.job.finish(index)  # aborts it on the worker when a stop string cut it short
        return render(choice, delta), None


async def collect(
    job: Job,
    choices: Sequence[Choice],
    timeout_s: float,
    timer: RequestTimer,
    gone: Callable[[], Awaitable[bool]],
    poll_s: float,
) -> None:
    """Apply the job's events until every choice is done, everything buffered at each wake-up
    at once, in the caller's task; RequestError on failure, after `timeout_s` (504), or when
    `gone()`, asked every `poll_s` (tokens arriving or not), says the client left (499)."""
    clock = timer.metrics.clock
    deadline = clock() + timeout_s
    look_at = clock() + poll_s  # when to ask `gone` next
    feed = ChoiceFeed(job, choices, timer)
    events = job.events
    while not feed.done:
        now = clock()
        if now >= deadline:
            raise RequestError("the request timed out", code=504, type="timeout")
        if now >= look_at:
            if await gone():
                raise RequestError("the client closed the connection", code=499)
            look_at = now + poll_s
        try:
            await events.wait(min(deadline, look_at) - now)
        except asyncio.TimeoutError:
            continue
        _, error = feed.apply(events.take_all(), _pair)
        if error is not None:
            raise error
