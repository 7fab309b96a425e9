"""The router side of generation: workers' token outputs in, a response's choices or SSE out.

Owns `choice_delta_batches` (and `choice_deltas`, one delta at a time), the loop that applies a
job's events (the decode workers' `TokenOutput`s, or a flight's failure) to its choices until all
are done, everything buffered at each wake-up at once, releasing each choice on the worker once it
is done (which aborts it there when a stop string cut it short), timing tokens into the request's
metrics, and turning failures and timeouts into `RequestError`s; and `sse_events`, the byte stream
a `StreamingResponse` sends (role chunks, delta chunks, the usage chunk, an error event, `[DONE]`;
one event per delta as always, the events of one wake-up written in one piece), closing the job at
the end. The choices are `common.api.choice.Choice`s and every body comes from
`common.api.responses`. Called by `router.app`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence
from typing import TypeVar

from common.api.choice import Choice, Delta
from common.api.requests import GenerationRequest, RequestError
from common.api.responses import (
    DONE,
    delta_chunk,
    error_event,
    role_chunk,
    sse,
    usage_chunk,
)
from common.api.tokenizer import Tokenizer
from router.dispatch import FlightFailed
from router.job import Job
from router.metrics import RequestTimer

T = TypeVar("T")


def _pair(choice: Choice, delta: Delta) -> tuple[Choice, Delta]:
    return choice, delta


async def choice_delta_batches(
    job: Job,
    choices: Sequence[Choice],
    timeout_s: float,
    timer: RequestTimer,
    render: Callable[[Choice, Delta], T] = _pair,
) -> AsyncIterator[list[T]]:
    """Apply the job's events until every choice is done, yielding `render(choice, delta)` of
    everything that arrived by each wake-up together; RequestError on failure or timeout.

    `render` runs right after its delta is applied (a chunk's logprobs are the choice's tokens
    from the delta's first on: later tokens of the same wake-up must not be there yet)."""
    clock = timer.metrics.clock
    deadline = clock() + timeout_s
    remaining = sum(not c.done for c in choices)
    while remaining:
        rendered = []
        for index, event in await job.next_events(deadline - clock()):
            if isinstance(event, FlightFailed):
                if rendered:  # what came before the failure is shown first, as it came
                    yield rendered
                raise RequestError(event.reason, code=event.code, type="service_unavailable")
            choice = choices[index]
            if choice.done:
                continue  # tokens a worker sent before it saw the abort of a stopped choice
            timer.tokens(index, len(event.token_ids))
            delta = choice.add(
                event.token_ids,
                event.logprobs,
                event.top_logprobs,
                finished=event.finished,
                finish_reason=event.finish_reason,
                prompt_logprobs=event.prompt_logprobs,
            )
            if choice.done:
                remaining -= 1
                job.finish(index)  # aborts it on the worker when a stop string cut it short
            rendered.append(render(choice, delta))
            if not remaining:
                break
        yield rendered


async def choice_deltas(
    job: Job, choices: Sequence[Choice], timeout_s: float, timer: RequestTimer
) -> AsyncIterator[tuple[Choice, Delta]]:
    """`choice_delta_batches`, one delta at a time."""
    async for deltas in choice_delta_batches(job, choices, timeout_s, timer):
        for item in deltas:
            yield item


async def sse_events(
    request: GenerationRequest,
    response_id: str,
    created: int,
    job: Job,
    choices: Sequence[Choice],
    tokenizer: Tokenizer,
    prompt_tokens: int,
    timeout_s: float,
    timer: RequestTimer,
) -> AsyncIterator[bytes]:
    """The SSE body of a streamed response; the job is closed (aborting what runs) at the end.

    A failure mid-stream becomes an error event; the stream then ends with [DONE] as usual.
    """
    try:
        if request.endpoint == "chat":
            for choice in choices:
                yield sse(role_chunk(request, response_id, created, choice.index))

        def event(choice: Choice, delta: Delta) -> bytes:
            new_tokens = len(choice.token_ids) > delta.first_token
            # A delta with no text still carries its tokens' logprobs when they were asked for
            # (and an echoed prompt's: an empty prompt text may still have tokens).
            shows_tokens = new_tokens or delta.echo
            if (
                delta.text
                or delta.finish_reason
                or delta.tool_calls
                or (choice.want_logprobs and shows_tokens)
            ):
                return sse(delta_chunk(request, response_id, created, choice, delta, tokenizer))
            return b""

        # One event per delta, as always; the events of one wake-up go out in one piece (one
        # send through the server, not one per token).
        async for events in choice_delta_batches(job, choices, timeout_s, timer, event):
            if any(events):
                yield b"".join(events)
        completion_tokens = sum(len(c.token_ids) for c in choices)
        timer.finished(prompt_tokens, completion_tokens, [c.finish_reason or "" for c in choices])
        if request.include_usage:
            yield sse(usage_chunk(request, response_id, created, prompt_tokens, completion_tokens))
    except RequestError as e:
        timer.failed(e.code)
        yield error_event(e)
    finally:
        job.close()  # also when the client went away: abort on the workers
    yield DONE
