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
host shares), router RSS per open stream (peak over idle); (2b) paced relay (`--paced-rate`,
after the saturated one): the same number of streams, `--paced-tokens` each, the workers stepping
every streams/rate seconds so that the offered rate stays below what the router can do: added
latency p50/p90/p99/max (`paced_*`) of the tokens sent once every stream had its first, the rate
relayed, router CPU and core share; (2c) churn (`--churn-s`, after the paced phase): steady
arrivals, `--streams` lanes each opening a new stream of `--churn-tokens` as its last one ends
(lanes started spread over one stream's length), at `--churn-rate` tokens/s: the `churn_*` keys,
the same figures over the tokens sent once every lane has started, with the router's garbage
collections then (`--router-trace`), which the requests' acceptance and garbage drive; (3) the
prefix index's memory per million blocks
(tracemalloc around a standalone `router.kv_index.PrefixIndex` fed `--index-blocks` keys).

The saturated figures drive the router as fast as the workers step (`--streams` x 1000 /
`--step-ms` tokens/s offered); on a small host where workers and clients share its cores the
router gets part of a core, its loop runs behind and latency_p50/p99 measure that queue, not a
router with room. The paced figures are the added latency below capacity. Both include the
synthetic workers' and clients' own scheduling on the host (their processes share its cores).

Workers send a step's tokens as one `TokenBatch` per router when `common.protocol` has it, else
one `TokenOutput` per token (`--relay tokens` forces that: the pre-batch wire, for comparisons).
With `--routers N` there are N router processes, every worker serves all of them (a control
connection and heartbeat thread per router, as the runtime's router links) and the clients spread
their requests over them; CPU figures are the routers' sum, `router_core_use` the busiest's.

Beside this file: the synthetic workers (`router_scale_workers.py`), the HTTP clients and what is
read of the router processes (`router_scale_clients.py`), the in-process routing choices and the
index's memory (`router_scale_decisions.py`).

Run: .venv/bin/python benchmarks/router_scale.py [--workers 100 --streams 500 --tokens 100]
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
for path in (ROOT, HERE):  # the project, and this benchmark's own modules beside it
    if path not in sys.path:
        sys.path.insert(0, path)

from router_scale_clients import proc_cpu_s, proc_rss_bytes, run_clients  # noqa: E402
from router_scale_decisions import decision_figures, index_bytes_per_million  # noqa: E402
from router_scale_workers import worker_proc  # noqa: E402

# ---- the router process -------------------------------------------------------------------------


# The router under cProfile timing CPU seconds, not wall seconds: on a shared host the wall clock
# charges a function for the time other processes held the core. Only the relay phase: SIGUSR1
# (sent as it starts) turns the profiler on, SIGUSR2 (as it ends) off and writes the stats.
CPU_PROFILE = (
    "import cProfile, signal, sys, time; from common.cli import main; sys.argv[0] = 'pdserve'; "
    "p = cProfile.Profile(time.process_time); "
    "signal.signal(signal.SIGUSR1, lambda *a: p.enable()); "
    "signal.signal(signal.SIGUSR2, lambda *a: (p.disable(), p.dump_stats(sys.argv[1]))); "
    "sys.exit(main(sys.argv[2:]))"
)


# The router with `router_scale_trace` installed: its read-to-write time per token, SIGUSR1 to 2.
TRACE = (
    "import sys; sys.path.insert(0, sys.argv[1]); import router_scale_trace; "
    "sys.exit(router_scale_trace.run(sys.argv[2], sys.argv[3:]))"
)


def cpu_list(text: str) -> set[int]:
    """CPUs as taskset writes them: '0', '0,2', '0-3'."""
    cpus: set[int] = set()
    for part in filter(None, text.split(",")):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return cpus


def start_router(
    python: str, ready_file: str, profile: str = "", heartbeat_timeout_s: float = 0.0,
    max_loop_lag_s: float = 0.0, event_loop: str = "", cpus: set[int] | None = None,
    trace: str = "",
) -> subprocess.Popen:  # fmt: skip
    """A router process; on `cpus` only (every thread of it: set before it starts) when given;
    under cProfile with `profile`, or with its read-to-write trace to `trace`."""
    if profile:
        run = ["-c", CPU_PROFILE, profile]
    elif trace:
        run = ["-c", TRACE, HERE, trace]
    else:
        run = ["-m", "common.cli"]
    cmd = [python, *run, "router", "--port", "0", "--control-port", "0",
           "--colocated", "--routing", "least_loaded", "--log-level", "warning",
           "--ready-file", ready_file, "--max-loop-lag-s", str(max_loop_lag_s)]  # fmt: skip
    if heartbeat_timeout_s:
        cmd += ["--heartbeat-timeout-s", str(heartbeat_timeout_s)]
    if event_loop:
        cmd += ["--event-loop", event_loop]
    pin = (lambda: os.sched_setaffinity(0, cpus)) if cpus else None
    proc = subprocess.Popen(cmd, cwd=ROOT, preexec_fn=pin)
    deadline = time.monotonic() + 120
    while not os.path.exists(ready_file):
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError("the router did not start")
        time.sleep(0.1)
    return proc


# ---- the run ------------------------------------------------------------------------------------


def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))] if values else float("nan")


