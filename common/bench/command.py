"""The `pdserve bench` command: arguments, the run plan (one profile or a sweep), progress on
stderr, Ctrl-C handling (in-flight requests cancelled, partial results written, exit code 130)."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.bench.datasets import BenchRequest, build_dataset
from common.bench.profiles import PROFILES, Run, execute, request_rate, sweep_rates

if TYPE_CHECKING:  # httpx and the report's numpy load when a benchmark runs, not for `--help`
    import httpx

EXIT_INTERRUPTED = 130
DEFAULT_NUM_REQUESTS = 100


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    a = parser.add_argument
    a("--base-url", default="http://127.0.0.1:8000/v1", help="the OpenAI API root")
    a("--model", required=True, help="model name sent with each request")
    a("--api-key", default=None, help="sent as a Bearer token")
    a("--profile", choices=PROFILES, default="synchronous")
    a("--concurrency", type=int, default=8, help="requests in flight (concurrent)")
    a("--rate", type=float, default=1.0, help="requests/s (constant, poisson)")
    a("--rates", default=None, help="comma-separated requests/s for sweep (default: measured)")
    a(
        "--num-requests",
        type=int,
        default=None,
        help=f"requests per run (default {DEFAULT_NUM_REQUESTS} unless --duration-s is given)",
    )
    a("--duration-s", type=float, default=None, help="stop launching requests after this long")
    a("--dataset", default="random", help="random | shared-prefix | repetitive | FILE.jsonl")
    a("--prompt-tokens", type=int, default=128, help="random/repetitive prompt length")
    a("--output-tokens", type=int, default=64, help="max_tokens of each request")
    a("--tenants", type=int, default=8, help="shared-prefix: number of system prompts")
    a("--system-prompt-tokens", type=int, default=1024, help="shared-prefix: system prompt length")
    a("--question-tokens", type=int, default=32, help="shared-prefix: question length")
    a("--slo-ttft-ms", type=float, default=None, help="goodput: TTFT limit")
    a("--slo-itl-ms", type=float, default=None, help="goodput: mean inter-token latency limit")
    a("--seed", type=int, default=0)
    a("--output-dir", required=True, type=Path, help="where results.json/.csv and plot.png go")


class Bench:
    """The runs of one invocation, in order, and what progress reporting reads."""

    def __init__(self, args: argparse.Namespace, dataset: list[BenchRequest]) -> None:
        self.args, self.dataset = args, dataset
        self.runs: list[Run] = []
        self.num_requests = args.num_requests
        if self.num_requests is None and args.duration_s is None:
            self.num_requests = DEFAULT_NUM_REQUESTS

    async def _run(self, client: httpx.AsyncClient, run: Run) -> Run:
        self.runs.append(run)
        return await execute(
            run,
            client,
            self.args.model,
            self.dataset,
            self.num_requests,
            self.args.duration_s,
            self.args.seed,
        )

    async def main(self) -> None:
        import httpx

        a = self.args
        headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        async with httpx.AsyncClient(
            base_url=a.base_url.rstrip("/") + "/",
            headers=headers,
            limits=limits,
            timeout=httpx.Timeout(600.0, connect=10.0),
        ) as client:
            if a.profile == "synchronous":
                await self._run(client, Run("synchronous", "synchronous"))
            elif a.profile == "concurrent":
                run = Run(f"concurrent@{a.concurrency}", "concurrent", concurrency=a.concurrency)
                await self._run(client, run)
            elif a.profile in ("constant", "poisson"):
                await self._run(client, Run(f"{a.profile}@{a.rate:.4g}/s", a.profile, rate=a.rate))
            else:
                await self._sweep(client)

    async def _sweep(self, client: httpx.AsyncClient) -> None:
        if self.args.rates:
            rates = [float(r) for r in self.args.rates.split(",") if r.strip()]
        else:
            sync = await self._run(client, Run("synchronous", "synchronous"))
            max_concurrency = self.num_requests or self.args.concurrency
            peak = await self._run(
                client,
                Run(f"concurrent@{max_concurrency}", "concurrent", concurrency=max_concurrency),
            )
            rates = sweep_rates(request_rate(sync), request_rate(peak))
        for rate in rates:
            await self._run(client, Run(f"constant@{rate:.4g}/s", "constant", rate=rate))

    async def progress(self, interval_s: float = 1.0) -> None:
        while True:
            await asyncio.sleep(interval_s)
            if not self.runs:
                continue
            run = self.runs[-1]
            done = len(run.results)
            errors = sum(not r.ok for r in run.results)
            tokens = sum(r.output_tokens for r in run.results if r.ok)
            elapsed = run.elapsed_s()
            total = run.total if run.total is not None else "?"
            print(
                f"[bench {run.name}] {done}/{total} done, {errors} errors, "
                f"{tokens / max(elapsed, 1e-9):.1f} tok/s, {elapsed:.1f} s",
                file=sys.stderr,
                flush=True,
            )


async def _run_until_interrupted(bench: Bench) -> bool:
    """Runs the bench; SIGINT cancels it. Returns whether it was interrupted."""
    loop = asyncio.get_running_loop()
    main = asyncio.ensure_future(bench.main())
    progress = asyncio.ensure_future(bench.progress())
    interrupted = False

    def on_sigint() -> None:
        nonlocal interrupted
        interrupted = True
        main.cancel()

    loop.add_signal_handler(signal.SIGINT, on_sigint)
    try:
        await main
    except asyncio.CancelledError:
        if not interrupted:
            raise
    finally:
        loop.remove_signal_handler(signal.SIGINT)
        progress.cancel()
        await asyncio.gather(progress, return_exceptions=True)
    return interrupted


def run_bench_command(args: argparse.Namespace) -> int:
    from common.bench.report import markdown, summarize, write_outputs

    n = args.num_requests or DEFAULT_NUM_REQUESTS
    dataset = build_dataset(
        args.dataset,
        n,
        prompt_tokens=args.prompt_tokens,
        output_tokens=args.output_tokens,
        tenants=args.tenants,
        system_prompt_tokens=args.system_prompt_tokens,
        question_tokens=args.question_tokens,
        seed=args.seed,
    )
    bench = Bench(args, dataset)
    started = time.time()
    interrupted = asyncio.run(_run_until_interrupted(bench))
    summaries = [summarize(run, args.slo_ttft_ms, args.slo_itl_ms) for run in bench.runs]
    config: dict[str, Any] = {
        k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "func"
    }
    config["started_unix_s"] = started
    write_outputs(args.output_dir, config, bench.runs, summaries, interrupted)
    print(markdown(summaries))
    if interrupted:
        print("pdserve bench: interrupted; partial results written", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0
