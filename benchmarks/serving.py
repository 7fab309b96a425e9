"""End-to-end serving: 1P1D (disaggregated) vs colocated, through the router, as real processes.

For each configuration in `--configs`, one after the other, starts what `pdserve up` starts
(router + workers with up's flags, through `common.runtime.launcher`, on loopback ports the OS
gives), waits until every worker serves, sends a short warm-up, then `--num-requests` streamed
`POST /v1/completions` with `--concurrency` in flight at once, and stops the cluster. Both
configurations get the same model, dtype, engine flags and prompts (distinct random token ids, so
the prefix cache has nothing to reuse), `ignore_eos` and greedy sampling, so every request
produces `--output-len` tokens.

- `disagg` (1P1D): `up --prefill 1 --decode 1 --local-prefill-max-tokens 0`, so that every prompt
  is prefilled on the prefill worker and its KV moved to the decode worker (by default prompts up
  to 256 tokens stay on the decode worker).
- `colocated`: `up --prefill 0 --decode 1`, the decode worker prefills its own prompts.

`up` gives each worker cores / workers torch threads (`--num-threads` overrides), so both
configurations use the same cores. Per request, timed by `pdserve bench`'s client
(`common.bench.client`, which also defines them): TTFT (request sent to first chunk with text),
ITL (every gap between chunks with text), TPOT ((E2E - TTFT) / (tokens - 1)), E2E, and output
tokens from the stream's usage chunk. A request that fails, or ends with fewer
than `--output-len` tokens, counts as an error and is left out of the latencies. Output tok/s is
all output tokens over the wall time of the timed requests. Ratios (1P1D / colocated), not
absolute times, are the result: the machines are shared and noisy.

    python benchmarks/serving.py [--model default] [--dtype bfloat16] [--num-requests 64]
        [--concurrency 16] [--prompt-len 512] [--output-len 64] [--configs disagg,colocated]
        [--warmup 2] [--num-threads N] [--startup-timeout-s 900] [--request-timeout-s 600]
        [--seed 0] [--json PATH] [-- ENGINE FLAGS]

Engine flags after `--` go to every worker (e.g. `-- --kv-cache-memory 1GiB`). Result: a machine
line, then a Markdown table on stdout (per configuration and the ratio 1P1D / colocated) and, for
1P1D, the KV bytes the prefill worker sent (from the router's /metrics: a check that prompts were
really prefilled remotely); progress on stderr; with `--json PATH` the summaries, ratios and every
request's raw numbers as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.bench.client import RequestResult, send_request  # noqa: E402
from common.bench.datasets import BenchRequest  # noqa: E402

MIN_TOKEN_ID, MAX_TOKEN_ID = 100, 40000  # random prompt ids: no special tokens, inside the vocab
CONFIGS = {
    "disagg": {"label": "1P1D", "prefill": 1, "decode": 1},
    "colocated": {"label": "colocated", "prefill": 0, "decode": 1},
}


def log(msg: str) -> None:
    print(f"[serving] {msg}", file=sys.stderr, flush=True)


def percentile(values: list[float], q: float) -> float | None:
    """Linear interpolation between closest ranks (numpy's default); None when empty."""
    if not values:
        return None
    xs = sorted(values)
    pos = (len(xs) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def random_prompts(n: int, length: int, seed: int) -> list[list[int]]:
    """n distinct prompts of `length` random token ids."""
    rng = random.Random(seed)
    seen: set[tuple[int, ...]] = set()
    prompts: list[list[int]] = []
    while len(prompts) < n:
        prompt = [rng.randrange(MIN_TOKEN_ID, MAX_TOKEN_ID) for _ in range(length)]
        if tuple(prompt) not in seen:
            seen.add(tuple(prompt))
            prompts.append(prompt)
    return prompts


# ---------------------------------------------------------------------------------------------
# Cluster: what `pdserve up` runs for a configuration


def up_cluster(name: str, args: argparse.Namespace, engine_args: list[str], log_dir: Path):
    """The processes `pdserve up --prefill P --decode 1` starts, with the same flags (threads per
    worker included), on ports from the OS; every process logs to `log_dir`."""
    from common.runtime.up import add_up_args, cluster_from_args

    spec = CONFIGS[name]
    flags = [
        "--model", args.model, "--dtype", args.dtype,
        "--prefill", str(spec["prefill"]), "--decode", str(spec["decode"]),
        "--port", "0", "--control-port", "0",
    ]  # fmt: skip
    if spec["prefill"] > 0:
        flags += ["--local-prefill-max-tokens", "0"]  # every prompt to the prefill worker
    if args.num_threads:
        flags += ["--num-threads", str(args.num_threads)]
    if engine_args:
        flags += ["--", *engine_args]
    up = argparse.ArgumentParser()
    add_up_args(up)
    return cluster_from_args(up.parse_args(flags), log_dir=log_dir, name=name)


# ---------------------------------------------------------------------------------------------
# Load


async def one_request(
    client: httpx.AsyncClient, model: str, prompt: list[int], output_len: int, index: int
) -> RequestResult:
    """One streamed request timed by `pdserve bench`'s client; fewer than `output_len` tokens is
    an error here (ignore_eos asks for exactly that many)."""
    sink: list[RequestResult] = []
    request = BenchRequest(max_tokens=output_len, prompt=prompt, ignore_eos=True)
    result = await send_request(client, model, request, index, time.perf_counter(), sink)
    if result.ok and result.output_tokens < output_len:
        result.error = f"short output: {result.output_tokens} of {output_len} tokens"
    return result


async def run_load(
    url: str,
    model: str,
    prompts: list[list[int]],
    output_len: int,
    concurrency: int,
    timeout_s: float,
    label: str,
) -> tuple[list[RequestResult], float]:
    """All prompts, `concurrency` in flight at once; returns the results and the wall time."""
    limits = httpx.Limits(max_connections=concurrency + 4, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(timeout_s, connect=10)
    done = 0
    step = max(1, len(prompts) // 8)
    async with httpx.AsyncClient(
        base_url=url + "/v1/", timeout=timeout, limits=limits, trust_env=False
    ) as client:
        sem = asyncio.Semaphore(concurrency)

        async def bounded(index: int, prompt: list[int]) -> RequestResult:
            nonlocal done
            async with sem:
                r = await one_request(client, model, prompt, output_len, index)
            done += 1
            if done % step == 0 or done == len(prompts):
                log(f"{label}: {done}/{len(prompts)} done")
            return r

        t0 = time.perf_counter()
        results = await asyncio.gather(*(bounded(i, p) for i, p in enumerate(prompts)))
        seconds = time.perf_counter() - t0
    return list(results), seconds


def summarize(label: str, results: list[RequestResult], seconds: float) -> dict:
    ok = [r for r in results if not r.error]
    ms = 1000.0

    def pct(values: list[float], q: float) -> float | None:
        p = percentile(values, q)
        return None if p is None else p * ms

    ttft = [r.ttft_s for r in ok if r.ttft_s is not None]
    itl = [g for r in ok for g in r.itls_s]
    tpot = [r.tpot_s for r in ok if r.tpot_s is not None]
    e2e = [r.e2e_s for r in ok]
    output_tokens = sum(r.output_tokens for r in results)
    return {
        "config": label,
        "requests": len(ok),
        "errors": len(results) - len(ok),
        "seconds": seconds,
        "output_tokens": output_tokens,
        "output_tok_s": output_tokens / seconds if seconds > 0 else None,
        "ttft_p50_ms": pct(ttft, 50),
        "ttft_p99_ms": pct(ttft, 99),
        "itl_p50_ms": pct(itl, 50),
        "itl_p99_ms": pct(itl, 99),
        "tpot_p50_ms": pct(tpot, 50),
        "e2e_p50_ms": pct(e2e, 50),
        "first_errors": sorted({r.error for r in results if r.error})[:5],
    }


# ---------------------------------------------------------------------------------------------
# Report

COLUMNS = [
    ("requests", "requests", "{:d}"),
    ("errors", "errors", "{:d}"),
    ("seconds", "seconds", "{:.2f}"),
    ("output_tok_s", "output tok/s", "{:.1f}"),
    ("ttft_p50_ms", "TTFT p50 ms", "{:.1f}"),
    ("ttft_p99_ms", "TTFT p99 ms", "{:.1f}"),
    ("itl_p50_ms", "ITL p50 ms", "{:.1f}"),
    ("itl_p99_ms", "ITL p99 ms", "{:.1f}"),
    ("tpot_p50_ms", "TPOT p50 ms", "{:.1f}"),
    ("e2e_p50_ms", "E2E p50 ms", "{:.1f}"),
]
NO_RATIO = {"requests", "errors"}


def fmt(value, spec: str) -> str:
    return "-" if value is None else spec.format(value)


def ratios(summaries: dict[str, dict]) -> dict[str, float | None] | None:
    if "disagg" not in summaries or "colocated" not in summaries:
        return None
    a, b = summaries["disagg"], summaries["colocated"]
    out: dict[str, float | None] = {}
    for key, _, _ in COLUMNS:
        if key in NO_RATIO:
            continue
        out[key] = a[key] / b[key] if a[key] is not None and b[key] else None
    return out


def print_report(machine: dict, args: argparse.Namespace, summaries: dict[str, dict]) -> None:
    print(
        f"machine: {machine['cpu_cores']} CPU cores, device {machine['device']}, "
        f"torch {machine['torch']}, python {machine['python']}"
    )
    print()
    print(
        f"model {args.model}, dtype {args.dtype}; {args.num_requests} requests at concurrency "
        f"{args.concurrency}, prompt {args.prompt_len} tokens (random ids), output "
        f"{args.output_len} tokens (ignore_eos, greedy); workers get cores / workers torch threads"
        + (f" (--num-threads {args.num_threads})" if args.num_threads else "")
    )
    print()
    print("| config | " + " | ".join(title for _, title, _ in COLUMNS) + " |")
    print("|---|" + "---:|" * len(COLUMNS))
    for s in summaries.values():
        cells = [fmt(s[key], spec) for key, _, spec in COLUMNS]
        print(f"| {s['config']} | " + " | ".join(cells) + " |")
    r = ratios(summaries)
    if r is not None:
        cells = ["-" if k in NO_RATIO else fmt(r[k], "{:.2f}x") for k, _, _ in COLUMNS]
        print("| 1P1D / colocated | " + " | ".join(cells) + " |")
    for name, s in summaries.items():
        if CONFIGS[name]["prefill"]:
            note = " (none: prompts were not prefilled remotely)" if not s["kv_sent_mb"] else ""
            print(f"\n{s['config']}: KV sent prefill -> decode {s['kv_sent_mb']:.1f} MB{note}")
        for err in s["first_errors"]:
            print(f"\n{s['config']} error: {err}")


# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    engine_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, engine_args = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--configs", default="disagg,colocated", help="comma list of disagg,colocated")
    p.add_argument("--warmup", type=int, default=2, help="untimed requests per configuration")
    p.add_argument("--num-threads", type=int, default=0, help="torch threads per worker (0: up's)")
    p.add_argument("--startup-timeout-s", type=float, default=900.0)
    p.add_argument("--request-timeout-s", type=float, default=600.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    args.configs = [c.strip() for c in args.configs.split(",") if c.strip()]
    unknown = [c for c in args.configs if c not in CONFIGS]
    if unknown or not args.configs:
        p.error(f"--configs: unknown {unknown}; choose from {sorted(CONFIGS)}")
    if min(args.num_requests, args.concurrency, args.prompt_len, args.output_len) < 1:
        p.error("--num-requests, --concurrency, --prompt-len and --output-len must be >= 1")
    return args, engine_args


def machine_info() -> dict:
    import torch

    cuda = torch.cuda.is_available()
    return {
        "cpu_cores": os.cpu_count(),
        "device": torch.cuda.get_device_name(0) if cuda else "cpu",
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args, engine_args = parse_args(sys.argv[1:] if argv is None else argv)
    # SIGTERM unwinds like Ctrl-C, so the clusters' `finally` still stops them.
    signal.signal(signal.SIGTERM, _interrupt)
    machine = machine_info()
    log(f"machine: {machine}")
    prompts = random_prompts(args.num_requests + args.warmup, args.prompt_len, args.seed)
    warmup, timed = prompts[args.num_requests :], prompts[: args.num_requests]

    summaries: dict[str, dict] = {}
    raw: dict[str, list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="pdserve-bench-") as tmp:
        for name in args.configs:
            label = CONFIGS[name]["label"]
            cluster = up_cluster(name, args, engine_args, Path(tmp))
            try:
                log(f"{label}: starting")
                t0 = time.monotonic()
                cluster.start(args.startup_timeout_s)
                log(f"{label}: ready after {time.monotonic() - t0:.1f} s at {cluster.url}")
                if warmup:
                    log(f"{label}: {len(warmup)} warm-up requests")
                    results, _ = asyncio.run(
                        run_load(
                            cluster.url,
                            args.model,
                            warmup,
                            min(4, args.output_len),
                            args.concurrency,
                            args.request_timeout_s,
                            label + " warm-up",
                        )
                    )
                    bad = [r.error for r in results if r.error]
                    if bad:
                        raise RuntimeError(f"{label}: warm-up failed: {bad[0]}")
                log(f"{label}: {len(timed)} requests at concurrency {args.concurrency}")
                results, seconds = asyncio.run(
                    run_load(
                        cluster.url,
                        args.model,
                        timed,
                        args.output_len,
                        args.concurrency,
                        args.request_timeout_s,
                        label,
                    )
                )
                if any(r.error for r in results):
                    log(f"{label}: errors; log tail:\n{cluster.logs()}")
                kv_bytes = 0.0
                if CONFIGS[name]["prefill"]:  # counters travel with heartbeats: poll a while
                    kv_bytes = cluster.wait_counter("kv_transfer_bytes_total", 1, timeout_s=5)
            finally:
                cluster.stop()
            summaries[name] = summarize(label, results, seconds)
            summaries[name]["kv_sent_mb"] = kv_bytes / 1e6
            if CONFIGS[name]["prefill"]:
                log(f"{label}: prefill workers sent {kv_bytes / 1e6:.1f} MB of KV (with warm-up)")
            raw[name] = [r.to_dict() for r in results]

    print_report(machine, args, summaries)
    if args.json:
        out = {
            "machine": machine,
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "engine_args": engine_args,
            "summaries": summaries,
            "ratios_disagg_over_colocated": ratios(summaries),
            "requests": raw,
        }
        args.json.write_text(json.dumps(out, indent=1))
        log(f"wrote {args.json}")
    return 1 if any(s["errors"] for s in summaries.values()) else 0


if __name__ == "__main__":
    sys.exit(main())
