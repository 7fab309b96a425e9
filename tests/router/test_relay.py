"""router/relay.py: a job's event buffer and the router-wide bound, alone and in a real router.

Alone: everything buffered comes out at once in order, the counts follow, one job past its limit
is emptied and told, the budget is overloaded from its limit until half drained. In a router
(fake workers, real HTTP): `TokenBatch`es relay into several streams in order and give exactly
the SSE bytes per-token `TokenOutput`s give; a client that stops reading makes the router answer
new requests with 429 until it reads again, and a stream whose client falls too far behind is
aborted on its worker, with what the router buffers for it bounded throughout.
"""

from __future__ import annotations

import asyncio
import json
import re
import socket
import threading
import time

import httpx
import pytest

from common.protocol import Abort, TokenOutput
from router.relay import EventBuffer, RelayBudget
from tests.router.fake_worker import RouterThread

PROMPT = "The quick brown fox jumps over the lazy dog"
SHORT = {"model": "default", "prompt": PROMPT, "max_tokens": 2}


def out(n: int, finished: bool = False) -> TokenOutput:
    return TokenOutput("r", list(range(n)), [], [], finished, "length" if finished else None, 3, 0)


def test_buffer_hands_out_everything_in_order_and_counts_tokens() -> None:
    budget = RelayBudget(max_tokens=100, max_request_tokens=50)
    a, b = EventBuffer(budget), EventBuffer(budget)
    a.put_nowait((0, out(3)))
    b.put_nowait((0, out(2)))
    a.put_nowait((1, out(4)))
    assert (a.num_tokens, b.num_tokens, budget.num_tokens) == (7, 2, 9)
    assert [(i, len(e.token_ids)) for i, e in a.take_all()] == [(0, 3), (1, 4)]
    assert (a.num_tokens, budget.num_tokens) == (0, 2)
    b.clear()
    assert budget.num_tokens == 0 and b.empty()


def test_a_job_past_its_limit_is_emptied_and_told() -> None:
    budget = RelayBudget(max_tokens=1000, max_request_tokens=10)
    told = []
    buf = EventBuffer(budget, lambda: told.append(True))
    for _ in range(3):
        buf.put_nowait((0, out(4)))  # 12 > 10 on the third
    assert told == [True] and buf.overflowed
    assert buf.empty() and budget.num_tokens == 0 and budget.num_overflows == 1
    buf.put_nowait((0, out(20)))  # told once only
    assert told == [True]


def test_budget_is_overloaded_from_its_limit_until_half_drained() -> None:
    budget = RelayBudget(max_tokens=10, max_request_tokens=100)
    buf = EventBuffer(budget)
    buf.put_nowait((0, out(9)))
    assert not budget.overloaded
    buf.put_nowait((0, out(1)))
    assert budget.overloaded
    buf.get_nowait()  # 9 tokens out: 1 left, under half
    assert not budget.overloaded and budget.num_tokens == 1


def test_wait_times_out_and_wakes_on_an_event() -> None:
    async def run() -> None:
        buf = EventBuffer()
        with pytest.raises(asyncio.TimeoutError):
            await buf.wait(0.01)
        waiter = asyncio.ensure_future(buf.wait(5.0))
        await asyncio.sleep(0)
        buf.put_nowait((0, out(1)))
        await waiter
        assert len(buf) == 1

    asyncio.run(run())


# ---- in a router ---------------------------------------------------------------------------------

REQUESTS = [
    {"prompt": PROMPT, "max_tokens": 12},
    {"prompt": PROMPT + " again", "max_tokens": 9, "logprobs": 2},
    {"prompt": PROMPT, "max_tokens": 30, "stop": [" lazy"]},
    {"messages": [{"role": "user", "content": "Hello there"}], "max_tokens": 7},
]


def _normalized(body: str) -> str:
    """The SSE text without what differs between runs (ids, creation time)."""
    body = re.sub(r'"id": "(chat)?cmpl-[0-9a-f]+"', '"id": "X"', body)
    return re.sub(r'"created": \d+', '"created": 0', body)


