"""The bytes of a token stream on the wire: pre-encoded SSE chunks and writes without a wake-up.

Owns `ChunkTemplates`: a streamed request's text-only delta chunk (no logprobs, tool calls, echo
or finish reason: nearly every chunk of a stream) as the bytes before and after its JSON-encoded
text, cut once per choice from `common.api.responses.delta_chunk`'s own output, so a token's
chunk is two concatenations and one string encoding instead of a dict built and encoded, byte
for byte what `delta_chunk` makes. And `DirectWriter`: a streamed response's body chunks written
from any callback on the event loop (the control plane's, as a `TokenBatch` is read), without
waking the response's task and without the per-message path through the middleware and the
HTTP library (a third of a token's cost): framed as the server frames them, straight onto the
connection's transport, whenever the client's socket is not paused for back-pressure (uvicorn's
flow control). `expose_http_cycle` (the outermost ASGI layer, wrapped around the app by
`router.server`) puts uvicorn's per-request cycle into the scope, where `direct_writer` finds
the transport, the flow control and the framing; under any other server there is none and the
stream's task writes through `send` as usual. And `FlushQueue`: the streams whose chunks wait
to be written, all written by one loop callback once the callbacks running now are done, not
one callback per stream; the control plane runs it itself as each read of a batch of worker
messages ends (router.control), so those tokens do not wait for the loop's other callbacks.

Used by `router.streaming`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import weakref
from collections.abc import Callable
from typing import Any

from starlette.types import ASGIApp, Receive, Scope, Send

from common.api.choice import Choice, Delta
from common.api.requests import GenerationRequest
from common.api.responses import delta_chunk, sse
from common.api.tokenizer import Tokenizer

log = logging.getLogger(__name__)

HTTP_CYCLE = "pdserve.http_cycle"  # the scope key `expose_http_cycle` sets
_TEXT = "pdserve-text-3b9e1f"  # stands for the text in a template; JSON-encodes as itself
_JSON = json.JSONEncoder(ensure_ascii=False)  # as common.api.responses.sse encodes
# What `_JSON.encode` does with a str, without the method around it (a token's text, each token).
_encode_text = json.encoder.encode_basestring


class ChunkTemplates:
    """A streamed request's text-only delta chunks, pre-encoded per choice index."""

    def __init__(
        self, request: GenerationRequest, response_id: str, created: int, tokenizer: Tokenizer
    ) -> None:
        self.request = request
        self.response_id = response_id
        self.created = created
        self.tokenizer = tokenizer
        self._parts: dict[int, tuple[bytes, bytes]] = {}  # choice index -> before, after the text

    @staticmethod
    def applies(choice: Choice, delta: Delta) -> bool:
        """Whether the delta's chunk is text only (else `delta_chunk` must build it)."""
        return not (choice.want_logprobs or delta.finish_reason or delta.tool_calls or delta.echo)

    def text_chunk(self, choice: Choice, text: str) -> bytes:
        """The SSE event of a text-only delta of `choice` (only where `applies`)."""
        parts = self._parts.get(choice.index)
        if parts is None:
            parts = self._parts[choice.index] = self._cut(choice)
        return parts[0] + _encode_text(text).encode() + parts[1]

    def _cut(self, choice: Choice) -> tuple[bytes, bytes]:
        placeholder = Delta(_TEXT, len(choice.token_ids), None)
        chunk = delta_chunk(
            self.request, self.response_id, self.created, choice, placeholder, self.tokenizer
        )
        before, after = sse(chunk).split(_JSON.encode(_TEXT).encode())
        return before, after


def expose_http_cycle(app: ASGIApp) -> ASGIApp:
    """`app` with uvicorn's request cycle (the owner of the `send` it is given) in the scope."""

    async def exposed(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await app(scope, receive, send)
            return
        cycle = getattr(send, "__self__", None)
        if all(hasattr(cycle, name) for name in ("transport", "flow", "disconnected")):
            scope[HTTP_CYCLE] = cycle
        try:
            await app(scope, receive, send)
        finally:
            # The cycle holds the scope: left in it, the pair (with the connection's transport,
            # flow control and events) is a reference cycle that only the garbage collector's
            # full collections free, each request's, pausing the loop for all of them at once.
            scope.pop(HTTP_CYCLE, None)

    return exposed


class DirectWriter:
    """Writes a streamed response's body chunks at once, from any callback on the loop: framed
    as the server frames them (HTTP/1.1 chunked, or raw to an HTTP/1.0 client) straight onto
    the connection's transport, after the response start went through the server's `send`."""

    def __init__(self, cycle: Any, chunked: bool) -> None:
        self.cycle = cycle
        self.transport = cycle.transport
        self.chunked = chunked

    def ready(self) -> bool:
        """A write now goes out at once (the client's socket is not paused, nor gone)."""
        return not (
            self.cycle.flow.write_paused or self.cycle.disconnected or self.transport.is_closing()
        )

    def write(self, data: bytes) -> None:
        """Send `data` as a body chunk now; call only when `ready` (and never with b'')."""
        self.transport.write(b"%x\r\n%b\r\n" % (len(data), data) if self.chunked else data)


def direct_writer(scope: Scope) -> DirectWriter | None:
    """A `DirectWriter` for this response, or None when the server exposes no cycle."""
    cycle = scope.get(HTTP_CYCLE)
    if cycle is None:
        return None
    # uvicorn's httptools protocol says how it frames; h11 chunks for HTTP/1.1 peers.
    chunked = getattr(cycle, "chunked_encoding", None)
    if chunked is None:
        chunked = scope.get("http_version") == "1.1"
    return DirectWriter(cycle, bool(chunked))


class FlushQueue:
    """Flushes waiting for the loop's next turn, run together by one callback, in order."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.due: list[Callable[[], None]] = []

    def add(self, flush: Callable[[], None]) -> None:
        """Run `flush` once the callbacks running now are done (add it once per write due)."""
        due = self.due
        due.append(flush)
        if len(due) == 1:
            self.loop.call_soon(self.run)

    def run(self) -> None:
        due, self.due = self.due, []
        for flush in due:
            try:
                flush()
            except Exception:  # one stream's failure must not keep the others' bytes back
                log.exception("writing a stream's chunks failed")


_flush_queues: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, FlushQueue] = (
    weakref.WeakKeyDictionary()
)


def flush_queue(loop: asyncio.AbstractEventLoop | None = None) -> FlushQueue:
    """The `FlushQueue` of `loop` (default: the running loop)."""
    loop = loop or asyncio.get_running_loop()
    queue = _flush_queues.get(loop)
    if queue is None:
        queue = _flush_queues[loop] = FlushQueue(loop)
    return queue
