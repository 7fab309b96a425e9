"""router/streaming.py without processes: a scripted job of worker events, a fake clock.

The SSE bytes of streamed completions and chat (with and without the usage chunk), the error event
of a failed or timed-out flight, stop strings that release a choice on the worker, and the
non-streamed path (`collect`, then a whole body) giving the same text. Every test runs with
the response's task writing (`task`: no direct writer, as under a server other than uvicorn) and
with chunks written as the events are put (`direct`: a fake uvicorn cycle).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from types import SimpleNamespace

import pytest

from common.api.choice import Choice
from common.api.prompts import choice_params, engine_inputs
from common.api.requests import RequestError, parse_request
from common.api.responses import completion_body
from common.api.tokenizer import Tokenizer
from common.model.model_files import resolve_model
from common.protocol import TokenOutput
from router.dispatch import FlightFailed
from router.feed import collect
from router.metrics import RouterMetrics
from router.relay import EventBuffer
from router.sse import HTTP_CYCLE
from router.streaming import SSEResponse

IM_END = 2


class ScriptedJob:
    """Stands in for `router.job.Job`: scripted events, put into a real event buffer one per loop
    turn (`feed`, as the dispatcher puts them) or handed out one per wake-up (`next_events`);
    records finish and close."""

    together = False  # put every scripted event at once

    def __init__(self, events: Sequence[tuple[int, TokenOutput | FlightFailed]]) -> None:
        self.script = list(events)
        self.events = EventBuffer()
        self.finished: list[int] = []
        self.closed = False

    async def feed(self) -> None:
        while self.script and not self.closed:
            for _ in range(len(self.script) if self.together else 1):
                self.events.put_nowait(self.script.pop(0))
            await asyncio.sleep(0)

    async def next_event(self, timeout_s: float) -> tuple[int, TokenOutput | FlightFailed]:
        if not self.script:  # what Job does when nothing arrives before the deadline
            raise RequestError("the request timed out", code=504, type="timeout")
        return self.script.pop(0)

    async def next_events(self, timeout_s: float) -> list[tuple[int, TokenOutput | FlightFailed]]:
        return [await self.next_event(timeout_s)]  # one event per wake-up

    def finish(self, index: int) -> None:
        self.finished.append(index)

    def close(self) -> None:
        self.closed = True
        self.events.clear()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        self.now += 0.01  # every look at the clock is 10 ms later
        return self.now


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_source(resolve_model("default"))


def ids(tok: Tokenizer, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def tokens(
    token_ids: list[int], finish_reason: str | None = None, logprobs: bool = False
) -> TokenOutput:
    return TokenOutput(
        request_id="r",
        token_ids=token_ids,
        logprobs=[-1.0] * len(token_ids) if logprobs else [],
        top_logprobs=[[] for _ in token_ids] if logprobs else [],
        finished=finish_reason is not None,
        finish_reason=finish_reason,
        num_prompt_tokens=3,
        num_cached_tokens=0,
    )


def setup(tok: Tokenizer, url: str, body: dict) -> tuple:
    """(request, choices, prompt tokens) as router.app builds them for `body`."""
    request = parse_request(url, body, ["default"])
    inputs = engine_inputs(request, tok, max_model_len=2048)
    choices = [
        Choice(p * request.n + k, inp.prompt_token_ids, params, request, tok)
        for p, inp in enumerate(inputs)
        for k, params in enumerate(choice_params(inp.params, request.n))
    ]
    return request, choices, sum(len(inp.prompt_token_ids) for inp in inputs)


MODE = {"writer": "task"}


@pytest.fixture(autouse=True, params=["task", "direct"])
def writer(request: pytest.FixtureRequest) -> str:
    MODE["writer"] = request.param
    return request.param


class FakeTransport:
    def __init__(self, out: list[bytes]) -> None:
        self.out = out

    def write(self, data: bytes) -> None:
        self.out.append(data)

    def is_closing(self) -> bool:
        return False


class FakeCycle:
    """What `router.sse.DirectWriter` reads of uvicorn's request cycle; its transport writes
    where the response's `send` does."""

    def __init__(self, out: list[bytes]) -> None:
        self.flow = SimpleNamespace(write_paused=False)
        self.disconnected = False
        self.transport = FakeTransport(out)


