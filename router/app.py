"""The router's HTTP API: a FastAPI app over the registry and the dispatcher.

Owns the endpoints: `POST /v1/completions` and `POST /v1/chat/completions` (served by
`router.generate`, which the guard calls past FastAPI's routing; the routes document them),
`GET /v1/models` and `GET /v1/models/{id}`, `GET /health`, `GET /metrics`, `GET /debug/block_books`
(each worker's KV block audit, for leak checks), `POST /tokenize` and `POST /detokenize` (served by
`router.tokenize`), and FastAPI's `/openapi.json` and `/docs` (request schemas from
`common.api.schemas`); optional Bearer auth on every endpoint but `/health` (and `/metrics` with
`--metrics-without-key`); the body size limit (413); admission control (`router.admission`, 429:
too many requests waiting, too many tokens buffered for slow readers, or the router short of
CPU); and the rule that every error is an OpenAI error body (bad input is a 4xx, never a 500).
Request validation comes from `common.api.body`, `common.api.requests` and `common.api.prompts`,
the choices are `common.api.choice.Choice`s, bodies come from `common.api.responses`, streaming
from `router.streaming`; workers are reached only through `router.dispatch`.

The event loop never tokenizes, detokenizes or parses a large body itself: that work runs on a
small thread pool (`RouterState.offload`; the tokenizer releases the GIL), so one 10 MB request
cannot stall every stream (a completions prompt of token ids or a few hundred characters is
tokenized on the loop: the hop to the pool would cost more). A prompt too long to fit the
context by its character count alone is refused before tokenizing
(`common.api.body.check_prompt_chars`). The heap a large request freed goes back to the OS once
it is over (`router.memory`).

`/health` is 200 when at least one decode worker is live and either a prefill worker is live or
the router runs with `--colocated` (decode workers prefill themselves).

Built by `router.server` (`create_app`), which runs it under uvicorn.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from common.api import schemas
from common.api.prompts import (
    tool_call_format,
)
from common.api.requests import (
    CHAT_URL,
    COMPLETIONS_URL,
    RequestError,
)
from common.api.tokenizer import Tokenizer
from router.admission import Admission
from router.dispatch import Dispatcher
from router.generate import (
    error_response,
    generate,
    serve_generate,
    too_large,
)
from router.memory import Trimmer
from router.metrics import RouterMetrics
from router.registry import Registry
from router.tokenize import check_model, detokenize_body, tokenize_body

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 32 * 2**20
TOKENIZER_THREADS = 4  # tokenizing releases the GIL: a few requests at once, never the event loop
OPEN_PATHS = frozenset({"/health"})  # served without the API key
# /metrics renders on the loop up to this many workers (~40 series each), beyond on a thread: the
# loop then waits at most a GIL switch interval at a time, not the whole render. The render reads
# counts the loop may change meanwhile; a scrape is a snapshot within a few ms, not an atomic one.
METRICS_INLINE_WORKERS = 64
GENERATE_URLS = frozenset({COMPLETIONS_URL, CHAT_URL})
T = TypeVar("T")


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
    metrics_without_key: bool = False
    tool_call_parser: str = ""  # --tool-call-parser: hermes, or generic (also when unset)
    colocated: bool = False
    request_timeout_s: float = 600.0
    created: int = 0
    max_body_bytes: int = MAX_BODY_BYTES
    admission: Admission = field(default_factory=Admission)
    trimmer: Trimmer = field(default_factory=Trimmer)  # heap back to the OS after big requests
    executor: ThreadPoolExecutor = field(
        default_factory=lambda: ThreadPoolExecutor(TOKENIZER_THREADS, "tokenizer")
    )

    async def offload(self, fn: Callable[..., T], *args: Any) -> T:
        """Run fn(*args) on the tokenizer pool, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def tool_format(self) -> str:
        """hermes or generic: --tool-call-parser as the chat template allows (cached there)."""
        return tool_call_format(self.tool_call_parser, self.tokenizer)

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


