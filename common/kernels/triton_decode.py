"""Triton decode attention: one new token per sequence, over its paged cache, with split-k.

Owns `_decode_kernel`, `_decode_reduce_kernel`, the split heuristic `decode_num_splits` and the
launch `launch_decode`. Grid (sequence, kv head, split); each program attends all the query heads
of one kv-head group at once, so K/V are read once per group, over a contiguous range of keys;
with more than one split a reduce kernel merges the partial softmaxes. Called by
`triton_attention.paged_attention_triton` when every sequence has exactly one new token.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from common.kernels.attention import AttentionMetadata
from common.kernels.triton_varlen import NEG_BIG, dequant_rows, dot, interpreted

MIN_DOT = 16  # tl.dot needs every dimension >= 16


@triton.jit
def _decode_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
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
    QUANT: tl.constexpr,
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

    m = tl.full([BLOCK_G], NEG_BIG, tl.float32)
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
        k = tl.load(k_cache_ptr + kv_off[:, None] + d[None, :], mask=key_ok[:, None], other=0)
        if QUANT:
            scale_off = (block * block_size + pos % block_size) * tl.num_programs(1) + kv_head
            k = dequant_rows(k, k_scale_ptr, scale_off, key_ok, q.dtype)
        s = dot(q, tl.trans(k), DOT_FP32) * scale_log2
        s = tl.where(key_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        alpha = tl.exp2(m - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_sum = l_sum * alpha + tl.sum(p, 1)
        v = tl.load(v_cache_ptr + kv_off[:, None] + d[None, :], mask=key_ok[:, None], other=0)
        if QUANT:
            v = dequant_rows(v, v_scale_ptr, scale_off, key_ok, q.dtype)
        acc = acc * alpha[:, None] + dot(p.to(v.dtype), v, DOT_FP32)
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


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def decode_num_splits(num_programs: int, max_seq_len: int, device: torch.device) -> int:
    """Split long sequences' keys when (sequences x kv heads) alone would leave most SMs idle."""
    if device.type != "cuda":
        return 1
    num_sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    splits = 1
    while splits < 16 and num_programs * splits < num_sms and max_seq_len >= 512 * splits * 2:
        splits *= 2
    return splits


def launch_decode(
    out: torch.Tensor,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    block_tables: torch.Tensor,
    strides: tuple[int, ...],
    scale_log2: float,
    num_splits: int | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> None:
    """Fill `out` [num_seqs, H, D] with each sequence's one-token attention.

    `strides` are triton_attention's `_strides` (their order is the kernel's argument order);
    `num_splits` (a power of two) overrides `decode_num_splits`; an 8-bit cache comes with its
    contiguous float32 scales [blocks, block_size, kv heads].
    """
    num_heads, head_dim = q.shape[1], q.shape[2]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    common = (meta.seq_lens, meta.query_start_loc)
    num_seqs = meta.num_seqs
    splits = num_splits or decode_num_splits(num_seqs * num_kv_heads, meta.max_seq_len, q.device)
    assert splits & (splits - 1) == 0, f"num_splits must be a power of two, got {splits}"
    block_n = 32 if head_dim > 64 else 64
    if splits > 1:
        part_acc = torch.empty(
            (num_seqs, num_heads, splits, head_dim), dtype=torch.float32, device=q.device
        )
        part_max = torch.empty((num_seqs, num_heads, splits), dtype=torch.float32, device=q.device)
        part_sum = torch.empty_like(part_max)
    else:
        part_acc = part_max = part_sum = out  # unused by the NUM_SPLITS == 1 branch
    _decode_kernel[(num_seqs, num_kv_heads, splits)](
        out,
        q,
        k_cache,
        v_cache,
        k_scales if k_scales is not None else k_cache,  # unread without QUANT
        v_scales if v_scales is not None else v_cache,
        block_tables,
        *common,
        part_acc,
        part_max,
        part_sum,
        scale_log2,
        *strides,
        block_size,
        GROUP=group,
        BLOCK_G=max(MIN_DOT, triton.next_power_of_2(group)),
        HEAD_DIM=head_dim,
        BLOCK_N=block_n,
        NUM_SPLITS=splits,
        DOT_FP32=interpreted(),
        QUANT=k_scales is not None,
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