def stream(tok, request, choices, prompt_tokens, job, metrics, timeout_s: float = 60.0) -> str:
    """The body of an `SSEResponse` over `job`, run as an ASGI app."""

    async def collect() -> bytes:
        timer = metrics.start_request()
        response = SSEResponse(
            request, "resp-1", 1700, job, choices, tok, prompt_tokens, timeout_s, timer
        )
        body: list[bytes] = []

        async def send(message: dict) -> None:
            if message["type"] == "http.response.body":
                body.append(message["body"])

        async def receive() -> dict:
            await asyncio.Event().wait()  # the client never leaves
            return {"type": "http.disconnect"}

        scope = {"type": "http"}
        if MODE["writer"] == "direct":
            scope[HTTP_CYCLE] = FakeCycle(body)  # HTTP/1.0 framing: the bare bytes
        feeding = asyncio.ensure_future(job.feed())
        await response(scope, receive, send)
        feeding.cancel()
        return b"".join(body)

    return asyncio.run(collect()).decode()


def parse_sse(text: str) -> list[dict | str]:
    events = text.split("\n\n")
    assert events[-1] == "" and all(e.startswith("data: ") for e in events[:-1])
    return [
        e.removeprefix("data: ") if e == "data: [DONE]" else json.loads(e.removeprefix("data: "))
        for e in events[:-1]
    ]


def test_completion_stream_is_exact_sse_text(tok: Tokenizer) -> None:
    hello, world = ids(tok, " Hello world")
    request, choices, prompt_tokens = setup(
        tok, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2, "stream": True}
    )
    job = ScriptedJob([(0, tokens([hello])), (0, tokens([world], "length"))])
    metrics = RouterMetrics(clock=Clock())
    text = stream(tok, request, choices, prompt_tokens, job, metrics)
    head = '"id": "resp-1", "object": "text_completion", "created": 1700, "model": "default"'
    assert text == (
        f'data: {{{head}, "choices": [{{"index": 0, "text": " Hello", "logprobs": null, '
        '"finish_reason": null}]}\n\n'
        f'data: {{{head}, "choices": [{{"index": 0, "text": " world", "logprobs": null, '
        '"finish_reason": "length"}]}\n\n'
        "data: [DONE]\n\n"
    )
    assert job.finished == [0] and job.closed
    assert metrics.generation_tokens_total == 2 and metrics.prompt_tokens_total == 3
    assert dict(metrics.request_success_total) == {"length": 1}
    assert metrics.ttft.count == 1 and metrics.itl.count == 1 and metrics.e2e.count == 1


def test_chat_stream_with_usage_chunk_and_two_choices(tok: Tokenizer) -> None:
    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 3,
        "n": 2,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    request, choices, prompt_tokens = setup(tok, "/v1/chat/completions", body)
    a, b, c = ids(tok, " one two three")
    job = ScriptedJob(
        [
            (1, tokens([a, b])),
            (0, tokens([a])),
            (1, tokens([c], "length")),
            (0, tokens([b, IM_END], "stop")),
        ]
    )
    events = parse_sse(stream(tok, request, choices, prompt_tokens, job, RouterMetrics(Clock())))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all(c["object"] == "chat.completion.chunk" and c["id"] == "resp-1" for c in chunks)
    # Each choice opens with the assistant role, before any content.
    assert [c["choices"][0]["delta"] for c in chunks[:2]] == [
        {"role": "assistant", "content": ""}
    ] * 2
    assert [c["choices"][0]["index"] for c in chunks[:2]] == [0, 1]
    usage = chunks[-1]
    assert usage["choices"] == []
    assert usage["usage"] == {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": 6,  # <|im_end|> is generated, so it counts
        "total_tokens": prompt_tokens + 6,
    }
    texts, reasons = {0: "", 1: ""}, {}
    for chunk in chunks[2:-1]:
        (choice,) = chunk["choices"]
        texts[choice["index"]] += choice["delta"].get("content", "")
        if choice["finish_reason"]:
            reasons[choice["index"]] = choice["finish_reason"]
    assert texts == {0: " one two", 1: " one two three"}
    assert reasons == {0: "stop", 1: "length"}
    assert sorted(job.finished) == [0, 1] and job.closed