def _streams(url: str) -> list[str]:
    """Each request of REQUESTS streamed at once; the SSE bodies in request order."""
    results: list[str] = [""] * len(REQUESTS)

    def one(i: int) -> None:
        body = {"model": "default", "stream": True, **REQUESTS[i]}
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        results[i] = httpx.post(url + path, json=body, timeout=30).text

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(REQUESTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [_normalized(r) for r in results]


def test_token_batches_give_the_same_sse_as_per_token_messages() -> None:
    bodies = {}
    for batch in (False, True):
        with RouterThread(colocated=True) as r:
            r.worker("decode", "d0", batch=batch, token_delay_s=0.002)
            bodies[batch] = _streams(r.url)
    assert all(b.endswith("data: [DONE]\n\n") for b in bodies[True])
    assert sum(b.count("data: {") for b in bodies[True]) >= 30  # one event per token
    assert bodies[True] == bodies[False]


LONG = 100_000  # tokens a slow stream asks for: far more bytes than the sockets can hold
FAST = {"batch": True, "token_delay_s": 0.002, "tokens_per_output": 32, "max_model_len": 2 * LONG}


def _slow_stream(port: int) -> socket.socket:
    """A long streamed completion (20 logprobs a token: ~600 bytes) whose client reads nothing
    (a receive buffer of 4 KiB)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", port))
    body = json.dumps({"model": "default", "prompt": PROMPT, "max_tokens": LONG, "stream": True,
                       "logprobs": 20, "ignore_eos": True}).encode()  # fmt: skip
    sock.sendall(
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
        + body
    )
    return sock


class Reader(threading.Thread):
    """Reads a socket to its end (the slow client starts reading again)."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__(daemon=True)
        self.sock, self.chunks = sock, []
        self.start()

    def run(self) -> None:
        self.sock.settimeout(60)
        try:
            while data := self.sock.recv(1 << 16):
                self.chunks.append(data)
        except ConnectionResetError:  # the client shut its socket while the router still wrote
            pass

    def text(self) -> str:
        self.join(60)
        self.sock.close()
        return b"".join(self.chunks).decode()


def _wait(predicate, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_a_client_that_stops_reading_gets_new_work_refused_until_it_reads() -> None:
    with RouterThread(colocated=True, max_buffered_tokens=2000) as r:
        worker = r.worker("decode", "d0", **FAST)
        relay = r.server.state.admission.relay
        slow = _slow_stream(int(r.url.rsplit(":", 1)[1]))
        _wait(lambda: relay.overloaded)
        refused = httpx.post(r.url + "/v1/completions", json=SHORT)
        assert refused.status_code == 429 and refused.headers["retry-after"] == "1"
        error = refused.json()["error"]
        assert error["type"] == "rate_limit_exceeded" and "not read yet" in error["message"]
        reader = Reader(slow)  # the client reads again: the buffer drains, new work is taken
        _wait(lambda: not relay.overloaded)
        ok = httpx.post(r.url + "/v1/completions", json=SHORT)
        assert ok.status_code == 200
        slow.shutdown(socket.SHUT_RDWR)  # the client leaves: its stream is aborted
        worker.wait_for(Abort)
        reader.text()
        _wait(lambda: relay.num_tokens == 0)
        assert relay.num_overflows == 0


def test_a_stream_too_far_behind_is_aborted_and_its_buffer_bounded() -> None:
    cap = 2000
    with RouterThread(colocated=True, max_request_buffered_tokens=cap) as r:
        worker = r.worker("decode", "d0", **FAST)
        relay = r.server.state.admission.relay
        peak = [0]
        stop = threading.Event()

        def watch() -> None:
            while not stop.is_set():
                peak[0] = max(peak[0], relay.num_tokens)
                time.sleep(0.001)

        watcher = threading.Thread(target=watch)
        watcher.start()
        try:
            slow = _slow_stream(int(r.url.rsplit(":", 1)[1]))
            abort = worker.wait_for(Abort, timeout_s=30)
            # emptied: only the failure waits for the reader (still stuck writing to the client)
            _wait(lambda: relay.num_overflows == 1 and relay.num_tokens == 1)
        finally:
            stop.set()
            watcher.join()
        assert 0 < peak[0] <= cap + 32  # one output past the cap at most, then emptied
        text = Reader(slow).text()
        assert "read too slowly" in text and text.endswith("data: [DONE]\n\n\r\n0\r\n\r\n")
        assert relay.num_tokens == 0
        assert text.count("data: {") < LONG // 32
        assert abort.request_id.startswith("cmpl-")
