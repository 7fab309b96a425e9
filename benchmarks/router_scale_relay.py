"""The router's relay path in one process: Python CPU per relayed token, without sockets.

`benchmarks/router_scale.py` measures the whole router process (kernel, ZeroMQ's I/O thread,
HTTP clients and workers sharing the host); this measures only what the router's event loop
runs per token, repeatably on a busy host: the real `router.control.ControlPlane`,
`router.dispatch.Dispatcher`, `router.job.Job` and `router.streaming.SSEResponse` (its direct
writer on a transport that keeps the bytes), fed encoded `TokenBatch` frames as the control
socket hands them over (`ControlPlane._receive`, `MAX_MESSAGES_PER_WAKEUP` per loop turn). No
socket reads or writes, no heartbeats. Every stream's bytes are checked to hold every token's
event and `[DONE]`.

Run: .venv/bin/python benchmarks/router_scale_relay.py [--workers 1000 --streams-per-worker 1
--tokens 50] [--profile out.prof]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
from types import SimpleNamespace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


class _Transport:
    """Keeps what the direct writer writes (the bytes a client would read)."""

    def __init__(self) -> None:
        self.out: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.out.append(data)

    def is_closing(self) -> bool:
        return False


class _Cycle:
    """What `router.sse.DirectWriter` reads of uvicorn's request cycle (HTTP/1.1, chunked)."""

    chunked_encoding = True

    def __init__(self) -> None:
        self.flow = SimpleNamespace(write_paused=False)
        self.disconnected = False
        self.transport = _Transport()