def test_stream_without_include_usage_has_no_usage_chunk(tok: Tokenizer) -> None:
    body = {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1, "stream": True}
    request, choices, prompt_tokens = setup(tok, "/v1/chat/completions", body)
    job = ScriptedJob([(0, tokens(ids(tok, " yes"), "length"))])
    events = parse_sse(stream(tok, request, choices, prompt_tokens, job, RouterMetrics(Clock())))
    assert events[-1] == "[DONE]"
    assert all("usage" not in e and e["choices"] for e in events[:-1])


def test_failed_flight_becomes_an_error_event_then_done(tok: Tokenizer) -> None:
    request, choices, prompt_tokens = setup(
        tok, "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "stream": True}
    )
    job = ScriptedJob(
        [(0, tokens(ids(tok, " a"))), (0, FlightFailed("decode worker d0 died", code=503))]
    )
    metrics = RouterMetrics(Clock())
    events = parse_sse(stream(tok, request, choices, prompt_tokens, job, metrics))
    assert events[0]["choices"][0]["text"] == " a"
    assert events[1] == {
        "error": {
            "message": "decode worker d0 died",
            "type": "service_unavailable",
            "param": None,
            "code": 503,
        }
    }
    assert events[2:] == ["[DONE]"]
    assert job.closed and job.finished == []  # close aborts what still runs
    assert dict(metrics.request_errors_total) == {503: 1} and not metrics.request_success_total


def test_timeout_becomes_a_504_error_event(tok: Tokenizer) -> None:
    request, choices, prompt_tokens = setup(
        tok, "/v1/completions", {"prompt": "Hello", "max_tokens": 4, "stream": True}
    )
    job = ScriptedJob([])  # the worker never answers
    metrics = RouterMetrics(Clock())
    events = parse_sse(stream(tok, request, choices, prompt_tokens, job, metrics, timeout_s=0.05))
    assert events[0]["error"]["code"] == 504 and events[0]["error"]["type"] == "timeout"
    assert events[1:] == ["[DONE]"] and job.closed
    assert dict(metrics.request_errors_total) == {504: 1}


def test_stop_string_releases_the_choice_and_ignores_later_tokens(tok: Tokenizer) -> None:
    body = {"prompt": "Hello", "max_tokens": 10, "stop": " three", "stream": True}
    request, choices, prompt_tokens = setup(tok, "/v1/completions", body)
    one, two, three, four = ids(tok, " one two three four")
    # The worker had sent " four" before it saw the abort: dropped.
    job = ScriptedJob([(0, tokens([one, two])), (0, tokens([three])), (0, tokens([four]))])
    metrics = RouterMetrics(Clock())
    events = parse_sse(stream(tok, request, choices, prompt_tokens, job, metrics))
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == " one two"
    assert events[-2]["choices"][0]["finish_reason"] == "stop"
    assert job.finished == [0]  # released on the worker: " four" may still come, never shown
    assert metrics.generation_tokens_total == 3  # the stop string's token counts, " four" not


def test_logprobs_without_text_still_get_a_chunk(tok: Tokenizer) -> None:
    body = {"prompt": "Hello", "max_tokens": 4, "stream": True, "logprobs": 0}
    request, choices, prompt_tokens = setup(tok, "/v1/completions", body)
    coffee = ids(tok, " ☕")
    first_byte = [t for t in coffee if "\ufffd" in tok.decode([t])][0]
    rest = coffee[coffee.index(first_byte) + 1 :]
    head = coffee[: coffee.index(first_byte) + 1]
    job = ScriptedJob(
        [(0, tokens(head, logprobs=True)), (0, tokens(rest, "length", logprobs=True))]
    )
    events = parse_sse(stream(tok, request, choices, prompt_tokens, job, RouterMetrics(Clock())))
    bodies = [e["choices"][0] for e in events[:-1]]
    assert len(bodies) == 2 and bodies[0]["text"] == ""  # the cup is not whole yet
    assert "".join(b["text"] for b in bodies) == " ☕"
    assert sum(len(b["logprobs"]["tokens"]) for b in bodies) == len(coffee)


