"""The 8-bit KV cache (int8 / fp8 e4m3 with a scale per (token, KV head)) in every CPU attention
path: the C paged decode kernel, the torch decode path, prefill and chunked prefill.

Two checks per path. Exact: an 8-bit path equals the float path run over the dequantized cache
(float32 rounding only, 1e-5). Bounded: against the unquantized float32 cache, the error is within
what per-(token, head) absmax quantization allows. A K element is off by at most e_k (int8:
absmax/254, half a step; fp8: 2^-4 of itself or 2^-10 of the scale for subnormals), so a score
moves by at most delta = softmax scale * sum_d |q_d| * e_k, the softmax weights by a factor within
exp(+-2 delta), and the output (a convex combination of V rows off by at most e_v) by at most
e_v + (exp(2 delta) - 1) * max|v|.
"""

from __future__ import annotations

import math

import pytest
import torch

from common.kernels import cpu_attention, kv_quant
from common.kernels.attention import AttentionMetadata, build_batch, paged_attention, write_kv_cache

KV_DTYPES = [torch.int8] + ([kv_quant.FP8] if kv_quant.FP8 is not None else [])


def quant_error(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The most each element of x may move when stored in `dtype` with its row's scale."""
    scale = x.abs().amax(-1, keepdim=True) / kv_quant.QMAX[dtype]
    if dtype == torch.int8:
        return (scale / 2).expand_as(x)
    return torch.maximum(x.abs() * 2**-4, scale * 2**-10)


def reference(*args, **kwargs) -> torch.Tensor:
    cpu_attention.enabled = False
    try:
        return paged_attention(*args, **kwargs)
    finally:
        cpu_attention.enabled = True


def bound(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dtype, scale: float) -> float:
    """The module docstring's bound on |8-bit output - float output|, over the whole batch."""
    e_k = quant_error(k, dtype).max().item()
    e_v = quant_error(v, dtype).max().item()
    delta = scale * q.abs().sum(-1).max().item() * e_k
    return e_v + math.expm1(2 * delta) * v.abs().max().item() + 1e-5


@pytest.mark.parametrize("dtype", KV_DTYPES)
def test_quantize_error_within_half_a_step(dtype):
    x = torch.randn(64, 4, 64) * torch.logspace(-3, 2, 64)[:, None, None]
    x[3, 1] = 0  # an all-zero row stays zero (no 0/0)
    q, s = kv_quant.quantize(x, dtype)
    assert q.dtype == dtype and s.shape == (64, 4) and s.dtype == torch.float32
    back = kv_quant.dequantize(q, s, torch.float32)
    assert (back - x).abs().le(quant_error(x, dtype) * 1.0001 + 1e-30).all()
    assert back[3, 1].eq(0).all()


def paged(dtype, num_blocks, block_size, kv_heads, head_dim, g):
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    (kq, ks), (vq, vs) = kv_quant.quantize(k, dtype), kv_quant.quantize(v, dtype)
    return k, v, kq, ks, vq, vs


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(8, 2, 64), (4, 4, 128), (6, 2, 32)])
@pytest.mark.parametrize("c_kernel", [True, False])
def test_decode_reads_8bit_cache(kv_dtype, q_dtype, heads, kv_heads, head_dim, c_kernel):
    g = torch.Generator().manual_seed(heads + head_dim)
    block_size, lens = 16, [1, 15, 16, 17, 50, 200]
    max_blocks = max(-(-n // block_size) for n in lens)
    num_blocks = len(lens) * max_blocks + 3
    k, v, kq, ks, vq, vs = paged(kv_dtype, num_blocks, block_size, kv_heads, head_dim, g)
    tables = torch.randperm(num_blocks, generator=g)[: len(lens) * max_blocks]
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(len(lens), dtype=torch.long),
        query_start_loc=torch.arange(len(lens) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(lens, dtype=torch.int32),
        block_tables=tables.view(len(lens), max_blocks).int(),
        query_lens_cpu=[1] * len(lens),
        seq_lens_cpu=lens,
    )
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(q_dtype)
    scale = head_dim**-0.5
    if c_kernel and not cpu_attention.available():
        pytest.skip("no C compiler")
    assert cpu_attention.supports(q, kq, ks) == cpu_attention.available()
    run = paged_attention if c_kernel else reference
    out = run(q, kq, vq, meta, scale, k_scales=ks, v_scales=vs).float()
    kd, vd = (kv_quant.dequantize(x, s, q_dtype) for x, s in ((kq, ks), (vq, vs)))
    exact = reference(q, kd, vd, meta, scale).float()
    tol = 1e-5 if q_dtype == torch.float32 else 2e-2  # bf16: the output's own rounding
    torch.testing.assert_close(out, exact, atol=tol, rtol=tol)
    if q_dtype == torch.float32:
        full = reference(q, k, v, meta, scale)
        assert (out - full).abs().max().item() <= bound(q, k, v, kv_dtype, scale)


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_prefill_and_chunked_prefill_read_8bit_cache(kv_dtype):
    # a mixed batch: a fresh prompt, a chunk after a cached prefix, two decode rows
    g = torch.Generator().manual_seed(3)
    heads, kv_heads, head_dim, block_size = 4, 2, 64, 8
    rows = [
        (list(range(13)), 0, [5, 2]),
        (list(range(9)), 20, [7, 1, 9, 4]),
        ([1], 30, [3, 6, 8, 10]),
        ([1], 6, [11]),
    ]
    _, _, meta = build_batch(rows, block_size, torch.device("cpu"))
    num_blocks, tokens = 12, meta.slot_mapping.numel()
    full_k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    full_v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g)
    new_k = torch.randn(tokens, kv_heads, head_dim, generator=g)
    new_v = torch.randn(tokens, kv_heads, head_dim, generator=g)
    write_kv_cache(new_k, new_v, full_k, full_v, meta.slot_mapping)
    # the whole cache as the 8-bit writer leaves it (prefixes written by earlier steps)
    (kq, ks), (vq, vs) = kv_quant.quantize(full_k, kv_dtype), kv_quant.quantize(full_v, kv_dtype)
    q = torch.randn(tokens, heads, head_dim, generator=g)
    scale = head_dim**-0.5
    out = paged_attention(q, kq, vq, meta, scale, new_k, new_v, ks, vs)
    # the fresh prompt attends to its own unrounded K/V; every other row reads the cache
    kd, vd = (kv_quant.dequantize(x, s, torch.float32) for x, s in ((kq, ks), (vq, vs)))
    exact = reference(q, kd, vd, meta, scale, new_k, new_v)
    torch.testing.assert_close(out, exact, atol=1e-5, rtol=1e-5)
    full = reference(q, full_k, full_v, meta, scale)
    assert (out - full).abs().max().item() <= bound(q, full_k, full_v, kv_dtype, scale)
    torch.testing.assert_close(out[:13], full[:13], atol=1e-5, rtol=1e-5)  # fresh: unrounded


@pytest.mark.parametrize("kv_dtype", KV_DTYPES)
def test_write_quantizes_each_token_and_head(kv_dtype):
    g = torch.Generator().manual_seed(5)
    k_cache = torch.zeros(4, 8, 2, 16, dtype=kv_dtype)
    v_cache, k_scales, v_scales = k_cache.clone(), torch.zeros(4, 8, 2), torch.zeros(4, 8, 2)
    k, v = torch.randn(5, 2, 16, generator=g), torch.randn(5, 2, 16, generator=g) * 100
    slots = torch.tensor([3, 17, 18, 30, 9])
    write_kv_cache(k, v, k_cache, v_cache, slots, k_scales, v_scales)
    for x, cache, scales in ((k, k_cache, k_scales), (v, v_cache, v_scales)):
        stored = kv_quant.dequantize(
            kv_quant.storage(cache).view(-1, 2, 16)[slots].view(kv_dtype),
            scales.view(-1, 2)[slots],
            torch.float32,
        )
        assert (stored - x).abs().le(quant_error(x, kv_dtype) * 1.0001).all()
    assert k_scales.view(-1, 2)[0].eq(0).all()  # slots not written stay untouched


@pytest.mark.parametrize("cache_dtype", [*KV_DTYPES, torch.float16])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_c_store_writes_the_torch_writers_bytes(cache_dtype, dtype):
    """cpu_ops.store_kv (one C call a layer; write_kv_cache's CPU path) against
    kv_quant.write: the same cache bytes and scales, from k and v as views of a fused qkv row
    (as the attention layer has them), with a padding slot, rows of all sizes, zeros, huge ones."""
    from common.kernels import cpu_ops

    if not cpu_ops.available():
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(11)
    heads, kv_heads, head_dim, tokens = 6, 2, 64, 9
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g)
    qkv *= torch.logspace(-4, 4, tokens)[:, None]
    qkv[2] = 0
    qkv = qkv.to(dtype)
    k = qkv[:, heads * head_dim : (heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    v = qkv[:, (heads + kv_heads) * head_dim :].view(tokens, kv_heads, head_dim)
    slots = torch.tensor([3, 17, -1, 30, 9, 0, 31, 12, 5])
    eight_bit = kv_quant.is_8bit(cache_dtype)

    def fresh():
        cache = torch.zeros(4, 8, kv_heads, head_dim).to(cache_dtype)
        scales = torch.full((4, 8, kv_heads), -1.0) if eight_bit else None
        return cache, cache.clone(), scales, None if scales is None else scales.clone()

    got, want = fresh(), fresh()
    assert cpu_ops.store_kv(k, v, *got[:2], got[2], got[3], slots)
    keep = slots >= 0  # the torch writer has no padding slots
    kv_quant.write(k[keep], v[keep], *want[:2], want[2], want[3], slots[keep])
    for a, b in zip(got, want):
        if a is not None:
            assert torch.equal(kv_quant.storage(a).view(torch.uint8).flatten(),
                               kv_quant.storage(b).view(torch.uint8).flatten())  # fmt: skip
    with pytest.raises(IndexError):
        cpu_ops.store_kv(k, v, *got[:2], got[2], got[3], slots + 100)
