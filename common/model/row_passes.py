"""A long prefill's MLP in passes of rows that fit the last-level cache.

The MLP is row-wise: a token's output depends on its own row alone. In one pass over a prefill
of thousands of tokens, its gate/up product ([rows, 2 x intermediate]: 48 MiB in bfloat16 for
8,192 rows of the default model) and SiLU product go to memory and come back, and the
int8-activation GEMM writing the gate/up product runs slower for it. Measured on a 2-core AMD
EPYC (Zen 4, 32 MiB L3), the default model's int4 gate/up projection alone, 8,192 rows: 462-466
GOP/s in one call, 582-605 in calls of 512 to 2,048 rows; in the engine (bfloat16, int8
activations), prefills of 32 x 256 tokens, one pass and passes alternated twice, three prefills a
run: the gate/up projections' 30 calls 1.59-1.79 s in one pass, 1.47-1.51 s in passes of 512
rows; each whole prefill 4.11-4.37 s in one pass, 3.89-4.00 s in this module's 14 passes of 585
or 586 rows (a whole offline run, half of it prefill: within its noise; benchmarks/README.md).

Only where both projections go through the int8-activation kernel (common.kernels.cpu_qgemm) at
every pass's row count as at the whole's: its rows do not depend on how many rows a call has, so
the passes give the same bits as one pass. Called by common.model.llama.MLP.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

import torch

from common.kernels import cpu_quant
from common.model.quant import QuantLinear

MIN_ROWS = 256  # a pass has at least this many rows (the GEMM's rate holds from there on)
CACHE_SHARE = 4  # a pass's intermediates fill at most this fraction of the last-level cache
DEFAULT_CACHE_BYTES = 8 << 20  # where the system does not say


@functools.cache
def last_level_cache_bytes() -> int:
    """The largest data or unified cache of CPU 0, from sysfs (8 MiB where it does not say)."""
    best = 0
    for index in Path("/sys/devices/system/cpu/cpu0/cache").glob("index*"):
        try:
            if (index / "type").read_text().strip() == "Instruction":
                continue
            text = (index / "size").read_text().strip().upper()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text.rstrip("KMG")
        if digits.isdigit():
            best = max(best, int(digits) * scale)
    return best or DEFAULT_CACHE_BYTES


def rows_per_pass(bytes_per_row: int, cache_bytes: int | None = None) -> int:
    """Rows whose intermediates fill 1 / CACHE_SHARE of the cache, at least MIN_ROWS."""
    cache = last_level_cache_bytes() if cache_bytes is None else cache_bytes
    return max(MIN_ROWS, cache // CACHE_SHARE // max(1, bytes_per_row))


def _int8_rows(module: torch.nn.Module, rows: int, x: torch.Tensor) -> bool:
    """Whether `module` multiplies `rows` rows of x's dtype through the int8-activation GEMM."""
    if not isinstance(module, QuantLinear):
        return False
    probe = torch.zeros(1, module.in_features, dtype=x.dtype).expand(rows, -1)
    return cpu_quant.path_for(module.kernel_weight(), probe) == "a8"


def mlp_passes(gate_up: torch.nn.Module, down: torch.nn.Module, x: torch.Tensor) -> list[int]:
    """The row counts of the passes an MLP takes over x [rows, hidden]: [rows] (one pass) unless
    x is a CPU tensor of at least two passes' rows and both projections take the int8 GEMM at
    every count (the counts differ by at most one row)."""
    rows = x.shape[0]
    if rows < 2 * MIN_ROWS or x.dim() != 2 or x.device.type != "cpu":
        return [rows]
    inter = getattr(down, "in_features", 0)
    size = x.element_size()
    # gate/up and SiLU products, x and the output, and the two GEMMs' int8 copies of their inputs
    per_row = 3 * inter * size + 2 * x.shape[1] * size + x.shape[1] + inter
    count = -(-rows // rows_per_pass(per_row))
    if count < 2:
        return [rows]
    base, extra = divmod(rows, count)
    counts = [base + 1] * extra + [base] * (count - extra)
    for n in {rows, *counts}:
        if not (_int8_rows(gate_up, n, x) and _int8_rows(down, n, x)):
            return [rows]
    return counts


def run(
    gate_up: torch.nn.Module,
    down: torch.nn.Module,
    x: torch.Tensor,
    mlp: Callable[[torch.Tensor], torch.Tensor],
) -> torch.Tensor:
    """mlp(x), in the passes `mlp_passes` gives (their outputs joined in order)."""
    counts = mlp_passes(gate_up, down, x)
    if len(counts) == 1:
        return mlp(x)
    return torch.cat([mlp(part) for part in x.split(counts)])
