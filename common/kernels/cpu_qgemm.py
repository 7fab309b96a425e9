"""Batched CPU matmuls over quantized weights with int8 activations (W4A8 and W8A8).

x [M, K] @ W.T for W a `quant_weight.QuantWeight` (int4 groups, int8 per channel or group, with
or without zero points), M from 2 up (decode batches, small prefills): each row of x is quantized
per block of `BLOCK` columns to int8 with a float32 scale (max |x| / 127, round to nearest even),
each block's products are summed exactly in int32 (AMX tiles from 32 rows on where the CPU and
kernel allow them, AVX-512 VNNI / AVX-VNNI dpbusd, AVX2 maddubs, or portable C:
csrc/quant_gemm.c), then scaled in float32. The weight is repacked once into
panels of `PANEL` output columns (`pack`, kept by the caller), with 16-bit scales and zeros where
those give back every one exactly (a bfloat16 model's are bfloat16; a float32 GGUF weight's are
float16 scales and minimums): 20 bytes a block of 32 int4 weights to stream instead of 24, the
same results. The result differs
from the float-activation paths by the activation rounding only: at most sum_b max_b|x| / 254 *
sum_{j in b} |w_j| per output (b: x's blocks of 32), against the float product's own rounding.

Called by common.kernels.cpu_quant (its "a8" path) and benchmarks/qgemm.py; builds its library on
first use through common.kernels.cbuild.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import torch

from common.kernels.cbuild import CLibrary
from common.kernels.quant_weight import QuantWeight

BLOCK = 32  # columns of K per activation scale (llama.cpp's Q8_0 block)
PANEL = 16  # output columns per weight panel (one 512-bit vector of int32 sums)
ISA_NAMES = ("portable", "avx2", "avxvnni", "avx512vnni", "amx")  # qgemm_isa's codes

_SOURCE = Path(__file__).parent / "csrc" / "quant_gemm.c"
# Exact float steps matter here (x / scale must round as torch's does): none of REDUCTION_FLAGS.
FLAGS = ("-O3", "-fopenmp")  # cbuild adds the ISA level's flags

_p, _i = ctypes.c_void_p, ctypes.c_int
_SIGNATURES = {
    "qgemm_a8": [_p, ctypes.c_long, _i, _i, _i, _i, _i, _i, _p, _p, _p, _i, _p, _i],
    "qgemm_isa": [],
    "qgemm_set_prefetch": [_i],
    "qgemm_prefetch": [],
    "qgemm_amx_rows": [_i],
    "qgemm_set_row_block": [_i],
    "qgemm_row_block": [_i],
}


def new_library() -> CLibrary:
    """A kernel library, built on its first use at the ISA level cbuild picks then (tests build
    one per level)."""
    return CLibrary(_SOURCE, list(FLAGS), _SIGNATURES, "the CPU int8-activation quantized GEMM")


_LIB = new_library()


def available() -> bool:
    """True when the library is built (building it on the first call)."""
    return _LIB.available()


def isa(lib: CLibrary | None = None) -> str:
    """Which of the C file's sections the library runs."""
    return ISA_NAMES[(lib or _LIB).get().qgemm_isa()]


@dataclass
class PackedWeight:
    """A quantized [n, k] weight in quant_gemm.c's panel layout (see its header).

    codes: uint8, int4 [P, k/8, 16, 4] (two codes a byte) or int8 [P, k/4, 16, 4] (q + 128);
    scale, zero: float32 [P, k/group_size, 16], zero None means 0; P = ceil(n / 16), the pad
    columns' scale 0. Or 16-bit, chosen by `pack` only where exact: scale and zero bfloat16;
    or scale float16 and, for int4, zero the float16 minimum mn with zero = mn + 8 * scale
    (float32, one rounding). `scale_format` is the kernel's code for which."""

    bits: int
    group_size: int
    n: int
    k: int
    codes: torch.Tensor
    scale: torch.Tensor
    zero: torch.Tensor | None

    @property
    def scale_format(self) -> int:
        """quant_gemm.c's sf: 0 float32, 1 float16 (zeros as minimums), 2 bfloat16."""
        return {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}[self.scale.dtype]

    @property
    def nbytes(self) -> int:
        zero = 0 if self.zero is None else self.zero.nbytes
        return self.codes.nbytes + self.scale.nbytes + zero


def supports(bits: int, group_size: int, k: int) -> bool:
    """Whether the kernel takes this weight format: groups and K whole multiples of 32."""
    return bits in (4, 8) and group_size % BLOCK == 0 and k % group_size == 0