def test_non_streamed_collects_the_same_text(tok: Tokenizer) -> None:
    request, choices, prompt_tokens = setup(
        tok, "/v1/completions", {"prompt": "Hello", "max_tokens": 3, "n": 2}
    )
    a, b, c = ids(tok, " red green blue")
    job = ScriptedJob([(0, tokens([a, b])), (1, tokens([c], "length")), (0, tokens([c], "length"))])
    metrics = RouterMetrics()
    asked: list[bool] = []

    async def gone() -> bool:
        asked.append(True)
        return False

    async def run() -> None:
        feeding = asyncio.ensure_future(job.feed())  # one event per loop turn
        await collect(job, choices, 60.0, metrics.start_request(), gone, 60.0)
        await feeding

    asyncio.run(run())
    assert not asked  # answered within the first poll: the client was never looked for
    body = completion_body(request, [ch.result() for ch in choices], tok, prompt_tokens)
    assert [ch["text"] for ch in body["choices"]] == [" red green blue", " blue"]
    assert body["usage"]["completion_tokens"] == 4
    assert job.finished == [1, 0] and not job.closed  # router.app closes it after the body


@pytest.mark.parametrize("leaves", [False, True])
def test_a_whole_response_times_out_or_sees_its_client_leave(tok: Tokenizer, leaves: bool) -> None:
    """Nothing arrives: the client is looked for at every poll (499 once it left), else 504 at
    the deadline; either way no choice was applied."""
    request, choices, _ = setup(tok, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 2})
    job = ScriptedJob([])
    asked: list[bool] = []

    async def gone() -> bool:
        asked.append(True)
        return leaves and len(asked) >= 3

    async def run() -> None:
        await collect(job, choices, 0.5, RouterMetrics().start_request(), gone, 0.01)

    with pytest.raises(RequestError) as e:
        asyncio.run(run())
    assert e.value.code == (499 if leaves else 504)
    assert len(asked) == 3 if leaves else len(asked) >= 3
    assert not choices[0].token_ids


def test_a_whole_response_sees_its_client_leave_while_tokens_keep_coming(tok: Tokenizer) -> None:
    """The client is looked for every poll even when tokens never stop arriving (a stream of a
    token per 5 ms, polls every 20 ms): 499 long before the last token."""
    request, choices, _ = setup(tok, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 400})
    (a,) = ids(tok, " red")
    job = ScriptedJob([])
    asked: list[bool] = []

    async def gone() -> bool:
        asked.append(True)
        return len(asked) >= 2

    async def run() -> None:
        async def drip() -> None:
            for _ in range(399):
                job.events.put_nowait((0, tokens([a])))
                await asyncio.sleep(0.005)

        dripping = asyncio.ensure_future(drip())
        try:
            await collect(job, choices, 60.0, RouterMetrics().start_request(), gone, 0.02)
        finally:
            dripping.cancel()

    with pytest.raises(RequestError) as e:
        asyncio.run(run())
    assert e.value.code == 499 and len(asked) == 2
    assert 0 < len(choices[0].token_ids) < 100


class TogetherJob(ScriptedJob):
    """Puts every scripted event at once, as a `TokenBatch` (or a router behind its workers)
    delivers them."""

    together = True


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_events_that_arrive_together_give_the_same_sse(tok: Tokenizer, endpoint: str) -> None:
    a, b, c = ids(tok, " one two three")
    if endpoint == "chat":
        url = "/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": "Hi"}], "n": 2, "logprobs": True,
                "top_logprobs": 1, "max_tokens": 3, "stream": True}  # fmt: skip
    else:
        url = "/v1/completions"
        body = {"prompt": [5, 6, 7], "n": 2, "logprobs": 1, "max_tokens": 3, "stream": True}
    script = [
        (1, tokens([a, b], logprobs=True)),
        (0, tokens([a], logprobs=True)),
        (0, tokens([b], logprobs=True)),
        (1, tokens([c], "length", logprobs=True)),
        (0, tokens([c], "length", logprobs=True)),
    ]
    texts = []
    for job in (ScriptedJob(script), TogetherJob(script)):
        request, choices, prompt_tokens = setup(tok, url, body)
        texts.append(stream(tok, request, choices, prompt_tokens, job, RouterMetrics(Clock())))
        assert job.closed
    assert texts[0] == texts[1]
    assert texts[1].count("data: {") == (5 + 2 if endpoint == "chat" else 5)


