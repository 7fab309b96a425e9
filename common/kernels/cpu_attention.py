"""The CPU decode-attention kernel: a small C file compiled once with the system's C compiler.

Decode attention on the CPU is memory-bound, and the torch formulation has to gather every
sequence's KV blocks into a padded copy first (several times the bytes attention itself reads).
`csrc/paged_decode.c` reads the blocks in place through the block table instead. It is built on
first use into `$PDSERVE_CACHE/kernels/` and called through ctypes (which releases the GIL);
where no C compiler is found, `available()` is False and the torch path is used. Called by
common.kernels.attention.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import torch

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
    },  # fmt: skip
    "CPU decode attention",
)
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
enabled = os.environ.get("PDSERVE_CPU_KERNELS", "1") != "0"  # tests flip it to reach the torch path


def available() -> bool:
    """True when the kernel is built (building it on the first call)."""
    return _LIB.available()


def supports(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    return (
        enabled
        and q.device.type == "cpu"
        and q.dtype in _DTYPES
        and k_cache.dtype == q.dtype
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
) -> torch.Tensor:
    """One query per sequence: q [B, H, D] -> [B, H, D], reading K/V through the block tables."""
    if not available():
        raise RuntimeError("the CPU decode attention kernel could not be built")
    batch, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, _ = k_cache.shape
    tables = block_tables.to(torch.int32).contiguous()
    lens = seq_lens.to(torch.int32).contiguous()
    out = torch.empty(batch, num_heads, head_dim, dtype=q.dtype)
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
