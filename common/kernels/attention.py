"""Paged attention: the batch's attention metadata and the torch reference path.

Owns `AttentionMetadata` and `build_batch`, which lays a step's rows (tokens, first position, block
table) out as one flat batch with its metadata (called once per step by the model runner, and by
the draft proposer for its own forwards), and the two operations on the paged KV cache: writing
new keys/values into their slots and attending each new query token over its sequence's cached
prefix plus the new tokens (causally).
The torch code here is the CPU path and the reference the Triton kernels are tested against.

Cache layout, per layer: `k_cache`, `v_cache` of shape
[num_blocks, block_size, num_kv_heads, head_dim]; an 8-bit cache (int8 / fp8) has `k_scales`,
`v_scales` [num_blocks, block_size, num_kv_heads] beside it (common.kernels.kv_quant), and every
reader here dequantizes what it reads.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from common.kernels import cpu_attention, cpu_ops, cpu_prefill, kv_quant


@dataclass
class AttentionMetadata:
    """Where each new token's K/V goes and which cached tokens each sequence attends to.

    Sequence i owns new tokens `query_start_loc[i]:query_start_loc[i+1]` of the flat batch; after
    this step its cache holds `seq_lens[i]` tokens (cached prefix + new), laid out along
    `block_tables[i]` (padded with 0 past its last block). New token j of sequence i is at position
    `seq_lens[i] - query_len_i + j` and attends to positions `0..` itself.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    block_tables: torch.Tensor  # [num_seqs, max_num_blocks] int32
    query_lens_cpu: list[int]
    seq_lens_cpu: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_cpu)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_cpu)


# One row of a forward: input token ids, the position of the first, the sequence's block table.
Row = tuple[list[int], int, list[int]]


