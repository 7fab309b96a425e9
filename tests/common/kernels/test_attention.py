"""Paged attention: the torch reference and the Triton kernels against a dense float64 attention.

Tests `common/kernels/attention.py` and the Triton kernels behind `triton_attention.py` (varlen in
`triton_varlen.py`, decode in `triton_decode.py`). Without a GPU they run in the interpreter
(tests/conftest.py switches it on before triton's import).
"""

import math

import pytest
import torch

from common.kernels.attention import AttentionMetadata, paged_attention, write_kv_cache
from common.kernels.triton_attention import paged_attention_triton, write_kv_cache_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NUM_HEADS = 4


def make_batch(
    spec: list[tuple[int, int]], num_kv_heads: int, head_dim: int, block_size: int,
    dtype: torch.dtype = torch.float32, seed: int = 0, garbage: float = float("nan"),
) -> dict:
    """A batch of sequences given as (query_len, seq_len): random cached prefixes, random new
    tokens written through `write_kv_cache`, blocks scattered over a shuffled pool.

    Slots no sequence owns hold `garbage` (NaN by default): any read past a sequence's end shows.
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [math.ceil(seq_len / block_size) for _, seq_len in spec]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks, never referenced
    physical = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(blocks_per_seq) + 1  # one column of padding for everyone
    block_tables = torch.zeros(len(spec), max_blocks, dtype=torch.int32)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, garbage, dtype=dtype)
    v_cache = torch.full(shape, garbage, dtype=dtype)
    used = 0
    slots, prefix_slots = [], []
    for i, ((q_len, seq_len), nb) in enumerate(zip(spec, blocks_per_seq)):
        table = physical[used:used + nb]
        used += nb
        block_tables[i, :nb] = table.to(torch.int32)
        pos = torch.arange(seq_len)
        seq_slots = table[pos // block_size] * block_size + pos % block_size
        prefix_slots.append(seq_slots[:seq_len - q_len])
        slots.append(seq_slots[seq_len - q_len:])
    prefix_slots = torch.cat(prefix_slots)
    for cache in (k_cache, v_cache):
        flat = cache.view(-1, num_kv_heads, head_dim)
        flat[prefix_slots] = torch.randn(len(prefix_slots), num_kv_heads, head_dim,
                                         generator=gen).to(dtype)
    num_tokens = sum(q_len for q_len, _ in spec)
    q = torch.randn(num_tokens, NUM_HEADS, head_dim, generator=gen).to(dtype)
    new_k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    new_v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    slot_mapping = torch.cat(slots).long()
    write_kv_cache(new_k, new_v, k_cache, v_cache, slot_mapping)
    query_lens = [q_len for q_len, _ in spec]
    seq_lens = [seq_len for _, seq_len in spec]
    meta = AttentionMetadata(
        slot_mapping=slot_mapping.to(DEVICE),
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()],
                                     dtype=torch.int32, device=DEVICE),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEVICE),
        block_tables=block_tables.to(DEVICE),
        query_lens_cpu=query_lens,
        seq_lens_cpu=seq_lens,
    )
    return dict(q=q.to(DEVICE), k_cache=k_cache.to(DEVICE), v_cache=v_cache.to(DEVICE), meta=meta,
                new_k=new_k.to(DEVICE), new_v=new_v.to(DEVICE), scale=head_dim ** -0.5)


def dense_attention(b: dict) -> torch.Tensor:
    """Naive float64 attention: each sequence's keys gathered position by position, GQA expanded."""
    meta, q = b["meta"], b["q"].double().cpu()
    k_flat = b["k_cache"].double().cpu().flatten(0, 1)
    v_flat = b["v_cache"].double().cpu().flatten(0, 1)
    block_size = b["k_cache"].shape[1]
    group = q.shape[1] // k_flat.shape[1]
    out = torch.empty_like(q)
    start = 0
    for i, (q_len, seq_len) in enumerate(zip(meta.query_lens_cpu, meta.seq_lens_cpu)):
        table = meta.block_tables[i].cpu().long()
        slots = [int(table[p // block_size]) * block_size + p % block_size for p in range(seq_len)]
        k = k_flat[slots].repeat_interleave(group, dim=1)  # [seq_len, H, D]
        v = v_flat[slots].repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q[start:start + q_len], k) * b["scale"]
        q_pos = torch.arange(q_len) + seq_len - q_len
        hidden = torch.arange(seq_len)[None, :] > q_pos[:, None]
        probs = scores.masked_fill(hidden, float("-inf")).softmax(-1)
        out[start:start + q_len] = torch.einsum("hqk,khd->qhd", probs, v)
        start += q_len
    return out


def assert_close(actual: torch.Tensor, expected: torch.Tensor, atol: float, rtol: float) -> None:
    assert not torch.isnan(actual).any(), "NaN in output"
    torch.testing.assert_close(actual.double().cpu(), expected, atol=atol, rtol=rtol)


# (query_len, seq_len) per sequence. Block size is 4 or 16 below, so for each the lengths 1,
# bs-1, bs, bs+1 and 2*bs+3 appear in some batch; 70 and 150 span several key/query tiles.
BATCHES = {
    "decode": [(1, 1), (1, 3), (1, 4), (1, 5), (1, 11), (1, 15), (1, 16), (1, 17), (1, 35)],
    "decode_long": [(1, 150), (1, 2), (1, 97)],
    "prefill": [(1, 1), (3, 3), (4, 4), (5, 5), (15, 15), (16, 16), (17, 17), (35, 35)],
    "prefill_long": [(70, 70), (2, 2)],
    "chunked_prefill": [(3, 7), (12, 16), (5, 21), (20, 35), (40, 150)],
    "mixed": [(1, 9), (4, 13), (1, 1), (17, 17), (5, 40), (1, 35), (3, 19)],
    "spec_decode": [(3, 10), (4, 33), (5, 5), (5, 64), (4, 17)],
}
SHAPES = [  # (num_kv_heads, head_dim, block_size): GQA groups of 1, 2 and 4
    (4, 16, 4),
    (2, 32, 16),
    (1, 16, 16),
    (1, 32, 4),
]
CASES = [(name, *shape) for name in BATCHES for shape in SHAPES] + [
    ("mixed", 2, 64, 16),
    ("decode", 2, 64, 4),
]


@pytest.mark.parametrize("name,num_kv_heads,head_dim,block_size", CASES)
def test_torch_reference_matches_dense(name, num_kv_heads, head_dim, block_size):
    b = make_batch(BATCHES[name], num_kv_heads, head_dim, block_size)
    expected = dense_attention(b)
    args = (b["q"], b["k_cache"], b["v_cache"], b["meta"], b["scale"])
    assert_close(paged_attention(*args), expected, atol=1e-5, rtol=1e-4)
    with_new = paged_attention(*args, new_k=b["new_k"], new_v=b["new_v"])
    assert_close(with_new, expected, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name,num_kv_heads,head_dim,block_size", CASES)
def test_triton_matches_dense(name, num_kv_heads, head_dim, block_size):
    b = make_batch(BATCHES[name], num_kv_heads, head_dim, block_size, seed=1)
    out = paged_attention_triton(b["q"], b["k_cache"], b["v_cache"], b["meta"], b["scale"])
    assert out.shape == b["q"].shape and out.dtype == b["q"].dtype
    assert_close(out, dense_attention(b), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("num_splits", [2, 4])
@pytest.mark.parametrize("num_kv_heads,block_size", [(2, 16), (1, 4)])
def test_triton_split_k_decode(num_splits, num_kv_heads, block_size):
    # 1 and 2 keys leave some splits empty; 150 and 97 split across several.
    b = make_batch(BATCHES["decode_long"] + [(1, 1)], num_kv_heads, 32, block_size, seed=2)
    args = (b["q"], b["k_cache"], b["v_cache"], b["meta"], b["scale"])
    out = paged_attention_triton(*args, num_splits=num_splits)
    assert_close(out, dense_attention(b), atol=1e-5, rtol=1e-4)


def test_triton_varlen_handles_decode_only_batch():
    # A batch of one-token rows forced through the varlen kernel (as when a mixed batch has a
    # single long row elsewhere) gives the decode kernel's result.
    b = make_batch(BATCHES["decode"] + [(2, 2)], 2, 32, 4, seed=3)
    out = paged_attention_triton(b["q"], b["k_cache"], b["v_cache"], b["meta"], b["scale"])
    assert_close(out, dense_attention(b), atol=1e-5, rtol=1e-4)


def test_triton_strided_query():
    # q sliced out of a fused QKV projection is not contiguous.
    b = make_batch(BATCHES["mixed"], 2, 32, 16, seed=4)
    num_tokens = b["q"].shape[0]
    qkv = torch.randn(num_tokens, (NUM_HEADS + 4) * 32, device=DEVICE)
    qkv[:, :NUM_HEADS * 32] = b["q"].flatten(1)
    q = qkv[:, :NUM_HEADS * 32].view(num_tokens, NUM_HEADS, 32)
    assert not q.is_contiguous()
    out = paged_attention_triton(q, b["k_cache"], b["v_cache"], b["meta"], b["scale"])
    assert_close(out, dense_attention(b), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("name", ["decode", "mixed"])
def test_torch_reference_bfloat16(name):
    b = make_batch(BATCHES[name], 2, 32, 16, dtype=torch.bfloat16, seed=5)
    expected = dense_attention(b)
    args = (b["q"], b["k_cache"], b["v_cache"], b["meta"], b["scale"])
    out = paged_attention(*args)
    assert out.dtype == torch.bfloat16
    assert_close(out, expected, atol=3e-2, rtol=3e-2)
    assert_close(paged_attention(*args, new_k=b["new_k"], new_v=b["new_v"]), expected,
                 atol=3e-2, rtol=3e-2)


def test_triton_bfloat16():
    b = make_batch(BATCHES["mixed"], 2, 32, 4, dtype=torch.bfloat16, seed=6)
    out = paged_attention_triton(b["q"], b["k_cache"], b["v_cache"], b["meta"], b["scale"])
    assert out.dtype == torch.bfloat16
    assert_close(out, dense_attention(b), atol=3e-2, rtol=3e-2)


def test_triton_rejects_bad_head_dim():
    b = make_batch([(1, 3)], 2, 16, 4)
    q = torch.randn(1, NUM_HEADS, 24, device=DEVICE)
    cache = torch.zeros(4, 4, 2, 24, device=DEVICE)
    with pytest.raises(AssertionError, match="power of two"):
        paged_attention_triton(q, cache, cache, b["meta"], 0.2)


@pytest.mark.parametrize("write", [write_kv_cache, write_kv_cache_triton])
@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(2, 16, 4), (1, 32, 16)])
def test_write_kv_cache_fills_each_slot(write, num_kv_heads, head_dim, block_size):
    num_blocks, num_tokens = 6, 13
    gen = torch.Generator().manual_seed(7)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    k = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    v = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, -7.0, device=DEVICE)
    v_cache = torch.full(shape, -7.0, device=DEVICE)
    write(k.to(DEVICE), v.to(DEVICE), k_cache, v_cache, slots.to(DEVICE))
    k_cache, v_cache = k_cache.cpu(), v_cache.cpu()
    for t, slot in enumerate(slots.tolist()):
        block, offset = divmod(slot, block_size)
        assert torch.equal(k_cache[block, offset], k[t])
        assert torch.equal(v_cache[block, offset], v[t])
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    assert (k_cache.flatten(0, 1)[untouched] == -7.0).all()
    assert (v_cache.flatten(0, 1)[untouched] == -7.0).all()


def test_write_kv_cache_triton_skips_padding_slots():
    k = torch.ones(3, 1, 16, device=DEVICE)
    k_cache = torch.zeros(2, 4, 1, 16, device=DEVICE)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([5, -1, 2], device=DEVICE)
    write_kv_cache_triton(k, 2 * k, k_cache, v_cache, slots)
    assert k_cache.flatten(0, 1)[:, 0, 0].tolist() == [0, 0, 1, 0, 0, 1, 0, 0]
    assert v_cache.flatten(0, 1)[:, 0, 0].tolist() == [0, 0, 2, 0, 0, 2, 0, 0]


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8"])
@pytest.mark.parametrize(
    "name", ["decode", "decode_long", "chunked_prefill", "mixed", "spec_decode"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_reads_an_8bit_cache(kv_dtype, name, dtype):
    """--kv-cache-dtype int8|fp8 with Triton: both kernels dequantize each K/V row in registers
    (code x its float32 scale per token and kv head, rounded once to q's dtype) as the torch
    reference does, so only the summation order differs: float32 to 1e-5; bfloat16's products
    round to 2^-8, so 3e-2 as for a bfloat16 cache. Split-k decode included."""
    from common.kernels import kv_quant

    code = {"int8": torch.int8, "fp8": getattr(torch, "float8_e4m3fn", None)}[kv_dtype]
    if code is None:
        pytest.skip("this torch has no float8_e4m3fn")
    if kv_dtype == "fp8" and DEVICE == "cpu":
        pytest.skip("Triton's interpreter has no float8 (numpy has none): runs on a GPU")
    b = make_batch(BATCHES[name], 2, 32, 4, dtype=dtype, seed=7, garbage=0.0)
    k_cache, k_scales = kv_quant.quantize(b["k_cache"], code)
    v_cache, v_scales = kv_quant.quantize(b["v_cache"], code)
    k_scales, v_scales = k_scales.contiguous(), v_scales.contiguous()
    args = (b["q"], k_cache, v_cache, b["meta"], b["scale"])
    ref = paged_attention(*args, k_scales=k_scales, v_scales=v_scales)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    out = paged_attention_triton(*args, k_scales=k_scales, v_scales=v_scales)
    assert out.dtype == dtype
    assert_close(out, ref.double().cpu(), atol=tol, rtol=tol)
    if name == "decode_long":
        split = paged_attention_triton(*args, num_splits=4, k_scales=k_scales, v_scales=v_scales)
        assert_close(split, ref.double().cpu(), atol=tol, rtol=tol)
    with pytest.raises(ValueError, match="needs its k_scales and v_scales"):
        paged_attention_triton(*args)
