"""What another process's CPU work costs a decode step that runs on every core.

A served token is relayed by other processes on the same cores (the router, its zmq I/O thread,
the client): on a 2-core host about 0.4-0.5 ms of their CPU per token. The batch-1 decode step
runs on all the cores and meets at a barrier after each of its ~150 parallel parts (OpenMP), so
when that work takes a core from one of the step's threads, the other waits at the next barrier:
the step can lose more wall time than the CPU taken from it. Perfectly shared, a step on `n`
cores loses the work's CPU / n.

This measures that loss with a synthetic co-runner instead of the relay (so it is repeatable and
the same for every setting): a process that burns `--burst-us` of CPU, then sleeps
`--period-us`, over and over (by default about the relay's share: 250 us of CPU every ~2.7 ms).
For each OpenMP spin setting (`--spins`: `default` = libgomp's own, or microseconds, applied as
`PDSERVE_OMP_SPIN_US` is in the workers), a fresh process loads the model (`--model`, the
engine's defaults and `--quantization`), then times its batch-1 decode step as the engine runs it
(the default model's: the C decode layers and the LM head) at `--context` tokens of context,
alone and with the co-runner, in turns, `--rounds` times.

    python benchmarks/shared_cores.py [--model default] [--quantization auto] [--context 256]
        [--spins default,30,200] [--burst-us 250] [--period-us 2500] [--steps 300] [--rounds 3]

Result: a Markdown table on stdout, one row per spin setting (the medians of the rounds): step
alone, step with the co-runner, the co-runner's CPU per step (from /proc), the step's extra time,
and the extra as a multiple of that CPU (`loss`: 1 / cores if perfectly shared, 1 when the step
loses all of it, more when its threads also wait for each other); progress on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

from router_scale_clients import proc_cpu_s  # benchmarks/: /proc's CPU seconds of a process

ROOT = Path(__file__).resolve().parents[1]


def log(message: str) -> None:
    print(f"[shared_cores] {message}", file=sys.stderr, flush=True)


def burn(burst_s: float, period_s: float) -> None:
    """The co-runner: `burst_s` of CPU, then `period_s` asleep, until killed or until the process
    that started it is gone (killed itself, it leaves no burner behind)."""
    parent = os.getppid()
    while os.getppid() == parent:
        end = time.perf_counter() + burst_s
        while time.perf_counter() < end:
            pass
        time.sleep(period_s)


def child(args: argparse.Namespace) -> dict:
    """One spin setting, in its own process: the spin is set before torch loads libgomp."""
    sys.path.insert(0, str(ROOT))  # run from a plain checkout too
    from common.runtime import omp_spin

    omp_spin.configure()  # sets GOMP_SPINCOUNT where PDSERVE_OMP_SPIN_US asks
    import torch

    from common.config import EngineConfig
    from common.model.model_files import resolve_model
    from common.model.model_runner import ModelRunner
    from common.model.weights import iter_weights

    source = resolve_model(args.model)
    config = EngineConfig(
        model=args.model,
        quantization=args.quantization,
        block_size=16,
        max_model_len=args.context + 32,
        kv_cache_memory="64MiB",
    )
    runner = ModelRunner(config, source.hf_config, iter_weights(source))
    blocks = list(range(args.context // 16 + 1))
    ids, pos, meta = runner.prepare_rows([([7], args.context, blocks)])
    model = runner.model

    @torch.inference_mode()
    def steps(n: int) -> float:
        start = time.perf_counter()
        for _ in range(n):
            model.compute_logits(model(ids, pos, meta))
        return (time.perf_counter() - start) / n

    steps(20)  # warm-up (and the kernels' build)
    alone, loaded, cpu = [], [], []
    argv = [sys.executable, __file__, "--burn", str(args.burst_us), str(args.period_us)]
    for _ in range(args.rounds):
        alone.append(steps(args.steps))
        co = subprocess.Popen(argv)
        try:
            time.sleep(0.05)  # started and burning
            before = proc_cpu_s(co.pid)
            loaded.append(steps(args.steps))
            cpu.append((proc_cpu_s(co.pid) - before) / args.steps)
        finally:
            co.kill()
            co.wait()
    return {
        "spin": os.environ.get("GOMP_SPINCOUNT", "-"),  # "-": libgomp's own
        "threads": torch.get_num_threads(),
        "alone_ms": statistics.median(alone) * 1e3,
        "loaded_ms": statistics.median(loaded) * 1e3,
        "co_cpu_ms": statistics.median(cpu) * 1e3,
    }


def main() -> int:
    if len(sys.argv) == 4 and sys.argv[1] == "--burn":
        burn(float(sys.argv[2]) / 1e6, float(sys.argv[3]) / 1e6)
        return 0
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="default")
    p.add_argument("--quantization", default="auto", help="the engine's flag")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--spins", default="default,30,200", help="comma list: default or microseconds")
    p.add_argument("--burst-us", type=float, default=250.0)
    p.add_argument("--period-us", type=float, default=2500.0)
    p.add_argument("--steps", type=int, default=300, help="decode steps per timing")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(child(args)))
        return 0
    rows = []
    for spin in args.spins.split(","):
        unset = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "PDSERVE_OMP_SPIN_US")
        env = {k: v for k, v in os.environ.items() if k not in unset}
        if spin != "default":
            env["PDSERVE_OMP_SPIN_US"] = spin
        log(f"spin {spin}: loading the model, {args.rounds} rounds of {args.steps} steps")
        argv = [sys.executable, __file__, "--child", *sys.argv[1:]]
        out = subprocess.run(argv, env=env, cwd=ROOT, capture_output=True, text=True)
        if out.returncode != 0:
            log(f"spin {spin} failed:\n{out.stderr[-2000:]}")
            return 1
        rows.append({"setting": spin, **json.loads(out.stdout.strip().splitlines()[-1])})
    cores = os.cpu_count() or 1
    print(
        f"co-runner: {args.burst_us:g} us of CPU every {args.burst_us + args.period_us:g} us "
        f"(plus its sleep's wake-up); batch-1 decode step at {args.context} tokens of context; "
        f"{cores} cores. loss = the step's extra time / the co-runner's CPU in it (perfectly "
        f"shared: 1/{cores} = {1 / cores:.2f})\n"
    )
    print(
        "| OpenMP spin (us) | GOMP_SPINCOUNT | threads | step alone ms | step with co-runner ms "
        "| co-runner CPU ms per step | extra ms | loss |\n|---|---|---:|---:|---:|---:|---:|---:|"
    )
    for r in rows:
        extra = r["loaded_ms"] - r["alone_ms"]
        loss = extra / r["co_cpu_ms"] if r["co_cpu_ms"] > 0 else float("nan")
        print(
            f"| {r['setting']} | {r['spin']} | {r['threads']} | {r['alone_ms']:.2f} "
            f"| {r['loaded_ms']:.2f} | {r['co_cpu_ms']:.3f} | {extra:.2f} | {loss:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
