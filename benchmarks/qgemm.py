"""Quantized GEMM rates on the default model's linear shapes, all paths in one process.

Paths, all x [M, K] float32 @ W.T:
  a8        common.kernels.cpu_qgemm: x quantized to int8 per block of 32, int32 block sums
  c         cpu_quant's "c" path (csrc/quant_matmul.c, float32 sums)
  f32tiles  cpu_quant's "f32tiles" path (dequantized float32 tiles times torch's sgemm)
  float32   F.linear on a dense float32 weight of the same shape (torch's sgemm): the yardstick
Weights: random, quantized as the default GGUF's formats: q4_1 (int4, groups of 32, scale and
zero) for the projections, q8_0 (int8, groups of 32, scale only) as its embedding / LM head;
both formats are run on every shape. Shapes (SmolLM2-135M, N x K): fused q/k/v 960x576, o
576x576, fused gate/up 3072x576, down 576x1536, LM head 49152x576.
Each repeat times every path once, in a rotated order (calls repeated to >= 20 ms); a path's
figure is its best repeat: GFLOP/s = 2 M N K / time. Caches are hot (the same weight each call).
Output: a markdown table per format, one row per (shape, M), and "a8 / float32" (the same run's
ratio); progress on stderr. Noisy on shared machines: compare the ratios. `--clock cpu` times
with the process's CPU time instead of the wall clock: on a machine shared with other jobs, use it
with `--threads 1` (time spent waiting for a core is then not counted; with more threads OpenMP's
waits would be).

    python benchmarks/qgemm.py [--formats q4_1,q8_0] [--shapes qkv,o,gate_up,down,lm_head]
        [--rows 1,2,4,8,16,32,64,128] [--repeats 5] [--threads N] [--clock wall|cpu]
"""

from __future__ import annotations

import argparse
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout too

from common.kernels import cpu_qgemm, cpu_quant  # noqa: E402
from common.model.quant import QuantLinear, quantize_rtn  # noqa: E402

SHAPES = {
    "qkv": (960, 576),
    "o": (576, 576),
    "gate_up": (3072, 576),
    "down": (576, 1536),
    "lm_head": (49152, 576),
}
FORMATS = {"q4_1": (4, True), "q8_0": (8, False)}  # bits, zero point
PATHS = ("a8", "c", "f32tiles", "float32")
MIN_TIME_S = 0.02
clock = time.perf_counter  # --clock cpu: time.process_time


def timed(fn, calls: int) -> float:
    start = clock()
    for _ in range(calls):
        fn()
    return (clock() - start) / calls


def rates(n: int, k: int, bits: int, zero: bool, m: int, repeats: int) -> dict[str, float]:
    """GFLOP/s of each path at this shape, best of `repeats` interleaved rounds."""
    qt = quantize_rtn(torch.randn(n, k), bits, 32)
    if not zero:
        qt.zero = None
    weight = QuantLinear(qt).kernel_weight()
    packed = cpu_qgemm.pack(weight)
    dense = qt.dequantize()
    x = torch.randn(m, k)
    fns = {
        "a8": lambda: cpu_qgemm.matmul_a8(x, packed),
        "c": lambda: cpu_quant._c_matmul(x, weight),
        "f32tiles": lambda: cpu_quant._f32tiles_matmul(x, weight),
        "float32": lambda: F.linear(x, dense),
    }
    calls = {}
    for name, fn in fns.items():  # warm up, and size each path's call count
        once = timed(fn, 1)
        calls[name] = max(1, int(MIN_TIME_S / max(once, 1e-6)))
    best = dict.fromkeys(fns, float("inf"))
    for r in range(repeats):
        order = list(fns)[r % len(fns) :] + list(fns)[: r % len(fns)]
        for name in order:
            best[name] = min(best[name], timed(fns[name], calls[name]))
    return {name: 2 * m * n * k / t / 1e9 for name, t in best.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--rows", default="1,2,4,8,16,32,64,128")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    parser.add_argument("--clock", choices=("wall", "cpu"), default="wall")
    args = parser.parse_args()
    global clock
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = [int(r) for r in args.rows.split(",")]
    print(
        f"# Quantized GEMM, GFLOP/s (best of {args.repeats}, interleaved)\n\n"
        f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, "
        f"{args.clock} clock, "
        f"torch {torch.__version__}, cpu_qgemm section {cpu_qgemm.isa()}\n"
    )
    for fmt in args.formats.split(","):
        bits, zero = FORMATS[fmt]
        print(f"## {fmt}\n")
        print("| shape (N x K) | M | " + " | ".join(PATHS) + " | a8 / float32 |")
        print("|---|---:|" + "---:|" * (len(PATHS) + 1))
        for shape in args.shapes.split(","):
            n, k = SHAPES[shape]
            for m in rows:
                print(f"{fmt} {shape} M={m}", file=sys.stderr, flush=True)
                r = rates(n, k, bits, zero, m, args.repeats)
                cells = " | ".join(f"{r[p]:.1f}" for p in PATHS)
                ratio = r["a8"] / r["float32"]
                print(f"| {shape} {n}x{k} | {m} | {cells} | {ratio:.2f} |", flush=True)
        print()


if __name__ == "__main__":
    main()
