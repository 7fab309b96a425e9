"""Can a batched decode step overlap its KV-cache walk with its projections on this machine?

A decode step's limit (common.bench.limits) is the larger of its read floor and its compute
floor: it assumes reading the KV cache and multiplying the weights overlap. This measures whether
they can, with the real parts of a step, each in its own process (one torch thread each, so
neither waits for the other's thread pool):
- walk: the CPU decode attention kernel (common.kernels.cpu_attention) over `--layers` layers of
  `--batch` sequences x `--context` cached tokens of a bfloat16 cache (the default model's heads:
  9 query / 3 KV heads of 64), the blocks in a random order, as a step reads them;
- linears: the model's projections at M = `--batch` rows in bfloat16 (F.linear, oneDNN: what
  the limits' matmul rates run), distinct weights for every layer (from memory, as in a step),
  plus the LM head.
Each alone on all the threads, each alone on one thread, then both at once on one thread each.
If the two at once take about as long as each alone on one thread, the cores are the resource
both need, and a step costs about the sum of the two parts' all-thread times whichever way it is
scheduled: its cores' floor (read + compute), not its limit (the larger), is what it can reach.

    python benchmarks/core_overlap.py [--batch 64] [--context 320] [--layers 30] [--repeats 2]

Result: a Markdown table on stdout (ms per step of each part by how it ran, the serial step on
all threads, the overlapped step on one thread each), one row per repeat; progress on stderr.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # qkv, o, gate/up, down (N, K)
HEAD_SHAPE = (49152, 576)


def _torch(threads: int):
    sys.path.insert(0, str(ROOT))
    import torch

    torch.set_num_threads(threads)
    return torch


def walk(threads: int, steps: int, args: argparse.Namespace, start, out) -> None:
    """The decode attention over every layer's cache, `steps` times: median ms to `out`."""
    torch = _torch(threads)
    from common.kernels import cpu_attention

    gen = torch.Generator().manual_seed(0)
    blocks = args.batch * args.context // BLOCK
    layers = []
    for _ in range(args.layers):
        shape = (blocks + 1, BLOCK, KV_HEADS, HEAD_DIM)
        k = torch.randn(shape, generator=gen).bfloat16()
        v = torch.randn(shape, generator=gen).bfloat16()
        table = (torch.randperm(blocks, generator=gen) + 1).view(args.batch, -1).int()
        layers.append((k, v, table))
    q = torch.randn(args.batch, HEADS, HEAD_DIM, generator=gen).bfloat16()
    lens = torch.full((args.batch,), args.context, dtype=torch.int32)

    def step() -> None:
        for k, v, table in layers:
            cpu_attention.paged_decode_attention(q, k, v, table, lens, HEAD_DIM**-0.5)

    out.put(("walk", threads, _timed(step, steps, start)))


def linears(threads: int, steps: int, args: argparse.Namespace, start, out) -> None:
    """Every layer's projections and the LM head at M = batch rows, `steps` times."""
    torch = _torch(threads)
    import torch.nn.functional as F

    weights = [
        [(torch.randn(n, k) * 0.05).bfloat16() for n, k in SHAPES] for _ in range(args.layers)
    ]
    head = (torch.randn(*HEAD_SHAPE) * 0.05).bfloat16()
    xs = {k: torch.randn(args.batch, k).bfloat16() for k in (576, 1536)}

    def step() -> None:
        with torch.inference_mode():
            for layer in weights:
                for w in layer:
                    F.linear(xs[w.shape[1]], w)
            F.linear(xs[576], head)

    out.put(("linears", threads, _timed(step, steps, start)))


def _timed(step, steps: int, start) -> float:
    step()  # warm-up: page faults, kernels built or loaded
    if start is not None:
        start.wait()  # both processes past their set-up before either is timed
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1e3


def run(jobs: list[tuple], args: argparse.Namespace) -> dict[tuple[str, int], float]:
    """Each (target, threads, steps) in its own process, together: {(part, threads): ms}."""
    out = mp.Queue()
    start = mp.Barrier(len(jobs)) if len(jobs) > 1 else None
    procs = [mp.Process(target=f, args=(th, st, args, start, out)) for f, th, st in jobs]
    for p in procs:
        p.start()
    results = [out.get(timeout=600) for _ in procs]
    for p in procs:
        p.join()
    return {(part, threads): ms for part, threads, ms in results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--context", type=int, default=320)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--threads", type=int, default=0, help="all threads (default: cores)")
    args = parser.parse_args()
    if args.context % BLOCK:
        raise SystemExit(f"--context must be a multiple of {BLOCK}")
    mp.set_start_method("spawn")
    n = args.threads or len(__import__("os").sched_getaffinity(0))
    print(
        f"batch {args.batch} x {args.context} tokens, {args.layers} layers, {n} threads\n\n"
        f"| repeat | walk, {n} threads | linears, {n} | walk, 1 | linears, 1 | serial, {n} "
        "| walk + linears at once, 1 each | at once / serial |\n|---|" + "---:|" * 7
    )
    for r in range(args.repeats):
        print(f"repeat {r + 1}", file=sys.stderr)
        alone = {}
        for target, threads in ((walk, n), (linears, n), (walk, 1), (linears, 1)):
            alone |= run([(target, threads, args.steps)], args)
        both = run([(walk, 1, args.steps), (linears, 1, 2 * args.steps)], args)
        serial = alone[("walk", n)] + alone[("linears", n)]
        at_once = max(both[("walk", 1)], both[("linears", 1)])
        print(
            f"| {r + 1} | {alone[('walk', n)]:.1f} | {alone[('linears', n)]:.1f} "
            f"| {alone[('walk', 1)]:.1f} | {alone[('linears', 1)]:.1f} | {serial:.1f} "
            f"| {both[('walk', 1)]:.1f} / {both[('linears', 1)]:.1f} | {at_once / serial:.2f} |",
            flush=True,
        )


if __name__ == "__main__":
    main()
