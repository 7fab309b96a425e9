"""What waking a sleeping thread in another process costs on this host: the waker's time, the delay.

A served token wakes four sleeping threads in turn: the worker's zmq I/O thread (its send), the
router's zmq I/O thread (the bytes on loopback TCP), the router's event loop (its zmq socket's
descriptor) and the client (the HTTP chunk). On bare metal a wake costs a few microseconds. On
some virtual machines (the 2-vCPU one with nested virtualisation these benchmarks ran on) each
one costs the thread that wakes the other tens of microseconds of its own time, inside its write
or send call, and delays the woken one more: a cost the worker pays per token, on the step's
cores.

This times one hop of each kind, a message every `--gaps` microseconds (0: back to back, where
the receiver never sleeps; 5,000: a token stream's pace, where it sleeps between messages), with
`--busy` spinning processes beside them (0: the cores idle; 2 on 2 cores: every core taken, as a
decode step's threads take them):

  pipe  one process writes 8 bytes into a pipe another reads (the plain OS wake);
  zmq   a DEALER sends 200 bytes over loopback TCP to a ROUTER in another process, as a worker
        sends tokens to the router (two wakes: the sender's I/O thread, then the receiver's).

    python benchmarks/wake_cost.py [--paths pipe,zmq] [--gaps 0,5000] [--busy 0,2]
        [--messages 400]

Result: a Markdown table on stdout, one row per (path, busy, gap): the sender's call (write or
send) in wall time and in its thread's CPU time, and the delay from just before the call to the
receiver holding the message (p50, p99; CLOCK_MONOTONIC, one clock for both processes; "nan"
back to back, where it is the receiver's queue), all in microseconds; progress on stderr.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import statistics
import struct
import sys
import time

from router_scale import pct  # benchmarks/: a nearest-rank percentile, nan when empty
from shared_cores import burn  # benchmarks/: a process that burns CPU until its parent is gone

STAMP = struct.Struct("<q")  # the sender's clock just before the call, in ns
PAYLOAD = 200  # bytes of a zmq message: about a token batch's frame
WARM_UP = 20  # messages sent first and left out of the figures


def log(message: str) -> None:
    print(f"[wake_cost] {message}", file=sys.stderr, flush=True)


def now_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def pipe_reader(conn, count: int, out) -> None:
    """Read `count` stamps from the pipe's read end; send back each one's delay (ns)."""
    fd, delays = conn.fileno(), []
    out.send("ready")
    for _ in range(count):
        data = b""
        while len(data) < STAMP.size:
            data += os.read(fd, STAMP.size - len(data))
        delays.append(now_ns() - STAMP.unpack(data)[0])
    out.send(delays)


def zmq_router(port_out, count: int, out) -> None:
    """A ROUTER on a free loopback port (sent back first); then `count` messages' delays (ns)."""
    import zmq

    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    port_out.send(sock.bind_to_random_port("tcp://127.0.0.1"))
    delays = []
    for _ in range(count + 1):  # the first one only connects
        _, frame = sock.recv_multipart()
        delays.append(now_ns() - STAMP.unpack(frame[: STAMP.size])[0])
    out.send(delays[1:])
    sock.close(linger=0)
    ctx.term()


def run_hop(path: str, gap_s: float, messages: int) -> dict:
    """One (path, gap) measurement: the sender here, the receiver in a fresh process."""
    spawn = mp.get_context("spawn")
    back, out = spawn.Pipe(duplex=False)
    if path == "pipe":
        read_end, write_end = spawn.Pipe(duplex=False)  # an OS pipe, its read end handed over
        proc = spawn.Process(
            target=pipe_reader, args=(read_end, WARM_UP + messages, out), daemon=True
        )
        proc.start()
        read_end.close()
        wfd = write_end.fileno()
        back.recv()  # the reader is up

        def send(stamp: bytes) -> None:
            os.write(wfd, stamp)

        def close() -> None:
            write_end.close()
    else:
        import zmq

        port_back, port_out = spawn.Pipe(duplex=False)
        proc = spawn.Process(
            target=zmq_router, args=(port_out, WARM_UP + messages, out), daemon=True
        )
        proc.start()
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.connect(f"tcp://127.0.0.1:{port_back.recv()}")
        pad = bytes(PAYLOAD - STAMP.size)
        sock.send(STAMP.pack(now_ns()) + pad)  # the connection, not timed
        time.sleep(0.2)

        def send(stamp: bytes) -> None:
            sock.send(stamp + pad)

        def close() -> None:
            sock.close(linger=1000)
            ctx.term()

    walls, cpus = [], []
    for _ in range(WARM_UP + messages):
        if gap_s:
            time.sleep(gap_s)
        c0, t0 = time.thread_time_ns(), now_ns()
        send(STAMP.pack(t0))
        walls.append(now_ns() - t0)
        cpus.append(time.thread_time_ns() - c0)
    delays = back.recv()[WARM_UP:]
    walls, cpus = walls[WARM_UP:], cpus[WARM_UP:]
    close()
    proc.join(timeout=10)
    us = 1e-3
    if not gap_s:  # back to back the receiver is behind: the delay is its queue, not a wake
        delays = []
    return {
        "wall_us": statistics.median(walls) * us,
        "cpu_us": statistics.fmean(cpus) * us,
        "delay_p50_us": pct(delays, 0.5) * us,
        "delay_p99_us": pct(delays, 0.99) * us,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--paths", default="pipe,zmq")
    parser.add_argument("--gaps", default="0,5000", help="microseconds between messages")
    parser.add_argument("--busy", default=f"0,{os.cpu_count() or 1}",
                        help="spinning processes beside the hop (comma list)")  # fmt: skip
    parser.add_argument("--messages", type=int, default=400)
    args = parser.parse_args()
    paths = args.paths.split(",")
    if any(p not in ("pipe", "zmq") for p in paths) or args.messages < 1:
        parser.error("--paths takes pipe and zmq; --messages at least 1")
    gaps = [int(g) for g in args.gaps.split(",")]
    busy_counts = [int(b) for b in args.busy.split(",")]
    print(f"{os.cpu_count()} CPUs, {args.messages} messages a row, microseconds\n")
    print("| path | busy processes | gap | call wall p50 | call CPU mean | delay p50 | delay p99 |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    spawn = mp.get_context("spawn")
    for busy in busy_counts:
        burners = [spawn.Process(target=burn, args=(1.0, 0.0), daemon=True) for _ in range(busy)]
        for b in burners:
            b.start()
        try:
            for path in paths:
                for gap in gaps:
                    log(f"{path}, {busy} busy, gap {gap} us")
                    r = run_hop(path, gap * 1e-6, args.messages)
                    cells = (r["wall_us"], r["cpu_us"], r["delay_p50_us"], r["delay_p99_us"])
                    row = " | ".join(f"{v:.1f}" for v in cells)
                    print(f"| {path} | {busy} | {gap} | {row} |", flush=True)
        finally:
            for b in burners:
                b.kill()
                b.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