class PausingCycle(FakeCycle):
    """A uvicorn cycle whose `send` waits while the client's socket is paused, as uvicorn's."""

    def __init__(self) -> None:
        self.body: list[bytes] = []
        super().__init__(self.body)
        self.resumed = asyncio.Event()
        self.resumed.set()

    def pause(self, paused: bool) -> None:
        self.flow.write_paused = paused
        if paused:
            self.resumed.clear()
        else:
            self.resumed.set()

    async def send(self, message: dict) -> None:
        if self.flow.write_paused:
            await self.resumed.wait()
        if message["type"] == "http.response.body":
            self.body.append(message["body"])


def test_direct_chunks_are_written_as_events_are_put_and_wait_out_back_pressure(
    tok: Tokenizer,
) -> None:
    words = ids(tok, " one two three four five six")
    request, choices, prompt_tokens = setup(
        tok, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 6, "stream": True}
    )
    job = ScriptedJob([])
    metrics = RouterMetrics(Clock())

    async def run() -> str:
        cycle = PausingCycle()
        timer = metrics.start_request()
        response = SSEResponse(
            request, "resp-1", 1700, job, choices, tok, prompt_tokens, 60.0, timer
        )

        async def receive() -> dict:
            await asyncio.Event().wait()
            return {"type": "http.disconnect"}

        task = asyncio.ensure_future(response({"type": "http", HTTP_CYCLE: cycle}, receive,
                                              cycle.send))  # fmt: skip
        await asyncio.sleep(0.01)
        job.events.put_nowait((0, tokens(words[:1])))
        await asyncio.sleep(0)  # one turn of the loop: the flush after a burst of messages
        assert cycle.body[-1].startswith(b"data: ")
        assert response._wake is not None and not response._wake.done()  # the task slept on
        cycle.pause(True)  # the client stops reading: the task writes, waiting for the socket
        job.events.put_nowait((0, tokens(words[1:2])))
        job.events.put_nowait((0, tokens(words[2:3])))
        await asyncio.sleep(0.01)
        assert len(cycle.body) == 1
        job.events.put_nowait((0, tokens(words[3:4])))
        cycle.pause(False)
        await asyncio.sleep(0.01)
        job.events.put_nowait((0, tokens(words[4:5])))  # direct again
        job.events.put_nowait((0, tokens(words[5:], "length")))
        await asyncio.wait_for(task, 5)
        return b"".join(cycle.body).decode()

    events = parse_sse(asyncio.run(run()))
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == tok.decode(words)
    assert events[-2]["choices"][0]["finish_reason"] == "length" and events[-1] == "[DONE]"
    assert job.closed and metrics.generation_tokens_total == 6


def test_the_chunks_of_messages_read_together_are_one_write(tok: Tokenizer) -> None:
    words = ids(tok, " one two three four")
    request, choices, prompt_tokens = setup(
        tok, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 4, "stream": True}
    )
    job = ScriptedJob([])

    async def run() -> list[bytes]:
        cycle = PausingCycle()
        timer = RouterMetrics(Clock()).start_request()
        response = SSEResponse(
            request, "resp-1", 1700, job, choices, tok, prompt_tokens, 60.0, timer
        )

        async def receive() -> dict:
            await asyncio.Event().wait()
            return {"type": "http.disconnect"}

        task = asyncio.ensure_future(response({"type": "http", HTTP_CYCLE: cycle}, receive,
                                              cycle.send))  # fmt: skip
        await asyncio.sleep(0.01)
        for word in words[:3]:  # three TokenBatches read in one wake-up of the control plane
            job.events.put_nowait((0, tokens([word])))
        await asyncio.sleep(0)
        job.events.put_nowait((0, tokens(words[3:], "length")))
        await asyncio.wait_for(task, 5)
        return cycle.body

    body = asyncio.run(run())
    assert body[0].count(b"data: ") == 3 and body[0].startswith(b"data: ")
    events = parse_sse(b"".join(body).decode())
    assert "".join(e["choices"][0]["text"] for e in events[:-1]) == tok.decode(words)


