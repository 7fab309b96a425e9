"""router/sse.py: pre-encoded chunks equal `delta_chunk`'s bytes, the direct writer's framing and
when it may write, and where the uvicorn cycle comes from."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from common.api.choice import Choice, Delta
from common.api.prompts import choice_params, engine_inputs
from common.api.requests import parse_request
from common.api.responses import delta_chunk, sse
from common.api.tokenizer import Tokenizer
from common.model.model_files import resolve_model
from router.sse import HTTP_CYCLE, ChunkTemplates, DirectWriter, direct_writer, expose_http_cycle

TEXTS = ["", " Hello", 'quote " and \\ backslash', "line\nbreak\ttab", "\x00\x1f control",
         "☕ café 日本語 🎉", "</script>", "pdserve-text-3b9e1f"]  # fmt: skip


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_source(resolve_model("default"))


def choices_for(tok: Tokenizer, url: str, body: dict) -> tuple:
    request = parse_request(url, body, ["default"])
    inputs = engine_inputs(request, tok, max_model_len=2048)
    choices = [
        Choice(p * request.n + k, inp.prompt_token_ids, params, request, tok)
        for p, inp in enumerate(inputs)
        for k, params in enumerate(choice_params(inp.params, request.n))
    ]
    return request, choices


BODIES = [
    ("/v1/completions", {"prompt": "Hi", "n": 2, "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "n": 2,
                              "stream": True}),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "Hi"}], "stream": True,
                              "tools": [{"type": "function", "function": {"name": "f"}}]}),
]  # fmt: skip


@pytest.mark.parametrize("url,body", BODIES)
def test_text_chunks_are_delta_chunks_bytes(tok: Tokenizer, url: str, body: dict) -> None:
    request, choices = choices_for(tok, url, body)
    templates = ChunkTemplates(request, "cmpl-7", 1700, tok)
    for choice in choices:
        for i, text in enumerate(TEXTS):
            delta = Delta(text, i, None)
            assert ChunkTemplates.applies(choice, delta)
            expected = sse(delta_chunk(request, "cmpl-7", 1700, choice, delta, tok))
            assert templates.text_chunk(choice, text) == expected


def test_only_text_deltas_use_templates(tok: Tokenizer) -> None:
    request, (choice,) = choices_for(tok, "/v1/completions", {"prompt": "Hi", "stream": True})
    assert not ChunkTemplates.applies(choice, Delta("x", 0, "stop"))
    assert not ChunkTemplates.applies(choice, Delta("x", 0, None, echo=True))
    request, (choice,) = choices_for(
        tok, "/v1/completions", {"prompt": "Hi", "stream": True, "logprobs": 1}
    )
    assert not ChunkTemplates.applies(choice, Delta("x", 0, None))


class Transport:
    def __init__(self) -> None:
        self.written: list[bytes] = []
        self.closing = False

    def write(self, data: bytes) -> None:
        self.written.append(data)

    def is_closing(self) -> bool:
        return self.closing


class Cycle:
    """What the writer reads of uvicorn's request cycle."""

    def __init__(self, chunked_encoding: bool | None = None) -> None:
        self.flow = SimpleNamespace(write_paused=False)
        self.disconnected = False
        self.transport = Transport()
        if chunked_encoding is not None:  # uvicorn's httptools protocol says how it frames
            self.chunked_encoding = chunked_encoding

    async def send(self, message: dict) -> None:
        pass


@pytest.mark.parametrize(
    "http_version,chunked_encoding,framed",
    [("1.1", None, True), ("1.0", None, False), ("1.1", True, True), ("1.0", False, False)],
)
def test_direct_writes_are_framed_as_the_server_frames(
    http_version: str, chunked_encoding: bool | None, framed: bool
) -> None:
    cycle = Cycle(chunked_encoding)
    writer = direct_writer({"type": "http", "http_version": http_version, HTTP_CYCLE: cycle})
    assert writer is not None and writer.ready()
    writer.write(b"data: x\n\n")
    writer.write(b"y" * 300)
    expected = [b"9\r\ndata: x\n\n\r\n", b"12c\r\n" + b"y" * 300 + b"\r\n"]
    assert cycle.transport.written == (expected if framed else [b"data: x\n\n", b"y" * 300])


def test_not_ready_while_paused_gone_or_closing() -> None:
    cycle = Cycle()
    writer = DirectWriter(cycle, chunked=True)
    assert writer.ready()
    cycle.flow.write_paused = True
    assert not writer.ready()
    cycle.flow.write_paused, cycle.disconnected = False, True
    assert not writer.ready()
    cycle.disconnected, cycle.transport.closing = False, True
    assert not writer.ready()


def test_the_cycle_is_exposed_only_from_a_server_that_has_one() -> None:
    seen: list[object] = []

    async def app(scope: dict, receive: object, send: object) -> None:
        seen.append(direct_writer(scope))  # type: ignore[arg-type]

    async def plain_send(message: dict) -> None:
        pass

    class NoFlow:  # a send bound to something else than a request cycle
        async def send(self, message: dict) -> None:
            pass

    async def run() -> None:
        cycle = Cycle()
        await expose_http_cycle(app)({"type": "http"}, None, cycle.send)
        await expose_http_cycle(app)({"type": "http"}, None, plain_send)
        scope = {"type": "http"}
        await expose_http_cycle(app)(scope, None, NoFlow().send)
        assert HTTP_CYCLE not in scope

    asyncio.run(run())
    assert isinstance(seen[0], DirectWriter) and seen[1] is None and seen[2] is None
