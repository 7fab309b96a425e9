"""The CPU prefill-attention kernel (common/kernels/cpu_prefill.py) against a float64 reference.

Tolerances: the kernel computes in float32 (scores as FMA chains over D products, exp within
about 1 ulp, sums over at most k_len terms) from inputs that float32 holds exactly (float32 or
bfloat16 ones); with O(1) values, as here, its error against float64 stays below ~1e-6 (measured
up to 1e-6 at 300 keys): float32 is held to 2e-5. A bfloat16 output is that value rounded once to
bfloat16 (a relative 2^-9 at most), so bfloat16 is held to rtol 2^-8 plus the float32 bound.
An AVX-512 BF16 build takes bfloat16 scores by dpbf16 (exact products, float32 sums in another
order): the same bound. The AMX path (bfloat16 on a CPU with AMX tiles) rounds the softmax
weights to bfloat16 before the V product, as torch's SDPA does: each weight off by at most 2^-9
of itself, so an output by at most 2^-9 max|v| more. Every ISA section the host builds
(portable, AVX2, AVX-512, AVX-512 BF16, AMX) is checked.
"""

from __future__ import annotations

import pytest
import torch

from common.kernels import attention, cpu_attention, cpu_prefill, isa

pytestmark = pytest.mark.skipif(not cpu_prefill.available(), reason="no C compiler")

# (q_len, k_len, H, Hkv, D): whole prompts and chunks after a prefix, lengths off the 32-key
# tiles and 64-key chunks, one query, grouped (3, 7, 8 heads a KV head), plain and head dim 128
CASES = [
    (256, 256, 9, 3, 64),
    (100, 100, 14, 2, 64),
    (17, 300, 4, 4, 128),
    (1, 5, 8, 1, 64),
    (1, 1, 2, 2, 64),
    (65, 65, 16, 2, 128),
    (40, 137, 6, 2, 64),
]


def reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float) -> torch.Tensor:
    """Causal attention in float64: query i at position k_len - q_len + i."""
    q_len, k_len = q.shape[0], k.shape[0]
    group = q.shape[1] // k.shape[1]
    kd, vd = (x.double().repeat_interleave(group, 1) for x in (k, v))
    s = torch.einsum("qhd,khd->hqk", q.double(), kd) * scale
    future = torch.arange(k_len)[None, :] > torch.arange(q_len)[:, None] + (k_len - q_len)
    return torch.einsum("hqk,khd->qhd", s.masked_fill(future, float("-inf")).softmax(-1), vd)


def inputs(q_len, k_len, heads, kv_heads, dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    draw = lambda n, h: torch.randn(n, h, dim, generator=g).to(dtype)  # noqa: E731
    return draw(q_len, heads), draw(k_len, kv_heads), draw(k_len, kv_heads)


def check(out: torch.Tensor, q, k, v, scale: float, lib=None) -> None:
    assert out.dtype == q.dtype and out.shape == q.shape
    bf16 = q.dtype == torch.bfloat16
    rtol = 2.0**-8 if bf16 else 0.0
    rounds = bf16 and cpu_prefill.rounds_weights(lib)
    atol = 2e-5 + (2.0**-9 * v.abs().max().item() if rounds else 0)
    torch.testing.assert_close(out.double(), reference(q, k, v, scale), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "q{}-k{}-h{}-kv{}-d{}".format(*c))
def test_matches_float64_reference(case, dtype):
    q_len, k_len, heads, kv_heads, dim = case
    q, k, v = inputs(*case, dtype)
    assert cpu_prefill.supports(q, k, v)
    check(cpu_prefill.prefill_attention(q, k, v, dim**-0.5), q, k, v, dim**-0.5)


def test_chunks_and_threads_give_the_whole_prompts_bits():
    q, k, v = inputs(200, 200, 9, 3, 64, torch.bfloat16)
    whole = cpu_prefill.prefill_attention(q, k, v, 0.125)
    for a, b in [(0, 70), (70, 150), (150, 199), (199, 200)]:
        part = cpu_prefill.prefill_attention(q[a:b], k[:b], v[:b], 0.125)
        assert torch.equal(part, whole[a:b])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu_prefill.prefill_attention(q, k, v, 0.125), whole)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_strided_tokens_read_in_place(dtype):
    # q, k, v as views of one fused projection output [tokens, (H + 2 Hkv) D], as llama splits it
    fused = torch.randn(50, (9 + 2 * 3) * 64).to(dtype)
    q, k, v = fused.split([9 * 64, 3 * 64, 3 * 64], dim=1)
    q, k, v = q.view(50, 9, 64), k.view(50, 3, 64), v.view(50, 3, 64)
    assert q.stride(0) == fused.shape[1] and cpu_prefill.supports(q, k, v)
    out = cpu_prefill.prefill_attention(q, k, v, 0.125)
    dense = [x.contiguous() for x in (q, k, v)]
    assert torch.equal(out, cpu_prefill.prefill_attention(*dense, 0.125))
    check(out, q, k, v, 0.125)


def test_a_nan_query_spoils_only_its_own_rows():
    q, k, v = inputs(30, 30, 4, 2, 64, torch.float32)
    q[7, 1, 3] = float("nan")
    out = cpu_prefill.prefill_attention(q, k, v, 0.125)
    assert out[7, 1].isnan().all()
    assert not out[7, [0, 2, 3]].isnan().any() and not out[:7].isnan().any()
    assert not out[8:].isnan().any()


