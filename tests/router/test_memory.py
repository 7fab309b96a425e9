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

from common.runtime.malloc import libc_function
from router.memory import (
    LARGE_BYTES,
    MIDDLE_EVERY_S,
    QUIET_YOUNG,
    CollectionPacer,
    Trimmer,
    pin_malloc_thresholds,
)

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


@pytest.mark.skipif(libc_function("mallopt") is None, reason="needs glibc")
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
    then: a request, streamed or not, leaves nothing of the kind. Two such cycles were found
    and broken: a job's buffer held a bound method of the job, and the scope held uvicorn's
    request cycle (for the direct writes), which holds the scope, its connection's transport,
    flow control and events: about 20 objects a request, 25-30k freed by each full collection
    of a router starting 200 streams a second, in pauses of 75-108 ms."""
    import gc
    import http.client
    import json
    from collections import Counter

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
            left = Counter(f"{type(o).__module__}.{type(o).__qualname__}" for o in gc.garbage)
        finally:
            gc.set_debug(0)
            gc.garbage.clear()
    assert not left, f"in reference cycles after 3 requests: {dict(left.most_common(12))}"


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _pacer(clock: _Clock, rss: list[int], collected: list[int]) -> CollectionPacer:
    return CollectionPacer(
        0.02, middle_s=1.0, full_s=60.0, full_rss_growth=64 << 20, clock=clock,
        rss=lambda: rss[0], collect=lambda g: collected.append(g) or 0,
    )  # fmt: skip


def test_the_pacer_collects_young_often_middle_each_second_and_all_each_minute() -> None:
    import gc

    clock, rss, collected = _Clock(), [100 << 20], []
    pacer = _pacer(clock, rss, collected)
    gc.disable()  # no automatic collection resets the young count under the test
    try:
        kept = [[i] for i in range(10)]  # tracked since the last collection: young is due
        assert pacer.tick() == 0 and collected == [0]
        for _ in range(48):  # a second of 20 ms turns: young ones only
            clock.now += 0.02
            kept.append([0])
            assert pacer.tick() == 0
    finally:
        gc.enable()
    assert collected == [0] * 49
    clock.now += 0.05  # past the second
    assert pacer.tick() == 1
    for _ in range(58):  # seconds 2..59: a middle collection each, never a full one
        clock.now += 1.0
        assert pacer.tick() == 1
    clock.now += 1.0  # a minute since start
    assert pacer.tick() == 2
    assert pacer.collections[2] == 1 and pacer.collections[1] == 59
    clock.now += 1.0
    assert pacer.tick() == 1  # the next full one is a minute away again
    del kept


def test_the_pacer_collects_all_once_the_process_grew() -> None:
    clock, rss, collected = _Clock(), [100 << 20], []
    pacer = _pacer(clock, rss, collected)
    rss[0] += 63 << 20
    clock.now += 1.0
    assert pacer.tick() == 1  # grown, but not by 64 MiB
    rss[0] += 1 << 20
    clock.now += 1.0
    assert pacer.tick() == 2  # 64 MiB since the last full one: collect everything now
    clock.now += 1.0
    assert pacer.tick() == 1  # measured from the RSS after that collection


def test_a_quiet_pacer_waits_longer_until_a_busy_tick() -> None:
    """Ticks that find next to nothing young double the wait up to the middle generation's
    period; one that finds QUIET_YOUNG or more brings back the interval."""
    import gc

    clock, rss, collected = _Clock(), [100 << 20], []
    pacer = _pacer(clock, rss, collected)  # interval 0.02 s; its collect collects nothing
    assert pacer.wait_s == 0.02
    waits = []
    gc.disable()
    try:
        for _ in range(6):
            gc.collect(0)  # nothing young: an idle router's tick
            clock.now += pacer.wait_s
            pacer.tick()
            waits.append(pacer.wait_s)
        kept = [[i] for i in range(2 * QUIET_YOUNG)]  # a busy loop's tick
        clock.now += pacer.wait_s
        pacer.tick()
    finally:
        gc.enable()
    assert waits == [0.04, 0.08, 0.16, MIDDLE_EVERY_S, MIDDLE_EVERY_S, MIDDLE_EVERY_S]
    assert pacer.wait_s == 0.02
    del kept


def test_a_quiet_pacer_ticks_less_often_while_it_runs() -> None:
    """`run` sleeps the wait its ticks set: on a quiet loop, 0.01 s doubling towards 0.2 s makes
    a handful of ticks in 0.3 s, where a wait that stayed at the interval would make 30."""

    async def run() -> int:
        pacer = CollectionPacer(0.01)
        ticks, tick = [], pacer.tick
        pacer.tick = lambda: ticks.append(tick()) or ticks[-1]
        task = asyncio.ensure_future(pacer.run())
        await asyncio.sleep(0.3)
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return len(ticks)

    assert 2 <= asyncio.run(run()) <= 10


def test_the_pacer_owns_collection_while_it_runs() -> None:
    import gc

    async def run() -> tuple[bool, int]:
        pacer = CollectionPacer(0.01)
        task = asyncio.ensure_future(pacer.run())
        await asyncio.sleep(0.2)
        automatic = gc.isenabled()
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return automatic, pacer.collections[0]

    assert gc.isenabled()
    automatic, young = asyncio.run(run())
    assert not automatic and young >= 1
    assert gc.isenabled()  # given back on cancel


@pytest.mark.parametrize("interval_s", [-0.01, 1.5])
def test_a_bad_gc_interval_is_refused_at_start(interval_s: float) -> None:
    from router.config import RouterConfig
    from router.server import _validate

    with pytest.raises(ValueError, match="--gc-interval-s"):
        _validate(RouterConfig(gc_interval_s=interval_s))