def added_latencies(
    streams: list, sent: dict[str, list[float]], since_s: float = float("-inf")
) -> list[float]:
    """Per token: a worker's send time to the client's receipt of its data event (seconds), for
    tokens sent from `since_s` on."""
    latencies = []
    for rid, _, times in streams:
        send = sent.get(f"{rid}-0", [])
        latencies.extend(r - s for s, r in zip(send, times) if s >= since_s)
    return latencies


def trace_figures(
    paths: list[str], since_s: float, streams: list, sent: dict[str, list[float]]
) -> dict:
    """The routers' own read-to-write time per token over the paced phase (`--router-trace`), of
    the tokens read from `since_s` on (the same tokens as `paced_latency_*`, give or take the ones
    in flight then): wall seconds, and the loop thread's CPU seconds (its own work only). Then
    the paced added latency split in three, per token sent from `since_s` on (`paced_latency_*`'s
    tokens) whose stream the trace holds whole: the worker's send to the router's read of its
    message (ZeroMQ, the router's loop not yet at it), the router's read to its write, and the
    write to the client's read (the kernel, the client process getting its core)."""
    wall: list[float] = []
    cpu: list[float] = []
    traced: dict[str, list] = {}  # response id -> per token read, write (flat)
    unmeasured = 0
    pauses: dict[int, list[float]] = {0: [], 1: [], 2: []}  # garbage collections, by generation
    slow: dict[str, list[float]] = {}  # event-loop callbacks over the trace's SLOW_CALLBACK_S
    for path in paths:
        with open(path) as f:
            trace = json.load(f)
        for read_s, wall_s, cpu_s in trace["samples"]:
            if read_s >= since_s:
                wall.append(wall_s)
                cpu.append(cpu_s)
        unmeasured += trace["unmeasured"]
        traced.update(trace.get("streams", {}))
        for start_s, generation, seconds, collected, cpu_s, size in trace.get("gc", []):
            if start_s >= since_s:
                pauses[generation].append(seconds)
                if generation == 2 or seconds > 0.005:
                    print(f"collection of generation {generation} at {start_s - since_s:.2f} s: "
                          f"{1e3 * seconds:.1f} ms ({1e3 * cpu_s:.1f} ms of the loop thread's "
                          f"CPU), {size} objects walked, {collected} freed",
                          file=sys.stderr)  # fmt: skip
        for name, (objects, references) in trace.get("census", {}).items():
            print(f"gc census (first full collection): {name}: {objects} objects, "
                  f"{references} references", file=sys.stderr)  # fmt: skip
        for start_s, cpu_s, what in trace.get("slow", []):
            if start_s >= since_s:
                slow.setdefault(what, []).append(cpu_s)
    figures: dict = {
        "paced_router_read_to_write_tokens": len(wall),
        "paced_router_read_to_write_unmeasured": unmeasured,  # via the stream's task: all phase
    }
    figures["paced_router_slow_callbacks"] = sum(len(v) for v in slow.values())
    figures["paced_router_slow_callbacks_cpu_ms"] = 1e3 * sum(sum(v) for v in slow.values())
    for what, seconds in sorted(slow.items(), key=lambda kv: -sum(kv[1]))[:5]:
        print(f"slow callbacks: {len(seconds)} x {what}, {1e3 * sum(seconds):.1f} ms CPU, "
              f"longest {1e3 * max(seconds):.1f} ms", file=sys.stderr)  # fmt: skip
    for generation, seconds in pauses.items():
        figures[f"paced_router_gc{generation}_collections"] = len(seconds)
        figures[f"paced_router_gc{generation}_max_ms"] = 1e3 * max(seconds, default=0.0)
        figures[f"paced_router_gc{generation}_total_ms"] = 1e3 * sum(seconds)
    for name, values in (("", wall), ("_cpu", cpu)):
        for q in (50, 90, 99):
            figures[f"paced_router_read_to_write{name}_p{q}_ms"] = 1e3 * pct(values, q / 100)
        figures[f"paced_router_read_to_write{name}_max_ms"] = 1e3 * max(values, default=math.nan)
    parts: dict[str, list[float]] = {"send_to_read": [], "read_to_write": [], "write_to_client": []}
    for rid, _, times in streams:
        send, rw = sent.get(f"{rid}-0", []), traced.get(rid, [])
        if not len(send) == len(rw) // 2 == len(times):
            continue  # tokens the trace did not see (a stream's task wrote them)
        for s_, r_, w_, c_ in zip(send, rw[::2], rw[1::2], times):
            if s_ >= since_s:
                parts["send_to_read"].append(r_ - s_)
                parts["read_to_write"].append(w_ - r_)
                parts["write_to_client"].append(c_ - w_)
    figures["paced_split_tokens"] = len(parts["send_to_read"])
    for part, values in parts.items():
        for q in (50, 99):
            figures[f"paced_split_{part}_p{q}_ms"] = 1e3 * pct(values, q / 100)
    return figures


