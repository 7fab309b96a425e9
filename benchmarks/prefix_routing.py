"""Prefix-aware routing vs round robin on a shared-prefix workload, 2 prefill + 1 decode workers.

For each policy in `--policies`, one after the other, starts a router (`--routing POLICY`,
`--local-prefill-max-tokens 0` so every prompt is prefilled on a prefill worker) with two prefill
workers and one decode worker (`common.runtime.launcher`), runs `pdserve bench --dataset
shared-prefix` against it (`--tenants` system prompts of `--system-prompt-tokens` words, tenants in
random order, short questions, `--concurrency` requests in flight), then reads the prefill workers'
prefix-cache counters from the router's /metrics.

The prefill workers' KV cache (`--prefill-kv-cache-memory`, default 160 MiB: about 6 of the 8
default tenants' prompts in bfloat16) is smaller than all tenants' prompts together but larger
than half of them: the regime prefix routing is for (the cluster's cache holds every tenant; one
worker's does not). Round robin makes each worker see every tenant, so its LRU cache thrashes;
prefix routing gives each worker about half the tenants.

Hit rate = prefix-cache hit tokens / query tokens on the prefill workers. Achievable = what a
single worker with an unlimited cache would hit on the same prompts: every request but each
tenant's first hits the full blocks of the longest prefix its tenant's prompts share. Targets:
prefix's hit rate >= 90% of the achievable, its TTFT p50 >= 2x better than round robin.

    python benchmarks/prefix_routing.py [--model default] [--dtype bfloat16] [--tenants 8]
        [--system-prompt-tokens 1024] [--question-tokens 24] [--output-tokens 16]
        [--num-requests 96] [--concurrency 4] [--prefill-kv-cache-memory 160MiB]
        [--decode-kv-cache-memory 512MiB] [--policies prefix,round_robin] [--seed 0]
        [--out DIR] [--json PATH]

Result: a Markdown table on stdout (policy, requests, errors, hit rate, % of achievable, TTFT
p50/p99, E2E p50, output and request throughput) and the TTFT ratio; `pdserve bench`'s own
results.json/.csv/plot.png per policy under `--out`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.runtime.launcher import LocalCluster, WorkerSpec  # noqa: E402


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def achievable(args: argparse.Namespace, block_size: int = 16) -> tuple[int, int, list[int]]:
    """(achievable hit tokens, prompt tokens, prompt lengths) for the bench's exact prompts."""
    from common.api.tokenizer import Tokenizer
    from common.bench.datasets import shared_prefix_dataset
    from common.model.model_files import resolve_model

    tok = Tokenizer.from_source(resolve_model(args.model))
    requests = shared_prefix_dataset(
        args.num_requests, args.tenants, args.system_prompt_tokens, args.question_tokens,
        args.output_tokens, args.seed,
    )  # fmt: skip
    prompts = [tok.apply_chat_template(r.messages) for r in requests]
    by_tenant: dict[str, list[list[int]]] = {}
    for r, p in zip(requests, prompts):
        by_tenant.setdefault(r.messages[0]["content"], []).append(p)
    hits = 0
    for group in by_tenant.values():
        common = min(len(p) for p in group)
        for p in group[1:]:
            common = next((i for i in range(common) if p[i] != group[0][i]), common)
        for p in group[1:]:  # the first of a tenant computes what the rest reuse
            hits += min(common // block_size, (len(p) - 1) // block_size) * block_size
    return hits, sum(len(p) for p in prompts), [len(p) for p in prompts]


def run_policy(policy: str, args: argparse.Namespace, out: Path, log_dir: Path) -> dict:
    engine = ["--dtype", args.dtype, "--num-threads", "1", "--max-model-len", "2048"]
    prefill = [*engine, "--kv-cache-memory", args.prefill_kv_cache_memory]
    decode = [*engine, "--kv-cache-memory", args.decode_kv_cache_memory]
    workers = [
        WorkerSpec("prefill", "prefill-0", prefill, threads=1),
        WorkerSpec("prefill", "prefill-1", prefill, threads=1),
        WorkerSpec("decode", "decode-0", decode, threads=1),
    ]
    router = ["--routing", policy, "--local-prefill-max-tokens", "0"]
    cluster = LocalCluster(
        args.model, workers, router_flags=router, log_dir=log_dir, name=policy,
        startup_timeout_s=900,
    )  # fmt: skip
    log(f"{policy}: starting router + {len(workers)} workers")
    with cluster:
        log(f"{policy}: ready at {cluster.url}")
        bench_dir = out / policy
        cmd = [
            sys.executable, "-m", "common.cli", "bench", "--base-url", cluster.url + "/v1",
            "--model", args.model, "--profile", "concurrent", "--concurrency",
            str(args.concurrency), "--num-requests", str(args.num_requests), "--dataset",
            "shared-prefix", "--tenants", str(args.tenants), "--system-prompt-tokens",
            str(args.system_prompt_tokens), "--question-tokens", str(args.question_tokens),
            "--output-tokens", str(args.output_tokens), "--seed", str(args.seed),
            "--output-dir", str(bench_dir),
        ]  # fmt: skip
        log(f"{policy}: pdserve bench ({args.num_requests} requests)")
        subprocess.run(cmd, check=True, stdout=sys.stderr)
        summary = json.loads((bench_dir / "results.json").read_text())["runs"][0]["summary"]
        queries = hits = 0.0
        for w in ("prefill-0", "prefill-1"):
            # Counters come with heartbeats: wait until the worker has counted every prompt.
            q = cluster.wait_counter(
                "prefix_cache_queries_total", 1, timeout_s=5, worker=w
            )  # fmt: skip
            queries += q
            hits += cluster.sample("prefix_cache_hits_total", worker=w) or 0.0
        per_worker = {
            w: int(cluster.sample("prefill_dispatched_total", worker=w) or 0)
            for w in ("prefill-0", "prefill-1")
        }
    return {"summary": summary, "hit_tokens": hits, "query_tokens": queries,
            "dispatched": per_worker}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--tenants", type=int, default=8)
    p.add_argument("--system-prompt-tokens", type=int, default=1024)
    p.add_argument("--question-tokens", type=int, default=24)
    p.add_argument("--output-tokens", type=int, default=16)
    p.add_argument("--num-requests", type=int, default=96)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--prefill-kv-cache-memory", default="160MiB")
    p.add_argument("--decode-kv-cache-memory", default="512MiB")
    p.add_argument("--policies", default="prefix,round_robin")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=None, help="where pdserve bench writes its files")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    ach_hits, total_tokens, lengths = achievable(args)
    ach_rate = ach_hits / total_tokens
    log(f"prompts: {min(lengths)}-{max(lengths)} tokens, achievable hit rate {ach_rate:.1%}")
    results = {}
    with tempfile.TemporaryDirectory(prefix="pdserve-prefix-") as tmp:
        out = args.out or Path(tmp) / "bench"
        for policy in args.policies.split(","):
            results[policy] = run_policy(policy, args, out, Path(tmp))

    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    )
    print(
        f"workload: {args.num_requests} chat requests, {args.tenants} tenants, prompts "
        f"{min(lengths)}-{max(lengths)} tokens ({total_tokens} in all), {args.output_tokens} "
        f"output tokens, concurrency {args.concurrency}; 2 prefill workers with "
        f"{args.prefill_kv_cache_memory} KV cache each, 1 decode worker, {args.dtype}\n"
    )
    print(
        "| policy | requests | errors | dispatched p0/p1 | hit rate | % of achievable "
        "| TTFT p50 ms | TTFT p99 ms | E2E p50 ms | output tok/s | req/s |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for policy, r in results.items():
        s = r["summary"]
        rate = r["hit_tokens"] / r["query_tokens"] if r["query_tokens"] else 0.0
        r["hit_rate"], r["pct_of_achievable"] = rate, rate / ach_rate if ach_rate else None
        d = r["dispatched"]
        print(
            f"| {policy} | {s['completed']} | {s['errors']} | {d['prefill-0']}/{d['prefill-1']} "
            f"| {rate:.1%} | {rate / ach_rate:.0%} | {s['ttft_p50_ms']:.0f} "
            f"| {s['ttft_p99_ms']:.0f} | {s['e2e_p50_ms']:.0f} "
            f"| {s['output_token_throughput']:.1f} | {s['request_throughput']:.2f} |"
        )
    print(f"| achievable | | | | {ach_rate:.1%} | 100% | | | | | |")
    if "prefix" in results and "round_robin" in results:
        ratio = (
            results["round_robin"]["summary"]["ttft_p50_ms"]
            / results["prefix"]["summary"]["ttft_p50_ms"]
        )
        print(f"\nTTFT p50 round_robin / prefix: {ratio:.2f}x (target >= 2x)")
        results["ttft_p50_ratio"] = ratio
    if args.json:
        args.json.write_text(
            json.dumps({"args": vars(args) | {"out": str(args.out), "json": str(args.json)},
                        "achievable_hit_rate": ach_rate, "results": results}, indent=1)
        )  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
