"""pdserve vs llama.cpp's llama-server: same GGUF, same client, same cores, one run, ratios.

Systems, all started first, each a real server on loopback ports, then measured one after the
other (the others idle meanwhile), `--rounds` times in turns with the order rotated a place each
round (benchmarks/vs_llamacpp_report.py: medians, and ratios as the median of the rounds' own, so
a host whose speed drifts within minutes moves both sides of a round's ratio together):
  llama-server  llama.cpp's server (`--llama-server PATH`) on the default model's GGUF,
                `--parallel N` (N = `--concurrency`), `-t T` (T = `--threads`, default the cores)
  colocated     what `pdserve up --prefill 0 --decode 1 --num-threads T` starts (router + one
                decode worker that prefills its own prompts)
  1P1D          what `pdserve up --prefill 1 --decode 1 --num-threads T/2
                --local-prefill-max-tokens 0` starts: every prompt is prefilled on the prefill
                worker and its KV sent to the decode worker (checked: the KV bytes sent)
Each gets `--warmup` untimed requests, then the load of `pdserve bench` (common.bench: its random
dataset of `--prompt-len` token ids -> `--output-len` tokens, greedy, ignore_eos; its profiles and
report), first `synchronous` (1 stream, `--requests-1` requests), then `concurrent` with
`--concurrency` streams (`--requests-n` requests). Every phase has its own prompts, so no prefix
cache helps. Per phase: output tok/s, ITL p50 (gaps between streamed chunks), TTFT p50.

Limits (common.bench.limits, measured in this process on T threads before any server starts;
floors from common.bench.step_cost on the model pdserve serves, loaded here with the workers'
engine flags): tok/s beside its ceiling (tokens / the least time for the phase's work: one
prefill of the prompts, then output_len - 1 decode steps at the mean context; at 1 stream per
request, at N streams N at once), ITL beside the decode step's limit at that batch (the larger of
its read floor, bytes read / read bandwidth, and its compute floor, FLOPs / the best rate of the
dtype each linear computes in), TTFT beside the prefill floor of one prompt (a bound for any
request; at N streams a request also waits for the others' prefills and decode steps). A line
above the table also gives the cores' floors of the two decode steps and the N streams' ceiling
at them (common.bench.limits: where reading takes the cores, read and compute floors add up),
and the engine's own batch-1 decode step timed in this process at the mean context (the issue's
"batch-1 step", judged against its limit beside the served 1-stream ITL, which also waits for the
token's relay to the client on the same cores). Both judgements take the limit where the step
ran: the read bandwidth drifts on a shared host (33-57 GB/s within an hour on one 2-core VM), so
the in-process step is timed five times, each right after the read bandwidth is measured again,
and every round measures it again just before each pdserve system's turn; the judgement is the
median of the step / limit ratios so paired.

    python benchmarks/vs_llamacpp.py --llama-server PATH [--systems llama,colocated,disagg]
        [--threads T] [--prompt-len 256] [--output-len 128] [--concurrency 16]
        [--requests-1 8] [--requests-n 64] [--warmup 2] [--seed 0] [--rounds 1] [--quick]
        [--json PATH]
        [--log-dir DIR] [-- ENGINE FLAGS]

Result on stdout: the machine line, the limits' table, one Markdown table (per phase and metric:
each system's figure with its % of the limit, the limit, pdserve / llama-server ratios, the
target), then the targets met or missed; progress on stderr. With `--json PATH` the same as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import platform
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import httpx
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout too
sys.path.insert(0, str(Path(__file__).resolve().parent))  # its report (and step_profile)

from vs_llamacpp_report import (  # noqa: E402
    SYSTEMS,
    combine_rounds,
    print_report,
    report_rows,
    targets,
)

from common.bench import limits as machine_limits  # noqa: E402
from common.bench.datasets import random_dataset  # noqa: E402
from common.bench.profiles import Run, execute  # noqa: E402
from common.bench.report import summarize  # noqa: E402
from common.bench.step_cost import decode_floor, generate_floor_s  # noqa: E402
from common.model.model_files import resolve_model  # noqa: E402

MODEL_NAME = "default"


def log(msg: str) -> None:
    print(f"[vs_llamacpp] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------------------------
# Limits


def measure_floors(args, engine_args: list[str]):
    """The machine's limits on `args.threads` threads and the floors of this benchmark's work on
    the model the workers serve (loaded here with their engine flags, then freed), the engine's
    own batch-1 step timed in turns with its limit (`engine_pairs`), and a function that measures
    that limit again (the read bandwidth now: before each round)."""
    from common.config import add_engine_args, config_from_args
    from common.engine.engine import Engine

    torch.set_num_threads(args.threads)
    source = resolve_model(MODEL_NAME)
    log(f"measuring the machine's limits on {args.threads} threads")
    limits = machine_limits.measure(source.hf_config)
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    flags = ["--model", MODEL_NAME, "--dtype", args.dtype, *engine_args]
    flags += ["--kv-cache-memory", "128MiB", "--max-model-len", "2048"]
    flags += ["--num-threads", str(args.threads)]  # floors only: a small cache
    engine = Engine(config_from_args(parser.parse_known_args(flags)[0]))
    model, cfg, act = engine.runner.model, source.hf_config, engine.runner.dtype
    p, o, n = args.prompt_len, args.output_len, args.concurrency
    ctx = p + o // 2  # a stream's mean context
    step1 = decode_floor(limits, model, cfg, 1, ctx, act)
    step_n = decode_floor(limits, model, cfg, n, ctx, act)
    floors = {
        "step_1": {"read_ms": step1.read_s * 1e3, "compute_ms": step1.compute_s * 1e3,
                   "limit_ms": step1.limit_s * 1e3, "cores_ms": step1.core_s * 1e3,
                   "dtypes": list(step1.dtypes)},
        "step_n": {"read_ms": step_n.read_s * 1e3, "compute_ms": step_n.compute_s * 1e3,
                   "limit_ms": step_n.limit_s * 1e3, "cores_ms": step_n.core_s * 1e3,
                   "dtypes": list(step_n.dtypes)},
        "prefill_1_ms": generate_floor_s(limits, model, cfg, act, 1, p, 1) * 1e3,
        "ceiling_1_tok_s": o / generate_floor_s(limits, model, cfg, act, 1, p, o),
        "ceiling_n_tok_s": n * o / generate_floor_s(limits, model, cfg, act, n, p, o),
        "cores_ceiling_n_tok_s": n * o / generate_floor_s(
            limits, model, cfg, act, n, p, o, cores=True
        ),
        "act_dtype": str(act).removeprefix("torch."),
    }  # fmt: skip
    read_bytes, compute_ms = step1.read_s * limits.read_bytes_per_s, step1.compute_s * 1e3
    buf = machine_limits.read_buffer()

    def limit_now() -> float:
        """The batch-1 step's limit (ms) with the read bandwidth measured now."""
        return max(read_bytes / machine_limits.read_bandwidth_now(buf) * 1e3, compute_ms)

    pairs = engine_step_pairs(engine, ctx, limit_now)
    floors["step_1"]["engine_pairs"] = pairs
    floors["step_1"]["engine_ms"] = min(ms for ms, _ in pairs)
    del engine, model
    gc.collect()
    return limits, floors, limit_now


