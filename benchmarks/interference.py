"""Prefill interference on decode: 1P1D vs colocated, a steady chat stream plus long prompts.

For each configuration, one after the other (`common.runtime.launcher`, same cores in both):
- `disagg` (1P1D): one prefill and one decode worker, one torch thread each; the router's default
  `--local-prefill-max-tokens 256`, so the short chats prefill on the decode worker and the long
  prompts on the prefill worker.
- `colocated`: one decode worker with two threads that prefills everything itself.

Load: `--streams` clients each send short streamed chats (a `--chat-words`-word question,
`--output-tokens` tokens, `ignore_eos`) back to back for the whole run. After `--idle-s` seconds
of that alone ("idle"), a `--long-tokens`-token prompt (random ids, 1 output token) also arrives
every `--long-every-s` seconds for `--mixed-s` seconds ("mixed"). ITL = the gap between two
streamed chunks of one chat; each gap is assigned to the phase it ends in.

Expectation: colocated p99 ITL spikes while long prompts prefill; the split keeps p99 ITL
within 2x of its idle value.

    python benchmarks/interference.py [--model default] [--dtype bfloat16] [--streams 4]
        [--chat-words 20] [--output-tokens 48] [--long-tokens 2000] [--idle-s 20]
        [--mixed-s 48] [--long-every-s 8] [--configs disagg,colocated] [--seed 0]
        [--plot PATH] [--json PATH]

Result: a Markdown table on stdout (config; ITL p50/p99 idle and mixed; p99 mixed / idle; ITL
p99.9 and max; gaps over 1 s; chats finished; long-prompt latency p50) and a PNG (`--plot`,
default benchmarks/results/interference.png): every ITL against time, one panel per
configuration, long prompts shaded.
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
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.runtime.launcher import LocalCluster, WorkerSpec  # noqa: E402


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


WORDS = "the a sea ship wind port sail blue storm calm night star map crew deck rope".split()


@dataclass
class Trace:
    gaps: list[tuple[float, float]] = field(default_factory=list)  # (end time, ITL seconds)
    long_spans: list[tuple[float, float]] = field(default_factory=list)  # (sent, done)
    chats_done: int = 0
    errors: int = 0


async def chat_stream(
    client: httpx.AsyncClient, model: str, args: argparse.Namespace, rng: random.Random,
    t0: float, stop_at: float, trace: Trace,
) -> None:  # fmt: skip
    while time.monotonic() < stop_at:
        question = " ".join(rng.choice(WORDS) for _ in range(args.chat_words)) + "?"
        body = {
            "model": model,
            "messages": [{"role": "user", "content": question}],
            "max_tokens": args.output_tokens,
            "ignore_eos": True,
            "temperature": 0,
            "stream": True,
        }
        last = None
        try:
            async with client.stream("POST", "/v1/chat/completions", json=body) as r:
                if r.status_code != 200:
                    trace.errors += 1
                    await r.aread()
                    continue
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if not chunk.get("choices") or not chunk["choices"][0]["delta"].get("content"):
                        continue
                    now = time.monotonic() - t0
                    if last is not None:
                        trace.gaps.append((now, now - last))
                    last = now
            trace.chats_done += 1
        except httpx.HTTPError:
            trace.errors += 1


async def long_prompts(
    client: httpx.AsyncClient, model: str, args: argparse.Namespace, rng: random.Random,
    t0: float, trace: Trace,
) -> None:  # fmt: skip
    async def one() -> None:
        prompt = [rng.randrange(1000, 20000) for _ in range(args.long_tokens)]
        body = {"model": model, "prompt": prompt, "max_tokens": 1, "temperature": 0}
        sent = time.monotonic() - t0
        try:
            r = await client.post("/v1/completions", json=body)
            if r.status_code != 200:
                trace.errors += 1
                return
        except httpx.HTTPError:
            trace.errors += 1
            return
        trace.long_spans.append((sent, time.monotonic() - t0))

    await asyncio.sleep(args.idle_s)
    tasks = []
    n = max(1, int(args.mixed_s // args.long_every_s))
    for _ in range(n):
        tasks.append(asyncio.create_task(one()))
        await asyncio.sleep(args.long_every_s)
    await asyncio.gather(*tasks)


async def run_load(url: str, model: str, args: argparse.Namespace) -> Trace:
    trace = Trace()
    rng = random.Random(args.seed)
    limits = httpx.Limits(max_connections=args.streams + 16)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        # Warm-up: one chat and one long prompt, untimed (first-call costs are not interference).
        warm = Trace()
        await chat_stream(client, model, args, rng, time.monotonic(), time.monotonic() + 0.1, warm)
        await client.post(
            "/v1/completions",
            json={"model": model, "prompt": [rng.randrange(1000, 20000) for _ in range(64)],
                  "max_tokens": 1},
        )  # fmt: skip
        t0 = time.monotonic()
        stop_at = t0 + args.idle_s + args.mixed_s
        streams = [
            chat_stream(client, model, args, random.Random(args.seed + i + 1), t0, stop_at, trace)
            for i in range(args.streams)
        ]
        await asyncio.gather(*streams, long_prompts(client, model, args, rng, t0, trace))
    return trace


def pct(values: list[float], q: float) -> float | None:
    return float(np.percentile(values, q)) * 1000 if values else None


def summarize(trace: Trace, idle_s: float) -> dict:
    idle = [g for t, g in trace.gaps if t <= idle_s]
    mixed = [g for t, g in trace.gaps if t > idle_s]
    long_lat = [done - sent for sent, done in trace.long_spans]
    s = {
        "itl_idle_p50_ms": pct(idle, 50),
        "itl_idle_p99_ms": pct(idle, 99),
        "itl_mixed_p50_ms": pct(mixed, 50),
        "itl_mixed_p99_ms": pct(mixed, 99),
        "itl_mixed_p999_ms": pct(mixed, 99.9),
        "itl_max_ms": max((g for _, g in trace.gaps), default=0) * 1000,
        "stalls_over_1s": sum(g > 1.0 for _, g in trace.gaps),
        "chats": trace.chats_done,
        "errors": trace.errors,
        "long_prompts": len(trace.long_spans),
        "long_latency_p50_ms": pct(long_lat, 50),
    }
    if s["itl_idle_p99_ms"] and s["itl_mixed_p99_ms"]:
        s["p99_mixed_over_idle"] = s["itl_mixed_p99_ms"] / s["itl_idle_p99_ms"]
    return s


def plot(path: Path, traces: dict[str, Trace], idle_s: float) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(len(traces), 1, figsize=(11, 3.4 * len(traces)), sharex=True)
    axes = np.atleast_1d(axes)
    top = max((g for tr in traces.values() for _, g in tr.gaps), default=1) * 1000 * 1.5
    for ax, (name, trace) in zip(axes, traces.items()):
        for sent, done in trace.long_spans:
            ax.axvspan(sent, done, color="tab:orange", alpha=0.2, lw=0)
        xs = [t for t, _ in trace.gaps]
        ys = [g * 1000 for _, g in trace.gaps]
        ax.scatter(xs, ys, s=4, color="tab:blue")
        ax.axvline(idle_s, color="gray", ls="--", lw=1)
        ax.set_yscale("log")
        ax.set_ylim(top=top)
        ax.set_ylabel("ITL ms")
        ax.set_title(f"{name}: chat ITL (dots); long prompts in flight (shaded)")
    axes[-1].set_xlabel("seconds (dashed: long prompts start)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--streams", type=int, default=4)
    p.add_argument("--chat-words", type=int, default=20)
    p.add_argument("--output-tokens", type=int, default=48)
    p.add_argument("--long-tokens", type=int, default=2000)
    p.add_argument("--idle-s", type=float, default=20)
    p.add_argument("--mixed-s", type=float, default=48)
    p.add_argument("--long-every-s", type=float, default=8)
    p.add_argument("--configs", default="disagg,colocated")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", type=Path, default=Path("benchmarks/results/interference.png"))
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)

    common = ["--dtype", args.dtype, "--max-model-len", "4096", "--kv-cache-memory", "1GiB"]
    layouts = {
        "disagg": [
            WorkerSpec("prefill", "prefill-0", [*common, "--num-threads", "1"], threads=1),
            WorkerSpec("decode", "decode-0", [*common, "--num-threads", "1"], threads=1),
        ],
        "colocated": [WorkerSpec("decode", "decode-0", [*common, "--num-threads", "2"], threads=2)],
    }
    traces: dict[str, Trace] = {}
    with tempfile.TemporaryDirectory(prefix="pdserve-interference-") as tmp:
        for name in args.configs.split(","):
            log(f"{name}: starting router + {len(layouts[name])} workers")
            cluster = LocalCluster(
                args.model, layouts[name], log_dir=Path(tmp), name=name, startup_timeout_s=900
            )
            with cluster:
                log(
                    f"{name}: {args.idle_s:.0f} s chats alone, then {args.mixed_s:.0f} s with a "
                    f"{args.long_tokens}-token prompt every {args.long_every_s:.0f} s"
                )
                traces[name] = asyncio.run(run_load(cluster.url, args.model, args))
    summaries = {name: summarize(t, args.idle_s) for name, t in traces.items()}

    def f(v) -> str:
        return "-" if v is None else f"{v:.0f}"

    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    )
    print(
        f"load: {args.streams} chat streams ({args.output_tokens} tokens each), "
        f"{args.idle_s:.0f} s idle then {args.mixed_s:.0f} s with a {args.long_tokens}-token "
        f"prompt every {args.long_every_s:.0f} s; {args.dtype}\n"
    )
    print(
        "| config | ITL p50 idle | ITL p99 idle | ITL p50 mixed | ITL p99 mixed "
        "| p99 mixed/idle | ITL p99.9 mixed | ITL max | gaps > 1 s | chats | errors "
        "| long prompts | long latency p50 |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, s in summaries.items():
        ratio = s.get("p99_mixed_over_idle")
        print(
            f"| {name} | {f(s['itl_idle_p50_ms'])} | {f(s['itl_idle_p99_ms'])} "
            f"| {f(s['itl_mixed_p50_ms'])} | {f(s['itl_mixed_p99_ms'])} "
            f"| {'-' if ratio is None else f'{ratio:.2f}x'} | {f(s['itl_mixed_p999_ms'])} "
            f"| {f(s['itl_max_ms'])} | {s['stalls_over_1s']} "
            f"| {s['chats']} | {s['errors']} | {s['long_prompts']} "
            f"| {f(s['long_latency_p50_ms'])} |"
        )
    print("\n(all times ms)")
    plot(args.plot, traces, args.idle_s)
    print(f"plot: {args.plot}")
    if args.json:
        doc = {
            "args": {k: str(v) for k, v in vars(args).items()},
            "summaries": summaries,
            "traces": {n: {"gaps": t.gaps, "long_spans": t.long_spans} for n, t in traces.items()},
        }
        args.json.write_text(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
