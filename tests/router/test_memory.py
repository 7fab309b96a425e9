"""router/memory.py: `malloc_trim` after large requests only, off the event loop, coalesced.

The RSS effect through a real router process is tested in tests/e2e/test_router_edges.py.
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import ThreadPoolExecutor

from router.memory import LARGE_BYTES, Trimmer


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
