"""The synthetic decode workers of `benchmarks/router_scale.py`: the real protocol, no model.

`worker_proc` runs in its own process (the benchmark's `--worker-procs`): each of its worker ids
registers with every router through the worker runtime's own code (`common.runtime.worker`:
`ControlConnection`, `register`, `Heartbeater`) and answers each `Generate` with one token per
stream per step, a step's tokens in one `TokenBatch` per router (or one `TokenOutput` each), and
records when it sent each token, for the benchmark's added-latency figure.
"""

from __future__ import annotations

import heapq
import math
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

POLL_EVERY_S = 0.005


def worker_proc(
    routers: list[str], worker_ids: list[str], token_id: int, step, relay: str,
    stop, ready, results,
) -> None:  # fmt: skip
    """Run `worker_ids` as decode workers serving every router in `routers` (one control
    connection and heartbeat thread per router, as the worker runtime's links) until `stop` is
    set; put every request's token send times (monotonic seconds) on `results`. `step`: a
    shared float (multiprocessing Value), the seconds between a worker's steps, read every turn
    so that the benchmark can pace its phases."""
    import zmq

    from common import protocol
    from common.protocol import Abort, Generate, Heartbeat, Register, TokenOutput
    from common.runtime.worker import ControlConnection, Heartbeater, register

    batch_cls = getattr(protocol, "TokenBatch", None)
    if relay == "batch" and batch_cls is None:
        relay = "tokens"
    context = zmq.Context()
    context.set(zmq.MAX_SOCKETS, 8 * len(worker_ids) * len(routers) + 64)
    conns: list[list] = []  # per worker, per router
    early: list[tuple[int, int, list]] = []  # commands that came with a registration ack
    beaters, streams = [], []
    for wid in worker_ids:
        running: dict[str, list] = {}  # request id -> [tokens left, send times, router]

        def beat(wid=wid, running=running) -> Heartbeat:
            return Heartbeat(wid, len(running), 0, 100_000, 100_000)

        conns.append([])
        for address in routers:
            conn = ControlConnection(address, wid, context)
            hb = Heartbeater(address, wid, context, beat)
            reg = Register(
                version=protocol.PROTOCOL_VERSION, role="decode", worker_id=wid,
                model="default", block_size=16, num_blocks=100_000, max_model_len=8192,
                dtype="float32", host="bench", heartbeat_identity=hb.identity,
            )  # fmt: skip
            early.append((len(conns) - 1, len(conns[-1]), register(conn, reg)))
            hb.start()
            conns[-1].append(conn)
            beaters.append(hb)
        streams.append(running)
    ready.set()
    done: dict[str, list[float]] = {}

    def handle(i: int, r: int, msg) -> None:
        if isinstance(msg, Generate):
            streams[i][msg.request_id] = [msg.params.max_tokens, [], r]
        elif isinstance(msg, Abort):
            entry = streams[i].pop(msg.request_id, None)
            if entry is not None:
                done[msg.request_id] = entry[1]

    for i, r, msgs in early:
        for msg in msgs:
            handle(i, r, msg)
    poller = zmq.Poller()
    by_sock = {}
    for i, links in enumerate(conns):
        for r, conn in enumerate(links):
            poller.register(conn.sock, zmq.POLLIN)
            by_sock[conn.sock] = (i, r)

    def spread(step_s: float) -> list[tuple[float, int]]:
        """The workers' next steps, soonest first (a heap: a turn touches only the workers due,
        not all of them), spread evenly over one step from now: at a new step length too, so
        that a paced phase offers its rate evenly, not as one burst of every stream's token a
        step (the saturated phase leaves the steps bunched where each fell behind)."""
        now = time.monotonic()
        return [(now + step_s * i / len(conns), i) for i in range(len(conns))]

    step_s = step.value
    due = spread(step_s)
    # A poll of every worker's sockets costs in proportion to their number (polling them and
    # walking every worker each turn, a 500-worker process used 0.31-0.37 of a core while idle,
    # on the core the clients share; 0.16-0.18 now), so the loop polls at most every
    # POLL_EVERY_S and sleeps to the next step between polls: a Generate or Abort waits up to
    # that long (before the request's first token, which the added latency does not count); a
    # step's send does not.
    next_poll = 0.0
    while not stop.is_set():
        if step.value != step_s:
            step_s = step.value
            due = spread(step_s)
        now = time.monotonic()
        if now >= next_poll:
            wait_ms = max(0, math.ceil(1000 * (due[0][0] - now)))
            for sock, _ in poller.poll(min(wait_ms, 1000 * POLL_EVERY_S)):
                i, r = by_sock[sock]
                for msg in conns[i][r].poll():
                    handle(i, r, msg)
            next_poll = time.monotonic() + POLL_EVERY_S
        elif due[0][0] > now:
            time.sleep(min(due[0][0], next_poll) - now)
        now = time.monotonic()
        while due[0][0] <= now:
            phase, i = due[0]
            # a late step does not pile up
            heapq.heapreplace(due, (max(phase + step_s, now - step_s), i))
            links = conns[i]
            running = streams[i]
            if not running:
                continue
            by_router: list[list] = [[] for _ in links]  # one frame per router, as a worker
            for rid, entry in list(running.items()):
                entry[0] -= 1
                finished = entry[0] <= 0
                by_router[entry[2]].append((TokenOutput(
                    rid, [token_id], [], [], finished, "length" if finished else None, 4, 0
                ), entry[1]))  # fmt: skip
                if finished:
                    done[rid] = entry[1]
                    del running[rid]
            for conn, group in zip(links, by_router):
                if not group:
                    continue
                if relay == "batch":
                    conn.send(batch_cls([out for out, _ in group]))
                    sent_s = time.monotonic()
                for out, times in group:
                    if relay != "batch":
                        conn.send(out)
                        sent_s = time.monotonic()
                    times.append(sent_s)
    for hb in beaters:
        hb.stop()
    for running in streams:
        for rid, entry in running.items():
            done[rid] = entry[1]
    results.put(done)
    for links in conns:
        for conn in links:
            conn.close()
