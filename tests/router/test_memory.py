"""router/memory.py: `malloc_trim` after large requests only, off the event loop, coalesced; glibc's
thresholds pinned so that a tokenizer thread's arena gives its free top back.

The RSS effect through a real router process is tested in tests/e2e/test_router_edges.py.
"""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from router.memory import LARGE_BYTES, Trimmer, _libc_function, pin_malloc_thresholds

# What a round of large /tokenize requests does to glibc, in a fresh process: a large mmapped
# chunk freed (glibc then raises its thresholds), then 4 threads each fill their arena with 30 MB of
# 2 kB objects and free them, then malloc_trim. Prints the RSS left over the baseline, in MiB.
_ARENA_SCRIPT = """
import ctypes, sys, threading
from router.memory import _malloc_trim, pin_malloc_thresholds
if sys.argv[1] == "pin":
    assert pin_malloc_thresholds()
def rss():
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
big = bytes(16 << 20)
del big
base = rss()
def work():
    chunks = [bytes(2000) for _ in range(15000)]
    del chunks
threads = [threading.Thread(target=work) for _ in range(4)]
for t in threads:
    t.start()
for t in threads:
    t.join()
_malloc_trim()(0)
print(rss() - base)
"""


class _SlowTrim:
    """Stands in for glibc's malloc_trim: records the threads it ran on, takes a while."""

    def __init__(self) -> None:
        self.threads: list[str] = []
        self.release = threading.Event()

    def __call__(self, pad: int) -> int:
        assert pad == 0
        self.threads.append(threading.current_thread().name)
        self.release.wait(5)
        return 1


def test_only_large_requests_trim_and_a_burst_coalesces() -> None:
    async def run() -> tuple[Trimmer, _SlowTrim]:
        trimmer, trim = Trimmer(), _SlowTrim()
        trimmer._trim = trim
        with ThreadPoolExecutor(2, "pool") as executor:
            trimmer.request_done(LARGE_BYTES - 1, executor)  # small: nothing
            await asyncio.sleep(0.05)
            assert trim.threads == []
            trimmer.request_done(LARGE_BYTES, executor)
            await asyncio.sleep(0.05)
            assert len(trim.threads) == 1  # running, and the loop is free meanwhile
            for _ in range(10):  # a burst while it runs: one more trim after it, not ten
                trimmer.request_done(LARGE_BYTES, executor)
            trim.release.set()
            while trimmer._running:
                await asyncio.sleep(0.01)
        return trimmer, trim

    trimmer, trim = asyncio.run(run())
    assert trimmer.num_trims == 2 and all(t.startswith("pool") for t in trim.threads)


def test_serve_counts_the_bytes_read_and_sent() -> None:
    seen: list[int] = []

    class _Counting(Trimmer):
        def request_done(self, num_bytes: int, executor) -> None:
            seen.append(num_bytes)

    async def app(scope, receive, send) -> None:
        await receive()
        await receive()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"x" * 300})

    async def run() -> None:
        bodies = iter([b"a" * 100, b"b" * 20])

        async def receive():
            return {"type": "http.request", "body": next(bodies), "more_body": True}

        async def send(message) -> None:
            pass

        await _Counting().serve(app, {"type": "http"}, receive, send, None)

    asyncio.run(run())
    assert seen == [420]


def _rss_left(mode: str) -> float:
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    env.pop("GLIBC_TUNABLES", None)
    out = subprocess.run(
        [sys.executable, "-c", _ARENA_SCRIPT, mode],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
        env=env,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    return float(out.stdout)


@pytest.mark.skipif(_libc_function("mallopt") is None, reason="needs glibc")
def test_pinned_thresholds_give_a_thread_arenas_free_top_back() -> None:
    pinned, unpinned = _rss_left("pin"), _rss_left("none")
    assert pinned < 8, f"{pinned:.1f} MiB left over the baseline with the thresholds pinned"
    # the scenario is the one the pinning is for: glibc's own thresholds keep most of it
    assert unpinned > 20, f"only {unpinned:.1f} MiB left without pinning: scenario not reproduced"


def test_the_environment_keeps_its_own_thresholds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "4194304")
    assert pin_malloc_thresholds() is False
    monkeypatch.delenv("MALLOC_TRIM_THRESHOLD_")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.mmap_threshold=65536")
    assert pin_malloc_thresholds() is False


def test_a_finished_request_leaves_no_reference_cycle_of_the_routers() -> None:
    """What a request leaves for the garbage collector's full collections alone (objects in
    reference cycles) is what the router's long pauses walk and what its memory holds until
    then: none of it may be the router's own (its job, buffers, flights), streamed or not.
    uvicorn's request cycle keeps one of its own, which is not ours to break."""
    import gc
    import http.client
    import json

    from tests.router.fake_worker import RouterThread

    with RouterThread(colocated=True) as router:
        router.worker("decode", "d0")

        def complete(stream: bool) -> bytes:
            conn = http.client.HTTPConnection("127.0.0.1", router.server.http_port, timeout=30)
            body = {"model": "default", "prompt": [1, 2, 3, 4], "max_tokens": 5,
                    "stream": stream, "ignore_eos": True}  # fmt: skip
            conn.request("POST", "/v1/completions", json.dumps(body))
            data = conn.getresponse().read()
            conn.close()
            return data

        assert b"[DONE]" in complete(True)  # warm: what the first request creates for good
        gc.collect()
        gc.set_debug(gc.DEBUG_SAVEALL)
        try:
            for stream in (True, False, True):
                assert (b"[DONE]" if stream else b'"finish_reason":"length"') in complete(stream)
            gc.collect()
            ours = sorted(
                {f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage}
                & {"router.job.Job", "router.relay.EventBuffer", "router.flight.Flight"}
            )
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
    assert ours == []