async def run(workers: int, per_worker: int, tokens: int, profile: str) -> dict[str, float]:
    """Relay `tokens` tokens on `workers * per_worker` streams; CPU figures of the loop's work."""
    from common.api.choice import Choice
    from common.api.prompts import choice_params, engine_inputs
    from common.api.requests import parse_request
    from common.api.tokenizer import Tokenizer
    from common.model.model_files import resolve_model
    from common.protocol import PROTOCOL_VERSION, Register, TokenBatch, TokenOutput, encode
    from router.control import ControlPlane
    from router.dispatch import Dispatcher
    from router.kv_index import PrefixIndex
    from router.metrics import RouterMetrics
    from router.registry import Registry
    from router.relay import RelayBudget
    from router.sse import HTTP_CYCLE
    from router.streaming import SSEResponse

    tok = Tokenizer.from_source(resolve_model("default"))
    token_id = tok.encode(" hello", False)[0]
    registry = Registry({"default"}, timeout_s=3600.0)
    control = ControlPlane(registry, PrefixIndex())
    dispatcher = Dispatcher(registry, lambda worker, msg: True)  # Aborts go nowhere
    control.dispatcher = dispatcher
    metrics, budget = RouterMetrics(), RelayBudget()
    ids = [f"bench-decode-{i}" for i in range(workers)]
    for wid in ids:
        registry.register(wid.encode(), Register(
            version=PROTOCOL_VERSION, role="decode", worker_id=wid, model="default",
            block_size=16, num_blocks=100_000, max_model_len=8192, dtype="float32", host="bench",
        ))  # fmt: skip
    body = {"model": "default", "prompt": [1, 2, 3, 4], "max_tokens": tokens, "stream": True,
            "ignore_eos": True}  # fmt: skip

    async def receive() -> dict:
        await asyncio.Event().wait()  # the client never leaves
        return {"type": "http.disconnect"}

    from router.job import Job

    cycles, tasks, rids = [], [], []  # per stream; rids[w]: worker w's request ids
    for w, wid in enumerate(ids):
        rids.append([])
        for s in range(per_worker):
            gen = parse_request("/v1/completions", body, ["default"])
            inputs = engine_inputs(gen, tok, 2048)
            choices = [Choice(0, inputs[0].prompt_token_ids, p, gen, tok)
                       for p in choice_params(inputs[0].params, 1)]  # fmt: skip
            prompt = inputs[0].prompt_token_ids
            job = Job(dispatcher, f"cmpl-{w}-{s}", [(prompt, choices[0].params)], budget)
            flight = job.flights[0]
            flight.assign_decode(registry.workers[wid])
            flight.dispatched = True
            dispatcher.flights[flight.request_id] = flight
            rids[-1].append(flight.request_id)
            timer = metrics.start_request()
            timer.dispatched()
            response = SSEResponse(gen, f"cmpl-{w}-{s}", 1700, job, choices, tok, 4, 3600.0, timer)
            cycle = _Cycle()
            cycles.append(cycle)

            async def send(message: dict, out: list[bytes] = cycle.transport.out) -> None:
                if message.get("body"):  # what the server's own send frames: raw here
                    out.append(message["body"])

            tasks.append(asyncio.ensure_future(response({"type": "http", HTTP_CYCLE: cycle},
                                                        receive, send)))  # fmt: skip
    await asyncio.sleep(0.05)  # every response started and waiting
    frames = []  # per step, per worker: [identity, frame] as the control socket hands them over
    for step in range(tokens):
        last = step == tokens - 1
        frames.append([[wid.encode(), encode(TokenBatch([
            TokenOutput(rid, [token_id], [], [], last, "length" if last else None, 4, 0)
            for rid in rids[w]
        ]))] for w, wid in enumerate(ids)])  # fmt: skip
    per_wakeup = control.MAX_MESSAGES_PER_WAKEUP
    profiler = None
    if profile:
        import cProfile

        profiler = cProfile.Profile(time.process_time)
        profiler.enable()
    import gc

    gc_s = [0.0, 0.0, 0.0]  # CPU seconds in collections of each generation
    gc_started = [0.0]

    def gc_timer(phase: str, info: dict) -> None:
        if phase == "start":
            gc_started[0] = time.process_time()
        else:
            gc_s[info["generation"]] += time.process_time() - gc_started[0]

    gc.callbacks.append(gc_timer)
    gc0 = [g["collections"] for g in gc.get_stats()]
    cpu0, wall0 = time.process_time(), time.perf_counter()
    for step_frames in frames:
        for i in range(0, len(step_frames), per_wakeup):
            for message in step_frames[i : i + per_wakeup]:
                control._receive(message)
            await asyncio.sleep(0)  # the loop's other work: the streams' flushes
    await asyncio.gather(*tasks)
    cpu, wall = time.process_time() - cpu0, time.perf_counter() - wall0
    gc.callbacks.remove(gc_timer)
    collections = [g["collections"] - c for g, c in zip(gc.get_stats(), gc0)]
    if profiler is not None:
        profiler.disable()
        profiler.dump_stats(profile)
    num_tokens = workers * per_worker * tokens
    events, writes = 0, 0
    for cycle in cycles:
        data = b"".join(cycle.transport.out)
        writes += len(cycle.transport.out)
        assert data.count(b"data: {") == tokens, "a stream lost tokens"
        assert data.endswith(b"data: [DONE]\n\n"), "a stream did not end with [DONE]"
        events += tokens
    return {
        "streams": workers * per_worker,
        "relayed_tokens": num_tokens,
        "loop_cpu_us_per_token": 1e6 * cpu / num_tokens,
        "relayed_tokens_per_loop_cpu_s": num_tokens / cpu,
        "writes_per_token": writes / num_tokens,
        "gc_cpu_us_per_token": 1e6 * sum(gc_s) / num_tokens,
        "gc_collections_gen0": collections[0],
        "gc_collections_gen1": collections[1],
        "gc_collections_gen2": collections[2],
        "gc_gen2_ms_each": 1e3 * gc_s[2] / max(collections[2], 1),
        "wall_s": wall,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=1000)
    ap.add_argument("--streams-per-worker", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=50, help="tokens per stream")
    ap.add_argument("--repeat", type=int, default=1, help="runs; the best is printed")
    ap.add_argument("--profile", default="", help="cProfile (CPU time) of the relay, stats here")
    ap.add_argument("--event-loop", choices=("uvloop", "asyncio"), default="uvloop")
    args = ap.parse_args()
    from router.memory import freeze_startup_heap
    from router.server import run_loop

    freeze_startup_heap()  # as the router does once it has started
    best: dict[str, float] = {}
    for _ in range(args.repeat):
        out: dict[str, float] = {}

        async def once(out: dict[str, float] = out) -> None:
            out.update(await run(args.workers, args.streams_per_worker, args.tokens, args.profile))

        run_loop(once(), args.event_loop)
        if not best or out["loop_cpu_us_per_token"] < best["loop_cpu_us_per_token"]:
            best = out
    width = max(len(k) for k in best)
    for k, v in best.items():
        print(f"{k:<{width}}  {v:.4g}" if isinstance(v, float) else f"{k:<{width}}  {v}")


if __name__ == "__main__":
    main()