def test_a_client_that_leaves_closes_the_job(tok: Tokenizer) -> None:
    request, choices, prompt_tokens = setup(
        tok, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 6, "stream": True}
    )
    job = ScriptedJob([])

    async def run() -> None:
        cycle = PausingCycle()
        timer = RouterMetrics(Clock()).start_request()
        response = SSEResponse(
            request, "resp-1", 1700, job, choices, tok, prompt_tokens, 60.0, timer
        )
        left = asyncio.Event()

        async def receive() -> dict:
            await left.wait()
            return {"type": "http.disconnect"}

        task = asyncio.ensure_future(response({"type": "http", HTTP_CYCLE: cycle}, receive,
                                              cycle.send))  # fmt: skip
        await asyncio.sleep(0.01)
        job.events.put_nowait((0, tokens(ids(tok, " one"))))
        left.set()
        await asyncio.wait_for(task, 5)

    asyncio.run(run())
    assert job.closed and job.events.empty()


def test_streams_fed_in_bursts_through_the_control_plane_get_every_token_in_order(
    tok: Tokenizer,
) -> None:
    """Real control plane and dispatcher: `TokenBatch` frames for three streams arrive in bursts
    (several read in one wake-up, a stream's tokens spread over them, one stream's socket paused
    for a while): each stream's bytes are its tokens' events in order, then [DONE]; with the
    direct writer each burst is one write per stream."""
    from common.protocol import PROTOCOL_VERSION, Register, TokenBatch, encode
    from router.control import ControlPlane
    from router.dispatch import Dispatcher
    from router.job import Job
    from router.kv_index import PrefixIndex
    from router.registry import Registry

    words = ids(tok, " alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu")
    n = len(words)
    assert n > 10
    registry = Registry({"default"}, timeout_s=3600.0)
    control = ControlPlane(registry, PrefixIndex())
    dispatcher = Dispatcher(registry, lambda worker, msg: True)
    control.dispatcher = dispatcher
    registry.register(b"d0", Register(
        PROTOCOL_VERSION, "decode", "d0", "default", 16, 100, 4096, "float32", "h",
    ))  # fmt: skip
    metrics = RouterMetrics(Clock())

    async def run() -> list[PausingCycle]:
        cycles, tasks, rids = [], [], []
        for s in range(3):
            request, choices, prompt_tokens = setup(
                tok, "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": n, "stream": True}
            )
            job = Job(dispatcher, f"cmpl-{s}", [(choices[0].prompt_token_ids, choices[0].params)])
            flight = job.flights[0]
            flight.assign_decode(registry.workers["d0"])
            dispatcher.flights[flight.request_id] = flight
            rids.append(flight.request_id)
            response = SSEResponse(request, f"cmpl-{s}", 1700, job, choices, tok, prompt_tokens,
                                   60.0, metrics.start_request())  # fmt: skip

            async def receive() -> dict:
                await asyncio.Event().wait()
                return {"type": "http.disconnect"}

            cycle = PausingCycle()
            cycles.append(cycle)
            tasks.append(asyncio.ensure_future(response({"type": "http", HTTP_CYCLE: cycle},
                                                        receive, cycle.send)))  # fmt: skip
        await asyncio.sleep(0.01)

        def frame(step: int, streams: list[int]) -> list[bytes]:
            last = step == n - 1
            outputs = [tokens([words[step]], "length" if last else None) for _ in streams]
            for out, s in zip(outputs, streams):
                out.request_id = rids[s]
            return [b"d0", encode(TokenBatch(outputs))]

        step = 0
        for burst in (1, 3, 2, 4, n - 10):  # steps read together in one wake-up
            if step == 4:
                cycles[1].pause(True)  # stream 1's client stops reading for a while
            writes = [len(c.body) for c in cycles]
            for i in range(burst):
                control._receive(frame(step + i, [0, 1, 2] if i % 2 else [2, 1, 0]))
            step += burst
            await asyncio.sleep(0)  # the flush after the burst
            for s in (0, 2):
                assert len(cycles[s].body) == writes[s] + 1, "one write per stream and burst"
            if step == 6:
                cycles[1].pause(False)
            await asyncio.sleep(0.01)
        assert step == n
        await asyncio.wait_for(asyncio.gather(*tasks), 5)
        return cycles

    for cycle in asyncio.run(run()):
        events = parse_sse(b"".join(cycle.body).decode())
        assert events[-1] == "[DONE]" and events[-2]["choices"][0]["finish_reason"] == "length"
        assert "".join(e["choices"][0]["text"] for e in events[:-1]) == tok.decode(words)
    assert not dispatcher.flights or all(f.finished for f in dispatcher.flights.values())