def paced_figures(paced: dict, sent: dict[str, list[float]], args: argparse.Namespace) -> dict:
    """The paced phase's figures: the added latency of the tokens sent once every stream had its
    first (not the arrival burst of `--streams` requests), its rate, and the router's CPU."""
    streams = paced["results"]
    num_tokens = sum(len(t) for _, _, t in streams)
    all_started = max((t[0] for _, _, t in streams if t), default=float("inf"))
    latencies = added_latencies(streams, sent, all_started)
    first = min((t[0] for _, _, t in streams if t), default=0.0)
    last = max((t[-1] for _, _, t in streams if t), default=0.0)
    return {
        "paced_offered_tokens_per_s": float(args.paced_rate),
        "paced_relayed_tokens_per_s": num_tokens / max(last - first, 1e-9),
        "paced_streams_complete": sum(
            1 for _, s, t in streams if s == 200 and len(t) == args.paced_tokens
        ),
        "paced_router_core_use": paced["router_core_use_max"],
        "paced_router_cpu_us_per_token": 1e6 * paced["router_cpu_s"] / max(num_tokens, 1),
        "paced_router_runqueue_wait_share": paced["router_runqueue_wait_share"],
        "paced_latency_tokens": len(latencies),
        "paced_latency_p50_ms": 1e3 * pct(latencies, 0.5),
        "paced_latency_p90_ms": 1e3 * pct(latencies, 0.9),
        "paced_latency_p99_ms": 1e3 * pct(latencies, 0.99),
        "paced_latency_max_ms": 1e3 * max(latencies, default=float("nan")),
    }


