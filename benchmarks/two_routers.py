"""Two routers over one cluster against one router: the same workers, the same load, no loss.

Starts two routers and one prefill and one decode worker (`pdserve router` / `prefill` / `decode`
as their own processes on loopback ports, both workers given both routers' control addresses),
then runs `pdserve bench` (concurrent, random prompts) three times, back to back on the same
workers: `--concurrency` streams through router A alone, half through each router at once (two
bench processes), and through A alone again (the drift of a shared host between the runs). Each
run has its own seed, so no run finds the prompts of another in the prefix cache.

Prints one line per run (output tokens/s summed over its bench processes, TTFT and ITL p50) and
`two_over_one`: the two-router run's output tokens/s over the mean of the one-router runs (issue
target: no throughput loss, so >= about 1). Host load average before each run, as the host is
shared. `--json` writes the same.

Run: .venv/bin/python benchmarks/two_routers.py [--model default] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.request

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def healthy(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def bench(port: int, args: argparse.Namespace, concurrency: int, requests: int, seed: int,
          out: str) -> subprocess.Popen:  # fmt: skip
    cmd = [sys.executable, "-m", "common.cli", "bench", "--base-url",
           f"http://127.0.0.1:{port}/v1", "--model", args.model, "--profile", "concurrent",
           "--concurrency", str(concurrency), "--num-requests", str(requests),
           "--prompt-tokens", str(args.prompt_tokens), "--output-tokens", str(args.output_tokens),
           "--seed", str(seed), "--output-dir", out]  # fmt: skip
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def summary(out: str) -> dict:
    with open(os.path.join(out, "results.json")) as f:
        return json.load(f)["runs"][0]["summary"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--concurrency", type=int, default=16, help="streams in each run (even)")
    ap.add_argument("--num-requests", type=int, default=48, help="requests in each run")
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--output-tokens", type=int, default=64)
    ap.add_argument("--port", type=int, default=18100, help="router A's HTTP port; its control "
                    "port is the next, router B's are 10 above")  # fmt: skip
    ap.add_argument("--json", default="")
    args = ap.parse_args()

    tmp = tempfile.mkdtemp(prefix="two_routers")
    ports = [args.port, args.port + 10]
    controls = ",".join(f"tcp://127.0.0.1:{p + 1}" for p in ports)
    procs = []
    cli = [sys.executable, "-m", "common.cli"]
    try:
        for i, port in enumerate(ports):
            with open(os.path.join(tmp, f"router{i}.log"), "w") as log:
                procs.append(subprocess.Popen(
                    [*cli, "router", "--port", str(port), "--control-port", str(port + 1),
                     "--model", args.model, "--log-level", "warning"],
                    cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                ))  # fmt: skip
        for role in ("prefill", "decode"):
            with open(os.path.join(tmp, f"{role}.log"), "w") as log:
                procs.append(subprocess.Popen(
                    [*cli, role, "--router", controls, "--model", args.model,
                     "--num-threads", "1"],
                    cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                ))  # fmt: skip
        deadline = time.monotonic() + 600
        while not all(healthy(p) for p in ports):
            if time.monotonic() > deadline or any(p.poll() is not None for p in procs):
                raise RuntimeError(f"the cluster did not come up (logs in {tmp})")
            time.sleep(1)
        half = args.concurrency // 2
        plan = [
            ("one_router", [(ports[0], args.concurrency, args.num_requests)]),
            ("two_routers", [(ports[0], half, args.num_requests // 2),
                             (ports[1], half, args.num_requests // 2)]),
            ("one_router_again", [(ports[0], args.concurrency, args.num_requests)]),
        ]  # fmt: skip
        figures: dict[str, float] = {}
        seed = 1
        for name, benches in plan:
            figures[f"{name}_load_avg"] = os.getloadavg()[0]
            running = []
            for port, concurrency, requests in benches:
                out = os.path.join(tmp, f"{name}_{port}")
                running.append((bench(port, args, concurrency, requests, seed, out), out))
                seed += 1
            for proc, _ in running:
                if proc.wait() != 0:
                    raise RuntimeError(f"pdserve bench failed ({tmp})")
            runs = [summary(out) for _, out in running]
            figures[f"{name}_output_tok_s"] = sum(r["output_token_throughput"] for r in runs)
            figures[f"{name}_errors"] = sum(r["errors"] for r in runs)
            figures[f"{name}_ttft_p50_ms"] = max(r["ttft_p50_ms"] for r in runs)
            figures[f"{name}_itl_p50_ms"] = max(r["itl_p50_ms"] for r in runs)
        one = (figures["one_router_output_tok_s"] + figures["one_router_again_output_tok_s"]) / 2
        figures["two_over_one"] = figures["two_routers_output_tok_s"] / one
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            try:
                proc.wait(20)
            except subprocess.TimeoutExpired:
                proc.kill()
    width = max(map(len, figures))
    for k, v in figures.items():
        print(f"{k:<{width}}  {v:.4g}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(figures, f, indent=1)


if __name__ == "__main__":
    main()