def build_batch(
    rows: list[Row], block_size: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
    """(input ids, positions, attention metadata) of one forward over `rows`, on `device`."""
    input_ids: list[int] = []
    slots: list[np.ndarray] = []
    positions: list[np.ndarray] = []
    query_lens: list[int] = []
    seq_lens: list[int] = []
    max_blocks = max(len(row[2]) for row in rows)
    tables = np.zeros((len(rows), max_blocks), dtype=np.int32)
    for i, (tokens, start, block_table) in enumerate(rows):
        n = len(tokens)
        input_ids.extend(tokens)
        pos = np.arange(start, start + n)
        table = np.asarray(block_table, dtype=np.int64)
        tables[i, : len(table)] = table
        positions.append(pos)
        slots.append(table[pos // block_size] * block_size + pos % block_size)
        query_lens.append(n)
        seq_lens.append(start + n)
    meta = AttentionMetadata(
        slot_mapping=torch.from_numpy(np.concatenate(slots)).to(device),
        query_start_loc=torch.tensor([0, *np.cumsum(query_lens)], dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.from_numpy(tables).to(device),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
    )
    ids = torch.tensor(input_ids, dtype=torch.long, device=device)
    pos = torch.from_numpy(np.concatenate(positions)).to(device)
    return ids, pos, meta


def write_kv_cache(
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> None:
    """Store new keys/values [num_tokens, num_kv_heads, head_dim] into their cache slots
    (quantized per (token, head) into an 8-bit cache and its scales)."""
    if k_cache.dtype != k.dtype:
        if not cpu_ops.store_kv(k, v, k_cache, v_cache, k_scales, v_scales, slot_mapping):
            kv_quant.write(k, v, k_cache, v_cache, k_scales, v_scales, slot_mapping)
        return
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, k)
    v_cache.view(-1, num_kv_heads, head_dim).index_copy_(0, slot_mapping, v)


def _gather_seq(
    cache: torch.Tensor,
    block_table: torch.Tensor,
    seq_len: int,
    scales: torch.Tensor | None,
    dtype: torch.dtype,
) -> torch.Tensor:
    """A sequence's first `seq_len` cached tokens as [seq_len, num_kv_heads, head_dim] in
    `dtype` (dequantized from an 8-bit cache with its `scales`)."""
    block_size = cache.shape[1]
    num_blocks = (seq_len + block_size - 1) // block_size
    index = block_table[:num_blocks].long()
    blocks = kv_quant.storage(cache).index_select(0, index).view(cache.dtype)
    block_scales = None if scales is None else scales.index_select(0, index).flatten(0, 1)[:seq_len]
    return kv_quant.dequantize(blocks.flatten(0, 1)[:seq_len], block_scales, dtype)


def _decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """One query per sequence, batched: q [B, H, D] -> [B, H, D]."""
    if cpu_attention.supports(q, k_cache, k_scales):
        return cpu_attention.paged_decode_attention(
            q, k_cache, v_cache, block_tables, seq_lens, scale, k_scales, v_scales
        )
    batch, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    num_blocks = (max_seq_len + block_size - 1) // block_size
    table = block_tables[:, :num_blocks].long()

    def gather(cache: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        """[B, L, Hkv, D] in q's dtype, a gathered copy."""
        if scales is None and cache.dtype == q.dtype:
            return cache[table].flatten(1, 2)
        blocks = kv_quant.storage(cache)[table].view(cache.dtype).flatten(1, 2)
        return kv_quant.dequantize(
            blocks, None if scales is None else scales[table].flatten(1, 2), q.dtype
        )

    # [B, nb, bs, Hkv, D] -> [B, Hkv, L, D]
    k = gather(k_cache, k_scales).permute(0, 2, 1, 3)
    v = gather(v_cache, v_scales)  # [B, L, Hkv, D], a gathered copy
    length = v.shape[1]
    mask = torch.arange(length, device=q.device)[None, :] >= seq_lens[:, None].long()
    # Slots past a sequence's end may hold anything (NaN in a torch.empty cache): 0 * NaN = NaN.
    v = v.masked_fill_(mask[:, :, None, None], 0).permute(0, 2, 1, 3)
    qg = q.view(batch, num_kv_heads, group, head_dim)
    scores = torch.matmul(qg, k.transpose(-1, -2)).float() * scale  # [B, Hkv, G, L]
    scores.masked_fill_(mask[:, None, None, :], float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v).reshape(batch, num_heads, head_dim)


def _prefill_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    out: torch.Tensor,
) -> None:
    """Causal; queries are the last q_len of k_len keys. q [q_len, H, D], k/v [k_len, Hkv, D];
    the result goes to `out` [q_len, H, D] (the CPU kernel writes it there directly)."""
    if cpu_prefill.supports(q, k, v) and out.is_contiguous():
        cpu_prefill.prefill_attention(q, k, v, scale, out=out)
        return
    q_len, k_len = q.shape[0], k.shape[0]
    num_heads, num_kv_heads, head_dim = q.shape[1], k.shape[1], q.shape[2]
    group = num_heads // num_kv_heads
    # [Hkv, G, len, D]: each kv head's G query heads as a batch row whose K/V are one head's,
    # broadcast (stride 0), not copied: SDPA's enable_gqa falls back to its slow math kernel on
    # CPU, and repeat_interleave copies K/V G times (same result to the bit, 25% slower at 2,048
    # tokens).
    qt = q.view(q_len, num_kv_heads, group, head_dim).permute(1, 2, 0, 3)
    kt, vt = (x.transpose(0, 1)[:, None].expand(-1, group, -1, -1) for x in (k, v))
    if q_len == k_len:
        attended = F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, scale=scale)
    else:
        rows = torch.arange(q_len, device=q.device)[:, None] + (k_len - q_len)
        allowed = torch.arange(k_len, device=q.device)[None, :] <= rows
        attended = F.scaled_dot_product_attention(qt, kt, vt, attn_mask=allowed, scale=scale)
    out.copy_(attended.permute(2, 0, 1, 3).reshape(q_len, num_heads, head_dim))


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    new_k: torch.Tensor | None = None,
    new_v: torch.Tensor | None = None,
    k_scales: torch.Tensor | None = None,
    v_scales: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention of new tokens q [num_tokens, H, D] over the paged cache (already holding them).

    `new_k`/`new_v`, when given, are the new tokens' keys/values: a sequence with no cached prefix
    then attends to them directly instead of gathering them back from the cache (same values, less
    copying; with an 8-bit cache, the unrounded values, as vLLM's prefill does). `k_scales`,
    `v_scales`: an 8-bit cache's scales.
    """
    if meta.max_query_len == 1:
        return _decode_attention(
            q, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.max_seq_len, scale,
            k_scales, v_scales,
        )  # fmt: skip
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)  # contiguous: written in place
    # Decode rows of a mixed batch are batched together; prefill rows go one sequence at a time.
    decode_rows = [i for i, q_len in enumerate(meta.query_lens_cpu) if q_len == 1]
    if len(decode_rows) > 1:
        rows = torch.tensor(decode_rows, device=q.device)
        tokens = meta.query_start_loc[rows].long()
        out[tokens] = _decode_attention(
            q[tokens],
            k_cache,
            v_cache,
            meta.block_tables[rows],
            meta.seq_lens[rows],
            max(meta.seq_lens_cpu[i] for i in decode_rows),
            scale,
            k_scales,
            v_scales,
        )
    else:
        decode_rows = []
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        end = start + q_len
        if decode_rows and q_len == 1:
            start = end
            continue
        if new_k is not None and new_v is not None and q_len == seq_len:
            k, v = new_k[start:end], new_v[start:end]
        else:
            k = _gather_seq(k_cache, meta.block_tables[i], seq_len, k_scales, q.dtype)
            v = _gather_seq(v_cache, meta.block_tables[i], seq_len, v_scales, q.dtype)
        _prefill_attention(q[start:end], k, v, scale, out[start:end])
        start = end
    return out
