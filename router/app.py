"""The router's HTTP API: a FastAPI app over the registry and the dispatcher.

Owns the endpoints: `POST /v1/completions` and `POST /v1/chat/completions` (streamed and whole),
`GET /v1/models`, `GET /health`, `GET /metrics`, `GET /debug/block_books` (each worker's KV block
audit, for leak checks), `POST /tokenize`, `POST /detokenize`; optional
Bearer auth on `/v1/*`; and the rule that every error is an OpenAI error body (bad input is a 4xx,
never a 500). Request validation comes from `common.api.requests` and `common.api.prompts`, the
choices are `common.api.choice.Choice`s, bodies come from `common.api.responses`, streaming from
`router.streaming`; workers are reached only through `router.dispatch`.

`/health` is 200 when at least one decode worker is live and either a prefill worker is live or
the router runs with `--colocated` (decode workers prefill themselves).

Built by `router.server` (`create_app`), which runs it under uvicorn.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from common.api.choice import Choice
from common.api.prompts import chat_prompt_ids, choice_params, engine_inputs
from common.api.requests import CHAT_URL, COMPLETIONS_URL, RequestError, parse_request
from common.api.responses import chat_body, completion_body
from common.api.tokenizer import Tokenizer
from router.dispatch import Dispatcher, Job
from router.metrics import RouterMetrics
from router.registry import Registry
from router.streaming import choice_deltas, sse_events

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 * 2**20
DISCONNECT_POLL_S = 0.5  # how often a non-streamed request checks that its client is still there


@dataclass
class RouterState:
    """What the endpoints work with; built once by router.server."""

    tokenizer: Tokenizer
    registry: Registry
    dispatcher: Dispatcher
    metrics: RouterMetrics
    served_model_names: list[str]
    model_max_len: int  # from the model's config; live workers may allow less
    max_model_len: int | None = None  # --max-model-len, when set
    api_key: str = ""
    colocated: bool = False
    request_timeout_s: float = 600.0
    created: int = 0

    def context_len(self) -> int:
        if self.max_model_len:
            return self.max_model_len
        return self.registry.max_model_len() or self.model_max_len

    def healthy(self) -> tuple[bool, str]:
        if not self.registry.live("decode"):
            return False, "no decode worker is live"
        if not self.colocated and not self.registry.live("prefill"):
            return (
                False,
                "no prefill worker is live (start the router with --colocated to serve without)",
            )
        return True, "ok"


def error_response(e: RequestError) -> JSONResponse:
    return JSONResponse(e.body(), status_code=e.code)


def create_app(state: RouterState) -> FastAPI:
    """The FastAPI app over `state`."""
    app = FastAPI(title="pdserve router", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.router = state

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, e: RequestError) -> JSONResponse:
        return error_response(e)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError) -> JSONResponse:
        return error_response(RequestError(f"invalid request: {e.errors()}"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "not_found_error" if e.status_code == 404 else "invalid_request_error"
        return error_response(RequestError(str(e.detail), code=e.status_code, type=kind))

    @app.exception_handler(Exception)
    async def _internal_error(request: Request, e: Exception) -> JSONResponse:
        log.exception("internal error on %s", request.url.path)
        return error_response(RequestError(f"internal error: {e}", code=500, type="internal_error"))

    def check_auth(request: Request) -> None:
        if not state.api_key:
            return
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not secrets.compare_digest(
            token.strip().encode(), state.api_key.encode()
        ):
            raise RequestError("invalid or missing API key", code=401, type="authentication_error")

    @app.post(COMPLETIONS_URL)
    async def completions(request: Request) -> Response:
        check_auth(request)
        return await _generate(state, request, COMPLETIONS_URL)

    @app.post(CHAT_URL)
    async def chat_completions(request: Request) -> Response:
        check_auth(request)
        return await _generate(state, request, CHAT_URL)

    @app.get("/v1/models")
    async def models(request: Request) -> dict[str, Any]:
        check_auth(request)
        return {
            "object": "list",
            "data": [
                {
                    "id": name,
                    "object": "model",
                    "created": state.created,
                    "owned_by": "pdserve",
                    "root": state.served_model_names[0],
                    "max_model_len": state.context_len(),
                }
                for name in state.served_model_names
            ],
        }

    @app.get("/health")
    async def health() -> Response:
        ok, why = state.healthy()
        if ok:
            return JSONResponse({"status": "ok"})
        return error_response(RequestError(why, code=503, type="service_unavailable"))

    @app.get("/metrics")
    async def metrics() -> Response:
        text = state.metrics.render(
            state.dispatcher.num_running,
            state.dispatcher.num_waiting,
            state.registry.workers.values(),
            state.dispatcher.prefix_index,
        )
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/debug/block_books")
    async def block_books() -> dict[str, Any]:
        """Per worker: free/cached/running/reserved/held block counts, `ok`, `errors`; null for
        a worker that did not answer in time. Unauthenticated, like /metrics."""
        replies = await state.registry.block_books(state.dispatcher.send)
        return {
            "workers": {
                worker_id: None if r is None else {**msgspec.structs.asdict(r), "ok": not r.errors}
                for worker_id, r in replies.items()
            }
        }

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict[str, Any]:
        body = await _json_body(request)
        _check_model(state, body)
        if "messages" in body:
            gen = parse_request(CHAT_URL, {**body, "max_tokens": 1}, state.served_model_names)
            ids = chat_prompt_ids(gen, state.tokenizer)
        else:
            prompt = body.get("prompt")
            if not isinstance(prompt, str):
                raise RequestError("prompt must be a string (or send messages)", "prompt")
            add_special = body.get("add_special_tokens", True)
            if not isinstance(add_special, bool):
                raise RequestError("add_special_tokens must be a boolean", "add_special_tokens")
            ids = state.tokenizer.encode(prompt, add_special_tokens=add_special)
        return {"count": len(ids), "max_model_len": state.context_len(), "tokens": ids}

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict[str, Any]:
        body = await _json_body(request)
        _check_model(state, body)
        ids = body.get("tokens")
        vocab = state.tokenizer.vocab_size
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t < vocab for t in ids
        ):
            raise RequestError(f"tokens must be a list of token ids in [0, {vocab})", "tokens")
        return {"prompt": state.tokenizer.decode(ids, skip_special_tokens=False)}

    return app


def _check_model(state: RouterState, body: dict) -> None:
    model = body.get("model")
    if model is not None and model not in state.served_model_names:
        raise RequestError(
            f"The model `{model}` does not exist.", "model", code=404, type="model_not_found"
        )


async def _json_body(request: Request) -> dict:
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise RequestError(f"the request body exceeds {MAX_BODY_BYTES} bytes", code=413)
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


async def _generate(state: RouterState, request: Request, url: str) -> Response:
    timer = state.metrics.start_request()
    try:
        body = await _json_body(request)
        gen = parse_request(url, body, state.served_model_names)
        inputs = await asyncio.to_thread(engine_inputs, gen, state.tokenizer, state.context_len())
    except RequestError as e:
        timer.failed(e.code)
        raise
    chat = gen.endpoint == "chat"
    response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    created = int(time.time())
    choices = [
        Choice(p * gen.n + k, inp.prompt_token_ids, params, gen, state.tokenizer)
        for p, inp in enumerate(inputs)
        for k, params in enumerate(choice_params(inp.params, gen.n))
    ]
    prompt_tokens = sum(len(inp.prompt_token_ids) for inp in inputs)
    job = Job(state.dispatcher, response_id, [(c.prompt_token_ids, c.params) for c in choices])
    try:
        await job.start()
    except BaseException as e:
        job.close()
        if isinstance(e, RequestError):
            timer.failed(e.code)
        raise
    timer.dispatched()
    if gen.stream:
        events = sse_events(
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
        return StreamingResponse(events, media_type="text/event-stream")

    async def collect() -> None:
        async for _ in choice_deltas(job, choices, state.request_timeout_s, timer):
            pass

    try:
        await _unless_disconnected(request, collect)
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


async def _unless_disconnected(request: Request, work: Callable[[], Awaitable[None]]) -> None:
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
