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
past FastAPI's routing and dependency machinery (which cost more than the routing decision
itself); the FastAPI routes stay for the OpenAPI schema and for any other server path.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.types import Receive, Scope, Send

from common.api.body import check_prompt_chars, parse_json_object
from common.api.choice import Choice
from common.api.prompts import EngineInput, choice_params, engine_inputs
from common.api.requests import CHAT_URL, GenerationRequest, RequestError, parse_request
from common.api.responses import chat_body, completion_body
from common.api.structured import check_structured_output
from common.api.tools import message_texts
from router.feed import choice_deltas
from router.job import Job
from router.streaming import SSEResponse

if TYPE_CHECKING:
    from router.app import RouterState

log = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.5  # how often a non-streamed request checks that its client is still there
INLINE_TOKENIZE_CHARS = 256  # completions prompts up to this many chars tokenize on the loop


def error_response(e: RequestError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.code, headers=e.headers)


def too_large(state: RouterState) -> RequestError:
    return RequestError(f"the request body exceeds {state.max_body_bytes} bytes", code=413)


async def serve_generate(
    state: RouterState, url: str, scope: Scope, receive: Receive, send: Send
) -> None:
    """One generation request as a plain ASGI app; errors as the app's exception handlers
    answer them (a RequestError's own body, anything else a logged 500)."""
    request = Request(scope, receive)
    try:
        response = await generate(state, request, url)
    except RequestError as e:
        response = error_response(e)
    except Exception as e:
        log.exception("internal error on %s", url)
        response = error_response(
            RequestError(f"internal error: {e}", code=500, type="internal_error")
        )
    await response(scope, receive, send)


def prompt_texts(gen: GenerationRequest) -> list[str]:
    """The request's text that tokenizing would read (token-id prompts need no tokenizing)."""
    if gen.endpoint == "chat":
        tools = [json.dumps(gen.tools.tools)] if gen.tools is not None else []
        return message_texts(gen.messages) + tools
    return [p for p in gen.prompts if isinstance(p, str)]


async def validated(
    state: RouterState, request: Request, url: str
) -> tuple[GenerationRequest, list[EngineInput]]:
    """The request read, validated and tokenized (off the loop): RequestError when it is bad."""
    body = await json_body(state, request)
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


async def json_body(state: RouterState, request: Request) -> dict:
    """The body as a validated JSON object, read up to the size limit and parsed off the loop."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > state.max_body_bytes:  # no or a false Content-Length: stop reading here
            raise too_large(state)
        chunks.append(chunk)
    raw = b"".join(chunks)
    if len(raw) < 65536:  # handing a small body to a thread costs more than parsing it
        return parse_json_object(raw)
    return await state.offload(parse_json_object, raw)


async def generate(state: RouterState, request: Request, url: str) -> Response:
    timer = state.metrics.start_request()
    try:
        with state.admission.admit():  # waiting from here until every flight is dispatched
            gen, inputs = await validated(state, request, url)
            chat = gen.endpoint == "chat"
            response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
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

    async def collect() -> None:
        async for _ in choice_deltas(job, choices, state.request_timeout_s, timer):
            pass

    try:
        await unless_disconnected(request, collect)
    except RequestError as e:
        timer.failed(e.code)
        raise
    finally:
        job.close()
    completion_tokens = sum(len(c.token_ids) for c in choices)
    timer.finished(prompt_tokens, completion_tokens, [c.finish_reason or "" for c in choices])
    build = chat_body if chat else completion_body
    results = [c.result() for c in choices]
    return JSONResponse(
        build(gen, results, state.tokenizer, prompt_tokens, request_id=response_id, created=created)
    )


async def unless_disconnected(request: Request, work: Callable[[], Awaitable[None]]) -> None:
    """Run `work`; cancel it (and raise RequestError 499) if the client goes away first."""
    task = asyncio.ensure_future(work())
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise RequestError("the client closed the connection", code=499)
    finally:
        if not task.done():
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