def engine_step_pairs(
    engine, context: int, limit_ms: Callable[[], float], iters: int = 20, pairs: int = 5
) -> list[tuple[float, float]]:
    """The engine's own batch-1 decode step at `context` tokens, in this process (the mean of
    `iters` steps: the step itself, without the relay to the client that a served token also
    waits for on the same cores), `pairs` times, each with its limit measured just before it
    (`limit_ms`): [(step ms, limit ms)]."""
    from step_profile import decode_inputs, step_ms  # this script's folder

    inputs = decode_inputs(engine.runner, 1, context)
    step_ms(engine.runner, inputs, iters)  # warm
    out = []
    for _ in range(pairs):
        limit = limit_ms()
        out.append((step_ms(engine.runner, inputs, iters), limit))
    return out


# ---------------------------------------------------------------------------------------------
# Servers


def free_port() -> int:
    """A free loopback port for llama-server (it cannot report one chosen by the OS)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LlamaServer:
    """llama.cpp's server on the GGUF, `--parallel` slots of prompt + output tokens each."""

    def __init__(self, path: str, gguf: Path, args, log_dir: Path) -> None:
        self.port = free_port()
        ctx = args.concurrency * (args.prompt_len + args.output_len + 64)
        self.cmd = [
            path, "-m", str(gguf), "--host", "127.0.0.1", "--port", str(self.port),
            "-c", str(ctx), "--parallel", str(args.concurrency), "-t", str(args.threads),
            "-tb", str(args.threads),
        ]  # fmt: skip
        self.log_path = log_dir / "llama-server.log"
        self.timeout_s = args.startup_timeout_s
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> LlamaServer:
        log(f"llama-server: {' '.join(self.cmd)}")
        with open(self.log_path, "wb") as out:
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.timeout_s
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.url}/health", timeout=2, trust_env=False).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            if self.proc.poll() is not None:
                tail = self.log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"llama-server exited with {self.proc.returncode}:\n{tail}")
            time.sleep(0.5)
        self.__exit__()
        raise TimeoutError(f"llama-server not healthy in {self.timeout_s} s")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def pdserve_cluster(name: str, args, engine_args: list[str], log_dir: Path):
    """The processes `pdserve up` starts for this configuration, with up's own flag handling."""
    from common.runtime.up import add_up_args, cluster_from_args

    prefill = 1 if name == "disagg" else 0
    threads = max(1, args.threads // (prefill + 1))  # T threads in all, as llama-server has
    flags = [
        "--model", MODEL_NAME, "--dtype", args.dtype, "--prefill", str(prefill),
        "--decode", "1", "--port", "0", "--control-port", "0", "--num-threads", str(threads),
    ]  # fmt: skip
    if prefill:
        flags += ["--local-prefill-max-tokens", "0"]  # every prompt to the prefill worker
    if engine_args:
        flags += ["--", *engine_args]
    up = argparse.ArgumentParser()
    add_up_args(up)
    cluster = cluster_from_args(up.parse_args(flags), log_dir=log_dir, name=name)
    cluster.startup_timeout_s = args.startup_timeout_s
    return cluster


# ---------------------------------------------------------------------------------------------
# Load: pdserve bench's client, dataset, profiles and report


async def run_phase(url: str, run: Run, dataset, timeout_s: float) -> Run:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with httpx.AsyncClient(
        base_url=url + "/v1/",
        limits=limits,
        timeout=httpx.Timeout(timeout_s, connect=10.0),
        trust_env=False,
    ) as client:
        return await execute(run, client, MODEL_NAME, dataset, len(dataset), None)


def phases(args, rnd: int = 0) -> list[tuple[str, Run, int, int]]:
    """(key, run, requests, dataset seed) of each phase of round `rnd` (from 0): the warm-up in
    round 0 only, then the timed phases, on prompts of their own in every round (seeds offset by
    the round: no round finds another's prompts in a prefix cache)."""
    n, seed = args.concurrency, args.seed + 7919 * rnd
    out = [
        ("s1", Run("synchronous", "synchronous"), args.requests_1, seed + 1),
        (f"s{n}", Run(f"concurrent@{n}", "concurrent", concurrency=n), args.requests_n, seed),
    ]
    if rnd == 0:
        out.insert(0, ("warmup", Run("warm-up", "concurrent", concurrency=n), args.warmup,
                       args.seed + 1000))  # fmt: skip
    return out


def measure_system(name: str, url: str, args, rnd: int = 0) -> dict:
    label = SYSTEMS[name]
    out: dict = {}
    for key, run, count, seed in phases(args, rnd):
        if count < 1:
            continue
        output_len = min(8, args.output_len) if key == "warmup" else args.output_len
        dataset = random_dataset(count, args.prompt_len, output_len, seed)
        log(f"{label}: {run.name}, {count} requests of {args.prompt_len} -> {output_len}")
        asyncio.run(run_phase(url, run, dataset, args.request_timeout_s))
        for r in run.results:  # ignore_eos asks for exactly output_len tokens
            if r.ok and r.output_tokens != output_len:
                r.error = f"{r.output_tokens} output tokens, not {output_len}"
        summary = summarize(run, None, None)
        errors = sorted({r.error for r in run.results if r.error})
        if errors:
            log(f"{label}: {run.name}: {len(errors)} kinds of error, first: {errors[0]}")
        summary["first_errors"] = errors[:3]
        if key != "warmup":
            summary["raw"] = [r.to_dict() for r in sorted(run.results, key=lambda r: r.index)]
            log(
                f"{label}: {run.name}: {summary['output_token_throughput']:.1f} tok/s, ITL p50 "
                f"{summary['itl_p50_ms']} ms, TTFT p50 {summary['ttft_p50_ms']} ms"
            )
        out[key] = summary
    return out


def start_system(name: str, args, engine_args: list[str], log_dir: Path, gguf: Path,
                 stack: ExitStack):  # fmt: skip
    """Start one system, stopped when `stack` closes: its URL, and its cluster for pdserve."""
    t0 = time.monotonic()
    cluster = None
    if name == "llama":
        url = stack.enter_context(LlamaServer(args.llama_server, gguf, args, log_dir)).url
    else:
        cluster = pdserve_cluster(name, args, engine_args, log_dir)
        stack.enter_context(cluster)
        url = cluster.url
    log(f"{SYSTEMS[name]}: ready after {time.monotonic() - t0:.1f} s at {url}")
    return url, cluster


def rotated(names: list[str], rnd: int) -> list[str]:
    """Round `rnd`'s order: `names` rotated `rnd` places (each system leads in turn)."""
    k = rnd % len(names) if names else 0
    return names[k:] + names[:k]


def run_systems(
    args, engine_args: list[str], log_dir: Path, gguf: Path, limit_now: Callable[[], float],
    round_limits: dict[str, list[float]],
) -> dict:  # fmt: skip
    """Every system started, then measured in `args.rounds` rounds, one system after the other
    in each, the order rotated every round; each system's rounds combined (combine_rounds). A
    system that fails to start is reported failed; an interrupt (SIGTERM, Ctrl-C) ends the
    rounds and reports what was measured. The servers that wait meanwhile are idle. Just before
    each pdserve system's turn the batch-1 step's limit is measured again (`limit_now`, into
    `round_limits[name]`, kept for the turns that finished): its served 1-stream ITL in that
    round is judged against it. Measured once a round, before the first system's turn, it was
    minutes old by the last one's, and the read bandwidth moves that fast on a shared host (a
    round began at 35 GB/s, the next two at 57)."""
    results: dict[str, dict] = {}
    per_round: dict[str, list[dict]] = {}
    with ExitStack() as stack:
        up = {}
        try:
            for name in args.systems:
                try:
                    up[name] = start_system(name, args, engine_args, log_dir, gguf, stack)
                except (RuntimeError, TimeoutError) as e:
                    log(f"{SYSTEMS[name]} failed: {e}")
                    results[name] = {"failed": str(e)[:2000]}
            for rnd in range(args.rounds):
                for name in rotated(list(up), rnd):
                    log(f"round {rnd + 1} of {args.rounds}: {SYSTEMS[name]}")
                    limit = limit_now() if name != "llama" else None
                    per_round.setdefault(name, []).append(
                        measure_system(name, up[name][0], args, rnd)
                    )
                    if limit is not None:
                        round_limits.setdefault(name, []).append(limit)
        except KeyboardInterrupt:  # SIGTERM / Ctrl-C / timeout: report what was measured
            log("interrupted; reporting the rounds measured before it")
        for name, rounds in per_round.items():
            results[name] = combine_rounds(rounds)
        cluster = up.get("disagg", (None, None))[1]
        if cluster is not None and "disagg" in per_round:  # counters travel with heartbeats
            kv = cluster.wait_counter("kv_transfer_bytes_total", 1, timeout_s=5)
            results["disagg"]["kv_sent_mb"] = kv / 1e6
    return {name: results[name] for name in args.systems if name in results}


# ---------------------------------------------------------------------------------------------


def parse_args(argv: list[str]) -> tuple[argparse.Namespace, list[str]]:
    engine_args: list[str] = []
    if "--" in argv:
        i = argv.index("--")
        argv, engine_args = argv[:i], argv[i + 1 :]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--llama-server", metavar="PATH", help="llama.cpp's llama-server binary")
    p.add_argument("--systems", default="llama,colocated,disagg",
                   help="comma list of llama,colocated,disagg (run in this order)")  # fmt: skip
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1,
                   help="threads per system in all (default: the cores)")  # fmt: skip
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--prompt-len", type=int, default=256)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--concurrency", type=int, default=16, help="streams of the second phase")
    p.add_argument("--requests-1", type=int, default=8, help="requests at 1 stream")
    p.add_argument("--requests-n", type=int, default=64, help="requests at --concurrency")
    p.add_argument("--warmup", type=int, default=2, help="untimed short requests per system")
    p.add_argument("--startup-timeout-s", type=float, default=900.0)
    p.add_argument("--request-timeout-s", type=float, default=900.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--rounds", type=int, default=1,
                   help="measure each system this many times, in turns (medians)")  # fmt: skip
    p.add_argument("--quick", action="store_true", help="tiny sizes: checks that it runs")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--log-dir", type=Path, default=None, help="keep the servers' logs here")
    args = p.parse_args(argv)
    if args.quick:
        args.prompt_len, args.output_len, args.concurrency = 32, 8, 4
        args.requests_1, args.requests_n, args.warmup = 2, 4, 1
    if args.rounds < 1:
        p.error("--rounds must be at least 1")
    args.systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    if not args.systems or any(s not in SYSTEMS for s in args.systems):
        p.error(f"--systems: choose from {', '.join(SYSTEMS)}")
    if "llama" in args.systems and not args.llama_server:
        p.error("--llama-server PATH is needed (or leave llama out of --systems)")
    return args, engine_args


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> int:
    args, engine_args = parse_args(sys.argv[1:] if argv is None else argv)
    signal.signal(signal.SIGTERM, _interrupt)  # unwind, so servers are stopped
    load = {"start": Path("/proc/loadavg").read_text().split()[:3]}
    limits, floors, limit_now = measure_floors(args, engine_args)
    gguf = resolve_model(MODEL_NAME).path
    with tempfile.TemporaryDirectory(prefix="pdserve-vs-llamacpp-") as tmp:
        log_dir = args.log_dir or Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        round_limits = floors["step_1"]["limit_ms_rounds"] = {}
        results = run_systems(args, engine_args, log_dir, gguf, limit_now, round_limits)
    load["end"] = Path("/proc/loadavg").read_text().split()[:3]
    machine = (
        f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, torch "
        f"{torch.__version__}"
    )
    rows = report_rows(results, floors, args)
    goals = targets(rows, args, floors)
    print_report(machine, load, limits, floors, rows, goals, results, args)
    if args.json:
        out = {
            "machine": machine,
            "loadavg": load,
            "limits": limits.as_dict(),
            "floors": floors,
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "engine_args": engine_args,
            "rows": rows,
            "targets": goals,
            "results": results,
        }
        args.json.write_text(json.dumps(out, indent=1))
        log(f"wrote {args.json}")
    failed = any("failed" in r for r in results.values())
    errors = any(isinstance(s, dict) and s.get("errors") for r in results.values()
                 for s in r.values())  # fmt: skip
    return 1 if failed or errors else 0


if __name__ == "__main__":
    sys.exit(main())
