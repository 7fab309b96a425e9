"""The C decode-attention kernel against the torch reference path."""

from __future__ import annotations

import pytest
import torch

from common.kernels import cpu_attention
from common.kernels.attention import AttentionMetadata, paged_attention

pytestmark = pytest.mark.skipif(not cpu_attention.available(), reason="no C compiler")


def torch_reference(q, k_cache, v_cache, meta, scale):
    cpu_attention.enabled = False
    try:
        return paged_attention(q, k_cache, v_cache, meta, scale)
    finally:
        cpu_attention.enabled = True


@pytest.mark.parametrize("cache_dtype", [None, torch.float16])  # None: q's dtype
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim",
    [(4, 4, 64), (8, 2, 64), (9, 3, 64), (6, 1, 32), (4, 2, 128), (6, 2, 128), (10, 2, 64)],
)
@pytest.mark.parametrize("block_size", [4, 16])
def test_decode_kernel_matches_torch(cache_dtype, dtype, heads, kv_heads, head_dim, block_size):
    g = torch.Generator().manual_seed(heads * 7 + head_dim + block_size)
    seq_lens = [1, block_size - 1, block_size, block_size + 1, 3 * block_size + 2, 50]
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    num_blocks = len(seq_lens) * max_blocks + 3
    cache_dtype = cache_dtype or dtype
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(cache_dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(cache_dtype)
    perm = torch.randperm(num_blocks, generator=g)
    tables = perm[: len(seq_lens) * max_blocks].view(len(seq_lens), max_blocks).int()
    # q as a strided view of a fused projection, the way the model hands it over
    fused = torch.randn(len(seq_lens), heads * head_dim + 2 * kv_heads * head_dim, generator=g)
    q = fused.to(dtype)[:, : heads * head_dim].view(len(seq_lens), heads, head_dim)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(len(seq_lens), dtype=torch.long),
        query_start_loc=torch.arange(len(seq_lens) + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        query_lens_cpu=[1] * len(seq_lens),
        seq_lens_cpu=seq_lens,
    )
    assert cpu_attention.supports(q, k_cache)
    out = paged_attention(q, k_cache, v_cache, meta, head_dim**-0.5)
    ref = torch_reference(q, k_cache, v_cache, meta, head_dim**-0.5)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_unsupported_layouts_fall_back():
    q = torch.randn(2, 4, 64).transpose(0, 1)  # head dim fine, but rows not [H, D]-contiguous
    k_cache = torch.randn(4, 16, 2, 64)
    assert not cpu_attention.supports(q, k_cache)
    assert not cpu_attention.supports(torch.randn(2, 4, 64).half(), k_cache.half())


def test_loading_the_kernels_leaves_float_mode_alone():
    """Building with -ffast-math linked crtfastmath.o, which turned on flush-to-zero for the whole
    process on load: 5e-324 * 1.0 became 0.0 in every thread that loaded it (a worker's sampler
    then saw top_p / repetition_penalty 5e-324 as 0). A fresh process loading every C kernel of
    the project (attention, fused ops, quantized matmul) from the suite's kernel cache: its build
    key holds the flags and sources, so what loads is the build of today's flags (crtfastmath's
    switch runs at load, so loading a cached build shows it as a fresh build would; a fresh cache
    here only compiled them all once more: 40 s of the suite)."""
    import subprocess
    import sys

    code = (
        "from common.kernels import cpu_attention, cpu_ops, cpu_quant\n"
        "assert cpu_attention.available() and cpu_ops.available() and cpu_quant.c_available()\n"
        "x = float('5e-324')\n"
        "print(repr(x * 1.0), repr(x + x))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["5e-324", "1e-323"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seq_lens", [[700], [33, 700], [1, 65], [1100, 512, 513]])
@pytest.mark.parametrize("heads", [3, 6])  # 3: the AVX2 path (up to 4 per kv head), 6: generic
def test_token_split_for_few_sequences_matches_torch(dtype, seq_lens, heads):
    """Sequences longer than SPLIT_TOKENS: their tokens are split into parts whose softmax
    statistics are merged (a shorter sequence of the same step has fewer parts); the result must
    not depend on it."""
    kv_heads, head_dim, block_size = 1, 64, 16
    g = torch.Generator().manual_seed(len(seq_lens) + seq_lens[-1])
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    num_blocks = len(seq_lens) * max_blocks
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g).view(len(seq_lens), max_blocks).int()
    q = torch.randn(len(seq_lens), heads, head_dim, generator=g).to(dtype) * 3
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(len(seq_lens), dtype=torch.long),
        query_start_loc=torch.arange(len(seq_lens) + 1, dtype=torch.int32),
        seq_lens=lens,
        block_tables=tables,
        query_lens_cpu=[1] * len(seq_lens),
        seq_lens_cpu=seq_lens,
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(2)  # the split needs more than one thread
    try:
        got = cpu_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.125)
    finally:
        torch.set_num_threads(threads)
    # against float32 (a bfloat16 reference adds its own rounding over 1,100 tokens)
    ref = torch_reference(q.float(), k_cache.float(), v_cache.float(), meta, 0.125)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert (got.float() - ref).abs().max() <= tol


