"""Triton paged attention: the GPU path for the two operations of `common.kernels.attention`.

Owns `paged_attention_triton` (same inputs and result as the torch reference `paged_attention`)
and `write_kv_cache_triton` (same as `write_kv_cache`). Attention layers call them on CUDA; the
tests run them on CPU under `TRITON_INTERPRET=1` against a dense reference. Importing this module
launches nothing and needs no GPU.

Kernels:
- varlen (prefill, chunked prefill, speculative k+1 rows, mixed batches): grid (query tile of
  BLOCK_M rows, sequence, query head); each program streams its sequence's keys in tiles of BLOCK_N
  up to the tile's causal limit, with an online softmax accumulated in fp32.
- decode (every sequence has exactly one new token): grid (sequence, kv head, split); each program
  attends all the query heads of one kv-head group at once, so K/V are read once per group, over a
  contiguous range of keys; with more than one split a reduce kernel merges the partial softmaxes.
Both resolve every key's slot through the block table, so any block_size works with any tile size.
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from common.kernels.attention import AttentionMetadata

_LOG2E = 1.4426950408889634
_MIN_DOT = 16  # tl.dot needs every dimension >= 16
# Finite start for running maxima, so a fully masked tile never computes inf - inf.
_NEG_BIG = tl.constexpr(-1.0e30)


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "").lower() in ("1", "true", "yes", "on")


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    # The interpreter multiplies bf16 operands as their raw uint16 bits (numpy has no bf16), so
    # under it we take the product in fp32; compiled kernels keep the tensor-core input type.
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee")


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


@triton.jit
def _varlen_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
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
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
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

    m = tl.full([BLOCK_M], _NEG_BIG, tl.float32)
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
        k = tl.load(k_cache_ptr + kv_off[:, None] + d[None, :], mask=key_ok[:, None], other=0.0)
        s = _dot(q, tl.trans(k), DOT_FP32) * scale_log2
        visible = key_ok[None, :] & (pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=key_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_FP32)
        m = m_new

    out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
    tl.store(
        out_ptr + tokens[:, None] * stride_ot + head * stride_oh + d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_ok[:, None],
    )


@triton.jit
def _decode_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
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
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_FP32: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + seq)
    token = tl.load(query_start_ptr + seq).to(tl.int64)

    g = tl.arange(0, BLOCK_G)
    group_ok = g < GROUP  # BLOCK_G pads the group up to the smallest dot shape
    heads = kv_head * GROUP + g
    d = tl.arange(0, HEAD_DIM)
    q = tl.load(
        q_ptr + token * stride_qt + heads[:, None] * stride_qh + d[None, :],
        mask=group_ok[:, None],
        other=0.0,
    )

    m = tl.full([BLOCK_G], _NEG_BIG, tl.float32)
    l_sum = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, HEAD_DIM], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    # Splits are per sequence (not from the batch's max_seq_len) so a captured CUDA graph stays
    # right as sequences grow.
    keys_per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * keys_per_split
    hi = tl.minimum(seq_len, lo + keys_per_split)
    for n0 in range(lo, hi, BLOCK_N):
        pos = n0 + tl.arange(0, BLOCK_N)
        key_ok = pos < hi
        block = tl.load(table + pos // block_size, mask=key_ok, other=0).to(tl.int64)
        kv_off = block * stride_cb + (pos % block_size) * stride_cs + kv_head * stride_ch
        k = tl.load(k_cache_ptr + kv_off[:, None] + d[None, :], mask=key_ok[:, None], other=0.0)
        s = _dot(q, tl.trans(k), DOT_FP32) * scale_log2
        s = tl.where(key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=key_ok[:, None], other=0.0)
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_FP32)
        m = m_new

    if NUM_SPLITS == 1:
        out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]
        tl.store(
            out_ptr + token * stride_ot + heads[:, None] * stride_oh + d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=group_ok[:, None],
        )
    else:
        # Partials are [num_seqs, num_heads, NUM_SPLITS] (+ HEAD_DIM for acc), contiguous fp32.
        row = (seq.to(tl.int64) * tl.num_programs(1) * GROUP + heads) * NUM_SPLITS + split
        tl.store(part_max_ptr + row, m, mask=group_ok)
        tl.store(part_sum_ptr + row, l_sum, mask=group_ok)
        tl.store(part_acc_ptr + row[:, None] * HEAD_DIM + d[None, :], acc, mask=group_ok[:, None])


@triton.jit
def _decode_reduce_kernel(
    out_ptr,
    query_start_ptr,
    part_acc_ptr,
    part_max_ptr,
    part_sum_ptr,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    token = tl.load(query_start_ptr + seq).to(tl.int64)
    rows = (seq.to(tl.int64) * tl.num_programs(1) + head) * NUM_SPLITS + tl.arange(0, NUM_SPLITS)
    d = tl.arange(0, HEAD_DIM)
    m = tl.load(part_max_ptr + rows)
    # An empty split (past its sequence's end) has m = -1e30 and weight exp2(-huge) = 0.
    weight = tl.exp2(m - tl.max(m, 0))
    l_sum = tl.sum(tl.load(part_sum_ptr + rows) * weight, 0)
    acc = tl.sum(tl.load(part_acc_ptr + rows[:, None] * HEAD_DIM + d[None, :]) * weight[:, None], 0)
    l_sum = tl.where(l_sum > 0, l_sum, 1.0)  # a zero-length (padding) sequence gives 0, not NaN
    tl.store(
        out_ptr + token * stride_ot + head * stride_oh + d,
        (acc / l_sum).to(out_ptr.dtype.element_ty),
    )


def _check_shapes(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    head_dim = q.shape[-1]
    assert head_dim >= _MIN_DOT and head_dim & (head_dim - 1) == 0, (
        f"triton attention needs head_dim a power of two >= {_MIN_DOT}, got {head_dim}"
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
    assert q.dtype == k_cache.dtype == v_cache.dtype, "q and the cache must share a dtype"


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def _decode_num_splits(num_programs: int, max_seq_len: int, device: torch.device) -> int:
    """Split long sequences' keys when (sequences x kv heads) alone would leave most SMs idle."""
    if device.type != "cuda":
        return 1
    num_sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    splits = 1
    while splits < 16 and num_programs * splits < num_sms and max_seq_len >= 512 * splits * 2:
        splits *= 2
    return splits


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
) -> torch.Tensor:
    """Attention of new tokens q [num_tokens, H, D] over the paged cache (already holding them).

    Decode kernel when every sequence has one new token, else the varlen kernel. `num_splits`
    (a power of two) overrides the decode split-k heuristic; it exists for tests and tuning.
    """
    _check_shapes(q, k_cache, v_cache)
    if q.stride(-1) != 1:
        q = q.contiguous()
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty((num_tokens, num_heads, head_dim), dtype=q.dtype, device=q.device)
    if num_tokens == 0:
        return out
    block_tables = meta.block_tables.contiguous()
    common = (meta.seq_lens, meta.query_start_loc)
    scale_log2 = scale * _LOG2E
    strides = (
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
    )

    if meta.max_query_len == 1:
        num_seqs = meta.num_seqs
        splits = num_splits or _decode_num_splits(
            num_seqs * num_kv_heads, meta.max_seq_len, q.device
        )
        assert splits & (splits - 1) == 0, f"num_splits must be a power of two, got {splits}"
        block_n = 32 if head_dim > 64 else 64
        if splits > 1:
            part_acc = torch.empty(
                (num_seqs, num_heads, splits, head_dim), dtype=torch.float32, device=q.device
            )
            part_max = torch.empty(
                (num_seqs, num_heads, splits), dtype=torch.float32, device=q.device
            )
            part_sum = torch.empty_like(part_max)
        else:
            part_acc = part_max = part_sum = out  # unused by the NUM_SPLITS == 1 branch
        _decode_kernel[(num_seqs, num_kv_heads, splits)](
            out,
            q,
            k_cache,
            v_cache,
            block_tables,
            *common,
            part_acc,
            part_max,
            part_sum,
            scale_log2,
            *strides,
            block_size,
            GROUP=group,
            BLOCK_G=max(_MIN_DOT, triton.next_power_of_2(group)),
            HEAD_DIM=head_dim,
            BLOCK_N=block_n,
            NUM_SPLITS=splits,
            DOT_FP32=_interpreted(),
            num_warps=4,
        )
        if splits > 1:
            _decode_reduce_kernel[(num_seqs, num_heads)](
                out,
                meta.query_start_loc,
                part_acc,
                part_max,
                part_sum,
                out.stride(0),
                out.stride(1),
                HEAD_DIM=head_dim,
                NUM_SPLITS=splits,
            )
        return out

    # Short queries (speculative k+1 rows, chunk tails) waste less of a small query tile.
    block_m = 16 if meta.max_query_len <= 16 else 64
    block_n = 32 if head_dim > 64 else 64
    grid = (triton.cdiv(meta.max_query_len, block_m), meta.num_seqs, num_heads)
    _varlen_kernel[grid](
        out,
        q,
        k_cache,
        v_cache,
        block_tables,
        *common,
        scale_log2,
        *strides,
        block_size,
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        DOT_FP32=_interpreted(),
        num_warps=4 if head_dim <= 64 else 8,
    )
    return out
