"""How many tokens one router process relays, and what it costs: the router's scale benchmark.

Drives one real router (`pdserve router --colocated`, its own process, real sockets) with N
synthetic decode workers that speak the real control protocol through the worker runtime's own
code (`common.runtime.worker`: `ControlConnection`, `register`, `Heartbeater`) and answer each
`Generate` with a scripted token stream (no model: one token per stream per step, every
`--step-ms`), and with real HTTP clients (raw asyncio streams, several processes, their CPU
measured too so that they are seen not to be the bottleneck). Workers run in `--worker-procs`
processes, clients in `--client-procs`.

Phases: (0) idle: the router's CPU share while it holds the N workers (`--idle-s`); (1) routing:
`--routing-requests` non-streamed completions of one token against the N registered workers, 64
at a time per client process: routing decisions (dispatched requests) per second, router CPU per
request, decisions per router CPU second (and per CPU second beyond the idle share); (2) relay:
`--streams` concurrent streamed completions of `--tokens` tokens each: relayed tokens/s, router
CPU per token (/proc/<pid>/stat over the phase) and its kernel share, added latency (a worker's
send time of token i to the client's receipt of data event i, on the one monotonic clock this
host shares), router RSS per open stream (peak over idle); (3) the prefix index's memory per
million blocks (tracemalloc around a standalone `router.kv_index.PrefixIndex` fed
`--index-blocks` keys).

Workers send a step's tokens as one `TokenBatch` per router when `common.protocol` has it, else
one `TokenOutput` per token (`--relay tokens` forces that: the pre-batch wire, for comparisons).
With `--routers N` there are N router processes, every worker serves all of them (a control
connection and heartbeat thread per router, as the runtime's router links) and the clients spread
their requests over them; CPU figures are the routers' sum, `router_core_use` the busiest's.

Run: .venv/bin/python benchmarks/router_scale.py [--workers 100 --streams 500 --tokens 100]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import re
import subprocess
import sys
import tempfile
import time
import tracemalloc

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


# ---- the router process -------------------------------------------------------------------------


def proc_cpu_s(pid: int, system_only: bool = False) -> float:
    """User + system (or system only) CPU seconds of process `pid` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[12]) + (0 if system_only else int(fields[11]))) / CLOCK_TICKS


