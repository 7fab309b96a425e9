"""Soak: minutes of mixed traffic through a real cluster; memory per process, throughput per window.

Starts a router with one prefill and one decode worker (`common.runtime.launcher`, as the other
benchmarks do; default model, every prompt over `--local-prefill-max-tokens` prefilled remotely),
then `--concurrency` clients send requests back to back for `--minutes`, each drawn from a mix
(`KINDS` in `benchmarks/soak_mix.py`): short and long prompts, chat and completions, streamed and
not, streams the client drops mid-body (aborts), n=2, logprobs, stop strings, JSON-schema answers
(a new schema most times; a finished answer outside its schema counts as failed). Every
`--sample-s` it reads each process's RSS (/proc/PID/status VmRSS) and, through
`benchmarks/soak_probe/sitecustomize.py` loaded into every child, glibc's heap view (mallinfo2
bytes in use); `--tracemalloc` also traces Python allocations in the children and prints, at the
end, what grew over the second half (tracemalloc by line, live objects by type).

    python benchmarks/soak.py [--minutes 30] [--concurrency 4] [--window-s 60] [--sample-s 5]
        [--model default] [--dtype bfloat16] [--kv-cache-memory 2GiB] [--long-words 400]
        [--max-tokens 48] [--max-num-batched-tokens 256] [--num-threads 1] [--tracemalloc]
        [--seed 0] [--json PATH]
        [--log-dir DIR]

Result (stdout, bounded: one row per window): the machine line; a Markdown table per window
(requests ok / aborted / failed, output tok/s, RSS MiB and heap-in-use MiB of each process); then
per process RSS at start, end, max, growth per hour (least-squares line over the second half of
the run, so warm-up does not count) and the same for the heap; the RSS after `malloc_trim`; error
counts by kind and cause; the decode worker's free KV blocks once idle.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from soak_mix import KINDS, Stats, client_loop, one_request  # noqa: E402 (this script's folder)

from common.runtime.launcher import LocalCluster, WorkerSpec, parse_metrics  # noqa: E402

PROBE_DIR = Path(__file__).resolve().parent / "soak_probe"
MIB = 2**20


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---- memory ------------------------------------------------------------------------------------


def rss_bytes(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def probe(probe_dir: Path, pid: int) -> dict:
    try:
        return json.loads((probe_dir / f"{pid}.json").read_text())
    except (OSError, ValueError):
        return {}


def ask(probe_dir: Path, pids: dict[str, int], cmd: str, wait_s: float, done: str = "") -> None:
    """Ask every probe to run `cmd` and wait until each has taken it (they look every
    --sample-s / 2) and, with `done`, has written `<pid>.<done>`."""
    for pid in pids.values():
        (probe_dir / f"{pid}.{done}").unlink(missing_ok=True)
        (probe_dir / f"{pid}.{cmd}").touch()
    deadline = time.monotonic() + wait_s

    def pending(pid: int) -> bool:
        taken = not (probe_dir / f"{pid}.{cmd}").exists()
        return not taken or bool(done) and not (probe_dir / f"{pid}.{done}").exists()

    while time.monotonic() < deadline and any(pending(pid) for pid in pids.values()):
        time.sleep(0.2)


def slope_per_hour(points: list[tuple[float, float]]) -> float | None:
    """Least-squares slope of (seconds, bytes) points, in MiB per hour."""
    if len(points) < 3:
        return None
    n = len(points)
    mt = sum(t for t, _ in points) / n
    mv = sum(v for _, v in points) / n
    var = sum((t - mt) ** 2 for t, _ in points)
    if var == 0:
        return None
    cov = sum((t - mt) * (v - mv) for t, v in points)
    return cov / var * 3600 / MIB


# ---- the run -----------------------------------------------------------------------------------


async def soak(cluster: LocalCluster, args: argparse.Namespace, probe_dir: Path) -> dict:
    pids = {name: proc.pid for name, proc in cluster.procs.items()}
    names = list(pids)
    samples: dict[str, list[tuple[float, int, int | None]]] = {n: [] for n in names}
    stats = Stats()
    windows: list[dict] = []
    limits = httpx.Limits(max_connections=args.concurrency + 4)
    timeout = httpx.Timeout(args.request_timeout_s)
    header = (
        "| t min | ok | aborted | failed | out tok/s | "
        + " | ".join(f"{n} RSS / heap MiB" for n in names)
        + " |"
    )
    async with httpx.AsyncClient(base_url=cluster.url, timeout=timeout, limits=limits) as client:
        # Warm-up, untimed: one request of each kind, one at a time (first-call costs are not
        # what a soak measures); its errors are counted apart.
        warm = Stats()
        for i, kind in enumerate(KINDS):
            await one_request(client, kind, random.Random(-1 - i), args, warm)
        if warm.errors:
            print(f"warm-up errors: {dict(warm.errors)}")
        t0 = time.monotonic()
        stop_at = t0 + args.minutes * 60
        loops = [
            asyncio.create_task(client_loop(client, args.seed + i, stop_at, args, stats))
            for i in range(args.concurrency)
        ]
        print(header)
        print("|" + "---:|" * (5 + len(names)), flush=True)
        next_window = t0 + args.window_s
        marked = False
        while any(not t.done() for t in loops):
            await asyncio.sleep(args.sample_s)
            now = time.monotonic()
            for n, pid in pids.items():
                rss = rss_bytes(pid)
                if rss is not None:
                    samples[n].append((now - t0, rss, probe(probe_dir, pid).get("heap_in_use")))
            if not marked and now - t0 >= args.minutes * 30:
                marked = True  # the second half starts: the tracemalloc diff counts from here
                if args.tracemalloc:
                    await asyncio.to_thread(ask, probe_dir, pids, "mark", 60)
            if now >= next_window or all(t.done() for t in loops):
                ok, aborted, failed, tokens = stats.take()
                span = now - (next_window - args.window_s)
                row = {"t_min": (now - t0) / 60, "ok": ok, "aborted": aborted, "failed": failed,
                       "out_tok_s": tokens / span, "mem": {}}  # fmt: skip
                for n in names:
                    last = samples[n][-1] if samples[n] else (0, 0, None)
                    row["mem"][n] = (last[1] / MIB, last[2] / MIB if last[2] else None)
                windows.append(row)
                cells = " | ".join(
                    f"{r:.0f} / {h:.0f}" if h is not None else f"{r:.0f} / -"
                    for r, h in row["mem"].values()
                )
                print(
                    f"| {row['t_min']:.1f} | {ok} | {aborted} | {failed} "
                    f"| {row['out_tok_s']:.1f} | {cells} |",
                    flush=True,
                )
                next_window = now + args.window_s
        await asyncio.gather(*loops)
    duration_s = time.monotonic() - t0
    diffs = {}
    if args.tracemalloc:
        await asyncio.to_thread(ask, probe_dir, pids, "diff", 300, "diff.json")
        for n, pid in pids.items():
            try:
                diffs[n] = json.loads((probe_dir / f"{pid}.diff.json").read_text())
            except (OSError, ValueError):
                diffs[n] = {}
    await asyncio.sleep(3)  # let the last aborts and heartbeats settle
    idle_rss = {n: rss_bytes(pid) for n, pid in pids.items()}
    await asyncio.to_thread(ask, probe_dir, pids, "trim", 30)
    trimmed_rss = {n: rss_bytes(pid) for n, pid in pids.items()}
    blocks = {}
    for name, labels, value in parse_metrics(cluster.metrics()):
        if name in ("pdserve:num_free_blocks", "pdserve:num_blocks"):
            blocks.setdefault(labels.get("worker", "?"), {})[name.split(":")[1]] = value
    return {
        "duration_s": duration_s, "samples": samples, "windows": windows, "stats": stats,
        "idle_rss": idle_rss, "trimmed_rss": trimmed_rss, "diffs": diffs, "blocks": blocks,
    }  # fmt: skip


def report(result: dict, args: argparse.Namespace) -> dict:
    """Print the per-process summary (after the per-window table) and return it as a dict."""
    half = result["duration_s"] / 2
    summary = {}
    print(
        "\n| process | RSS start | RSS end | RSS max | RSS growth MiB/h (2nd half) "
        "| heap in use start | heap end | heap growth MiB/h | RSS idle | RSS after malloc_trim |"
    )
    print("|---|" + "---:|" * 9)
    for n, pts in result["samples"].items():
        if not pts:
            continue
        second = [(t, r) for t, r, _ in pts if t >= half]
        heap = [(t, h) for t, _, h in pts if h is not None]
        s = {
            "rss_start_mib": pts[0][1] / MIB,
            "rss_end_mib": pts[-1][1] / MIB,
            "rss_max_mib": max(r for _, r, _ in pts) / MIB,
            "rss_growth_mib_h": slope_per_hour(second),
            "heap_start_mib": heap[0][1] / MIB if heap else None,
            "heap_end_mib": heap[-1][1] / MIB if heap else None,
            "heap_growth_mib_h": slope_per_hour([(t, h) for t, h in heap if t >= half]),
            "rss_idle_mib": (result["idle_rss"].get(n) or 0) / MIB,
            "rss_trimmed_mib": (result["trimmed_rss"].get(n) or 0) / MIB,
        }
        summary[n] = s

        def f(v: float | None, spec: str = "{:.0f}") -> str:
            return "-" if v is None else spec.format(v)

        print(
            f"| {n} | {f(s['rss_start_mib'])} | {f(s['rss_end_mib'])} | {f(s['rss_max_mib'])} "
            f"| {f(s['rss_growth_mib_h'], '{:+.1f}')} | {f(s['heap_start_mib'])} "
            f"| {f(s['heap_end_mib'])} | {f(s['heap_growth_mib_h'], '{:+.1f}')} "
            f"| {f(s['rss_idle_mib'])} | {f(s['rss_trimmed_mib'])} |"
        )
    stats: Stats = result["stats"]
    print(f"\nrequests by kind: {dict(stats.kinds)}")
    total_errors = sum(stats.errors.values())
    print(f"errors: {total_errors}" + ("" if not total_errors else ""))
    for (kind, cause), count in stats.errors.most_common(10):
        print(f"  {count} x {kind}: {cause}")
    for worker, b in result["blocks"].items():
        print(f"KV blocks once idle, {worker}: {b.get('num_free_blocks', 0):.0f} free of "
              f"{b.get('num_blocks', 0):.0f} (prefix-cached blocks count as free)")  # fmt: skip
    for n, d in result["diffs"].items():
        if d.get("tracemalloc"):
            print(f"\n{n}: tracemalloc growth over the second half (top lines)")
            for where, size, count in d["tracemalloc"][:8]:
                print(f"  {size / 1024:+10.1f} KiB {count:+8d} blocks  {where}")
        if d.get("objects"):
            print(f"{n}: live objects grown over the second half: {d['objects'][:8]}")
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--minutes", type=float, default=30)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--window-s", type=float, default=60)
    p.add_argument("--sample-s", type=float, default=5)
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--kv-cache-memory", default="2GiB", help="each worker's (the workers' default)")
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--long-words", type=int, default=400, help="words in a long prompt")
    # Bounded steps: on a loaded 2-core machine an unchunked 2,000-token bfloat16 step took over
    # the router's 30 s --worker-stall-timeout-s, which then declared a healthy worker dead.
    p.add_argument("--max-num-batched-tokens", type=int, default=256)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--num-threads", type=int, default=1, help="torch threads per worker")
    p.add_argument("--request-timeout-s", type=float, default=300)
    p.add_argument("--tracemalloc", action="store_true", help="trace the children's allocations")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--log-dir", type=Path, default=None, help="keep the processes' logs here")
    args = p.parse_args(argv)

    flags = [
        "--dtype", args.dtype, "--max-model-len", str(args.max_model_len),
        "--kv-cache-memory", args.kv_cache_memory, "--num-threads", str(args.num_threads),
        "--max-num-batched-tokens", str(args.max_num_batched_tokens),
    ]  # fmt: skip
    workers = [
        WorkerSpec("prefill", "prefill-0", flags, threads=args.num_threads),
        WorkerSpec("decode", "decode-0", flags, threads=args.num_threads),
    ]
    # The children import the probe (sitecustomize) from PYTHONPATH, which the launcher builds
    # from this process's.
    os.environ["PYTHONPATH"] = os.pathsep.join(
        s for s in (str(PROBE_DIR), os.environ.get("PYTHONPATH")) if s
    )
    with tempfile.TemporaryDirectory(prefix="pdserve-soak-") as tmp:
        probe_dir = Path(tmp) / "probe"
        probe_dir.mkdir()
        log_dir = args.log_dir or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        env = {"PDSERVE_SOAK_PROBE_DIR": str(probe_dir),
               "PDSERVE_SOAK_PROBE_S": str(min(args.sample_s / 2, 2.0)),
               "PDSERVE_SOAK_TRACEMALLOC": "1" if args.tracemalloc else "0"}  # fmt: skip
        cluster = LocalCluster(
            args.model, workers, router_flags=["--local-prefill-max-tokens", "256"],
            log_dir=log_dir, name="soak", env=env, startup_timeout_s=900,
        )  # fmt: skip
        log("starting router + 1 prefill + 1 decode worker")
        with cluster:
            print(
                f"machine: {platform.machine()}, {os.cpu_count()} cores (shared with other "
                f"work: numbers from a loaded machine), Python {platform.python_version()}"
            )
            print(
                f"soak: {args.minutes:g} min at concurrency {args.concurrency}, mix {KINDS}, "
                f"long prompts {args.long_words} words, max_tokens <= {args.max_tokens}, "
                f"{args.dtype}, KV cache {args.kv_cache_memory} per worker, "
                f"{args.num_threads} torch thread(s) per worker, "
                f"--max-num-batched-tokens {args.max_num_batched_tokens}"
                + (", tracemalloc on" if args.tracemalloc else "")
                + "\n"
            )
            result = asyncio.run(soak(cluster, args, probe_dir))
            dead = cluster.dead()
            summary = report(result, args)
            warnings = [
                line
                for path in sorted(log_dir.glob("soak-*.log"))
                for line in path.read_text(errors="replace").splitlines()
                if "WARNING" in line or "ERROR" in line or "Traceback" in line
            ]
            print(f"\nlog lines with WARNING / ERROR / Traceback: {len(warnings)}")
            for line in warnings[:10]:
                print("  " + line[:200])
            if dead:
                print(f"processes that died: {dead}\n{cluster.logs(1500)}")
    if args.json:
        doc = {
            "args": {k: str(v) for k, v in vars(args).items()},
            "windows": result["windows"],
            "summary": summary,
            "errors": [[k, c, n] for (k, c), n in result["stats"].errors.items()],
            "samples": result["samples"],
        }
        args.json.write_text(json.dumps(doc))
    return 1 if dead else 0


if __name__ == "__main__":
    sys.exit(main())