def churn_figures(
    churn: dict, sent: dict[str, list[float]], args: argparse.Namespace, traces: list[str]
) -> dict:
    """The churn phase's figures, over the tokens sent once every lane has started (one
    stream's length of steps after the phase's first token: lanes start spread over it): streams
    started a second, the tokens' added latency, the router's CPU; with `--router-trace` its
    garbage collections in that window and the latency's three parts."""
    streams = churn["results"]
    firsts = [t[0] for _, _, t in streams if t]
    if not firsts:
        return {"churn_streams": 0}
    since = min(firsts) + args.churn_tokens * args.streams / args.churn_rate
    latencies = added_latencies(streams, sent, since)
    num_tokens = sum(len(t) for _, _, t in streams)
    figures = {
        "churn_streams": len(streams),
        "churn_streams_started_per_s": sum(1 for f in firsts if f >= since)
        / max(max(firsts) - since, 1e-9),
        "churn_errors": sum(1 for _, s, _ in streams if s != 200),
        "churn_router_core_use": churn["router_core_use_max"],
        "churn_router_cpu_us_per_token": 1e6 * churn["router_cpu_s"] / max(num_tokens, 1),
        "churn_latency_tokens": len(latencies),
        "churn_latency_p50_ms": 1e3 * pct(latencies, 0.5),
        "churn_latency_p99_ms": 1e3 * pct(latencies, 0.99),
        "churn_latency_max_ms": 1e3 * max(latencies, default=float("nan")),
        # what the routers' RSS grew by over the phase, at its peak (what arrivals leave behind)
        "churn_router_rss_growth_mib": (churn["rss_peak"] - churn["rss0"]) / 2**20,
    }
    if traces:
        traced = trace_figures(traces, since, streams, sent)
        figures.update({k.replace("paced_", "churn_", 1): v for k, v in traced.items()})
    return figures


