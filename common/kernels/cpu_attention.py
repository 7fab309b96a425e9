"""The CPU decode-attention kernel: a small C file compiled once with the system's C compiler.

Decode attention on the CPU is memory-bound, and the torch formulation has to gather every
sequence's KV blocks into a padded copy first (several times the bytes attention itself reads).
`csrc/paged_decode.c` reads the blocks in place through the block table instead. It is built on
first use into `$PDSERVE_CACHE/kernels/` and called through ctypes (which releases the GIL);
where no C compiler is found, `available()` is False and the torch path is used. An 8-bit cache
(int8 / fp8 e4m3 with a float32 scale per (token, KV head), common.kernels.kv_quant) is read as
such and dequantized in registers, and a float16 cache beside bfloat16 or float32 activations is
converted in registers. A decode step of enough sequences goes by whole sequences, each
sequence's kv heads in one walk over its cache rows (`whole_sequences`). Called by
common.kernels.attention.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import torch

from common.kernels import kv_quant
from common.kernels.cbuild import REDUCTION_FLAGS, CLibrary

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "paged_decode.c"
# -fopenmp links the libgomp torch already loaded (same soname): one thread pool, not two competing.
_FLAGS = ["-O3", *REDUCTION_FLAGS, "-fopenmp"]
_c_int, _ptr = ctypes.c_int, ctypes.c_void_p
_LIB = CLibrary(
    _SOURCE,
    _FLAGS,
    {
        "paged_decode": [_ptr, ctypes.c_long, _ptr, _ptr, _ptr, _ptr, _ptr, _c_int, _c_int,
                         _c_int, _c_int, _c_int, _c_int, ctypes.c_float, _c_int, _c_int],
        "paged_decode_kv": [_ptr, ctypes.c_long, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr, _ptr,
                            _c_int, _c_int, _c_int, _c_int, _c_int, _c_int, ctypes.c_float,
                            _c_int, _c_int, _c_int],
        "paged_decode_whole": [_c_int, _c_int, _c_int, _c_int, _c_int, _c_int],
    },  # fmt: skip
    "CPU decode attention",
)
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_KV_DTYPES = {torch.int8: 2, **({kv_quant.FP8: 3} if kv_quant.FP8 is not None else {})}
KV_FLOAT16 = 4  # the C code of a float16 cache beside activations of another dtype (no scales)
enabled = os.environ.get("PDSERVE_CPU_KERNELS", "1") != "0"  # tests flip it to reach the torch path


def available() -> bool:
    """True when the kernel is built (building it on the first call)."""
    return _LIB.available()


def isa_level() -> str | None:
    """The ISA level the kernel library was built at (None where it could not be built)."""
    return _LIB.level if available() else None


def whole_sequences(
    batch: int, heads: int, kv_heads: int, head_dim: int, max_len: int, threads: int
) -> bool:
    """Whether a decode step of this shape goes through the kernel by whole sequences (each
    sequence's kv heads in one walk over its cache rows) rather than by (sequence, kv head)
    parts: the same bits either way (tests check both)."""
    return bool(
        _LIB.get().paged_decode_whole(batch, heads, kv_heads, head_dim, max_len, threads)
    )


def supports(
    q: torch.Tensor, k_cache: torch.Tensor, k_scales: torch.Tensor | None = None
) -> bool:
    """True when the kernel takes this query and cache (a 16/32-bit cache of q's dtype, a
    float16 one, or an 8-bit one with its scales)."""
    same = k_cache.dtype == q.dtype and k_scales is None
    half = k_cache.dtype == torch.float16 and k_scales is None
    return (
        enabled
        and q.device.type == "cpu"
        and q.dtype in _DTYPES
        and (same or half or (k_cache.dtype in _KV_DTYPES and k_scales is not None))
        and k_cache.is_contiguous()
        and q.stride(2) == 1
        and q.stride(1) == q.shape[2]
        and available()
    )


def paged_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per sequence: q [B, H, D] -> [B, H, D], reading K/V through the block tables
    (an 8-bit cache with its scales [blocks, block_size, kv heads], contiguous float32)."""
    if not available():
        raise RuntimeError("the CPU decode attention kernel could not be built")
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty(batch, num_heads, head_dim, dtype=q.dtype)
    half = k_scales is None and k_cache.dtype == torch.float16  # converted in registers
    if k_scales is not None or half:
        if k_scales is not None and not (
            v_scales is not None
            and k_scales.dtype == v_scales.dtype == torch.float32
            and k_scales.is_contiguous()
            and v_scales.is_contiguous()
            and v_cache.is_contiguous()
        ):
            raise ValueError("8-bit KV needs contiguous float32 k_scales and v_scales")
        rc = _LIB.get().paged_decode_kv(
            q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(),
            None if half else k_scales.data_ptr(), None if half else v_scales.data_ptr(),
            tables.data_ptr(), lens.data_ptr(), out.data_ptr(), batch, num_heads, num_kv_heads,
            head_dim, block_size, tables.shape[1], scale, _DTYPES[q.dtype],
            KV_FLOAT16 if half else _KV_DTYPES[k_cache.dtype], torch.get_num_threads(),
        )  # fmt: skip
        if rc != 0:
            raise ValueError("shape not supported by the CPU decode kernel")
        return out
    rc = _LIB.get().paged_decode(
        q.data_ptr(),
        q.stride(0),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        tables.data_ptr(),
        lens.data_ptr(),
        out.data_ptr(),
        batch,
        num_heads,
        num_kv_heads,
        head_dim,
        block_size,
        tables.shape[1],
        scale,
        _DTYPES[q.dtype],
        torch.get_num_threads(),
    )
    if rc != 0:
        raise ValueError("shape not supported by the CPU decode kernel")
    return out
