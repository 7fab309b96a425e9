"""A streamed response: a job's events out as server-sent events, without a wake-up per token.

Owns `SSEResponse` (role chunks, delta chunks, the usage chunk, an error event, `[DONE]`; one
event per delta as always). A stream's events are applied (`router.feed.ChoiceFeed`) and its
chunks written as the events are put (`EventBuffer.on_put`, from the control plane's handling of
a `TokenBatch`), through a `router.sse.DirectWriter`: no task wakes up per token, and a text chunk
is a pre-encoded template (`router.sse.ChunkTemplates`). When the client's socket is paused
(back-pressure), or the server gives no direct writer, the response's task writes instead, each
wake-up's events in one piece, while the job's buffer holds what waits (bounded by
`router.relay`). The job is closed at the end, and when the client goes away. Every body comes
from `common.api.responses`. Called by `router.generate`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

from common.api.choice import Choice, Delta
from common.api.requests import GenerationRequest, RequestError
from common.api.responses import DONE, delta_chunk, error_event, role_chunk, sse, usage_chunk
from common.api.tokenizer import Tokenizer
from router.feed import ChoiceFeed
from router.flight import Event
from router.job import Job
from router.metrics import RequestTimer
from router.sse import ChunkTemplates, DirectWriter, FlushQueue, direct_writer, flush_queue


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
        self._flushes: FlushQueue | None = None  # the loop's, once the response runs

    def event(self, choice: Choice, delta: Delta) -> bytes:
        """The SSE event of one delta, or b'' when it shows nothing."""
        # ChunkTemplates.applies, inline: this runs once per token
        if not (choice.want_logprobs or delta.finish_reason or delta.tool_calls or delta.echo):
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
        gone = asyncio.ensure_future(disconnected(receive))
        try:
            await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
            if self.request.endpoint == "chat":
                head = b"".join(
                    sse(role_chunk(self.request, self.response_id, self.created, c.index))
                    for c in self.choices
                )
                await _body(send, head)
            self.writer = direct_writer(scope)
            self._flushes = flush_queue()
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
        is woken. The task is woken too when the stream ends here.

        The chunk goes out with the others of the messages read together with this one: every
        token they brought this stream in one write (`_flush`, from the loop's `FlushQueue`)."""
        writer = self.writer
        if (
            self.error is None
            and not self._busy
            and writer is not None
            and writer.ready()
            and self.feed.remaining
            and self.job.events.empty()
        ):
            self._busy = True
            try:
                data, error = self.feed.apply_one(event, self.event)
                if data:
                    self._out.append(data)
                    if not self._flush_due:
                        self._flush_due = True
                        assert self._flushes is not None
                        self._flushes.add(self._flush)
                if error is not None:
                    self.error = error
            except Exception as e:  # fails this stream, in its task; never the control plane
                self.error = e
            finally:
                self._busy = False
            if self.error is None and self.feed.remaining:
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
        out, writer = self._out, self.writer
        if out:
            if writer is not None and not self._busy and writer.ready():  # `_direct`, inline
                data = out[0] if len(out) == 1 else b"".join(out)
                out.clear()
                writer.write(data)
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


async def disconnected(receive: Receive) -> None:
    """Until the client goes away (the ASGI server's `http.disconnect`)."""
    while (await receive())["type"] != "http.disconnect":
        pass
