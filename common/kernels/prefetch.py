"""Where the a8 kernel prefetches the weights it streams next, chosen by measurement here.

quant_gemm.c's pair tiles ask for a thread's next pair of weight panels while they compute this
one: into L1 (prefetcht0, level 1, the kernel's default) or into L2 only (prefetcht2, level 2).
Which streams faster from memory depends on the CPU: on a 2-core AMD EPYC (Zen 4), the default
model's 121 projections at 1 row took 3.4-3.7 ms with L2 against 4.4-4.7 ms with L1 (a batch-1
decode step 9-17% faster); the Intel hosts that chose L1 were never measured with L2. The timing
only shows with the weights coming from memory, which a tune's cache-warm slices never do, so
`choose` times whole sweeps over the model's own packed weights at 1 row (the weights' bytes
exceed most L3s: each sweep evicts the last), the two levels alternated, and keeps L1 unless L2
is clearly faster. Both libraries that hold the kernel get the level: cpu_qgemm's (the per-op
path, an LM head) and the C decode layers' own copy (common.kernels.cpu_layer).

Called by common.kernels.tune.prepare at an engine's start, where the tune left a8 serving one
row; 0.3-0.4 s for the default model on a 2-core host.
"""

from __future__ import annotations

import logging
import statistics
import time
from collections.abc import Callable, Sequence

import torch

from common.kernels import cpu_qgemm
from common.kernels.cpu_qgemm import PackedWeight

log = logging.getLogger(__name__)

L1, L2 = 1, 2  # qgemm_set_prefetch's levels
NAMES = {L1: "L1", L2: "L2"}
ROUNDS = 5  # sweeps per level, alternated
MIN_GAIN = 0.02  # L2 replaces the default only when its median sweep is this much shorter
MIN_BYTES = 8 << 20  # smaller models stream from cache: nothing to choose


def set_level(level: int) -> None:
    """Set the prefetch level in every loaded library that holds the kernel."""
    from common.kernels import cpu_layer

    libs = [cpu_qgemm._LIB.get()]
    if cpu_layer.enabled and cpu_layer.available():
        libs.append(cpu_layer._LIB.get())
    for lib in libs:
        if lib.qgemm_set_prefetch(level) != 0:
            raise ValueError(f"the a8 kernel refused prefetch level {level}")


def packed_bytes(weights: Sequence[PackedWeight]) -> int:
    """The bytes a sweep over these weights streams (codes, scales, zeros)."""
    return sum(
        t.numel() * t.element_size()
        for w in weights
        for t in (w.codes, w.scale, w.zero)
        if t is not None
    )


def sweep_s(weights: Sequence[PackedWeight], xs: Sequence[torch.Tensor]) -> float:
    """Seconds of one 1-row a8 matmul per weight, in order."""
    t0 = time.perf_counter()
    for w, x in zip(weights, xs):
        cpu_qgemm.matmul_a8(x, w)
    return time.perf_counter() - t0


def choose(
    weights: Sequence[PackedWeight], dtype: torch.dtype,
    timer: Callable[[Sequence[PackedWeight], Sequence[torch.Tensor]], float] = sweep_s,
) -> tuple[int, dict[int, float]]:  # fmt: skip
    """Time both levels over `weights` (the model's, as the a8 path packed them), set the faster
    and return it with each level's median sweep in seconds ({} when the weights are too small
    to leave the caches: L1, the kernel's default, is set then). Packed weights mean the
    library is built."""
    if packed_bytes(weights) < MIN_BYTES:
        set_level(L1)
        return L1, {}
    xs = [torch.randn(1, w.k).to(dtype) for w in weights]
    times: dict[int, list[float]] = {L1: [], L2: []}
    for r in range(ROUNDS + 1):
        for level in (L1, L2) if r % 2 == 0 else (L2, L1):
            set_level(level)
            seconds = timer(weights, xs)
            if r:  # the first round warms both: packing's pages, the kernels' first calls
                times[level].append(seconds)
    medians = {level: statistics.median(t) for level, t in times.items()}
    best = L2 if medians[L2] < (1 - MIN_GAIN) * medians[L1] else L1
    set_level(best)
    return best, medians


def describe(level: int, medians: dict[int, float], weights: Sequence[PackedWeight]) -> str:
    """One log line: the level chosen and what each took."""
    name = NAMES[level]
    if not medians:
        return f"a8 weight prefetch: {name} (the weights fit in the caches: not measured)"
    mb = packed_bytes(weights) / 1e6
    times = ", ".join(f"{NAMES[lv]} {1e3 * s:.2f} ms" for lv, s in medians.items())
    return (f"a8 weight prefetch: into {name} (1-row sweep of {len(weights)} weights, {mb:.0f} MB, "
            f"median of {ROUNDS}: {times})")  # fmt: skip
