"""GPU weight-only quantized matmul benchmark: Triton W4A16 / W8A16 vs bf16 at decode batch sizes.

Needs CUDA (exits with a message otherwise); `scripts/gpu_check.sh` runs it after the CUDA tests.
Shapes: the fused linear layers of one Llama-3.2-1B decoder layer as pdserve builds them
(qkv 3072x2048, o 2048x2048, gate_up 16384x2048, down 2048x8192), plus the 1B LM head
(128256x2048) with --lm-head. For each batch size M (default 1, 8, 32, 64):

- bf16: `torch.nn.functional.linear` (cuBLAS) on a bf16 weight;
- W4A16: `quant_matmul` with int4 weights, group 128, scale and zero;
- W8A16: `quant_matmul` with int8 weights, one scale per output channel.

Every timing replays a CUDA graph of `--reps` calls (no launch gaps, as the engine's decode graphs
run) over enough copies of the weights to exceed the L2 cache, so each call streams its weight from
HBM; median over `--iters` replays. The read floor is the bytes the call reads (weight + scales +
activations) over the device's read-only bandwidth (a float32 sum over 1 GiB, measured in this
process by common.bench.limits.read_bandwidth, whose floor arithmetic it uses); "% of floor" =
floor / time.
Each format's output is first checked against the dequantized bf16 reference.

    python benchmarks/gpu_quant.py [--batches 1,8,32,64] [--iters 20] [--reps 50] [--sweep]

`--sweep` also times 30 configs (block N, split-K, warps) per shape, batch and format and prints
the best next to `choose_config`'s pick, to tune the heuristic: many minutes (each config
compiles); narrow it with --batches. Under two minutes on one H100/H200 without --sweep (mostly
Triton compiling).
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from common.bench.limits import Limits, read_bandwidth  # noqa: E402
from common.kernels.triton_quant import (  # noqa: E402
    QuantMatmulConfig,
    choose_config,
    quant_matmul,
)

# (name, N, K) of one Llama-3.2-1B layer's fused linears (hidden 2048, 32 q / 8 kv heads of 64,
# MLP 8192) and its LM head.
LAYER_SHAPES = [("qkv", 3072, 2048), ("o", 2048, 2048), ("gate_up", 16384, 2048),
                ("down", 2048, 8192)]
LM_HEAD = ("lm_head", 128256, 2048)
L2_FLUSH_BYTES = 256 << 20  # weight copies per format: several times any current L2


def graph_time_us(calls: list[Callable[[], object]], reps: int, iters: int) -> float:
    """Median time of one call (us): a CUDA graph of `reps` calls cycling through `calls`."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for fn in calls[:3]:  # warm-up outside the capture: Triton compiles here
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(reps):
            calls[i % len(calls)]()
    graph.replay()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / reps)
    return statistics.median(times)


FORMATS = ("bf16", "W4A16", "W8A16")