def make_caches(cache: str, dtype: torch.dtype, shape: tuple, g: torch.Generator):
    """K and V caches of `shape` as the engine keeps them: in q's dtype ("native"), float16,
    or 8-bit (int8 / fp8 e4m3) with float32 scales per (token, kv head); the scales or None."""
    if cache not in ("int8", "fp8"):
        kv_dtype = torch.float16 if cache == "float16" else dtype
        k = torch.randn(shape, generator=g).to(kv_dtype)
        return k, torch.randn(shape, generator=g).to(kv_dtype), None, None
    k_scales = torch.rand(shape[:3], generator=g) / 64 + 1e-3
    v_scales = torch.rand(shape[:3], generator=g) / 64 + 1e-3
    if cache == "int8":
        k_cache = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
        v_cache = torch.randint(-127, 128, shape, generator=g, dtype=torch.int8)
    else:
        k_cache = (torch.randn(shape, generator=g) * 50).to(torch.float8_e4m3fn)
        v_cache = (torch.randn(shape, generator=g) * 50).to(torch.float8_e4m3fn)
    return k_cache, v_cache, k_scales, v_scales


@pytest.mark.parametrize("cache", ["native", "float16", "int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim",
    [(9, 3, 64), (8, 2, 64), (4, 4, 64), (16, 8, 64), (4, 2, 128), (12, 3, 128), (18, 9, 64)],
)
def test_a_rows_result_does_not_depend_on_the_rows_beside_it(
    cache, dtype, heads, kv_heads, head_dim
):
    """Bit for bit, whatever the batch: a verify step's rows must equal the decode steps they
    stand for (int8 activations turn a last-bit difference into another code downstream). The
    batch goes by whole sequences (every kv head in one walk) where the build has that path,
    each row alone by (sequence, kv head) parts: the two must agree too."""
    block_size = 16
    seq_lens = [1, 200, 511, 512, 513, 1100]
    g = torch.Generator().manual_seed(5 + heads + head_dim)
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    num_blocks = len(seq_lens) * max_blocks
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache, k_scales, v_scales = make_caches(cache, dtype, shape, g)
    tables = torch.randperm(num_blocks, generator=g).view(len(seq_lens), max_blocks).int()
    q = torch.randn(len(seq_lens), heads, head_dim, generator=g).to(dtype)
    lens = torch.tensor(seq_lens, dtype=torch.int32)
    args = (k_cache, v_cache)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        # one sequence is never split by whole sequences (its kv heads share out the threads);
        # the batch is, where the build has that path and the layout allows it
        assert not cpu_attention.whole_sequences(1, heads, kv_heads, head_dim, 1100, 2)
        whole = cpu_attention.whole_sequences(len(seq_lens), heads, kv_heads, head_dim, 1100, 2)
        avx512 = cpu_attention.isa_level().startswith(("avx512", "amx"))
        assert whole == (avx512 and 1 < kv_heads <= 8)
        together = cpu_attention.paged_decode_attention(
            q, *args, tables, lens, 0.125, k_scales, v_scales
        )
        for i in range(len(seq_lens)):
            alone = cpu_attention.paged_decode_attention(
                q[i : i + 1], *args, tables[i : i + 1], lens[i : i + 1], 0.125, k_scales,
                v_scales,
            )  # fmt: skip
            assert torch.equal(alone[0], together[i]), seq_lens[i]
    finally:
        torch.set_num_threads(threads)


def test_whole_sequences_where_the_build_and_shape_allow():
    """The batch above goes by whole sequences on an AVX-512 build for up to 8 kv heads of 1-4
    query heads each, head dim 64 or 128; never with one kv head, nor for one sequence."""
    whole = cpu_attention.whole_sequences
    if not cpu_attention.isa_level().startswith(("avx512", "amx")):
        assert not whole(64, 9, 3, 64, 320, 2)
        return
    assert whole(6, 9, 3, 64, 1100, 2)  # 6 sequences x 3 parts of 512 tokens: 18 units
    assert whole(64, 9, 3, 64, 320, 2) and whole(8, 8, 8, 128, 320, 2)
    assert not whole(64, 18, 9, 64, 320, 2)  # more kv heads than the walk keeps maxima for
    assert not whole(64, 4, 1, 64, 320, 2)  # one kv head: the parts already are sequences
    assert not whole(64, 10, 2, 64, 320, 2)  # 5 query heads a kv head
    assert not whole(64, 9, 3, 32, 320, 2)
    assert not whole(7, 9, 3, 64, 320, 2) and whole(8, 9, 3, 64, 320, 2)  # 4 a thread


@pytest.mark.parametrize("cache", ["native", "float16", "int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 64), (8, 2, 64), (4, 1, 64), (4, 2, 128)]
)
def test_rows_of_one_sequence_equal_each_row_alone(cache, dtype, heads, kv_heads, head_dim):
    """A verify step's rows (one sequence, lengths one apart, the same block table) go through
    the grouped part (AVX-512, head dim 64) in groups of up to 8: each row's bits must still be
    those of that row alone, across a 512-token split and with other sequences beside them."""
    block_size = 16
    lens = [*range(5, 13), *range(505, 516), 300, *range(40, 42)]  # 8, 11 (8 + 3), 1, 2 rows
    seq_of = [0] * 8 + [1] * 11 + [2] + [3] * 2
    g = torch.Generator().manual_seed(heads + head_dim)
    max_blocks = -(-max(lens) // block_size) + 1
    num_blocks = 4 * max_blocks
    shape = (num_blocks, block_size, kv_heads, head_dim)
    k_cache, v_cache, k_scales, v_scales = make_caches(cache, dtype, shape, g)
    per_seq = torch.randperm(num_blocks, generator=g).view(4, max_blocks).int()
    tables = per_seq[torch.tensor(seq_of)].contiguous()
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        args = (k_cache, v_cache)
        together = cpu_attention.paged_decode_attention(
            q, *args, tables, seq_lens, 0.125, k_scales, v_scales
        )
        for i in range(len(lens)):
            alone = cpu_attention.paged_decode_attention(
                q[i : i + 1], *args, tables[i : i + 1], seq_lens[i : i + 1], 0.125, k_scales,
                v_scales,
            )  # fmt: skip
            assert torch.equal(alone[0], together[i]), lens[i]
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,first_len", [(2, 40), (3, 300), (5, 350), (8, 509), (8, 1030)])
@pytest.mark.parametrize("heads,kv_heads", [(9, 3), (4, 1)])
def test_a_lone_verify_steps_rows_equal_each_row_alone(dtype, rows, first_len, heads, kv_heads):
    """One sequence's k + 1 rows alone in the step: too few (group, kv head) units for the
    threads, so the kernel cuts the group smaller and deals the pieces out in turn; each row's
    bits must still be that row's alone (below, at and across the 512-token split)."""
    block_size, head_dim = 16, 64
    lens = list(range(first_len, first_len + rows))
    g = torch.Generator().manual_seed(rows * 1000 + first_len)
    max_blocks = -(-lens[-1] // block_size) + 1
    shape = (max_blocks + 3, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=g).to(dtype)
    v_cache = torch.randn(shape, generator=g).to(dtype)
    table = torch.randperm(shape[0], generator=g)[:max_blocks].int()
    tables = table.expand(rows, max_blocks).contiguous()
    q = torch.randn(rows, heads, head_dim, generator=g).to(dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32)
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        together = cpu_attention.paged_decode_attention(
            q, k_cache, v_cache, tables, seq_lens, 0.125
        )
        for i in range(rows):
            alone = cpu_attention.paged_decode_attention(
                q[i : i + 1], k_cache, v_cache, tables[i : i + 1], seq_lens[i : i + 1], 0.125
            )
            assert torch.equal(alone[0], together[i]), lens[i]
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [2, 16])  # by (sequence, kv head) parts; by whole sequences
def test_a_nan_query_gives_nan_where_torch_does(dtype, batch):
    """A NaN in one query head makes that head's output NaN, as the torch path's softmax does,
    and leaves every other row finite (the vectorised exp once clamped a NaN to a number)."""
    g = torch.Generator().manual_seed(batch)
    heads, kv_heads, head_dim, block_size = 9, 3, 64, 16
    seq_lens = [40 + 8 * i for i in range(batch)]  # multiples of 8: no scalar tail in the softmax
    max_blocks = max(-(-n // block_size) for n in seq_lens)
    num_blocks = batch * max_blocks + 1
    k_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    tables = (torch.arange(batch * max_blocks) + 1).view(batch, max_blocks).int()
    q = torch.randn(batch, heads, head_dim, generator=g).to(dtype)
    q[batch - 1, 4, 7] = float("nan")
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(batch, dtype=torch.long),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=tables,
        query_lens_cpu=[1] * batch,
        seq_lens_cpu=seq_lens,
    )
    out = paged_attention(q, k_cache, v_cache, meta, head_dim**-0.5)
    ref = torch_reference(q, k_cache, v_cache, meta, head_dim**-0.5)
    expected = torch.zeros(batch, heads, dtype=torch.bool)
    expected[batch - 1, 4] = True
    assert torch.equal(ref.isnan().any(-1), expected)
    assert torch.equal(out.isnan().any(-1), expected)
    assert torch.equal(out.isnan(), ref.isnan())
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol, equal_nan=True)
