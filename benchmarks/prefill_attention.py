"""The CPU prefill-attention kernel at each ISA level this host builds, one prompt's layer.

For each prompt length, one sequence's causal attention of one layer (the default model's
shape: 9 query heads over 3 KV heads of 64, bfloat16 q, k, v, as a prefill step calls it)
through `common.kernels.cpu_prefill`, built at each level in `--levels` that this CPU runs (one
library per level, through $PDSERVE_CPU_ISA), the levels taking turns in each repeat; a level's
figure is its best repeat. GFLOP/s counts the two products' multiply-adds over the causal keys
(2 x 2 x heads x D x sum of the keys each query attends). Noisy on shared machines: compare the
levels of one run.

    python benchmarks/prefill_attention.py [--lengths 256,1024,4096] [--levels avx512,avx512bf16]
        [--heads 9] [--kv-heads 3] [--head-dim 64] [--repeats 5] [--threads N]

Output: a Markdown table, one row per length, one column per level; progress on stderr.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a plain checkout too

from common.kernels import cpu_prefill, isa  # noqa: E402

MIN_TIME_S = 0.2  # calls repeated to at least this long a repeat


def libraries(levels: list[str]) -> dict[str, object]:
    """level -> a library built at exactly that level (levels this host cannot build left out)."""
    out = {}
    before = os.environ.get(isa.ENV)
    try:
        for level in levels:
            if not any(lv.name == level and isa.runs(lv) for lv in isa.LEVELS):
                print(f"[prefill_attention] this CPU does not run {level}", file=sys.stderr)
                continue
            os.environ[isa.ENV] = level
            lib = cpu_prefill.new_library()
            if lib.available() and lib.level == level:
                out[level] = lib
            else:
                print(f"[prefill_attention] no {level} build of the kernel", file=sys.stderr)
    finally:
        if before is None:
            os.environ.pop(isa.ENV, None)
        else:
            os.environ[isa.ENV] = before
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", default="256,1024,4096")
    parser.add_argument("--levels", default="avx512,avx512bf16,amx")
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    libs = libraries(args.levels.split(","))
    if not libs:
        print("no level of the kernel builds here", file=sys.stderr)
        return 1
    h, hkv, d = args.heads, args.kv_heads, args.head_dim
    print(f"# Prefill attention, one layer ({h} heads over {hkv} KV heads of {d}, bfloat16)\n")
    print(f"{platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}\n")
    print("| tokens | " + " | ".join(f"{lv} ms (GFLOP/s)" for lv in libs) + " |")
    print("|---:|" + "---:|" * len(libs))
    g = torch.Generator().manual_seed(0)
    for n in (int(x) for x in args.lengths.split(",")):
        q = torch.randn(n, h, d, generator=g).bfloat16()
        k, v = (torch.randn(n, hkv, d, generator=g).bfloat16() for _ in range(2))
        flops = 4 * h * d * n * (n + 1) / 2
        calls, best = {}, dict.fromkeys(libs, float("inf"))
        for level, lib in libs.items():  # warm up, and size each level's call count
            start = time.perf_counter()
            cpu_prefill.prefill_attention(q, k, v, d**-0.5, lib=lib)
            calls[level] = max(1, int(MIN_TIME_S / max(time.perf_counter() - start, 1e-6)))
        for r in range(args.repeats):
            order = list(libs)[r % len(libs) :] + list(libs)[: r % len(libs)]
            for level in order:
                start = time.perf_counter()
                for _ in range(calls[level]):
                    cpu_prefill.prefill_attention(q, k, v, d**-0.5, lib=libs[level])
                took = (time.perf_counter() - start) / calls[level]
                best[level] = min(best[level], took)
            print(f"[prefill_attention] {n} tokens, repeat {r + 1}", file=sys.stderr)
        cells = [f"{1e3 * t:.2f} ({flops / t / 1e9:.0f})" for t in best.values()]
        print(f"| {n} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
