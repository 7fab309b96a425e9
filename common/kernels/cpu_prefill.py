"""The CPU prefill-attention kernel: causal attention of a prompt's tokens (or a chunk's, after a
cached prefix) in one C call.

torch's CPU SDPA runs a prompt of a few hundred tokens at a small fraction of the machine's float
rate (measured, 256 tokens, 9 query / 3 KV heads of 64, one thread: ~32 GFLOP/s), and a prefill
step calls it once per sequence and layer. `csrc/prefill_attention.c` computes the scores, the
softmax and the weighted sum of V in float32 with register-blocked tiles (see its header); every
query's result is independent of how the prompt is chunked. Built on first use into
`$PDSERVE_CACHE/kernels/` at the host's ISA level (common.kernels.cbuild) and called through
ctypes (which releases the GIL). On a CPU with AMX, bfloat16 inputs run both products on the
tile unit (measured, 2 threads, 9 query / 3 KV heads of 64: 1,524 tokens 13.7 -> 5.7-6.0 ms, 256
tokens 0.47 -> 0.27 ms; torch's SDPA 5.5-7.2 and 0.25-0.28), chunk-invariant as well. Without
AMX but with AVX-512 BF16 (AMD Zen 4 and later), bfloat16 inputs take both products by dpbf16
on the vector units, the weights rounded to bfloat16 as on the tile unit (benchmarks/
prefill_attention.py, 2 threads, one layer: 1,024 tokens 7.57 -> 4.59 ms, 4,096 110.0 -> 67.3
ms). `rounds_weights` says where the weights are rounded. Called by
common.kernels.attention's prefill path; `supports` is False (and SDPA runs) off the CPU, for
other dtypes or head sizes, without a C compiler, or with PDSERVE_CPU_KERNELS=0.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from common.kernels import cpu_attention
from common.kernels.cbuild import REDUCTION_FLAGS, CLibrary

_SOURCE = Path(__file__).parent / "csrc" / "prefill_attention.c"
_FLAGS = ["-O3", *REDUCTION_FLAGS, "-fopenmp"]
_c_int, _c_long, _ptr = ctypes.c_int, ctypes.c_long, ctypes.c_void_p
_SIGNATURES = {
    "prefill_attention": [_ptr, _c_long, _ptr, _c_long, _ptr, _c_long, _ptr, _c_int, _c_int,
                          _c_int, _c_int, _c_int, ctypes.c_float, _c_int, _c_int],
    "prefill_uses_amx": [],
    "prefill_rounds_weights": [],
}  # fmt: skip
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
HEAD_DIMS = (64, 128)


def new_library() -> CLibrary:
    """A kernel library, built on its first use at the ISA level cbuild picks then (tests build
    one per level)."""
    return CLibrary(_SOURCE, list(_FLAGS), _SIGNATURES, "CPU prefill attention")


_LIB = new_library()


def available() -> bool:
    """True when the kernel is built (building it on the first call)."""
    return _LIB.available()


def _token_major(x: torch.Tensor) -> bool:
    """[tokens, heads, D] with heads and D contiguous within a token (any token stride)."""
    return x.stride(2) == 1 and x.stride(1) == x.shape[2] and x.stride(0) >= x.shape[1] * x.shape[2]


def uses_amx(lib: CLibrary | None = None) -> bool:
    """Whether bfloat16 inputs take the kernel's AMX tile path (an amx build on a CPU that
    granted the tile state): the weights are then rounded to bfloat16 before the V product."""
    lib = lib or _LIB
    return lib.available() and bool(lib.get().prefill_uses_amx())


def rounds_weights(lib: CLibrary | None = None) -> bool:
    """Whether bfloat16 inputs have their softmax weights rounded to bfloat16 before the V
    product (the AMX path, and an AVX-512 BF16 build's dpbf16 products), as torch's SDPA does:
    each output then up to 2^-9 max|v| from the float32 weights' result."""
    lib = lib or _LIB
    return lib.available() and bool(lib.get().prefill_rounds_weights())


def supports(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """True when the kernel takes these q [q_len, H, D], k / v [k_len, Hkv, D]."""
    return (
        cpu_attention.enabled
        and q.device.type == "cpu"
        and q.dtype in _DTYPES
        and k.dtype == v.dtype == q.dtype
        and q.shape[2] in HEAD_DIMS
        and k.shape == v.shape
        and k.shape[2] == q.shape[2]
        and q.shape[1] % k.shape[1] == 0
        and q.shape[0] <= k.shape[0]
        and all(_token_major(x) for x in (q, k, v))
        and available()
    )


def prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    lib: CLibrary | None = None,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention: queries q [q_len, H, D] are the last q_len of k_len keys k, v
    [k_len, Hkv, D]; returns [q_len, H, D] in q's dtype (see `supports` for what it takes),
    written into `out` when given (contiguous, that shape and dtype: a batch's rows, so the
    result needs no copy into them)."""
    q_len, num_heads, head_dim = q.shape
    k_len, num_kv_heads = k.shape[0], k.shape[1]
    if out is None:
        out = torch.empty(q_len, num_heads, head_dim, dtype=q.dtype)
    elif out.shape != q.shape or out.dtype != q.dtype or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous {tuple(q.shape)} {q.dtype} tensor")
    rc = (lib or _LIB).get().prefill_attention(
        q.data_ptr(), q.stride(0), k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0),
        out.data_ptr(), q_len, k_len, num_heads, num_kv_heads, head_dim, scale,
        _DTYPES[q.dtype], torch.get_num_threads(),
    )  # fmt: skip
    if rc == 2:
        raise MemoryError("CPU prefill attention: out of memory")
    if rc != 0:
        raise ValueError(f"shape not supported by the CPU prefill kernel: q {q.shape}, k {k.shape}")
    return out