def make_weight(fmt: str, n: int, k: int, group_size: int) -> dict:
    """One random weight in `fmt`, as kernel arguments, with its byte count."""
    if fmt == "bf16":
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) * 0.02
        return dict(w=w, bytes=w.numel() * 2)
    if fmt == "W4A16":
        q = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, device="cuda")
        s = torch.rand(n, k // group_size, device="cuda", dtype=torch.bfloat16) * 0.01
        z = torch.randn_like(s) * 0.01
        return dict(q=q, s=s, z=z, bits=4, g=group_size, bytes=q.numel() + 4 * s.numel())
    q = torch.randint(-128, 128, (n, k), dtype=torch.int8, device="cuda")
    s = torch.rand(n, 1, device="cuda", dtype=torch.bfloat16) * 0.001
    return dict(q=q, s=s, z=None, bits=8, g=k, bytes=q.numel() + 2 * s.numel())


def dequantized(f: dict) -> torch.Tensor:
    from common.model.quant import QuantizedTensor

    n = f["q"].shape[0]
    k = f["q"].shape[1] * (2 if f["bits"] == 4 else 1)
    return QuantizedTensor(bits=f["bits"], group_size=f["g"], qweight=f["q"], scale=f["s"],
                           zero=f["z"], shape=(n, k)).dequantize(torch.bfloat16)


def call(fmt: str, f: dict, x: torch.Tensor, cfg: QuantMatmulConfig | None = None):
    if fmt == "bf16":
        return lambda: torch.nn.functional.linear(x, f["w"])
    return lambda: quant_matmul(x, f["q"], f["s"], f["z"], f["bits"], f["g"], config=cfg)


def sweep_configs(pick: QuantMatmulConfig) -> list[QuantMatmulConfig]:
    """Block N, split-K and warps around the heuristic's pick (its block M and K kept)."""
    return [QuantMatmulConfig(pick.block_m, bn, pick.block_k, split, warps)
            for bn, split, warps in itertools.product((32, 64, 128), (1, 2, 4, 8, 16), (4, 8))]


@torch.inference_mode()
def run(args: argparse.Namespace) -> None:
    batches = [int(b) for b in args.batches.split(",")]
    shapes = LAYER_SHAPES + ([LM_HEAD] if args.lm_head else [])
    device = Limits(read_bytes_per_s=read_bandwidth(1 << 30, repeats=10, device="cuda"))
    bandwidth = device.read_bytes_per_s
    print(f"device read bandwidth: {bandwidth / 1e9:.0f} GB/s", flush=True)
    rows = []
    totals: dict[tuple[int, str], list[float]] = {}
    for name, n, k in shapes:
        copies = {}
        for fmt in FORMATS:
            first = make_weight(fmt, n, k, args.group_size)
            more = L2_FLUSH_BYTES // first["bytes"]
            copies[fmt] = [first] + [make_weight(fmt, n, k, args.group_size) for _ in range(more)]
        base = {fmt: c[0] for fmt, c in copies.items()}
        for m in batches:
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            for fmt in ("W4A16", "W8A16"):
                out = call(fmt, base[fmt], x)().float()
                exact = x.float() @ dequantized(base[fmt]).float().T
                err = ((out - exact).abs().max() / exact.abs().max()).item()
                if err > 2e-2:
                    raise SystemExit(f"{fmt} {name} M={m}: max error {err:.3g} vs reference")
            for fmt in FORMATS:
                us = graph_time_us([call(fmt, f, x) for f in copies[fmt]], args.reps, args.iters)
                nbytes = base[fmt]["bytes"] + x.numel() * 2  # read: weight, scales, x
                floor_us = device.read_floor_s(nbytes) * 1e6
                rows.append((name, n, k, m, fmt, us, floor_us))
                t = totals.setdefault((m, fmt), [0.0, 0.0])
                t[0] += us
                t[1] += floor_us
            if args.sweep:
                for fmt in ("W4A16", "W8A16"):
                    f = base[fmt]
                    pick = choose_config(m, n, k, f["bits"], f["g"])
                    best = min(
                        ((graph_time_us([call(fmt, c, x, cfg) for c in copies[fmt]], args.reps,
                                        args.iters), i, cfg)
                         for i, cfg in enumerate(sweep_configs(pick))), key=lambda t: t[:2])
                    print(f"sweep {name} M={m} {fmt}: best {best[0]:.1f} us with {best[2]}; "
                          f"heuristic {pick}", flush=True)
        print(f"{name} done", flush=True)
    print(f"\nWeight-only quantized matmul, {torch.cuda.get_device_name(0)}, bf16 activations, "
          f"int4 group {args.group_size} with zero, int8 per channel; "
          f"read floor = bytes read / {bandwidth / 1e9:.0f} GB/s:\n")
    print("| layer | N x K | M | format | us | floor us | % of floor | vs bf16 |")
    print("|---|---|---:|---|---:|---:|---:|---:|")
    bf16 = {(r[0], r[3]): r[5] for r in rows if r[4] == "bf16"}
    for name, n, k, m, fmt, us, floor_us in rows:
        print(f"| {name} | {n}x{k} | {m} | {fmt} | {us:.1f} | {floor_us:.1f} | "
              f"{100 * floor_us / us:.0f}% | {bf16[(name, m)] / us:.2f}x |")
    print("\nSum over the layers above (one decoder layer" +
          (" + LM head" if args.lm_head else "") + "):\n")
    print("| M | format | us | floor us | % of floor | vs bf16 |")
    print("|---:|---|---:|---:|---:|---:|")
    for (m, fmt), (us, floor_us) in totals.items():
        print(f"| {m} | {fmt} | {us:.1f} | {floor_us:.1f} | {100 * floor_us / us:.0f}% | "
              f"{totals[(m, 'bf16')][0] / us:.2f}x |")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", default="1,8,32,64", help="comma-separated M values")
    p.add_argument("--group-size", type=int, default=128, help="int4 group size")
    p.add_argument("--iters", type=int, default=20, help="timed graph replays")
    p.add_argument("--reps", type=int, default=50, help="calls per captured graph")
    p.add_argument("--lm-head", action="store_true", help="also the 128256x2048 LM head")
    p.add_argument("--sweep", action="store_true", help="time a grid of kernel configs too")
    args = p.parse_args(argv)
    batches = [int(b) for b in args.batches.split(",")]
    if not batches or min(batches) < 1:
        p.error("--batches: positive integers, comma-separated")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("gpu_quant: no CUDA device; nothing to measure")
        return 0
    print(f"device: {torch.cuda.get_device_name(0)}, torch {torch.__version__}", flush=True)
    run(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
