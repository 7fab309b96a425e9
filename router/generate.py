"""The generation endpoints: `POST /v1/completions` and `POST /v1/chat/completions`.

Owns a generation request's way through the router: the body read up to the size limit and
parsed (off the loop when large), validated (`common.api.requests`, the prompt's length by its
characters, structured-output features) and tokenized (on the tokenizer pool, or on the loop for a
completions prompt of token ids or a few hundred characters, where the hop costs more than the
work), the choices built, the job dispatched under admission control (`router.admission`: 429
beyond the waiting limit or while the relay is overloaded), and the answer: a streamed
`router.streaming.SSEResponse`, or the whole body once every choice is done (cancelled, 499, if
the client leaves first). Every error is an OpenAI error body (`error_response`).

`serve_generate` is the ASGI entry `router.app`'s guard calls for these two routes directly,
past FastAPI (its routing, middleware and dependency machinery cost more than the routing
decision itself); the FastAPI routes stay for the OpenAPI schema. The path is lean because at a
few hundred microseconds a request every piece counts: the body read straight off `receive`, no
task per request (a whole response is collected in the request's own task, the client's
departure looked for only once it has waited `DISCONNECT_POLL_S`), and a whole body encoded once
and sent as two ASGI messages (`WholeBody`, the bytes `JSONResponse` would send).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import time
from typing import TYPE_CHECKING, Any

from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from common.api.body import check_prompt_chars, parse_json_object
from common.api.choice import Choice
from common.api.prompts import EngineInput, choice_params, engine_inputs
from common.api.requests import CHAT_URL, GenerationRequest, RequestError, parse_request
from common.api.responses import chat_body, completion_body
from common.api.structured import check_structured_output
from common.api.tools import message_texts
from router.feed import collect
from router.job import Job
from router.streaming import SSEResponse, disconnected

if TYPE_CHECKING:
    from router.app import RouterState

log = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.5  # how often a non-streamed request checks that its client is still there
INLINE_TOKENIZE_CHARS = 256  # completions prompts up to this many chars tokenize on the loop


def error_response(e: RequestError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.code, headers=e.headers)


def too_large(state: RouterState) -> RequestError:
    return RequestError(f"the request body exceeds {state.max_body_bytes} bytes", code=413)


# As `JSONResponse` renders: the same bytes, without building an encoder per response.
_JSON = json.JSONEncoder(ensure_ascii=False, allow_nan=False, separators=(",", ":"))


class WholeBody(Response):
    """A whole (non-streamed) JSON answer: byte for byte `JSONResponse(content)`, its headers
    built without Starlette's header machinery."""

    def __init__(self, content: Any) -> None:
        self.status_code = 200
        self.background = None
        self.body = _JSON.encode(content).encode()
        self.raw_headers = [
            (b"content-length", b"%d" % len(self.body)),
            (b"content-type", b"application/json"),
        ]


async def serve_generate(
    state: RouterState, url: str, scope: Scope, receive: Receive, send: Send
) -> None:
    """One generation request as a plain ASGI app; errors as the app's exception handlers
    answer them (a RequestError's own body, anything else a logged 500). Tells the heap
    trimmer (`router.memory`) how many body bytes it read and sent."""
    counted = _Counted(receive, send)
    try:
        response = await generate(state, url, scope, counted.receive)
    except RequestError as e:
        response = error_response(e)
    except Exception as e:
        log.exception("internal error on %s", url)
        response = error_response(
            RequestError(f"internal error: {e}", code=500, type="internal_error")
        )
    try:
        if isinstance(response, WholeBody):
            counted.num_bytes += len(response.body)
            await response(scope, counted.receive, send)
        else:
            await response(scope, counted.receive, counted.send)
    finally:
        state.trimmer.request_done(counted.num_bytes, state.executor)


class _Counted:
    """`receive` and `send` counting the body bytes through them."""

    __slots__ = ("_receive", "_send", "num_bytes")

    def __init__(self, receive: Receive, send: Send) -> None:
        self._receive, self._send, self.num_bytes = receive, send, 0

    async def receive(self) -> dict:
        message = await self._receive()
        self.num_bytes += len(message.get("body", b""))
        return message

    async def send(self, message: dict) -> None:
        self.num_bytes += len(message.get("body", b""))
        await self._send(message)


def prompt_texts(gen: GenerationRequest) -> list[str]:
    """The request's text that tokenizing would read (token-id prompts need no tokenizing)."""
    if gen.endpoint == "chat":
        tools = [json.dumps(gen.tools.tools)] if gen.tools is not None else []
        return message_texts(gen.messages) + tools
    return [p for p in gen.prompts if isinstance(p, str)]


