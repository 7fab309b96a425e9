"""The HTTP clients of `benchmarks/router_scale.py`, and what it reads of the router processes.

Clients are raw asyncio connections in `--client-procs` processes (`client_proc`): streamed
completions read by a protocol that times their data events as they arrive, or one-token
requests on keep-alive streams. `run_clients` starts them together and measures the routers
meanwhile: CPU (user and kernel, /proc/<pid>/stat), run-queue wait (/proc/<pid>/schedstat), RSS,
and optionally the event-loop lag from /metrics.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import time

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PAGE_BYTES = os.sysconf("SC_PAGE_SIZE")


# ---- the router processes, from outside -------------------------------------------------------


def proc_cpu_s(pid: int, system_only: bool = False) -> float:
    """User + system (or system only) CPU seconds of process `pid` so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[12]) + (0 if system_only else int(fields[11]))) / CLOCK_TICKS


def proc_minor_faults(pid: int) -> int:
    """Minor page faults of process `pid` so far (all its threads): memory its allocator took
    back from the kernel and touched again."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])


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


class _StreamReader(asyncio.Protocol):
    """One streamed completion's connection, read in `data_received`: each read is timed and its
    data events counted where they arrive, with no stream reader, future or task step between
    (the clients' CPU per event is what a host of two cores runs short of)."""

    def __init__(self, request: bytes, record: list, done: asyncio.Future) -> None:
        self.request, self.record, self.done = request, record, done
        self.times: list[float] = record[2]
        self.tail, self.head = b"", b""
        self.transport: asyncio.Transport | None = None

    def connection_made(self, transport) -> None:
        self.transport = transport
        transport.write(self.request)

    def data_received(self, data: bytes) -> None:
        now = time.monotonic()
        record = self.record
        if not record[0]:
            self.head += data
            match = RESPONSE_ID.search(self.head)
            if match:
                record[0] = match.group(1).decode()
                record[1] = int(self.head[9:12]) if self.head[:5] == b"HTTP/" else 0
        buf = self.tail + data
        self.times.extend([now] * buf.count(PATTERN))
        self.tail = buf[-(len(PATTERN) - 1) :]
        if b"data: [DONE]" in buf:
            self.transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        head = self.head
        self.record[1] = int(head[9:12]) if head[:5] == b"HTTP/" else 0
        if not self.done.done():
            self.done.set_result(None)


async def _stream(port: int, body: dict, out: list) -> None:
    """One streamed completion: (response id, status, receipt time of each data event)."""
    record = ["", 0, []]  # kept up to date: a stream cut by --duration still counts
    out.append(record)
    loop = asyncio.get_running_loop()
    done = loop.create_future()
    request = _request(port, body, keep_alive=False)
    transport, _ = await loop.create_connection(
        lambda: _StreamReader(request, record, done), "127.0.0.1", port
    )
    try:
        await done
    finally:
        transport.close()


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
    ports: list[int], kind: str, count: int, tokens: int, duration_s: float, go, results,
    stagger_s: float = 0.0,
) -> None:  # fmt: skip
    """`count` streams (kind "stream") or one-token requests (kind "route"), started together
    when `go` is set, spread over the routers' `ports`; puts (results, client CPU seconds, wall
    seconds) on `results`; gives up after `duration_s` (what arrived by then counts). Kind
    "churn": `count` lanes, each starting a new stream as soon as its last one ended, for
    `duration_s` (the streams then running finish; a record per stream), lane k first after
    k / count x `stagger_s` (a stream's length: arrivals spread evenly, not in waves)."""
    prompt = [1, 2, 3, 4]

    out: list = []

    async def main() -> None:
        try:
            await asyncio.wait_for(requests(), duration_s + (60 if kind == "churn" else 0))
        except asyncio.TimeoutError:
            pass

    async def lane(port: int, body: dict, until: float, delay_s: float) -> None:
        await asyncio.sleep(delay_s)
        while time.monotonic() < until:
            await _stream(port, body, out)

    async def requests() -> None:
        body = {"model": "default", "prompt": prompt, "max_tokens": tokens, "stream": True,
                "ignore_eos": True}  # fmt: skip
        if kind == "stream":
            await asyncio.gather(*(_stream(ports[k % len(ports)], body, out) for k in range(count)))
        elif kind == "churn":
            until = time.monotonic() + duration_s
            await asyncio.gather(*(
                lane(ports[k % len(ports)], body, until, k / count * stagger_s)
                for k in range(count)
            ))  # fmt: skip
        else:
            body = {"model": "default", "prompt": prompt, "max_tokens": 1}
            lanes = min(64, count)
            per = [[body] * (count // lanes + (i < count % lanes)) for i in range(lanes)]
            await asyncio.gather(
                *(_unary(ports[k % len(ports)], bodies, out) for k, bodies in enumerate(per))
            )

    go.wait()
    cpu0, wall0 = time.process_time(), time.monotonic()
    try:  # the clients' own CPU per event is what a host of two cores runs short of
        import uvloop

        uvloop.run(main())
    except ImportError:
        asyncio.run(main())
    results.put((out, time.process_time() - cpu0, time.monotonic() - wall0))


def run_clients(ctx, ports: list[int], kind: str, total: int, procs: int, tokens: int,
                router_pids: list[int], sample_rss: bool, duration_s: float,
                lag_every_s: float = 0.0, stagger_s: float = 0.0) -> dict:  # fmt: skip
    go, results = ctx.Event(), ctx.Queue()
    shares = [total // procs + (i < total % procs) for i in range(procs)]
    clients = [ctx.Process(target=client_proc, args=(ports, kind, n, tokens, duration_s, go,
                                                        results, stagger_s))
               for n in shares if n]  # fmt: skip
    for c in clients:
        c.start()
    time.sleep(1.0)  # the clients' imports, before the clock starts
    rss0 = sum(proc_rss_bytes(pid) for pid in router_pids)
    cpu0 = [proc_cpu_s(pid) for pid in router_pids]
    sys0 = [proc_cpu_s(pid, system_only=True) for pid in router_pids]
    waits0 = [proc_runqueue_wait_s(pid) for pid in router_pids]
    faults0 = sum(proc_minor_faults(pid) for pid in router_pids)
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
    faults = sum(proc_minor_faults(pid) for pid in router_pids) - faults0
    for c in clients:
        c.join()
    return {
        "results": [r for out, _, _ in got for r in out],
        "client_cpu_s": sum(c for _, c, _ in got),
        "router_cpu_s": sum(cpus),
        "router_system_cpu_s": system,  # in the kernel: socket reads and writes
        "router_minor_faults": faults,
        "router_core_use_max": max(cpus) / wall,
        # Of the wall time, the share the busiest router's loop waited for a core it wanted.
        "router_runqueue_wait_share": max(waits) / wall,
        "router_loop_lag_s": lags,  # the first router's smoothed loop lag, every lag_every_s
        "host_load_avg": (load0, os.getloadavg()[0]),
        "wall_s": wall,
        "rss0": rss0,
        "rss_peak": rss_peak,
    }