def wait_for_traces(traces: list[str]) -> None:
    """Wait (up to 30 s) until every router has written its trace."""
    deadline = time.monotonic() + 30
    while not all(os.path.exists(t) for t in traces):
        if time.monotonic() > deadline:
            raise RuntimeError("a router wrote no trace")
        time.sleep(0.1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--workers", type=int, default=100, help="synthetic decode workers")
    ap.add_argument("--worker-procs", type=int, default=2)
    ap.add_argument("--streams", type=int, default=500, help="concurrent streamed completions")
    ap.add_argument("--tokens", type=int, default=100, help="tokens per stream")
    ap.add_argument("--step-ms", type=float, default=50.0, help="a worker's step: one token per "
                    "stream per step")  # fmt: skip
    ap.add_argument("--paced-rate", type=float, default=2000.0, help="tokens/s offered in the "
                    "paced phase (after the saturated one; 0: none): the same --streams, each "
                    "worker stepping every streams/rate seconds, for the added latency below the "
                    "router's capacity")  # fmt: skip
    ap.add_argument("--paced-tokens", type=int, default=10, help="tokens per stream, paced")
    ap.add_argument("--churn-s", type=float, default=0.0, help="after the paced phase, this many "
                    "seconds of steady arrivals (0: none): --streams lanes, each opening a new "
                    "stream of --churn-tokens as its last one ends, at --churn-rate tokens/s; the "
                    "requests' acceptance and their garbage run beside the relay")  # fmt: skip
    ap.add_argument("--churn-rate", type=float, default=2000.0, help="tokens/s, churn")
    ap.add_argument("--churn-tokens", type=int, default=40, help="tokens per stream, churn")
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
    ap.add_argument("--profile", default="", help="profile the router's relay phase with "
                    "cProfile (CPU time), stats here")  # fmt: skip
    ap.add_argument("--max-loop-lag-s", type=float, default=0.0, help="the router's (0: off, "
                    "the default here: this measures what a router can do, and the synthetic "
                    "workers and clients share its host; on a loaded host its loop runs late and "
                    "it would refuse work with 429s, as it should)")  # fmt: skip
    ap.add_argument("--event-loop", default="", help="the router's --event-loop (auto, uvloop, "
                    "asyncio; default: the router's own default)")  # fmt: skip
    ap.add_argument("--router-cpus", default="", help="CPUs the router processes run on "
                    "(taskset's form: 0 or 0,2 or 0-1); with --load-cpus, a router alone on its "
                    "core while workers and clients share the others")  # fmt: skip
    ap.add_argument("--load-cpus", default="", help="CPUs the synthetic workers, the HTTP "
                    "clients and this script run on")  # fmt: skip
    ap.add_argument("--router-trace", action="store_true", help="in the paced phase, also the "
                    "routers' own part of the latency: from the read of a token's message off "
                    "the control socket to its bytes' write to the client's connection "
                    "(router_scale_trace.py; not with --profile)")  # fmt: skip
    ap.add_argument("--decisions-only", action="store_true", help="only the routing choices "
                    "themselves (no router process, no HTTP): microseconds per decode and per "
                    "prefill choice with --workers workers, for each policy")  # fmt: skip
    args = ap.parse_args()
    if args.decisions_only:
        for name, value in decision_figures(args.workers).items():
            print(f"{name:<34}  {value:.4g}")
        return

    if args.router_trace and args.profile:
        ap.error("--router-trace and --profile both use the router's SIGUSR1/2: one at a time")
    router_cpus = cpu_list(args.router_cpus)
    load_cpus = cpu_list(args.load_cpus)
    if load_cpus:  # this script, and through it every worker and client process it starts
        os.sched_setaffinity(0, load_cpus)
    from common import protocol

    relay = args.relay if hasattr(protocol, "TokenBatch") else "tokens"
    ctx = mp.get_context("spawn")
    from common.api.tokenizer import Tokenizer
    from common.model.model_files import resolve_model

    token_id = Tokenizer.from_source(resolve_model("default")).encode(" hello", False)[0]
    tmp = tempfile.mkdtemp(prefix="router_scale")
    routers, ports, controls = [], [], []
    stop, res_q = ctx.Event(), ctx.Queue()
    step = ctx.Value("d", args.step_ms / 1000, lock=False)  # the workers' step, per phase
    workers = []
    traces = [os.path.join(tmp, f"trace{r}.json") if args.router_trace else ""
              for r in range(args.routers)]  # fmt: skip
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
                    router_cpus,
                    traces[r],
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
                args=(controls, ids[p :: args.worker_procs], token_id, step, relay, stop,
                      ready, res_q),
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
        if args.profile:
            for router in routers:
                router.send_signal(signal.SIGUSR1)
        relayed = run_clients(ctx, ports, "stream", args.streams, args.client_procs,
                              args.tokens, pids, sample_rss=True,
                              duration_s=args.duration, lag_every_s=args.lag_every_s)  # fmt: skip
        if args.profile:
            for router in routers:
                router.send_signal(signal.SIGUSR2)
        paced = None
        if args.paced_rate > 0:  # the same streams, each worker stepping slower
            time.sleep(1.0)
            step.value = args.streams / args.paced_rate
            if args.router_trace:
                for router in routers:
                    router.send_signal(signal.SIGUSR1)
            paced = run_clients(ctx, ports, "stream", args.streams, args.client_procs,
                                args.paced_tokens, pids, sample_rss=False,
                                duration_s=args.duration)  # fmt: skip
            if args.router_trace:
                for router in routers:
                    router.send_signal(signal.SIGUSR2)
                wait_for_traces(traces)
        churn = None
        if args.churn_s > 0:
            time.sleep(1.0)
            step.value = args.streams / args.churn_rate
            if args.router_trace:
                for t in traces:  # the paced phase's, kept beside the churn phase's
                    if os.path.exists(t):
                        os.replace(t, t + ".paced")
                for router in routers:
                    router.send_signal(signal.SIGUSR1)
            churn = run_clients(ctx, ports, "churn", args.streams, args.client_procs,
                                args.churn_tokens, pids, sample_rss=True,
                                duration_s=args.churn_s,
                                stagger_s=args.churn_tokens * step.value)  # fmt: skip
            if args.router_trace:
                for router in routers:
                    router.send_signal(signal.SIGUSR2)
                wait_for_traces(traces)
                for t in traces:
                    os.replace(t, t + ".churn")
                    if os.path.exists(t + ".paced"):
                        os.replace(t + ".paced", t)
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
    latencies = added_latencies(streams, sent)
    complete = sum(1 for _, s, t in streams if s == 200 and len(t) == args.tokens)
    figures = {
        "relay": relay,
        "routers": args.routers,
        "router_cpus": args.router_cpus or "any",
        "load_cpus": args.load_cpus or "any",
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
        # Pages the router's allocator gave back to the kernel and touched again, all threads.
        "router_minor_faults_per_1k_tokens": 1e3
        * relayed["router_minor_faults"]
        / max(num_tokens, 1),
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
    if paced is not None:
        figures.update(paced_figures(paced, sent, args))
        if args.router_trace:
            started = max((t[0] for _, _, t in paced["results"] if t), default=float("inf"))
            figures.update(trace_figures(traces, started, paced["results"], sent))
    if churn is not None:
        figures.update(churn_figures(churn, sent, args, [t + ".churn" for t in traces if t]))
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
