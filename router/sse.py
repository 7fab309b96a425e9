"""The bytes of a token stream on the wire: pre-encoded SSE chunks and writes without a wake-up.

Owns `ChunkTemplates`: a streamed request's text-only delta chunk (no logprobs, tool calls, echo
or finish reason: nearly every chunk of a stream) as the bytes before and after its JSON-encoded
text, cut once per choice from `common.api.responses.delta_chunk`'s own output, so a token's
chunk is two concatenations and one string encoding instead of a dict built and encoded, byte
for byte what `delta_chunk` makes. And `DirectWriter`: a streamed response's body chunks written
from any callback on the event loop (the control plane's, as a `TokenBatch` is read), without
waking the response's task: uvicorn's ASGI `send` completes without suspending unless the
client's socket is paused for back-pressure, and the writer only calls it when not paused.
`expose_http_cycle` (the outermost ASGI layer, wrapped around the app by `router.server`) puts
uvicorn's per-request cycle into the scope, where `direct_writer` finds what it needs; under any
other server there is none and the stream's task writes as usual.

Used by `router.streaming`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Coroutine
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from common.api.choice import Choice, Delta
from common.api.requests import GenerationRequest
from common.api.responses import delta_chunk, sse
from common.api.tokenizer import Tokenizer

HTTP_CYCLE = "pdserve.http_cycle"  # the scope key `expose_http_cycle` sets
_TEXT = "pdserve-text-3b9e1f"  # stands for the text in a template; JSON-encodes as itself
_JSON = json.JSONEncoder(ensure_ascii=False)  # as common.api.responses.sse encodes


class ChunkTemplates:
    """A streamed request's text-only delta chunks, pre-encoded per choice index."""

    def __init__(
        self, request: GenerationRequest, response_id: str, created: int, tokenizer: Tokenizer
    ) -> None:
        self.request = request
        self.response_id = response_id
        self.created = created
        self.tokenizer = tokenizer
        self._parts: dict[int, tuple[str, str]] = {}  # choice index -> (before, after) the text

    @staticmethod
    def applies(choice: Choice, delta: Delta) -> bool:
        """Whether the delta's chunk is text only (else `delta_chunk` must build it)."""
        return not (choice.want_logprobs or delta.finish_reason or delta.tool_calls or delta.echo)

    def text_chunk(self, choice: Choice, text: str) -> bytes:
        """The SSE event of a text-only delta of `choice` (only where `applies`)."""
        parts = self._parts.get(choice.index)
        if parts is None:
            parts = self._parts[choice.index] = self._cut(choice)
        return (parts[0] + _JSON.encode(text) + parts[1]).encode()

    def _cut(self, choice: Choice) -> tuple[str, str]:
        placeholder = Delta(_TEXT, len(choice.token_ids), None)
        chunk = delta_chunk(
            self.request, self.response_id, self.created, choice, placeholder, self.tokenizer
        )
        before, after = sse(chunk).decode().split(_JSON.encode(_TEXT))
        return before, after


def expose_http_cycle(app: ASGIApp) -> ASGIApp:
    """`app` with uvicorn's request cycle (the owner of the `send` it is given) in the scope."""

    async def exposed(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            cycle = getattr(send, "__self__", None)
            if cycle is not None and hasattr(cycle, "flow") and hasattr(cycle, "disconnected"):
                scope[HTTP_CYCLE] = cycle
        await app(scope, receive, send)

    return exposed


class DirectWriter:
    """Writes a streamed response's body chunks at once, from any callback on the loop."""

    def __init__(self, send: Send, cycle: Any) -> None:
        self.send = send  # the response's own send (through every middleware)
        self.cycle = cycle
        self._pending: asyncio.Task | None = None  # a write that had to wait after all

    def ready(self) -> bool:
        """A write now completes at once (the client's socket is not paused, nor gone)."""
        flow = self.cycle.flow
        return not (
            flow.write_paused
            or self.cycle.disconnected
            or (self._pending is not None and not self._pending.done())
        )

    def write(self, data: bytes) -> None:
        """Send `data` as a body chunk now; call only when `ready`."""
        coro = self.send({"type": "http.response.body", "body": data, "more_body": True})
        try:
            waiting_for = coro.send(None)
        except StopIteration:
            return
        # A server that suspended after all: a task finishes the write, later writes wait for it.
        self._pending = asyncio.ensure_future(_finish(coro, waiting_for))

    async def flush(self) -> None:
        """Until a write that had to wait is done."""
        if self._pending is not None:
            await self._pending


async def _finish(coro: Coroutine[Any, Any, None], waiting_for: Any) -> None:
    """Drive a coroutine that suspended on `waiting_for` (a future) to its end, as a task would."""
    while True:
        try:
            await waiting_for
        except asyncio.CancelledError:
            coro.close()
            raise
        except BaseException:
            pass  # the coroutine sees the future's exception when it resumes
        try:
            waiting_for = coro.send(None)
        except StopIteration:
            return


def direct_writer(scope: Scope, send: Send) -> DirectWriter | None:
    """A `DirectWriter` for this response, or None when the server exposes no cycle."""
    cycle = scope.get(HTTP_CYCLE)
    return DirectWriter(send, cycle) if cycle is not None else None
