"""Do running streams wait while a worker compiles a new grammar? The largest gap between two
tokens of `--streams` streams while a request with a large JSON schema, new to router and worker,
arrives.

Starts a router and one decode worker that prefills itself (`common.runtime.launcher`, default
model, `--threads` for the worker), starts `--streams` streamed completions (ignore_eos,
`--max-tokens` each), and `--after-s` seconds later sends one chat request whose
`response_format` is an object schema of `--properties` string properties, each with a pattern,
their names new to this run (so nothing is cached). Each stream's token arrival times give the
gaps. With `--warm`, the same schema is sent once before the streams start, so router and worker
have it cached: the gap left then is the structured request's own first step.

    python benchmarks/grammar_stall.py [--model default] [--streams 8] [--max-tokens 600]
        [--prompt-tokens 64] [--after-s 4] [--properties 3000] [--threads 2] [--warm]
        [--repeats 1] [--json PATH]

Result (stdout): the machine line, then a Markdown table, one row a run: the largest gap, its
99.9th percentile and median over all streams' gaps, how many gaps exceed 40 ms, and how long the
structured request took. Exit status 1 if a request failed or a stream came up short.
Measured 2026-12-06 (Intel Xeon, 2 vCPUs, defaults): largest gap 234 / 184 / 267 ms in three
runs, 9-13 ms median, the schema request 2.3-2.6 s; with `--warm` 187 ms (99.9th percentile 86);
with the worker compiling on its loop (33d614f's worker.py and grammar.py) 1,273 ms.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import statistics
import sys
import time
import uuid
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout too

from common.bench.datasets import random_dataset  # noqa: E402
from common.runtime.launcher import LocalCluster, WorkerSpec  # noqa: E402

GAP_MS = 40.0  # a gap over this counts as a stall (steps here take 7-12 ms)


def schema_request(properties: int, tag: str) -> dict:
    """A chat request whose JSON schema has `properties` patterned string properties named with
    `tag` (new names: no cache has them)."""
    props = {
        f"k{i}_{tag}": {"type": "string", "pattern": "[a-z]{1,20}@[a-z]+\\.(com|org)"}
        for i in range(properties)
    }
    return {
        "model": "default",
        "max_tokens": 4,
        "messages": [{"role": "user", "content": "hi"}],
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": "x", "schema": {"type": "object", "properties": props}},
        },
    }


async def stream(client: httpx.AsyncClient, prompt: list[int], max_tokens: int) -> list[float]:
    """One streamed completion; the arrival time of each chunk (a token whose text completes no
    character yet comes with the next one: random prompt ids, as `pdserve bench` sends, keep
    that rare)."""
    body = {"model": "default", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
            "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    times: list[float] = []
    tokens = 0
    async with client.stream("POST", "/v1/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if chunk.get("choices"):
                    times.append(time.perf_counter())
                if chunk.get("usage"):
                    tokens = chunk["usage"]["completion_tokens"]
    if tokens != max_tokens:
        raise httpx.HTTPError(f"a stream ended after {tokens} of {max_tokens} tokens")
    return times


async def one_run(url: str, args: argparse.Namespace, run: int) -> dict:
    request = schema_request(args.properties, uuid.uuid4().hex[:8])
    limits = httpx.Limits(max_connections=args.streams + 2)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        if args.warm:
            (await client.post("/v1/chat/completions", json=request)).raise_for_status()
        prompts = [r.prompt for r in random_dataset(args.streams, args.prompt_tokens, 1, run)]
        tasks = [asyncio.create_task(stream(client, p, args.max_tokens)) for p in prompts]
        await asyncio.sleep(args.after_s)
        start = time.perf_counter()
        reply = await client.post("/v1/chat/completions", json=request)
        took = time.perf_counter() - start
        reply.raise_for_status()
        streams = await asyncio.gather(*tasks)
    gaps = sorted(1e3 * (b - a) for times in streams for a, b in zip(times, times[1:]))
    return {
        "largest_ms": gaps[-1],
        "p999_ms": gaps[min(len(gaps) - 1, int(0.999 * len(gaps)))],
        "median_ms": statistics.median(gaps),
        "stalls": sum(g > GAP_MS for g in gaps),
        "gaps": len(gaps),
        "request_s": took,
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--streams", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=600)
    p.add_argument("--prompt-tokens", type=int, default=64)
    p.add_argument("--after-s", type=float, default=4.0)
    p.add_argument("--properties", type=int, default=3000)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    p.add_argument("--warm", action="store_true", help="send the schema once before the streams")
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args()
    flags = ["--dtype", "bfloat16", "--num-threads", str(args.threads)]  # as `pdserve up` starts it
    worker = WorkerSpec("decode", "decode-0", flags=flags, threads=args.threads)
    print(f"machine: {platform.machine()}, {os.cpu_count()} cores, Python "
          f"{platform.python_version()}; {args.streams} streams of {args.prompt_tokens} -> "
          f"{args.max_tokens} tokens; a schema of {args.properties} properties "
          f"{'sent once before (cached)' if args.warm else 'new'} after {args.after_s:g} s; "
          f"worker threads {args.threads}\n")  # fmt: skip
    print("| run | largest gap ms | 99.9% ms | median ms | gaps over 40 ms | of gaps | "
          "schema request s |")  # fmt: skip
    print("|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    with LocalCluster(args.model, [worker], name="stall", startup_timeout_s=900) as cluster:
        for run in range(args.repeats):
            try:
                row = asyncio.run(one_run(cluster.url, args, run))
            except httpx.HTTPError as e:
                print(f"a request failed: {e!r}\n{cluster.logs(1500)}")
                return 1
            rows.append(row)
            print(f"| {run + 1} | {row['largest_ms']:.0f} | {row['p999_ms']:.0f} | "
                  f"{row['median_ms']:.1f} | {row['stalls']} | {row['gaps']} | "
                  f"{row['request_s']:.2f} |", flush=True)  # fmt: skip
    if args.json:
        args.json.write_text(json.dumps({"args": vars(args) | {"json": str(args.json)},
                                         "rows": rows}, indent=1))  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