def test_what_it_does_not_take_goes_to_sdpa():
    q, k, v = inputs(10, 10, 4, 2, 96, torch.float32)  # head dim 96
    assert not cpu_prefill.supports(q, k, v)
    q, k, v = inputs(10, 10, 4, 2, 64, torch.float16)
    assert not cpu_prefill.supports(q, k, v)
    q, k, v = inputs(12, 10, 4, 2, 64, torch.float32)  # more queries than keys
    assert not cpu_prefill.supports(q, k, v)
    q, k, v = inputs(10, 10, 4, 2, 64, torch.float32)
    assert not cpu_prefill.supports(q, k.bfloat16(), v.bfloat16())
    with pytest.raises(ValueError, match="not supported"):
        cpu_prefill.prefill_attention(q[:, :3], k, v, 0.125)  # 3 heads over 2 KV heads
    with pytest.raises(ValueError, match="contiguous"):  # an output it cannot write in place
        cpu_prefill.prefill_attention(q, k, v, 0.125, out=torch.empty(10, 4, 128)[:, :, :64])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_prefill_path_uses_it_and_sdpa_agrees(dtype, monkeypatch):
    q, k, v = inputs(120, 150, 9, 3, 64, dtype)
    rows = torch.full((130, 9, 64), 7.0, dtype=dtype)  # a batch's rows: 5 before, 5 after
    attention._prefill_attention(q, k, v, 0.125, rows[5:125])
    ours = rows[5:125]
    assert torch.equal(ours, cpu_prefill.prefill_attention(q, k, v, 0.125))
    assert (rows[:5] == 7).all() and (rows[125:] == 7).all()  # written in place, nothing else
    monkeypatch.setattr(cpu_attention, "enabled", False)  # the torch (SDPA) path
    sdpa = torch.empty_like(q)
    attention._prefill_attention(q, k, v, 0.125, sdpa)
    # SDPA's bfloat16 kernel rounds the probabilities to bfloat16 before multiplying by V: up to
    # 2^-9 max|v| off in each output, beside both outputs' own bfloat16 rounding (2^-8 together)
    bf16 = dtype == torch.bfloat16
    atol = 2.0**-9 * v.abs().max().item() if bf16 else 2e-5
    torch.testing.assert_close(ours.double(), sdpa.double(), rtol=2.0**-8 if bf16 else 0, atol=atol)
    exact = reference(q, k, v, 0.125)
    assert (ours.double() - exact).abs().max() <= (sdpa.double() - exact).abs().max()


@pytest.mark.parametrize("level", ["portable", "avx2", "avx512", "avx512bf16", "amx"])
def test_each_isa_section(level, monkeypatch):
    if not any(lv.name == level and isa.runs(lv) for lv in isa.LEVELS):
        pytest.skip(f"this host does not run {level}")
    monkeypatch.setenv(isa.ENV, level)
    lib = cpu_prefill.new_library()
    if not lib.available() or lib.level != level:
        pytest.skip(f"no {level} build here")
    for case in CASES[:4]:
        for dtype in (torch.float32, torch.bfloat16):
            q, k, v = inputs(*case, dtype)
            scale = case[4] ** -0.5
            check(cpu_prefill.prefill_attention(q, k, v, scale, lib), q, k, v, scale, lib)


def against_the_float32_build(lib, monkeypatch, rtol: float) -> None:
    """`lib`'s bfloat16 results against the AVX-512 build's float32 products on long and odd
    cases: the weights' rounding (2^-9 max|v|) and the outputs' own (rtol) apart; each within the
    reference's bound; chunks keep their bits. Not the same bits: the weights' rounding shows
    (so `lib` did not fall back to the float32 products)."""
    monkeypatch.setenv(isa.ENV, "avx512")
    vector = cpu_prefill.new_library()
    assert vector.available() and vector.level == "avx512" and not cpu_prefill.uses_amx(vector)
    differ = 0
    for case in [*CASES, (700, 700, 9, 3, 64), (33, 513, 8, 2, 128)]:
        q, k, v = inputs(*case, torch.bfloat16, seed=len(case) + case[0])
        scale = case[4] ** -0.5
        ours = cpu_prefill.prefill_attention(q, k, v, scale, lib)
        check(ours, q, k, v, scale, lib)
        theirs = cpu_prefill.prefill_attention(q, k, v, scale, vector)
        differ += int((ours != theirs).sum())
        atol = 2.0**-9 * v.abs().max().item()
        torch.testing.assert_close(ours.double(), theirs.double(), rtol=rtol, atol=atol)
        cut = case[0] // 3
        part = cpu_prefill.prefill_attention(q[cut:], k, v, scale, lib)
        assert torch.equal(part, ours[cut:])
    assert differ > 0


def test_the_amx_path_against_the_vector_path(monkeypatch):
    """bfloat16 through the tile unit: both outputs' own rounding 2^-8 relative apart."""
    amx = cpu_prefill.new_library()
    if not amx.available() or amx.level != "amx" or not cpu_prefill.uses_amx(amx):
        pytest.skip("no AMX build here (no AMX, or the kernel refused the tile state)")
    against_the_float32_build(amx, monkeypatch, rtol=2.0**-8)


def test_paired_products_against_the_float32_ones(monkeypatch):
    """bfloat16 through dpbf16 (an AVX-512 BF16 build: the scores' exact products summed in
    float32, the weights rounded to bfloat16 before the V product). Each output rounded to
    bfloat16: one unit (2^-7 of the value at the bottom of a binade) apart at most."""
    monkeypatch.setenv(isa.ENV, "avx512bf16")
    paired = cpu_prefill.new_library()
    if not paired.available() or paired.level != "avx512bf16":
        pytest.skip("no avx512bf16 build here")
    assert cpu_prefill.rounds_weights(paired) and not cpu_prefill.uses_amx(paired)
    against_the_float32_build(paired, monkeypatch, rtol=2.0**-7)