def proc_runqueue_wait_s(pid: int) -> float:
    """Seconds the process's main thread (the router's event loop) has been runnable but not
    running, waiting for a core (/proc/<pid>/schedstat): the host's share of its lateness."""
    try:
        with open(f"/proc/{pid}/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return float("nan")


def loop_lag_s(port: int) -> float:
    """The router's smoothed event-loop lag, from its /metrics (nan if it has none)."""
    import urllib.request

    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            text = r.read().decode()
    except OSError:
        return float("nan")
    match = re.search(r"^pdserve:router_event_loop_lag_seconds ([0-9.e+-]+)$", text, re.M)
    return float(match.group(1)) if match else float("nan")


def proc_rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/statm") as f:
        return int(f.read().split()[1]) * PAGE_BYTES


# The router under cProfile timing CPU seconds, not wall seconds: on a shared host the wall clock
# charges a function for the time other processes held the core.
CPU_PROFILE = (
    "import cProfile, sys, time; from common.cli import main; sys.argv[0] = 'pdserve'; "
    "p = cProfile.Profile(time.process_time); p.enable(); "
    "rc = main(sys.argv[2:]); p.disable(); p.dump_stats(sys.argv[1]); sys.exit(rc)"
)


def start_router(
    python: str, ready_file: str, profile: str = "", heartbeat_timeout_s: float = 0.0,
    max_loop_lag_s: float = 0.0, event_loop: str = "",
) -> subprocess.Popen:  # fmt: skip
    run = ["-c", CPU_PROFILE, profile] if profile else ["-m", "common.cli"]
    cmd = [python, *run, "router", "--port", "0", "--control-port", "0",
           "--colocated", "--routing", "least_loaded", "--log-level", "warning",
           "--ready-file", ready_file, "--max-loop-lag-s", str(max_loop_lag_s)]  # fmt: skip
    if heartbeat_timeout_s:
        cmd += ["--heartbeat-timeout-s", str(heartbeat_timeout_s)]
    if event_loop:
        cmd += ["--event-loop", event_loop]
    proc = subprocess.Popen(cmd, cwd=ROOT)
    deadline = time.monotonic() + 120
    while not os.path.exists(ready_file):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the router did not start")
        time.sleep(0.1)
    return proc


# ---- synthetic decode workers -------------------------------------------------------------------


def worker_proc(
    routers: list[str], worker_ids: list[str], token_id: int, step_s: float, relay: str,
    stop, ready, results,
) -> None:  # fmt: skip
    """Run `worker_ids` as decode workers serving every router in `routers` (one control
    connection and heartbeat thread per router, as the worker runtime's links) until `stop` is
    set; put every request's token send times (monotonic seconds) on `results`."""
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
            register(conn, reg)
            hb.start()
            conns[-1].append(conn)
            beaters.append(hb)
        streams.append(running)
    ready.set()
    done: dict[str, list[float]] = {}
    poller = zmq.Poller()
    by_sock = {}
    for i, links in enumerate(conns):
        for r, conn in enumerate(links):
            poller.register(conn.sock, zmq.POLLIN)
            by_sock[conn.sock] = (i, r)
    phase = [time.monotonic() + step_s * i / len(conns) for i in range(len(conns))]
    while not stop.is_set():
        now = time.monotonic()
        wait_ms = max(0, int(1000 * (min(phase) - now)))
        for sock, _ in poller.poll(min(wait_ms, 5)):
            i, r = by_sock[sock]
            for msg in conns[i][r].poll():
                if isinstance(msg, Generate):
                    streams[i][msg.request_id] = [msg.params.max_tokens, [], r]
                elif isinstance(msg, Abort):
                    entry = streams[i].pop(msg.request_id, None)
                    if entry is not None:
                        done[msg.request_id] = entry[1]
        now = time.monotonic()
        for i, links in enumerate(conns):
            if now < phase[i]:
                continue
            phase[i] = max(phase[i] + step_s, now - step_s)  # a late step does not pile up
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


# ---- HTTP clients -------------------------------------------------------------------------------

PATTERN = b"data: {"
RESPONSE_ID = re.compile(rb'"id": ?"([^"]+)"')


def _request(port: int, body: dict, keep_alive: bool) -> bytes:
    raw = json.dumps(body).encode()
    return (
        f"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(raw)}\r\n"
        f"Connection: {'keep-alive' if keep_alive else 'close'}\r\n\r\n"
    ).encode() + raw


async def _stream(port: int, body: dict, out: list) -> None:
    """One streamed completion: (response id, status, receipt time of each data event)."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    writer.write(_request(port, body, keep_alive=False))
    times: list[float] = []
    record = ["", 0, times]  # kept up to date: a stream cut by --duration still counts
    out.append(record)
    tail, head, rid = b"", b"", ""
    while True:
        data = await reader.read(65536)
        if not data:
            break
        now = time.monotonic()
        if not rid:
            head += data
            match = RESPONSE_ID.search(head)
            if match:
                rid = record[0] = match.group(1).decode()
                record[1] = int(head[9:12]) if head[:5] == b"HTTP/" else 0
        buf = tail + data
        times.extend([now] * buf.count(PATTERN))
        tail = buf[-(len(PATTERN) - 1) :]
        if b"data: [DONE]" in buf:
            break
    writer.close()
    record[1] = int(head[9:12]) if head[:5] == b"HTTP/" else 0


async def _unary(port: int, bodies: list[dict], statuses: list[int]) -> None:
    """Non-streamed requests one after another on one keep-alive connection."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    for body in bodies:
        writer.write(_request(port, body, keep_alive=True))
        head = await reader.readuntil(b"\r\n\r\n")
        length = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                length = int(line.split(b":")[1])
        await reader.readexactly(length)
        statuses.append(int(head[9:12]))
    writer.close()


def client_proc(
    ports: list[int], kind: str, count: int, tokens: int, duration_s: float, go, results
) -> None:
    """`count` streams (kind "stream") or one-token requests (kind "route"), started together
    when `go` is set, spread over the routers' `ports`; puts (results, client CPU seconds, wall
    seconds) on `results`; gives up after `duration_s` (what arrived by then counts)."""
    prompt = [1, 2, 3, 4]

    out: list = []

    async def main() -> None:
        try:
            await asyncio.wait_for(requests(), duration_s)
        except asyncio.TimeoutError:
            pass

    async def requests() -> None:
        if kind == "stream":
            body = {"model": "default", "prompt": prompt, "max_tokens": tokens, "stream": True,
                    "ignore_eos": True}  # fmt: skip
            await asyncio.gather(*(_stream(ports[k % len(ports)], body, out) for k in range(count)))
        else:
            body = {"model": "default", "prompt": prompt, "max_tokens": 1}
            lanes = min(64, count)
            per = [[body] * (count // lanes + (i < count % lanes)) for i in range(lanes)]
            await asyncio.gather(
                *(_unary(ports[k % len(ports)], bodies, out) for k, bodies in enumerate(per))
            )

    go.wait()
    cpu0, wall0 = time.process_time(), time.monotonic()
    asyncio.run(main())
    results.put((out, time.process_time() - cpu0, time.monotonic() - wall0))


def run_clients(ctx, ports: list[int], kind: str, total: int, procs: int, tokens: int,
                router_pids: list[int], sample_rss: bool, duration_s: float,
                lag_every_s: float = 0.0) -> dict:  # fmt: skip
    go, results = ctx.Event(), ctx.Queue()
    shares = [total // procs + (i < total % procs) for i in range(procs)]
    clients = [ctx.Process(target=client_proc, args=(ports, kind, n, tokens, duration_s, go,
                                                        results))
               for n in shares if n]  # fmt: skip
    for c in clients:
        c.start()
    time.sleep(1.0)  # the clients' imports, before the clock starts
    rss0 = sum(proc_rss_bytes(pid) for pid in router_pids)
    cpu0 = [proc_cpu_s(pid) for pid in router_pids]
    sys0 = [proc_cpu_s(pid, system_only=True) for pid in router_pids]
    waits0 = [proc_runqueue_wait_s(pid) for pid in router_pids]
    load0 = os.getloadavg()[0]
    wall0 = time.monotonic()
    go.set()
    got, rss_peak, lags, next_lag = [], rss0, [], wall0 + lag_every_s
    while len(got) < len(clients):
        try:
            got.append(results.get(timeout=0.2))
        except Exception:
            pass
        if sample_rss:
            rss_peak = max(rss_peak, sum(proc_rss_bytes(pid) for pid in router_pids))
            if lag_every_s and time.monotonic() >= next_lag:
                lags.append(loop_lag_s(ports[0]))
                next_lag += lag_every_s
    wall = time.monotonic() - wall0
    cpus = [proc_cpu_s(pid) - c for pid, c in zip(router_pids, cpu0)]
    system = sum(proc_cpu_s(pid, system_only=True) - c for pid, c in zip(router_pids, sys0))
    waits = [proc_runqueue_wait_s(pid) - w for pid, w in zip(router_pids, waits0)]
    for c in clients:
        c.join()
    return {
        "results": [r for out, _, _ in got for r in out],
        "client_cpu_s": sum(c for _, c, _ in got),
        "router_cpu_s": sum(cpus),
        "router_system_cpu_s": system,  # in the kernel: socket reads and writes
        "router_core_use_max": max(cpus) / wall,
        # Of the wall time, the share the busiest router's loop waited for a core it wanted.
        "router_runqueue_wait_share": max(waits) / wall,
        "router_loop_lag_s": lags,  # the first router's smoothed loop lag, every lag_every_s
        "host_load_avg": (load0, os.getloadavg()[0]),
        "wall_s": wall,
        "rss0": rss0,
        "rss_peak": rss_peak,
    }


# ---- the prefix index ---------------------------------------------------------------------------


def index_bytes_per_million(num_blocks: int, num_workers: int = 8) -> float:
    """Bytes a standalone PrefixIndex holds for `num_blocks` keys, scaled to a million."""
    from common.prefix_hash import KEY_BYTES
    from common.protocol import KVEvents
    from router.kv_index import PrefixIndex

    per = num_blocks // num_workers
    batches = [[os.urandom(KEY_BYTES) for _ in range(per)] for _ in range(num_workers)]
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    index = PrefixIndex()
    for w, keys in enumerate(batches):
        index.apply(KVEvents(f"w{w}", 0, keys, [], reset=True))
    used = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    del index
    return used / (per * num_workers) * 1e6


# ---- routing decisions alone --------------------------------------------------------------------


def decision_us(num_workers: int, routing: str, repeats: int = 300) -> float:
    """Microseconds the router's decode choice takes (`Dispatcher._pick_decode`, no HTTP) with
    `num_workers` decode workers registered and heartbeating, best of 3 rounds."""
    from common import protocol
    from common.protocol import Heartbeat, Register
    from common.sampling_params import SamplingParams
    from router.dispatch import Dispatcher, Flight
    from router.registry import Registry

    registry = Registry({"default"})
    for i in range(num_workers):
        wid = f"w{i}"
        registry.register(wid.encode(), Register(
            protocol.PROTOCOL_VERSION, "decode", wid, "default", 16, 100_000, 8192,
            "float32", "bench", kv_salt=b"salt",
        ))  # fmt: skip
        registry.on_heartbeat(Heartbeat(wid, i % 7, 0, 100_000, 100_000))
    dispatcher = Dispatcher(registry, lambda w, m: True, routing=routing)
    flight = Flight("r", 0, list(range(100)), SamplingParams(), None)  # type: ignore[arg-type]
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        for _ in range(repeats):
            dispatcher._pick_decode(flight)
        best = min(best, (time.perf_counter() - t0) / repeats)
    return best * 1e6


def prefill_decision_us(num_workers: int, routing: str, repeats: int = 300) -> float:
    """Microseconds the prefill choice takes (`PrefillPolicy.choose` over the registry's live
    prefill workers, no HTTP) with `num_workers` prefill workers registered, loads spread, and a
    1,024-token prefix held in full by one worker in a hundred and in part by the others of
    them; best of 3 rounds. The prefix policy's figure includes hashing the prompt's block keys
    (`prompt_hash_us`), the rest is the choice."""
    from common import protocol
    from common.prefix_hash import block_keys
    from common.protocol import Heartbeat, KVEvents, Register
    from router.kv_index import PrefixIndex
    from router.policy import PrefillPolicy
    from router.registry import Registry

    salt = b"salt"
    registry = Registry({"default"})
    index = PrefixIndex()
    prefix = list(range(1024))
    keys = block_keys(prefix, 16, salt)
    for i in range(num_workers):
        wid = f"p{i}"
        registry.register(wid.encode(), Register(
            protocol.PROTOCOL_VERSION, "prefill", wid, "default", 16, 100_000, 8192,
            "float32", "bench", kv_salt=salt,
        ))  # fmt: skip
        registry.on_heartbeat(Heartbeat(wid, 0, 0, 100_000, 100_000, 64 * (i % 50)))
        if i % 100 == 1:
            index.apply(KVEvents(wid, 0, keys[: 64 if i % 200 == 1 else 8], [], reset=True))
    policy = PrefillPolicy(routing, index)
    live = registry.live_index("prefill")
    prompts = [prefix + [r] for r in range(repeats)]
    return _best_us(lambda: [policy.choose(live, prompt) for prompt in prompts], repeats)


def prompt_hash_us(repeats: int = 300) -> float:
    """Microseconds to hash a 1,025-token prompt's block keys (what the prefix policy does once
    per request and salt, whatever the number of workers)."""
    from common.prefix_hash import block_keys

    prompts = [list(range(1024)) + [r] for r in range(repeats)]
    return _best_us(lambda: [block_keys(prompt, 16, b"salt") for prompt in prompts], repeats)


def _best_us(run, repeats: int) -> float:
    best = float("inf")
    for _ in range(3):
        t0 = time.perf_counter()
        run()
        best = min(best, (time.perf_counter() - t0) / repeats)
    return best * 1e6


def decision_figures(num_workers: int) -> dict[str, float]:
    """Microseconds per choice at `num_workers` workers: the decode choice (colocated; round
    robin chooses decode workers as least_loaded does) and the prefill choice, per policy."""
    figures = {}
    for routing in ("least_loaded", "prefix"):
        figures[f"decision_us_{routing}"] = decision_us(num_workers, routing)
    for routing in ("least_loaded", "round_robin", "prefix"):
        figures[f"prefill_decision_us_{routing}"] = prefill_decision_us(num_workers, routing)
    figures["prompt_hash_us"] = prompt_hash_us()
    return figures


# ---- the run ------------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=100, help="synthetic decode workers")
    ap.add_argument("--worker-procs", type=int, default=2)
    ap.add_argument("--streams", type=int, default=500, help="concurrent streamed completions")
    ap.add_argument("--tokens", type=int, default=100, help="tokens per stream")
    ap.add_argument("--step-ms", type=float, default=50.0, help="a worker's step: one token per "
                    "stream per step")  # fmt: skip
    ap.add_argument("--client-procs", type=int, default=2)
    ap.add_argument("--routing-requests", type=int, default=2000)
    ap.add_argument("--index-blocks", type=int, default=1_000_000)
    ap.add_argument("--duration", type=float, default=120.0, help="longest each phase runs (s)")
    ap.add_argument("--relay", choices=("batch", "tokens"), default="batch")
    ap.add_argument("--routers", type=int, default=1, help="router processes; every worker "
                    "serves all, the clients spread over them")  # fmt: skip
    ap.add_argument("--heartbeat-timeout-s", type=float, default=0.0, help="the router's "
                    "(0: its default). Hundreds of synthetic workers' heartbeat threads on a "
                    "small host can be late through no fault of the router's: a longer timeout "
                    "keeps them from being declared dead mid-measurement")  # fmt: skip
    ap.add_argument("--idle-s", type=float, default=5.0, help="seconds the router's CPU is "
                    "measured with the workers registered and no requests")  # fmt: skip
    ap.add_argument("--lag-every-s", type=float, default=0.0, help="during the relay, read the "
                    "router's smoothed event-loop lag from its /metrics this often (0: never; a "
                    "scrape renders every worker's series in the loop, which itself delays "
                    "tokens: tens of ms at 100 workers)")  # fmt: skip
    ap.add_argument("--json", default="", help="also write the figures here")
    ap.add_argument("--profile", default="", help="run the router under cProfile (CPU time), "
                    "stats here")  # fmt: skip
    ap.add_argument("--max-loop-lag-s", type=float, default=0.0, help="the router's (0: off, "
                    "the default here: this measures what a router can do, and the synthetic "
                    "workers and clients share its host; on a loaded host its loop runs late and "
                    "it would refuse work with 429s, as it should)")  # fmt: skip
    ap.add_argument("--event-loop", default="", help="the router's --event-loop (auto, uvloop, "
                    "asyncio; default: the router's own default)")  # fmt: skip
    ap.add_argument("--decisions-only", action="store_true", help="only the routing choices "
                    "themselves (no router process, no HTTP): microseconds per decode and per "
                    "prefill choice with --workers workers, for each policy")  # fmt: skip
    args = ap.parse_args()
    if args.decisions_only:
        for name, value in decision_figures(args.workers).items():
            print(f"{name:<34}  {value:.4g}")
        return

    from common import protocol

    relay = args.relay if hasattr(protocol, "TokenBatch") else "tokens"
    ctx = mp.get_context("spawn")
    from common.api.tokenizer import Tokenizer
    from common.model.model_files import resolve_model

    token_id = Tokenizer.from_source(resolve_model("default")).encode(" hello", False)[0]
    tmp = tempfile.mkdtemp(prefix="router_scale")
    routers, ports, controls = [], [], []
    stop, res_q = ctx.Event(), ctx.Queue()
    workers = []
    try:
        for r in range(args.routers):
            ready_file = os.path.join(tmp, f"ready{r}.json")
            profile = f"{args.profile}.{r}" if args.profile and r else args.profile
            routers.append(
                start_router(
                    sys.executable,
                    ready_file,
                    profile,
                    args.heartbeat_timeout_s,
                    args.max_loop_lag_s,
                    args.event_loop,
                )  # fmt: skip
            )
            with open(ready_file) as f:
                ready_info = json.load(f)
            ports.append(ready_info["http_port"])
            controls.append(ready_info["control_address"])
        pids = [router.pid for router in routers]
        ids = [f"bench-decode-{i}" for i in range(args.workers)]
        readies = []
        for p in range(args.worker_procs):
            ready = ctx.Event()
            proc = ctx.Process(
                target=worker_proc,
                args=(controls, ids[p :: args.worker_procs], token_id, args.step_ms / 1000,
                      relay, stop, ready, res_q),
            )  # fmt: skip
            proc.start()
            workers.append(proc)
            readies.append(ready)
        for ready in readies:
            if not ready.wait(300):
                raise RuntimeError("the workers did not register")
        time.sleep(1.5)  # a heartbeat from each
        rss_idle = sum(proc_rss_bytes(pid) for pid in pids)
        idle_cpu0, idle_wall0 = sum(proc_cpu_s(pid) for pid in pids), time.monotonic()
        time.sleep(args.idle_s)  # what holding the workers costs: heartbeats, liveness checks
        idle_core_use = (sum(proc_cpu_s(pid) for pid in pids) - idle_cpu0) / (
            time.monotonic() - idle_wall0
        )

        route = run_clients(ctx, ports, "route", args.routing_requests, args.client_procs, 1,
                            pids, sample_rss=False, duration_s=args.duration)  # fmt: skip
        ok_routes = sum(1 for s in route["results"] if s == 200)
        time.sleep(1.0)
        relayed = run_clients(ctx, ports, "stream", args.streams, args.client_procs,
                              args.tokens, pids, sample_rss=True,
                              duration_s=args.duration, lag_every_s=args.lag_every_s)  # fmt: skip
        stop.set()
        sent: dict[str, list[float]] = {}
        for _ in workers:
            sent.update(res_q.get(timeout=60))
        for proc in workers:
            proc.join(30)
    finally:
        stop.set()
        for router in routers:
            router.terminate()
            try:
                router.wait(20)
            except subprocess.TimeoutExpired:
                router.kill()
        for proc in workers:
            if proc.is_alive():
                proc.kill()

    streams = relayed["results"]
    num_tokens = sum(len(t) for _, _, t in streams)
    first = min((t[0] for _, _, t in streams if t), default=0.0)
    last = max((t[-1] for _, _, t in streams if t), default=0.0)
    latencies = []
    for rid, _, times in streams:
        send = sent.get(f"{rid}-0", [])
        latencies.extend(r - s for s, r in zip(send, times))
    complete = sum(1 for _, s, t in streams if s == 200 and len(t) == args.tokens)
    figures = {
        "relay": relay,
        "routers": args.routers,
        "workers": args.workers,
        "streams": args.streams,
        "tokens_per_stream": args.tokens,
        "offered_tokens_per_s": args.streams * 1000 / args.step_ms,
        "router_idle_core_use": idle_core_use,  # heartbeats and liveness of --workers
        "routing_decisions_per_s": ok_routes / route["wall_s"],
        "routing_ok": ok_routes,
        "routing_refused": sum(1 for s in route["results"] if s == 429),
        "router_cpu_us_per_route": 1e6 * route["router_cpu_s"] / max(ok_routes, 1),
        # What one router core would do if it had nothing else to run (this host's clients and
        # workers share its cores): requests routed per second of router CPU.
        "routing_decisions_per_router_cpu_s": ok_routes / max(route["router_cpu_s"], 1e-9),
        # The same less what the router spends holding the workers while idle.
        "routing_decisions_per_marginal_cpu_s": ok_routes
        / max(route["router_cpu_s"] - idle_core_use * route["wall_s"], 1e-9),
        "routing_client_cpu_s": route["client_cpu_s"],
        "routing_wall_s": route["wall_s"],
        "streams_complete": complete,
        "relayed_tokens": num_tokens,
        "relayed_tokens_per_s": num_tokens / max(last - first, 1e-9),
        "router_cpu_us_per_token": 1e6 * relayed["router_cpu_s"] / max(num_tokens, 1),
        "relayed_tokens_per_router_cpu_s": num_tokens / max(relayed["router_cpu_s"], 1e-9),
        "router_cpu_s": relayed["router_cpu_s"],
        "router_kernel_share": relayed["router_system_cpu_s"] / max(relayed["router_cpu_s"], 1e-9),
        "relay_wall_s": relayed["wall_s"],
        "router_core_use": relayed["router_core_use_max"],  # the busiest router's
        # Latency the host adds: the router runnable but not running (other processes' load).
        "router_runqueue_wait_share": relayed["router_runqueue_wait_share"],
        "router_loop_lag_p50_ms": 1e3 * pct(relayed["router_loop_lag_s"], 0.5),
        "router_loop_lag_max_ms": 1e3 * max(relayed["router_loop_lag_s"], default=float("nan")),
        "host_load_avg_start": relayed["host_load_avg"][0],
        "host_load_avg_end": relayed["host_load_avg"][1],
        "client_cpu_s": relayed["client_cpu_s"],
        "latency_p50_ms": 1e3 * pct(latencies, 0.5),
        "latency_p99_ms": 1e3 * pct(latencies, 0.99),
        "router_rss_idle_mib": rss_idle / 2**20 / args.routers,
        "router_rss_kib_per_stream": (relayed["rss_peak"] - relayed["rss0"]) / 1024 / args.streams,
    }
    figures["index_mib_per_million_blocks"] = index_bytes_per_million(args.index_blocks) / 2**20
    figures.update(decision_figures(args.workers))
    width = max(len(k) for k in figures)
    for k, v in figures.items():
        print(f"{k:<{width}}  {v:.4g}" if isinstance(v, float) else f"{k:<{width}}  {v}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
