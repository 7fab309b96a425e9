"""Fused element-wise decoder ops for the CPU path: a small C file compiled once with gcc.

At decode batch sizes the non-matmul part of a layer is a dozen tiny torch ops (residual add,
RMSNorm's casts and reductions, rotary's slices and products, the KV-cache index copies, SiLU),
each costing far more in dispatch than in arithmetic. `csrc/fused_ops.c` does each group in one
call: `add_rms_norm`, `rope_qk` (q and k rotated in place, k and v stored into the cache) and
`silu_mul`; `store_kv` (new K and V into an 8-bit cache with their scales, or a float16
one: one call a layer instead of the dozen torch ops of common.kernels.kv_quant.write, which
cost an int8-KV decode step at 4,000 tokens 2 ms); `argmax` is the sampler's greedy pick over
a step's logits (torch's max over bfloat16 vocabulary rows is a scalar loop: ~2 ms a batch-64
step). It is built on first use into
`$PDSERVE_CACHE/kernels/` (no -ffast-math, no contraction: results round where torch's do) and
called through ctypes. Called by common.model.llama's RMSNorm, RotaryEmbedding, Attention and
MLP forwards, common.kernels.attention.write_kv_cache (store_kv) and common.engine.sampler;
`supports(x)` is False (and the callers use their
eager torch code) off the CPU, for other dtypes, without a C compiler, or with
PDSERVE_FUSED_OPS=0.
"""

from __future__ import annotations

import ctypes
import logging
import os
from pathlib import Path

import torch

from common.kernels.cbuild import CLibrary

log = logging.getLogger(__name__)

_SOURCE = Path(__file__).parent / "csrc" / "fused_ops.c"
# -ffp-contract=off: no FMA contraction, so products and sums round exactly as torch's separate
# ops do. -fno-math-errno (sqrtf inline) and -fno-trapping-math (lets the selects and the
# float-to-int conversion in exp vectorise) change no result and no process-wide float state.
_FLAGS = [
    "-O3",
    "-fopenmp",  # rows across threads at prefill sizes (fused_ops.c's PARALLEL_MIN)
    "-ffp-contract=off",
    "-fno-math-errno",
    "-fno-trapping-math",
]
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
MAX_HIDDEN = 16384  # MAX_DIM in fused_ops.c: the widest row add_rms_norm takes
# PDSERVE_FUSED_OPS=0 forces the eager torch ops; tests and benchmarks flip this attribute.
enabled = os.environ.get("PDSERVE_FUSED_OPS", "1") != "0"

_c_long, _c_int, _ptr = ctypes.c_long, ctypes.c_int, ctypes.c_void_p
_SIGNATURES = {
    "add_rms_norm": [_ptr, _c_long, _ptr, _c_long, _ptr, _ptr, _c_long, _c_int, _c_int,
                     ctypes.c_float, _c_int],
    "rope_qk": [_ptr, _c_long, _ptr, _ptr, _ptr, _c_long, _c_int, _c_int, _c_int, _c_int, _ptr,
                _ptr, _ptr, _c_long, _c_int],
    "silu_mul": [_ptr, _c_long, _ptr, _c_long, _c_int, _c_int, _c_int],
    "argmax_rows": [_ptr, _c_long, _c_int, _c_int, _c_int, _ptr],
    "store_kv_rows": [_ptr, _c_long, _ptr, _c_long, _c_int, _c_int, _c_int, _c_int, _ptr,
                      _c_long, _ptr, _ptr, _ptr, _ptr, _c_int],
}  # fmt: skip
# caches the C code stores into, with activations of another dtype (fused_ops.c's kv_dtype)
_STORE_DTYPES = {torch.int8: 2, torch.float16: 4}
if getattr(torch, "float8_e4m3fn", None) is not None:
    _STORE_DTYPES[torch.float8_e4m3fn] = 3


_LIB = CLibrary(_SOURCE, _FLAGS, _SIGNATURES, "the fused CPU ops")


def available() -> bool:
    """True when the kernels are built (building them on the first call)."""
    return _LIB.available()


