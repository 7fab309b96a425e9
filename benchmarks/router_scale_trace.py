"""The router's own part of a token's latency, for `benchmarks/router_scale.py --router-trace`.

Runs inside the router process (`run`, started in place of `pdserve router`): wraps the control
plane's handling of each worker message and each stream's write so that, between SIGUSR1 and
SIGUSR2, every token written straight to its HTTP connection (`router.streaming.SSEResponse`'s
direct path, nearly all of them) records the seconds from the moment the router read the message
that brought it off its control socket (`ControlPlane._receive`, right after the `recv`) to the
moment its bytes went to the connection's transport (`SSEResponse._flush`). That is the router's
event-loop work and queueing between read and write: not the worker's send or ZeroMQ's I/O
threads before the read, nor the kernel and the client after the write. Each sample has it twice:
on the wall clock (with any time the loop's thread was preempted: other processes on its core)
and in the loop thread's CPU time (its own work in between only: what it would be with a core
to itself). A flush writing several tokens of one stream counts each at the read time of the
stream's oldest chunk then waiting (the longest of them). SIGUSR2 writes the samples (JSON:
`samples`, per token [read time (monotonic seconds, the host's one clock), wall seconds to the
write, loop-thread CPU seconds to the write], and `unmeasured`, how many tokens went through the
stream's task instead) to the path given, with `gc`: each of the interpreter's garbage
collections in the loop's process meanwhile, [start (monotonic seconds), generation, wall
seconds, objects collected, the loop thread's CPU seconds, objects in the generations it walked]
(gc.callbacks): a collection stops the loop for its length, so the tokens read then wait for
it; `census`, what the first full collection walked, by type; and `slow`: the loop's
callbacks that took over SLOW_CALLBACK_S of its thread's CPU, [start, CPU seconds, what ran];
and `streams`: per response id, per token in
order, its read time and write time (monotonic seconds, flat: read, write, read, ...), so that
the benchmark can join them with the workers' send times and the clients' reads and split a
token's whole added latency in three.

The wrappers cost two clock reads per message, per flush and per loop callback (about a
microsecond a token). The samples are kept in float arrays until they are written, not as an
object or two per token: the router's garbage collector walks every container it tracks, and
the trace's own objects (a tuple per token, 40,000 in a paced phase; a first version of
`streams` added a list per token) made its full collections 30-35 ms instead of 5-9 (measured
with 1,000 workers and streams), which the paced latency then measured.
"""

from __future__ import annotations

import asyncio.events
import gc
import json
import os
import signal
import sys
import time
from array import array
from typing import Any

SLOW_CALLBACK_S = 0.001  # event-loop callbacks that took more of the loop thread's CPU: kept


def census(top: int = 25) -> dict[str, list[int]]:
    """What a full collection walks: the tracked objects outside the frozen heap, by type,
    [objects, references they hold] for the `top` types holding the most references."""
    counts: dict[str, list[int]] = {}
    for obj in gc.get_objects():
        entry = counts.setdefault(type(obj).__qualname__, [0, 0])
        entry[0] += 1
        entry[1] += len(gc.get_referents(obj))
    ranked = sorted(counts.items(), key=lambda kv: -kv[1][1])
    total = [sum(v[0] for v in counts.values()), sum(v[1] for v in counts.values())]
    return {"(all)": total, **dict(ranked[:top])}


def run(out_path: str, argv: list[str]) -> int:
    """Install the trace, then run `pdserve` with `argv` (the router command line)."""
    from common.cli import main
    from router.control import ControlPlane
    from router.streaming import SSEResponse

    clock, cpu_clock = time.monotonic, time.thread_time
    state: dict[str, Any] = {
        "on": False, "read": (0.0, 0.0), "samples": array("d"), "unmeasured": 0, "gc": [],
        "gc_start": 0.0, "gc_cpu": 0.0, "gc_size": 0, "slow": [], "streams": {}, "census": {},
    }  # fmt: skip
    receive, on_put, flush = ControlPlane._receive, SSEResponse._on_put, SSEResponse._flush

    def traced_receive(self: ControlPlane, frames: list) -> None:
        state["read"] = (clock(), cpu_clock())
        receive(self, frames)

    def traced_on_put(self: SSEResponse, event: Any) -> bool:
        waiting = len(self._out)
        taken = on_put(self, event)
        if not waiting and self._out:  # the stream's oldest chunk now waiting for `_flush`
            self._trace_read = state["read"]  # type: ignore[attr-defined]
        elif not taken and state["on"]:
            state["unmeasured"] += 1  # buffered for the stream's task
        return taken

    def traced_flush(self: SSEResponse) -> None:
        waiting = len(self._out)
        flush(self)
        if waiting and not self._out and state["on"]:
            read_s, read_cpu_s = self._trace_read  # type: ignore[attr-defined]
            write_s = clock()
            sample = (read_s, write_s - read_s, cpu_clock() - read_cpu_s)
            state["samples"].extend(sample * waiting)
            times = state["streams"].setdefault(self.response_id, array("d"))
            times.extend((read_s, write_s) * waiting)

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            if state["on"] and info["generation"] == 2 and not state["census"]:
                state["census"] = census()  # before the clock starts: not in its length
            if state["on"]:  # the objects it walks (before the clock starts)
                walked = range(info["generation"] + 1)
                state["gc_size"] = sum(len(gc.get_objects(g)) for g in walked)
            state["gc_start"], state["gc_cpu"] = clock(), cpu_clock()
        elif state["on"]:
            start_s, cpu_s = state["gc_start"], cpu_clock() - state["gc_cpu"]
            state["gc"].append(
                (
                    start_s,
                    info["generation"],
                    clock() - start_s,
                    info["collected"],
                    cpu_s,
                    state["gc_size"],
                )
            )

    handle_run = asyncio.events.Handle._run

    def timed_run(self: Any) -> None:
        t0, c0 = clock(), cpu_clock()
        handle_run(self)
        cpu_s = cpu_clock() - c0
        if cpu_s > SLOW_CALLBACK_S and state["on"]:
            state["slow"].append((t0, cpu_s, repr(getattr(self, "_callback", self))[:120]))

    asyncio.events.Handle._run = timed_run  # type: ignore[method-assign]

    def start(*_: Any) -> None:
        state["samples"], state["unmeasured"], state["gc"], state["slow"] = array("d"), 0, [], []
        state["streams"], state["census"] = {}, {}
        state["on"] = True

    def stop(*_: Any) -> None:
        state["on"] = False
        with open(out_path + ".part", "w") as f:
            json.dump(
                {
                    "samples": [
                        state["samples"][i : i + 3].tolist()
                        for i in range(0, len(state["samples"]), 3)
                    ],
                    "unmeasured": state["unmeasured"],
                    "gc": state["gc"],
                    "slow": state["slow"],
                    "census": state["census"],
                    "streams": {rid: t.tolist() for rid, t in state["streams"].items()},
                },
                f,
            )
        os.replace(out_path + ".part", out_path)  # there whole, or not yet

    ControlPlane._receive = traced_receive  # type: ignore[method-assign]
    SSEResponse._on_put = traced_on_put  # type: ignore[method-assign]
    SSEResponse._flush = traced_flush  # type: ignore[method-assign]
    gc.callbacks.append(on_gc)
    signal.signal(signal.SIGUSR1, start)
    signal.signal(signal.SIGUSR2, stop)
    sys.argv[0] = "pdserve"
    return main(argv)


if __name__ == "__main__":
    sys.exit(run(sys.argv[1], sys.argv[2:]))