def pack(w: QuantWeight) -> PackedWeight:
    """Repack `w` into panels; ValueError when `supports` says no."""
    n, k = w.n, w.k
    if not supports(w.bits, w.group_size, k):
        raise ValueError(
            f"int8-activation GEMM needs K and the group size in multiples of {BLOCK}: "
            f"{w.bits}-bit [{n}, {k}], group {w.group_size}"
        )
    panels = -(-n // PANEL)
    pad = panels * PANEL - n
    codes = w.unpack()  # int16: int4 0..15, int8 -128..127
    if w.bits == 8:
        codes = codes + 128
    codes = torch.nn.functional.pad(codes.to(torch.uint8), (0, 0, 0, pad))
    if w.bits == 4:
        # [P, 16 columns, k/8, high/low, 4] -> [P, k/8, 16, 4, low/high] -> one byte per pair
        u = codes.view(panels, PANEL, k // 8, 2, 4).permute(0, 2, 1, 4, 3)
        codes = u[..., 0] | (u[..., 1] << 4)
    else:
        codes = codes.view(panels, PANEL, k // 4, 4).permute(0, 2, 1, 3)

    def per_panel(t: torch.Tensor) -> torch.Tensor:
        t = torch.nn.functional.pad(t, (0, 0, 0, pad))
        return t.view(panels, PANEL, -1).permute(0, 2, 1).contiguous()

    scales = sixteen_bit_scales(w)
    if scales is not None:
        scale, zero = scales
    else:
        scale = w.scale.to(torch.float32)
        zero = None if w.zero is None else w.zero.to(torch.float32)
    zero = None if zero is None else per_panel(zero)
    return PackedWeight(w.bits, w.group_size, n, k, codes.contiguous(), per_panel(scale), zero)


def sixteen_bit_scales(w: QuantWeight) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """`w`'s scales and zeros in the 16-bit form the panels keep where it is exact: bfloat16 as
    they are (a bfloat16 model's), else `half_scales`; None when neither gives them back."""
    if w.scale.dtype == torch.bfloat16 and (w.zero is None or w.zero.dtype == torch.bfloat16):
        return w.scale, w.zero
    return half_scales(w)


def half_scales(w: QuantWeight) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """`w`'s scales in float16 and (int4) its zeros as float16 minimums mn (zero = mn + 8 *
    scale), when they give back every float32 scale and zero exactly (the kernel computes the
    zero with one rounding, as float32 arithmetic here does: 8 * scale is exact); else None."""
    scale = w.scale.to(torch.float32)
    scale16 = scale.to(torch.float16)
    if not torch.equal(scale16.to(torch.float32), scale):
        return None
    if w.zero is None:
        return scale16, None
    if w.bits != 4:
        return None
    zero = w.zero.to(torch.float32)
    scale_back = scale16.to(torch.float32)
    low16 = (zero - 8 * scale_back).to(torch.float16)
    if not torch.equal(low16.to(torch.float32) + 8 * scale_back, zero):
        return None
    return scale16, low16


def matmul_a8(x: torch.Tensor, w: PackedWeight, lib: CLibrary | None = None) -> torch.Tensor:
    """x [M, K] (float32 or bfloat16; other dtypes go through float32) @ W.T with x quantized to
    int8 per row and block of 32; the result has x's dtype (float16 x: computed in float32)."""
    m, k = x.shape
    if k != w.k:
        raise ValueError(f"x has {k} columns, the weight {w.k}")
    dtype = x.dtype
    if x.dtype not in (torch.float32, torch.bfloat16) or x.stride(1) != 1:
        x = x.to(torch.float32).contiguous()
    out = torch.empty(m, w.n, dtype=x.dtype)
    rc = (lib or _LIB).get().qgemm_a8(
        x.data_ptr(), x.stride(0), 0 if x.dtype == torch.float32 else 1, m, k, w.n, w.bits,
        w.group_size, w.codes.data_ptr(), w.scale.data_ptr(),
        None if w.zero is None else w.zero.data_ptr(), w.scale_format, out.data_ptr(),
        torch.get_num_threads(),
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"int8-activation GEMM refused [{m}, {k}] x {w.bits}-bit (rc {rc})")
    return out if out.dtype == dtype else out.to(dtype)


def quantize_activations(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's activation rounding in torch, for tests and error bounds: (codes int8 [M, K],
    scales float32 [M, K / 32]) with x ~ codes * scale per block."""
    m, k = x.shape
    xb = x.to(torch.float32).reshape(m, k // BLOCK, BLOCK)
    scale = xb.abs().amax(dim=-1) / 127
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(xb / safe[..., None]).to(torch.int8)
    return codes.reshape(m, k), scale
