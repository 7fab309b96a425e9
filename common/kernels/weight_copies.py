"""The kernel copies a model's quantized weights need, made when the model loads.

Each cpu_quant path multiplies from its own copy of a weight (a8 panels, dense or AMX tiles,
tile-ordered codes), made on a weight's first call through it. `prepare_copies` makes, at
load, the copy of every path that some batch size up to a bound will take, so that no request
pays for one. Called by the model runner; reads cpu_quant's choice (`path_for`), its tuned
orders and its bounds.
"""

from __future__ import annotations

import torch

from common.kernels import cpu_dense, cpu_quant
from common.kernels.quant_weight import QuantWeight


def switch_rows(max_rows: int) -> list[int]:
    """Batch sizes up to `max_rows` where the path `cpu_quant.choose` picks may change: 1,
    `max_rows`, each tuned batch size and the one past it (a tuned order serves the sizes up to
    its own), and each bound of `cpu_quant.applies` and of `cpu_quant.TABLE`'s ranges and the
    one past it."""
    points = {1, max_rows}
    for sizes, _ in cpu_quant.tuned.values():
        points.update(sizes)
        points.update(m + 1 for m in sizes)
    bounds = [cpu_quant.dense_min_rows, cpu_dense.MIN_ROWS, cpu_dense.MAX_ROWS]
    for bound in (*bounds, *(max_m for _, max_m, _ in cpu_quant.TABLE)):
        points.update((bound, bound + 1))
    return sorted(m for m in points if 1 <= m <= max_rows)


def prepare_copies(weights: list[tuple[QuantWeight, int]], dtype: torch.dtype) -> dict[str, int]:
    """Make now the copies of every path that will serve each (weight, the most rows it
    multiplies in one call) at some batch size, for x of `dtype`, so that no request pays for
    one: made on first use, they fell on the first steps of each new size (measured, default
    model, 2 threads: the first 2,048-token prompt step 1.27-1.34 s against 0.41-0.46 s after,
    the first step with 20 logits rows 1.03-1.05 s against 0.31-0.33, mostly dequantizing and
    repacking). Returns how many weights each path serves."""
    serves: dict[str, int] = {}
    for w, most in weights:
        paths = {cpu_quant.path_for(w, torch.empty(m, w.k, dtype=dtype, device="meta"))
                 for m in switch_rows(most)}  # fmt: skip
        for path in sorted(paths):
            cpu_quant.copy_for(path, w, dtype)
            serves[path] = serves.get(path, 0) + 1
    return serves
