"""The 8-bit KV cache: storing new keys/values with a scale per (token, KV head), reading them back.

With `--kv-cache-dtype int8|fp8` each layer's cache is int8 or float8 e4m3 ([blocks, block_size,
kv heads, head_dim], as a 16-bit cache) and a float32 scales tensor [blocks, block_size, kv heads]
lies beside it: a (token, head) row of head_dim values x is stored as x / s, s = absmax(x) / QMAX
(127 for int8, rounded to nearest; 448 for e4m3, rounded by the cast), and read back as q * s. One
scale per row keeps an outlier head or token from costing every other row its precision, for
4 bytes per 64-128 values. fp8 keeps the scale too: on the default model's own K/V (1,000 tokens
of benchmarks/data/calibration.txt) the relative L2 error is int8 0.98%, fp8 with the scale 2.23%,
fp8 without one 2.62% (values near 0 fall into e4m3's subnormals), and one payload and kernel
layout serves both. A cache whose dtype merely differs from the model's (a bfloat16 cache
under a float32 model) is cast, without scales. Called by common.kernels.attention (the torch
path's writer and readers) and the model runner (which allocates the scales).
"""

from __future__ import annotations

import torch

FP8 = getattr(torch, "float8_e4m3fn", None)
# the largest magnitude each 8-bit type stores
QMAX: dict[torch.dtype, float] = {torch.int8: 127.0}
if FP8 is not None:
    QMAX[FP8] = 448.0


def is_8bit(dtype: torch.dtype) -> bool:
    """True for the KV dtypes that keep scales beside the cache."""
    return dtype in QMAX


def storage(cache: torch.Tensor) -> torch.Tensor:
    """The cache as a type index ops take: torch has no index_copy_ for float8."""
    return cache.view(torch.uint8) if cache.dtype == FP8 else cache


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., D] -> (x / s in `dtype`, s float32 [...]), s = absmax of each row / QMAX."""
    qmax = QMAX[dtype]
    xf = x.float()
    scale = xf.abs().amax(dim=-1) / qmax
    y = xf / scale.clamp_min(torch.finfo(torch.float32).tiny).unsqueeze(-1)  # an all-zero row: 0
    if dtype == torch.int8:
        return y.round_().clamp_(-qmax, qmax).to(torch.int8), scale
    return y.clamp_(-qmax, qmax).to(dtype), scale


def dequantize(q: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """Cached values as `dtype`: q * s for an 8-bit cache (scale [...] for q [..., D]), else a
    cast (nothing when the cache is already `dtype`)."""
    if scale is None:
        return q if q.dtype == dtype else q.to(dtype)
    return (q.float() * scale.unsqueeze(-1)).to(dtype)


def write(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scales: torch.Tensor | None,
    v_scales: torch.Tensor | None,
    slot_mapping: torch.Tensor,
) -> None:
    """Store new keys/values [tokens, kv heads, D] into their slots of a cache whose dtype is not
    theirs: quantized per (token, head) with their scales for an 8-bit cache, else cast."""
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    for x, cache, scales in ((k, k_cache, k_scales), (v, v_cache, v_scales)):
        if scales is None:
            values = x.to(cache.dtype)
        else:
            values, s = quantize(x, cache.dtype)
            scales.view(-1, num_kv_heads).index_copy_(0, slot_mapping, s)
        flat = storage(cache).view(-1, num_kv_heads, head_dim)
        flat.index_copy_(0, slot_mapping, storage(values))
