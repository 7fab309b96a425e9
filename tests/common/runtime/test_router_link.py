"""common/runtime/router_link.py and a worker serving several routers (WorkerBase's links).

Router addresses from --router; a real decode worker registered with two real routers (in this
process): both route to it, each gets only its own requests' tokens, and when one router goes
away the worker aborts that router's requests (their blocks come back) and keeps serving the other.
"""

from __future__ import annotations

import threading
import time

import httpx
import zmq

from common.runtime.router_link import resolve_routers
from decode.worker import DecodeWorker
from tests.common.engine.test_engine import make_engine
from tests.router.fake_worker import RouterThread


def test_router_addresses_from_a_list_and_host_names() -> None:
    spec = "tcp://127.0.0.1:8001, tcp://localhost:8002,tcp://127.0.0.1:8001,ipc:///tmp/r"
    want = ["tcp://127.0.0.1:8001", "tcp://127.0.0.1:8002", "ipc:///tmp/r"]
    assert resolve_routers(spec) == want
    assert resolve_routers("tcp://[::1]:9") == ["tcp://[::1]:9"]
    assert resolve_routers("tcp://no-such-router.invalid:8001") == []  # tried again later


def wait(condition, timeout_s: float = 15.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.05)


def test_a_worker_serves_two_routers_and_outlives_one(tiny_llama) -> None:
    hf_model, _ = tiny_llama
    a, b = RouterThread(model="tiny", colocated=True), RouterThread(model="tiny", colocated=True)
    ctx = zmq.Context()
    worker = DecodeWorker(
        make_engine(hf_model), f"{a.control},{b.control}", "decode-2r", "tcp://127.0.0.1:*",
        context=ctx,
    )  # fmt: skip
    thread = threading.Thread(target=worker.run, daemon=True)
    thread.start()
    try:
        for router in (a, b):
            wait(lambda r=router: r.server.registry.get("decode-2r") is not None)
        body = {"model": "tiny", "prompt": [5, 6, 7, 8, 9], "max_tokens": 12, "temperature": 0}
        body["ignore_eos"] = True
        texts = [httpx.post(r.url + "/v1/completions", json=body, timeout=30) for r in (a, b)]
        assert [t.status_code for t in texts] == [200, 200]
        assert texts[0].json()["choices"][0]["text"] == texts[1].json()["choices"][0]["text"]
        # a long stream through a, then a goes away: its request is aborted on the worker
        long_body = {**body, "max_tokens": 400, "stream": True}
        got_first = threading.Event()

        def stream_through_a() -> None:
            url = a.url + "/v1/completions"
            try:
                with httpx.stream("POST", url, json=long_body, timeout=30) as r:
                    for _ in r.iter_lines():
                        got_first.set()
            except httpx.HTTPError:
                pass  # the router went away mid-stream

        client = threading.Thread(target=stream_through_a, daemon=True)
        client.start()
        assert got_first.wait(15)
        assert len(worker.origin) == 1
        a.stop()
        wait(lambda: not worker.engine.has_unfinished() and not worker.origin)
        assert worker.engine.pool.num_free == worker.engine.pool.num_blocks  # blocks came back
        # b still serves, with the same greedy text as before
        again = httpx.post(b.url + "/v1/completions", json=body, timeout=30)
        assert again.status_code == 200
        assert again.json()["choices"][0]["text"] == texts[1].json()["choices"][0]["text"]
        client.join(10)
    finally:
        worker.running = False
        thread.join(10)
        worker.close()
        b.stop()
        ctx.term()


def queue_ack_then(router: zmq.Socket, identity: bytes, command) -> None:
    """Queue a registration ack and then `command` for a worker before it even sends its
    Register (retrying the ack until its connection is up), as a router that dispatches the
    moment it accepts a worker would."""
    from common import protocol
    from common.protocol import RegisterAck

    deadline = time.monotonic() + 10
    while True:
        try:
            router.send_multipart([identity, protocol.encode(RegisterAck(accepted=True))])
            break
        except zmq.ZMQError:  # not connected yet
            assert time.monotonic() < deadline
            time.sleep(0.01)
    router.send_multipart([identity, protocol.encode(command)])
    time.sleep(0.2)


def test_a_command_that_comes_with_the_registration_ack_is_kept() -> None:
    """A router may dispatch the moment it accepts a worker: a command read in the same poll as
    the ack goes back to the caller, not dropped (it once lost a decode worker's first Reserve)."""
    from common import protocol
    from common.protocol import Register, Reserve
    from common.runtime.router_link import RouterLink, register_any

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    link = RouterLink(f"tcp://127.0.0.1:{port}", "w-early", ctx, lambda _: None)  # type: ignore[arg-type,return-value]
    identity = link.control.sock.getsockopt(zmq.IDENTITY)
    try:
        queue_ack_then(router, identity, Reserve("r-first", [1, 2, 3], protocol.SamplingParams()))
        registration = Register(
            protocol.PROTOCOL_VERSION, "decode", "w-early", "tiny", 16, 64, 256, "float32", "h"
        )
        early = register_any([link], lambda _: registration)
        assert link.registered
        assert [(got_link, type(msg).__name__) for got_link, msg in early] == [(link, "Reserve")]
        assert early[0][1].request_id == "r-first"
    finally:
        link.close()
        router.close(0)
        ctx.term()


def test_register_keeps_a_command_that_comes_with_the_ack() -> None:
    """The single-router `register` (the scale benchmark's synthetic workers) returns what came
    with its ack too, rather than dropping it."""
    from common import protocol
    from common.protocol import Generate, Register
    from common.runtime.router_link import ControlConnection, register

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    conn = ControlConnection(f"tcp://127.0.0.1:{port}", "w-one", ctx)
    identity = conn.sock.getsockopt(zmq.IDENTITY)
    try:
        queue_ack_then(router, identity, Generate("g-first", [4, 5], protocol.SamplingParams()))
        registration = Register(
            protocol.PROTOCOL_VERSION, "decode", "w-one", "tiny", 16, 64, 256, "float32", "h"
        )
        early = register(conn, registration)
        assert [type(msg).__name__ for msg in early] == ["Generate"]
        assert early[0].request_id == "g-first"
    finally:
        conn.close()
        router.close(0)
        ctx.term()