async def validated(
    state: RouterState, receive: Receive, url: str
) -> tuple[GenerationRequest, list[EngineInput]]:
    """The request read, validated and tokenized (off the loop): RequestError when it is bad."""
    body = await json_body(state, receive)
    gen = parse_request(url, body, state.served_model_names, state.tool_format())
    context_len = state.context_len()
    texts = prompt_texts(gen)
    check_prompt_chars(texts, context_len, "messages" if url == CHAT_URL else "prompt")
    if gen.params.structured_output is not None:  # compiles (cached): a 400 names what fails
        await state.offload(check_structured_output, gen.params.structured_output, state.tokenizer)
    if gen.endpoint != "chat" and sum(map(len, texts)) <= INLINE_TOKENIZE_CHARS:
        # Token ids or a short text: a hop to the pool costs more than the work.
        return gen, engine_inputs(gen, state.tokenizer, context_len)
    return gen, await state.offload(engine_inputs, gen, state.tokenizer, context_len)


async def json_body(state: RouterState, receive: Receive) -> dict:
    """The body as a validated JSON object, read off `receive` up to the size limit and parsed
    off the loop when large; 499 if the client leaves before it is whole."""
    chunks, size = [], 0
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            raise RequestError("the client closed the connection", code=499)
        chunk = message.get("body", b"")
        size += len(chunk)
        if size > state.max_body_bytes:  # no or a false Content-Length: stop reading here
            raise too_large(state)
        chunks.append(chunk)
        if not message.get("more_body", False):
            break
    raw = chunks[0] if len(chunks) == 1 else b"".join(chunks)
    if len(raw) < 65536:  # handing a small body to a thread costs more than parsing it
        return parse_json_object(raw)
    return await state.offload(parse_json_object, raw)


async def generate(state: RouterState, url: str, scope: Scope, receive: Receive) -> Response:
    """The answer to one generation request (a stream, or the whole body once every choice is
    done); RequestError when it fails before an answer starts."""
    timer = state.metrics.start_request()
    try:
        with state.admission.admit():  # waiting from here until every flight is dispatched
            gen, inputs = await validated(state, receive, url)
            chat = gen.endpoint == "chat"
            response_id = f"{'chatcmpl' if chat else 'cmpl'}-{os.urandom(16).hex()}"
            choices = [
                Choice(p * gen.n + k, inp.prompt_token_ids, params, gen, state.tokenizer)
                for p, inp in enumerate(inputs)
                for k, params in enumerate(choice_params(inp.params, gen.n))
            ]
            job = Job(
                state.dispatcher,
                response_id,
                [(c.prompt_token_ids, c.params) for c in choices],
                state.admission.relay,
            )
            try:
                await job.start()
            except BaseException:
                job.close()
                raise
    except RequestError as e:
        timer.failed(e.code)
        raise
    created = int(time.time())
    prompt_tokens = sum(len(inp.prompt_token_ids) for inp in inputs)
    timer.dispatched()
    if gen.stream:
        return SSEResponse(
            gen,
            response_id,
            created,
            job,
            choices,
            state.tokenizer,
            prompt_tokens,
            state.request_timeout_s,
            timer,
        )
    watch = ClientWatch(receive)
    try:
        await collect(job, choices, state.request_timeout_s, timer, watch.gone, DISCONNECT_POLL_S)
    except RequestError as e:
        timer.failed(e.code)
        raise
    finally:
        watch.close()
        job.close()
    completion_tokens = sum(len(c.token_ids) for c in choices)
    timer.finished(prompt_tokens, completion_tokens, [c.finish_reason or "" for c in choices])
    build = chat_body if chat else completion_body
    results = [c.result() for c in choices]
    return WholeBody(
        build(gen, results, state.tokenizer, prompt_tokens, request_id=response_id, created=created)
    )


class ClientWatch:
    """Whether the HTTP client has gone, asked while a whole response waits: the watch on
    `receive` (a task) starts only when first asked, so a request answered within the first
    poll never starts one."""

    def __init__(self, receive: Receive) -> None:
        self.receive = receive
        self.task: asyncio.Future[None] | None = None

    async def gone(self) -> bool:
        if self.task is None:
            self.task = asyncio.ensure_future(disconnected(self.receive))
            await asyncio.sleep(0)  # a client already gone is seen now, not a poll later
        return self.task.done()

    def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
