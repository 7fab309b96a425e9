"""The router side of generation: workers' token outputs in, a response's choices or SSE out.

Owns `ChoiceFeed`, which applies a job's events (the decode workers' `TokenOutput`s, or a
flight's failure) to its choices: timing tokens into the request's metrics, releasing each choice
on the worker once it is done (which aborts it there when a stop string cut it short), and
turning a failure into a `RequestError`; `choice_delta_batches` / `choice_deltas`, the loop over
it for a whole (non-streamed) response, everything buffered at each wake-up at once; and
`SSEResponse`, a streamed response (role chunks, delta chunks, the usage chunk, an error event,
`[DONE]`; one event per delta as always). A stream's events are applied and its chunks written
as the events are put (`EventBuffer.on_put`, from the control plane's handling of a
`TokenBatch`), through a `router.sse.DirectWriter`: no task wakes up per token, and a text chunk
is a pre-encoded template (`router.sse.ChunkTemplates`). When the client's socket is paused
(back-pressure), or the server gives no direct writer, the response's task writes instead, each
wake-up's events in one piece, while the job's buffer holds what waits (bounded by
`router.relay`). The job is closed at the end, and when the client goes away. The choices are
`common.api.choice.Choice`s and every body comes from `common.api.responses`. Called by
`router.app`.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable, Sequence
from typing import TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from common.api.choice import Choice, Delta
from common.api.requests import GenerationRequest, RequestError
from common.api.responses import DONE, delta_chunk, error_event, role_chunk, sse, usage_chunk
from common.api.tokenizer import Tokenizer
from router.flight import Event, FlightFailed
from router.job import Job
from router.metrics import RequestTimer
from router.sse import ChunkTemplates, DirectWriter, direct_writer

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
        if isinstance(out, FlightFailed):
            return None, RequestError(out.reason, code=out.code, type="service_unavailable")
        choice = self.choices[index]
        if choice.done:
            return None, None  # tokens a worker sent before it saw the abort of a stopped choice
        self.timer.tokens(index, len(out.token_ids))
        delta = choice.add(
            out.token_ids,
            out.logprobs,
            out.top_logprobs,
            finished=out.finished,
            finish_reason=out.finish_reason,
            prompt_logprobs=out.prompt_logprobs,
        )
        if choice.done:
            self.remaining -= 1
            self.job.finish(index)  # aborts it on the worker when a stop string cut it short
        return render(choice, delta), None


async def choice_delta_batches(
    job: Job,
    choices: Sequence[Choice],
    timeout_s: float,
    timer: RequestTimer,
    render: Callable[[Choice, Delta], T] = _pair,
) -> AsyncIterator[list[T]]:
    """Apply the job's events until every choice is done, yielding `render(choice, delta)` of
    everything that arrived by each wake-up together; RequestError on failure or timeout."""
    clock = timer.metrics.clock
    deadline = clock() + timeout_s
    feed = ChoiceFeed(job, choices, timer)
    while not feed.done:
        rendered, error = feed.apply(await job.next_events(deadline - clock()), render)
        if error is not None:
            if rendered:
                yield rendered
            raise error
        yield rendered


async def choice_deltas(
    job: Job, choices: Sequence[Choice], timeout_s: float, timer: RequestTimer
) -> AsyncIterator[tuple[Choice, Delta]]:
    """`choice_delta_batches`, one delta at a time."""
    async for deltas in choice_delta_batches(job, choices, timeout_s, timer):
        for item in deltas:
            yield item


class _ClientGone(Exception):
    pass


class SSEResponse(Response):
    """A streamed response's SSE body; the job is closed (aborting what runs) at the end.

    A failure mid-stream becomes an error event; the stream then ends with [DONE] as usual.
    """

    media_type = "text/event-stream"

    def __init__(
        self,
        request: GenerationRequest,
        response_id: str,
        created: int,
        job: Job,
        choices: Sequence[Choice],
        tokenizer: Tokenizer,
        prompt_tokens: int,
        timeout_s: float,
        timer: RequestTimer,
    ) -> None:
        self.status_code = 200
        self.background = None
        self.init_headers(None)
        self.request, self.response_id, self.created = request, response_id, created
        self.job, self.choices, self.tokenizer = job, choices, tokenizer
        self.prompt_tokens, self.timeout_s, self.timer = prompt_tokens, timeout_s, timer
        self.feed = ChoiceFeed(job, choices, timer)
        self.templates = ChunkTemplates(request, response_id, created, tokenizer)
        self.writer: DirectWriter | None = None
        self.error: BaseException | None = None  # what ended the relay from `_on_put`
        self._wake: asyncio.Future[None] | None = None
        self._busy = False  # the task is sending, or `_on_put` is running: no direct writes
        self._out: list[bytes] = []  # chunks applied, for `_flush` to write together
        self._flush_due = False

    def event(self, choice: Choice, delta: Delta) -> bytes:
        """The SSE event of one delta, or b'' when it shows nothing."""
        if ChunkTemplates.applies(choice, delta):
            return self.templates.text_chunk(choice, delta.text) if delta.text else b""
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
            request, tokenizer = self.request, self.tokenizer
            return sse(
                delta_chunk(request, self.response_id, self.created, choice, delta, tokenizer)
            )
        return b""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        job, timer = self.job, self.timer
        gone = asyncio.ensure_future(_disconnect(receive))
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            if self.request.endpoint == "chat":
                head = b"".join(
                    sse(role_chunk(self.request, self.response_id, self.created, c.index))
                    for c in self.choices
                )
                await _body(send, head)
            self.writer = direct_writer(scope)
            job.events.on_put = self._on_put
            await self._relay(send, gone)
            await _body(send, self._take_out())
            completion_tokens = sum(len(c.token_ids) for c in self.choices)
            reasons = [c.finish_reason or "" for c in self.choices]
            timer.finished(self.prompt_tokens, completion_tokens, reasons)
            if self.request.include_usage:
                usage = usage_chunk(
                    self.request, self.response_id, self.created, self.prompt_tokens,
                    completion_tokens,
                )  # fmt: skip
                await _body(send, sse(usage))
        except RequestError as e:
            timer.failed(e.code)
            await _body(send, self._take_out() + error_event(e))
        except _ClientGone:
            return
        finally:
            gone.cancel()
            job.events.on_put = None
            job.close()  # also when the client went away: abort on the workers
        await send({"type": "http.response.body", "body": DONE, "more_body": False})

    async def _relay(self, send: Send, gone: asyncio.Future[None]) -> None:
        """Until every choice is done: `_on_put` writes, this task writes only what it cannot."""
        clock = self.timer.metrics.clock
        deadline = clock() + self.timeout_s
        while True:
            if self.error is not None:
                raise self.error
            if self.feed.done:
                return
            if self.job.events.empty() and not self._out:
                await self._wait(gone, deadline - clock())
            elif self._direct():
                self._drain()
            else:  # the socket is paused (or no direct writer): write here, waiting for it
                rendered, error = self.feed.apply(self.job.events.take_all(), self.event)
                self._busy = True
                try:
                    await _body(send, self._take_out() + b"".join(rendered))
                finally:
                    self._busy = False
                if error is not None:
                    raise error

    async def _wait(self, gone: asyncio.Future[None], timeout_s: float) -> None:
        """Until `_on_put` wakes the task; _ClientGone, or RequestError(504) after `timeout_s`."""
        wake = self._wake = asyncio.get_running_loop().create_future()
        try:
            done, _ = await asyncio.wait(
                (wake, gone), timeout=max(timeout_s, 0.0), return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            self._wake = None
        if gone in done:
            raise _ClientGone
        if not done:
            raise RequestError("the request timed out", code=504, type="timeout")

    def _direct(self) -> bool:
        return self.writer is not None and not self._busy and self.writer.ready()

    def _on_put(self, event: Event) -> bool:
        """An event for this stream: applied and its chunk written now (True) when nothing waits
        before it and the socket takes it; else left to be buffered (False) for the task, which
        is woken. The task is woken too when the stream ends here."""
        if self.error is None and not self.feed.done and self.job.events.empty() and self._direct():
            assert self.writer is not None
            self._busy = True
            try:
                data, error = self.feed.apply_one(event, self.event)
                if data:
                    self._out.append(data)
                    if not self._flush_due:  # once the messages read with this one are applied
                        self._flush_due = True
                        asyncio.get_running_loop().call_soon(self._flush)
                if error is not None:
                    self.error = error
            except Exception as e:  # fails this stream, in its task; never the control plane
                self.error = e
            finally:
                self._busy = False
            if self.error is None and not self.feed.done:
                return True
            self._wake_task()
            return True
        self._wake_task()
        return False

    def _drain(self) -> None:
        """Apply and write what the buffer holds, while the socket takes it."""
        assert self.writer is not None
        self._busy = True
        try:
            data = self._take_out()
            while not self.job.events.empty() and not self.feed.done and self.error is None:
                rendered, error = self.feed.apply(self.job.events.take_all(), self.event)
                data += b"".join(rendered)
                if error is not None:
                    self.error = error
            if data:
                self.writer.write(data)
        except Exception as e:
            self.error = e
        finally:
            self._busy = False

    def _flush(self) -> None:
        """Write the chunks applied since the last flush, in one piece: every token the messages
        read together brought this stream (one socket write per stream and wake-up, not per
        token, when the router runs behind)."""
        self._flush_due = False
        if self._out:
            if self._direct():
                assert self.writer is not None
                self.writer.write(self._take_out())
            else:
                self._wake_task()  # it writes them, waiting for the socket

    def _take_out(self) -> bytes:
        data = b"".join(self._out)
        self._out.clear()
        return data

    def _wake_task(self) -> None:
        wake = self._wake
        if wake is not None and not wake.done():
            wake.set_result(None)


async def _body(send: Send, data: bytes) -> None:
    if data:
        await send({"type": "http.response.body", "body": data, "more_body": True})


async def _disconnect(receive: Receive) -> None:
    """Until the client goes away."""
    while (await receive())["type"] != "http.disconnect":
        pass
