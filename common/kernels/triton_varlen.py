"""Triton varlen paged attention: any number of new tokens per sequence, causal over the cache.

Owns `_varlen_kernel` and its launch `launch_varlen` (prefill, chunked prefill, the k+1 rows of
speculative verification, mixed batches), and the tile pieces the decode kernel reuses: `dot` and
`NEG_BIG`. Grid (query tile of BLOCK_M rows, sequence, query head); each program streams its
sequence's keys in tiles of BLOCK_N up to the tile's causal limit, with an online softmax
accumulated in fp32, resolving each key's slot through the block table (so any block_size works
with any tile size). Called by `triton_attention.paged_attention_triton`, which checks shapes.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from common.kernels.attention import AttentionMetadata

# Finite start for running maxima, so a fully masked tile never computes inf - inf.
NEG_BIG = tl.constexpr(-1.0e30)


def interpreted() -> bool:
    """Whether Triton runs in its CPU interpreter (TRITON_INTERPRET, read at triton's import)."""
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "yes", "on")


@triton.jit
def dot(a, b, UPCAST: tl.constexpr):
    # The interpreter multiplies bf16 operands as their raw uint16 bits (numpy has no bf16), so
    # under it we take the product in fp32; compiled kernels keep the tensor-core input type.
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee")


@triton.jit
def dequant_rows(x, scale_ptr, scale_off, ok, dtype: tl.constexpr):
    """Rows of an 8-bit cache (int8 or fp8) as `dtype`: code x its row's float32 scale, rounded
    once to `dtype`, as common.kernels.kv_quant.dequantize does."""
    scale = tl.load(scale_ptr + scale_off, mask=ok, other=0.0)
    return (x.to(tl.float32) * scale[:, None]).to(dtype)


@triton.jit
def _varlen_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    block_size,
    num_kv_heads,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
    QUANT: tl.constexpr,
):
    tile = tl.program_id(0)
    seq = tl.program_id(1)
    head = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    q_len = tl.load(query_start_ptr + seq + 1) - q_start
    if tile * BLOCK_M >= q_len:  # the grid covers the longest query; shorter ones stop here
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len
    kv_head = head // GROUP

    rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    row_ok = rows < q_len
    q_pos = context_len + rows
    tokens = (q_start + rows).to(tl.int64)
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + tokens[:, None] * stride_qt + head * stride_qh + d[None, :],
        mask=row_ok[:, None],
        other=0.0,
    )

    m = tl.full([BLOCK_M], NEG_BIG, tl.float32)
    l_sum = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # Keys past the tile's last row are invisible to all of its rows (causal).
    hi = tl.minimum(seq_len, context_len + (tile + 1) * BLOCK_M)
    for n0 in range(0, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        key_ok = pos < hi
        block = tl.load(table + pos // block_size, mask=key_ok, other=0).to(tl.int64)
        kv_off = block * stride_cb + (pos % block_size) * stride_cs + kv_head * stride_ch
        k = tl.load(k_cache_ptr + kv_off[:, None] + d[None, :], mask=key_ok[:, None], other=0)
        if QUANT:
            scale_off = (block * block_size + pos % block_size) * num_kv_heads + kv_head
            k = dequant_rows(k, k_scale_ptr, scale_off, key_ok, q.dtype)
        s = dot(q, tl.trans(k), DOT_FP32) * scale_log2
        visible = key_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=key_ok[:, None], other=0)
        if QUANT:
            v = dequant_rows(v, v_scale_ptr, scale_off, key_ok, q.dtype)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_FP32)
        m = m_new

    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    tl.store(
        out_ptr + tokens[:, None] * stride_ot + head * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )


def launch_varlen(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    block_tables: torch.Tensor,
    strides: tuple[int, ...],
    scale_log2: float,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> None:
    """Fill `out` [num_tokens, H, D] with the attention of q's rows (see module docstring).

    `strides` are triton_attention's `_strides` (their order is the kernel's argument order);
    an 8-bit cache comes with its contiguous float32 scales [blocks, block_size, kv heads].
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    common = (meta.seq_lens, meta.query_start_loc)
    # Short queries (speculative k+1 rows, chunk tails) waste less of a small query tile.
    block_m = 16 if meta.max_query_len <= 16 else 64
    block_n = 32 if head_dim > 64 else 64
    grid = (triton.cdiv(meta.max_query_len, block_m), meta.num_seqs, num_heads)
    _varlen_kernel[grid](
        out,
        q,
        k_cache,
        v_cache,
        k_scales if k_scales is not None else k_cache,  # unread without QUANT
        v_scales if v_scales is not None else v_cache,
        block_tables,
        *common,
        scale_log2,
        *strides,
        block_size,
        num_kv_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_FP32=interpreted(),
        QUANT=k_scales is not None,
        num_warps=4 if head_dim <= 64 else 8,
    )