class _Guard:
    """The ASGI app in front of FastAPI (its own /openapi.json and /docs included): the API key,
    and a declared body size over the limit refused before a byte of it is read; then the
    generation endpoints straight to `router.generate.serve_generate`, everything else through
    FastAPI (its routing, middleware and exception handlers). Plain ASGI rather than
    BaseHTTPMiddleware, which would buffer streamed responses."""

    def __init__(self, app: FastAPI, state: RouterState) -> None:
        self.app = app
        self.state = state

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            error = self._refusal(scope)
            if error is not None:
                await error_response(error)(scope, receive, send)
                return
            path = scope["path"]
            if path in GENERATE_URLS and scope["method"] == "POST":  # past FastAPI
                await serve_generate(self.state, path, scope, receive, send)
                return
            await self.state.trimmer.serve(self.app, scope, receive, send, self.state.executor)
            return
        await self.app(scope, receive, send)

    def _refusal(self, scope: Scope) -> RequestError | None:
        state = self.state
        path = scope["path"]
        check_key = state.api_key and not (
            path in OPEN_PATHS or (path == "/metrics" and state.metrics_without_key)
        )
        authorization = length = b""
        for name, value in scope["headers"]:  # ASGI servers give header names in lower case
            if name == b"content-length":
                length = value
            elif name == b"authorization":
                authorization = value
        if check_key:
            scheme, _, token = authorization.partition(b" ")
            if scheme.lower() != b"bearer" or not secrets.compare_digest(
                token.strip(), state.api_key.encode()
            ):
                return RequestError(
                    "invalid or missing API key", code=401, type="authentication_error"
                )
        if length.isdigit() and int(length) > state.max_body_bytes:
            return too_large(state)
        return None


def create_app(state: RouterState) -> ASGIApp:
    """The router's ASGI app over `state`: the guard in front of the FastAPI app."""
    app = FastAPI(
        title="pdserve router",
        summary="OpenAI-compatible completions and chat over disaggregated prefill/decode workers",
        docs_url="/docs",
        redoc_url=None,
        openapi_url="/openapi.json",
    )
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

    # Served by the guard (`serve_generate`) before FastAPI sees them: here for the schema.
    @app.post(COMPLETIONS_URL, openapi_extra=schemas.openapi_body(schemas.COMPLETION_REQUEST))
    async def completions(request: Request) -> Response:
        return await generate(state, COMPLETIONS_URL, request.scope, request.receive)

    @app.post(CHAT_URL, openapi_extra=schemas.openapi_body(schemas.CHAT_REQUEST))
    async def chat_completions(request: Request) -> Response:
        return await generate(state, CHAT_URL, request.scope, request.receive)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(state, n) for n in state.served_model_names]}

    @app.get("/v1/models/{model_id:path}")  # ids may hold slashes (org/name)
    async def model(model_id: str) -> dict[str, Any]:
        check_model(state, {"model": model_id})
        return _model_card(state, model_id)

    @app.get("/health")
    async def health() -> Response:
        ok, why = state.healthy()
        if ok:
            return JSONResponse({"status": "ok"})
        return error_response(RequestError(why, code=503, type="service_unavailable"))

    @app.get("/metrics")
    async def metrics() -> Response:
        # Listed here, on the loop: the registry's dict changes while a thread renders.
        workers = list(state.registry.workers.values())
        args = (
            state.dispatcher.num_running,
            state.dispatcher.num_waiting,
            workers,
            state.dispatcher.prefix_index,
            state.admission,
            state.dispatcher.num_migrations,
        )
        if len(workers) <= METRICS_INLINE_WORKERS:
            text = state.metrics.render(*args)
        else:  # 1,000 workers: 40k series, a quarter of a second that no stream may wait for
            text = await state.offload(state.metrics.render, *args)
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/debug/block_books")
    async def block_books() -> dict[str, Any]:
        """Per worker: free/cached/running/reserved/held block counts, `ok`, `errors`; null for
        a worker that did not answer in time. Behind the API key, when there is one."""
        replies = await state.registry.block_books(state.dispatcher.send)
        return {
            "workers": {
                worker_id: None if r is None else {**msgspec.structs.asdict(r), "ok": not r.errors}
                for worker_id, r in replies.items()
            }
        }

    @app.post("/tokenize", openapi_extra=schemas.openapi_body(schemas.TOKENIZE_REQUEST))
    async def tokenize(request: Request) -> Response:
        return await tokenize_body(state, request)

    @app.post("/detokenize", openapi_extra=schemas.openapi_body(schemas.DETOKENIZE_REQUEST))
    async def detokenize(request: Request) -> dict[str, Any]:
        return await detokenize_body(state, request)

    return _Guard(app, state)


def _model_card(state: RouterState, name: str) -> dict[str, Any]:
    """A served model name as OpenAI's model object (plus vLLM's root and max_model_len)."""
    return {
        "id": name,
        "object": "model",
        "created": state.created,
        "owned_by": "pdserve",
        "root": state.served_model_names[0],
        "max_model_len": state.context_len(),
    }
