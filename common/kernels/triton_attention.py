"""Triton paged attention: the GPU path for the two operations of `common.kernels.attention`.

Owns the entry points `paged_attention_triton` (same inputs and result as the torch reference
`paged_attention`) and `write_kv_cache_triton` (same as `write_kv_cache`, with its small kernel),
and the shape checks both kernels rely on. Attention layers (common/model/llama.py) call them on
CUDA; the tests run them on CPU under `TRITON_INTERPRET=1` against a dense reference. Importing
this module launches nothing and needs no GPU.

Kernels, one module each:
- `triton_varlen.py` (prefill, chunked prefill, speculative k+1 rows, mixed batches): grid (query
  tile, sequence, query head), an online softmax over key tiles up to each tile's causal limit.
- `triton_decode.py` (every sequence has exactly one new token): grid (sequence, kv head, split),
  one program per kv-head group, split-k with a reduce kernel when the GPU would sit idle.
Both resolve every key's slot through the block table, so any block_size works with any tile size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from common.kernels.attention import AttentionMetadata
from common.kernels.triton_decode import MIN_DOT, launch_decode
from common.kernels.triton_varlen import launch_varlen

_LOG2E = 1.4426950408889634


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    k_cache_ptr,
    v_cache_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,
    stride_cs,
    stride_ch,
    block_size,
    HEAD_DIM: tl.constexpr,
):
    token = tl.program_id(0)
    head = tl.program_id(1)
    slot = tl.load(slot_ptr + token).to(tl.int64)
    if slot < 0:  # padded token (e.g. a CUDA-graph batch): nothing to store
        return
    d = tl.arange(0, HEAD_DIM)
    dst = (slot // block_size) * stride_cb + (slot % block_size) * stride_cs + head * stride_ch + d
    k = tl.load(k_ptr + token.to(tl.int64) * stride_kt + head * stride_kh + d)
    v = tl.load(v_ptr + token.to(tl.int64) * stride_vt + head * stride_vh + d)
    tl.store(k_cache_ptr + dst, k)
    tl.store(v_cache_ptr + dst, v)


def _check_shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    head_dim = q.shape[-1]
    assert head_dim >= MIN_DOT and head_dim & (head_dim - 1) == 0, (
        f"triton attention needs head_dim a power of two >= {MIN_DOT}, got {head_dim}"
    )
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride(), (
        "k_cache and v_cache must have the same shape and strides"
    )
    assert k_cache.shape[-1] == head_dim and k_cache.stride(-1) == 1, (
        "cache must be [num_blocks, block_size, num_kv_heads, head_dim] with unit last stride"
    )
    assert q.shape[1] % k_cache.shape[2] == 0, (
        f"num_heads {q.shape[1]} must be a multiple of num_kv_heads {k_cache.shape[2]}"
    )
    assert k_cache.dtype == v_cache.dtype, "k_cache and v_cache must share a dtype"


def _strides(
    q: torch.Tensor, out: torch.Tensor, k_cache: torch.Tensor, block_tables: torch.Tensor
) -> tuple[int, ...]:
    """The stride arguments both attention kernels take, in their order."""
    return (
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
    )


def write_kv_cache_triton(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
) -> None:
    """Store new keys/values [num_tokens, num_kv_heads, head_dim] into their cache slots.

    Grid (token, kv head), one head_dim row per program. Tokens with a negative slot are skipped.
    """
    num_tokens, num_kv_heads, head_dim = k.shape
    assert head_dim & (head_dim - 1) == 0, f"head_dim must be a power of two, got {head_dim}"
    assert k.stride(-1) == 1 and v.stride(-1) == 1, "k/v need a unit last stride"
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens, num_kv_heads)](
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        k_cache.shape[1],
        HEAD_DIM=head_dim,
    )


def paged_attention_triton(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    *,
    num_splits: int | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of new tokens q [num_tokens, H, D] over the paged cache (already holding them).

    Decode kernel when every sequence has one new token, else the varlen kernel. `num_splits`
    (a power of two) overrides the decode split-k heuristic; it exists for tests and tuning. A
    cache of q's dtype has no scales; an 8-bit one (int8, fp8) has its float32 scales per (token,
    kv head), contiguous [blocks, block_size, kv heads], read by the kernels beside each row.
    """
    _check_shapes(q, k_cache, v_cache)
    if (k_scales is None) != (k_cache.dtype == q.dtype) or (k_scales is None) != (v_scales is None):
        raise ValueError(
            f"a {k_cache.dtype} cache with {q.dtype} queries needs "
            + ("no scales" if k_cache.dtype == q.dtype else "its k_scales and v_scales")
        )
    if k_scales is not None:
        assert k_scales.is_contiguous() and v_scales.is_contiguous()
        assert k_scales.shape == k_cache.shape[:3] == v_scales.shape
        assert k_scales.dtype == v_scales.dtype == torch.float32
    if q.stride(-1) != 1:
        q = q.contiguous()
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if q.shape[0] == 0:
        return out
    block_tables = meta.block_tables.contiguous()
    args = (out, q, k_cache, v_cache, meta, block_tables, _strides(q, out, k_cache, block_tables))
    if meta.max_query_len == 1:
        launch_decode(*args, scale * _LOG2E, num_splits, k_scales, v_scales)
    else:
        launch_varlen(*args, scale * _LOG2E, k_scales, v_scales)
    return out