def supports(x: torch.Tensor) -> bool:
    """Whether the fused ops can take activations like `x` (CPU, float32 or bfloat16)."""
    return enabled and x.device.type == "cpu" and x.dtype in _DTYPES and available()


def _library() -> ctypes.CDLL:
    return _LIB.get()


def _check_rows(name: str, t: torch.Tensor, width: int) -> None:
    # The kernels walk rows of `width` contiguous elements at t.stride(0) apart.
    if t.dim() != 2 or t.shape[1] != width or t.stride(1) != 1:
        raise ValueError(f"{name}: expected rows of {width} contiguous elements, got {t.shape}")


def add_rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> torch.Tensor:
    """RMSNorm of x [T, dim <= MAX_HIDDEN]; with `residual`, first residual += x (in place).

    Same rounding as the eager code: float32 statistics, and in bfloat16 the normalised value is
    rounded before the weight multiply. `weight` must have x's dtype.
    """
    dim = weight.shape[0]
    _check_rows("x", x, dim)
    if weight.dtype != x.dtype or not weight.is_contiguous():
        raise ValueError("weight must be contiguous, in x's dtype")
    # empty_like costs a third of torch.empty(shape, dtype=...): this runs 61 times a step
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    res_ptr, res_stride = None, 0
    if residual is not None:
        _check_rows("residual", residual, dim)
        if residual.dtype != x.dtype:
            raise ValueError("residual and x must share a dtype")
        res_ptr, res_stride = residual.data_ptr(), residual.stride(0)
    rc = _library().add_rms_norm(
        x.data_ptr(), x.stride(0), res_ptr, res_stride, weight.data_ptr(), out.data_ptr(), dim,
        x.shape[0], dim, eps, _DTYPES[x.dtype],
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"add_rms_norm: hidden size {dim} not supported")
    return out


def rope_qk(
    qkv: torch.Tensor,
    positions: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    k_cache: torch.Tensor | None = None,
    v_cache: torch.Tensor | None = None,
    slot_mapping: torch.Tensor | None = None,
) -> None:
    """Rotate q's and k's heads of qkv [T, (H + 2*Hkv) * D] in place (half-split layout).

    `positions` int64 [T]; `cos`/`sin` float32 tables [max_positions, D]. With the caches
    ([blocks, block_size, Hkv, D], contiguous) and `slot_mapping` also stores the rotated k and
    the v heads in their slots (negative slots are skipped), replacing write_kv_cache.
    """
    width = (num_heads + 2 * num_kv_heads) * head_dim
    _check_rows("qkv", qkv, width)
    if positions.dtype != torch.int64 or not positions.is_contiguous():
        raise ValueError("positions must be contiguous int64")
    if cos.dtype != torch.float32 or not (cos.is_contiguous() and sin.is_contiguous()):
        raise ValueError("cos/sin tables must be contiguous float32")
    k_ptr = v_ptr = slots_ptr = None
    num_slots = 0
    if k_cache is not None:
        if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
            raise ValueError("the KV caches must be contiguous")
        if k_cache.dtype != qkv.dtype or slot_mapping.dtype != torch.int64:
            raise ValueError("KV cache dtype or slot mapping dtype mismatch")
        if k_cache.shape != v_cache.shape or k_cache.shape[-2:] != (num_kv_heads, head_dim):
            raise ValueError(f"KV cache shape {tuple(k_cache.shape)} does not fit the heads")
        if slot_mapping.shape[0] != qkv.shape[0]:
            raise ValueError("one slot per token expected")
        k_ptr, v_ptr = k_cache.data_ptr(), v_cache.data_ptr()
        num_slots = k_cache.numel() // (num_kv_heads * head_dim)
        slots_ptr = slot_mapping.contiguous().data_ptr()
    rc = _library().rope_qk(
        qkv.data_ptr(), qkv.stride(0), positions.data_ptr(), cos.data_ptr(), sin.data_ptr(),
        cos.shape[0], qkv.shape[0], num_heads, num_kv_heads, head_dim, k_ptr, v_ptr, slots_ptr,
        num_slots, _DTYPES[qkv.dtype],
    )  # fmt: skip
    if rc == 2:
        raise IndexError("rope_qk: a position is outside the cos/sin tables")
    if rc == 3:
        raise IndexError(f"rope_qk: a slot is outside the KV cache ({num_slots} slots)")
    if rc != 0:
        raise ValueError(f"rope_qk: head_dim {head_dim} not supported")


