"""Bfloat16 matmuls over dense copies of quantized weights on AMX tiles (csrc/dense_amx.c).

x [M, K] @ W.T with x bfloat16 and W the weight dequantized to bfloat16 once and packed into
the tile unit's layout (`pack`, kept by the caller: cpu_quant's "amxbf16" path keeps it on the
weight, within --dense-weight-memory). Float32 sums over the whole of K, one rounding to
bfloat16 per output: no per-block float steps, which bound the int8-activation kernel at
16-128 rows. The C decode layers run it inside their one call a layer, unlike oneDNN's dense
path (measured: the per-op path that oneDNN needs cost more than its faster matmul saved at
64 sequences). Where it serves is the kernel tune's choice, by measurement on the host.
`matmul_int4` (cpu_quant's "amx4") gives the same bits from a 4-bit weight with no dense copy:
the codes kept in tile order (`pack_int4`, half a byte a weight plus float32 scales), each
panel dequantized to bfloat16 by the thread that reaches it.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from common.kernels.cbuild import CLibrary
from common.kernels.quant_weight import QuantWeight

PANEL = 16  # output columns per packed panel
DEPTH = 32  # K per tile (16 pairs of bfloat16)
# Rows up to which it may serve: every pair of panels rereads all of x, which stays in L2 up to
# about this many rows; a long prompt's chunk goes to oneDNN's blocked GEMM (cpu_quant's dense).
# Measured (default model, 2 threads, AMX Xeon): 64 x (256 -> 128) run-batch, its prompt steps
# of ~900 rows took 4.49 s through oneDNN and 5.24 s through this kernel.
MAX_ROWS = 256
# ... and above which: a verify step of the CPU's default speculation (at most 2 sequences of
# k + 1 <= 8 rows) keeps the a8 kernel its decode steps use, so that greedy output with
# speculation stays greedy output without it (cpu_quant's uniform rows); at 16 rows this
# kernel gains little anyway (default model: 0.222 against a8's 0.25 ms a layer, 2 threads)
MIN_ROWS = 16

_SOURCE = Path(__file__).parent / "csrc" / "dense_amx.c"
_p, _i = ctypes.c_void_p, ctypes.c_int
_SIGNATURES = {
    "dense_amx": [_p, ctypes.c_long, _i, _i, _i, _p, _p, _i],
    "dense_amx_q4": [_p, ctypes.c_long, _i, _i, _i, _p, _p, _p, _i, _p, _i],
    "dense_amx_available": [],
}


def new_library() -> CLibrary:
    """A kernel library, built on its first use at the ISA level cbuild picks then."""
    return CLibrary(_SOURCE, ["-O3", "-fopenmp"], _SIGNATURES, "the CPU AMX bfloat16 matmul")


_LIB = new_library()


def available(lib: CLibrary | None = None) -> bool:
    """True when the library is built with AMX-BF16 and the kernel gave this process the tile
    state (building it on the first call)."""
    lib = lib or _LIB
    return lib.available() and bool(lib.get().dense_amx_available())


def supports(n: int, k: int) -> bool:
    """Whether the kernel takes a weight [n, k]: whole panels and tiles."""
    return n >= PANEL and n % PANEL == 0 and k >= DEPTH and k % DEPTH == 0


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A bfloat16 [n, k] weight in dense_amx.c's layout: [n/16, k/32, 16 pairs, 16 columns, 2]."""
    n, k = weight.shape
    if not supports(n, k):
        raise ValueError(f"the AMX matmul needs [16 x i, 32 x j] weights, not [{n}, {k}]")
    w = weight.to(torch.bfloat16).reshape(n // PANEL, PANEL, k // DEPTH, DEPTH // 2, 2)
    return w.permute(0, 2, 3, 1, 4).contiguous()


def _out_for(x: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """The result of x @ W.T for a W of [n, k], after checking that the kernels take x."""
    if x.dtype != torch.bfloat16 or x.dim() != 2 or x.shape[1] != k or x.stride(1) != 1:
        raise ValueError(f"AMX matmul: x must be bfloat16 [M, {k}] rows, not {tuple(x.shape)}")
    return torch.empty(x.shape[0], n, dtype=torch.bfloat16)


def matmul(x: torch.Tensor, packed: torch.Tensor, lib: CLibrary | None = None) -> torch.Tensor:
    """x [M, K] (bfloat16, rows of contiguous elements) @ W.T for W packed by `pack`."""
    n, k = packed.shape[0] * PANEL, packed.shape[1] * DEPTH
    out = _out_for(x, n, k)
    rc = (lib or _LIB).get().dense_amx(
        x.data_ptr(), x.stride(0), x.shape[0], k, n, packed.data_ptr(), out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"AMX matmul failed (code {rc})")
    return out


def supports_int4(w: QuantWeight) -> bool:
    """Whether `matmul_int4` takes this weight: 4-bit, whole panels and tiles, groups of a
    multiple of 32 columns (so a tile lies in one group)."""
    g = w.group_size
    return w.bits == 4 and supports(w.n, w.k) and g >= DEPTH and g % DEPTH == 0 and w.k % g == 0


def pack_int4(w: QuantWeight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """A 4-bit weight as dense_amx_q4 reads it, 0.5 byte a weight plus its scales: codes per
    panel of 16 columns and 32 columns of K, 16 rows (pairs of K) of 16 bytes (one per column,
    low nibble the pair's first code); scale and zero float32 [panels, groups, 16]."""
    if not supports_int4(w):
        raise ValueError(f"the AMX int4 matmul does not take {w}")
    panels, tiles, groups = w.n // PANEL, w.k // DEPTH, w.k // w.group_size
    # qweight [n, k/2]: byte j of row c holds K 2j (low nibble) and 2j + 1 (high)
    codes = w.qweight.view(panels, PANEL, tiles, DEPTH // 2).permute(0, 2, 3, 1).contiguous()

    def panel_floats(t: torch.Tensor) -> torch.Tensor:
        return t.to(torch.float32).view(panels, PANEL, groups).permute(0, 2, 1).contiguous()

    zero = None if w.zero is None else panel_floats(w.zero)
    return codes, panel_floats(w.scale), zero


def matmul_int4(
    x: torch.Tensor,
    packed: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None],
    group_size: int,
    lib: CLibrary | None = None,
) -> torch.Tensor:
    """x [M, K] (bfloat16 rows) @ W.T for W packed by `pack_int4`: the bits of `matmul` over
    pack(W.dequantize(bfloat16)), with no dense copy kept (each panel made as it is used)."""
    codes, scale, zero = packed
    out = _out_for(x, codes.shape[0] * PANEL, codes.shape[1] * DEPTH)
    rc = (lib or _LIB).get().dense_amx_q4(
        x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], out.shape[1], codes.data_ptr(),
        scale.data_ptr(),
        None if zero is None else zero.data_ptr(), group_size, out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise RuntimeError(f"AMX int4 matmul failed (code {rc})")
    return out