def silu_mul(gate_up: torch.Tensor, intermediate: int) -> torch.Tensor:
    """silu(gate) * up of gate_up [T, 2 * I] -> [T, I] (SiLU rounded to dtype first)."""
    _check_rows("gate_up", gate_up, 2 * intermediate)
    out = torch.empty(gate_up.shape[0], intermediate, dtype=gate_up.dtype)
    rc = _library().silu_mul(
        gate_up.data_ptr(), gate_up.stride(0), out.data_ptr(), intermediate, gate_up.shape[0],
        intermediate, _DTYPES[gate_up.dtype],
    )  # fmt: skip
    if rc != 0:
        raise ValueError(f"silu_mul: intermediate size {intermediate} not supported")
    return out


def argmax(x: torch.Tensor) -> list[int]:
    """Each row's argmax of x [rows, n] (float32 or bfloat16, rows of contiguous elements): the
    first largest value's index, or the first NaN's (torch's max ranks NaN highest)."""
    if x.dim() != 2 or x.stride(1) != 1 or x.shape[1] == 0:
        raise ValueError(f"argmax: expected rows of contiguous elements, got {tuple(x.shape)}")
    out = torch.empty(x.shape[0], dtype=torch.int64)
    rc = _library().argmax_rows(
        x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], _DTYPES[x.dtype], out.data_ptr()
    )
    if rc != 0:
        raise ValueError(f"argmax: rows of {x.shape[1]} not supported")
    return out.tolist()


def store_kv(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scales: torch.Tensor | None,
    v_scales: torch.Tensor | None,
    slot_mapping: torch.Tensor,
) -> bool:
    """New keys and values [tokens, kv heads, D] into their slots of a cache not in their dtype:
    an 8-bit one (int8 / fp8, quantized per (token, head) with float32 scales [blocks,
    block_size, kv heads]) or a float16 one, the bytes common.kernels.kv_quant.write would
    store. False (nothing written) where the C code does not take these tensors."""
    T, kv_heads, head_dim = k.shape if k.dim() == 3 else (0, 0, 0)
    kv_dtype = _STORE_DTYPES.get(k_cache.dtype)
    eight_bit = kv_dtype in (2, 3)
    if not (
        k.dim() == 3
        and supports(k)
        and kv_dtype is not None
        and v.dtype == k.dtype
        and v.shape == k.shape
        and all(t.stride(2) == 1 and t.stride(1) == head_dim for t in (k, v))
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and v_cache.dtype == k_cache.dtype
        and k_cache.shape[-2:] == (kv_heads, head_dim)
        and v_cache.shape == k_cache.shape
        and slot_mapping.shape == (T,)
        and (
            (k_scales is None and v_scales is None)
            if not eight_bit
            else (
                k_scales is not None
                and v_scales is not None
                and all(
                    s.dtype == torch.float32 and s.is_contiguous() and s.shape == k_cache.shape[:-1]
                    for s in (k_scales, v_scales)
                )
            )
        )
    ):
        return False
    slots = slot_mapping.to(torch.int64).contiguous()
    num_slots = k_cache.numel() // (kv_heads * head_dim)
    rc = _library().store_kv_rows(
        k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), T, kv_heads, head_dim,
        _DTYPES[k.dtype], slots.data_ptr(), num_slots, k_cache.data_ptr(), v_cache.data_ptr(),
        k_scales.data_ptr() if eight_bit else None, v_scales.data_ptr() if eight_bit else None,
        kv_dtype,
    )  # fmt: skip
    if rc == 3:
        raise IndexError(f"store_kv: a slot is outside the KV cache ({num_slots} slots)")
    if rc != 0:
        raise ValueError(f"store_kv: head_dim {head_dim} not supported")
    return True
