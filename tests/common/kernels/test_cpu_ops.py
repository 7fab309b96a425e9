"""The fused C ops (common/kernels/cpu_ops.py) against the eager torch code they replace.

Tolerances: the residual add and rotary round exactly where torch rounds (bit-exact); RMSNorm
sums its squares in another order (float32: a few ulp; bfloat16: a rounding flip of one bf16 ulp
in rare elements); SiLU's exp differs from torch's in the last float32 bit.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from common.kernels import cpu_ops
from common.kernels.attention import write_kv_cache
from common.model.layers import _rotate

pytestmark = pytest.mark.skipif(not cpu_ops.available(), reason="no C compiler")

DTYPES = [torch.float32, torch.bfloat16]


def eager_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """llama.RMSNorm's eager formula."""
    if x.dtype == torch.float32:
        return F.rms_norm(x, weight.shape, weight, eps)
    return weight * F.rms_norm(x.float(), weight.shape, eps=eps).to(x.dtype)


def assert_close_ulp(actual: torch.Tensor, expected: torch.Tensor) -> None:
    if actual.dtype == torch.float32:
        torch.testing.assert_close(actual, expected, rtol=4e-6, atol=1e-6)
    else:  # one bf16 rounding flip at most: 2**-7 relative
        torch.testing.assert_close(actual.float(), expected.float(), rtol=8e-3, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", [(1, 576), (3, 7), (8, 1000), (5, 64)])
def test_rms_norm_matches_eager(dtype, rows, dim):
    g = torch.Generator().manual_seed(rows * dim)
    x = (torch.randn(rows, dim, generator=g) * 3).to(dtype)
    weight = torch.randn(dim, generator=g).to(dtype)
    assert_close_ulp(cpu_ops.add_rms_norm(x, weight, 1e-5), eager_rms_norm(x, weight, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,dim", [(1, 576), (3, 7), (9, 129)])
def test_add_rms_norm_updates_residual_in_place(dtype, rows, dim):
    g = torch.Generator().manual_seed(rows + dim)
    x = torch.randn(rows, dim, generator=g).to(dtype)
    residual = torch.randn(rows, dim, generator=g).to(dtype)
    weight = torch.randn(dim, generator=g).to(dtype)
    expected_sum = x + residual
    out = cpu_ops.add_rms_norm(x, weight, 1e-6, residual)
    assert torch.equal(residual, expected_sum)  # bit-exact: one rounding, as torch's add
    assert_close_ulp(out, eager_rms_norm(expected_sum, weight, 1e-6))


def test_rms_norm_reads_strided_rows():
    base = torch.randn(4, 100)
    x = base[:, 10:60]  # rows 100 apart, as a slice of a fused projection
    weight = torch.rand(50)
    assert_close_ulp(cpu_ops.add_rms_norm(x, weight, 1e-5), eager_rms_norm(x, weight, 1e-5))


def _qkv(tokens, heads, kv_heads, head_dim, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)


def _tables(max_pos, head_dim):
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    freqs = torch.arange(max_pos).float()[:, None] * inv_freq[None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos(), emb.sin()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads,kv_heads,head_dim", [(9, 3, 64), (4, 4, 6), (2, 1, 128)])
def test_rope_qk_bit_exact_against_eager(dtype, heads, kv_heads, head_dim):
    tokens = 5
    qkv = _qkv(tokens, heads, kv_heads, head_dim, dtype, seed=heads * head_dim)
    cos, sin = _tables(40, head_dim)
    positions = torch.tensor([0, 3, 17, 39, 8])
    qk_width = (heads + kv_heads) * head_dim
    qk = qkv[:, :qk_width].view(tokens, heads + kv_heads, head_dim)
    expected = _rotate(qk, cos[positions].to(dtype)[:, None], sin[positions].to(dtype)[:, None])
    v_before = qkv[:, qk_width:].clone()
    cpu_ops.rope_qk(qkv, positions, cos, sin, heads, kv_heads, head_dim)
    assert torch.equal(qk, expected)
    assert torch.equal(qkv[:, qk_width:], v_before)  # v untouched


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_qk_non_finite_tiny_and_huge_values_as_eager(dtype):
    """Infinities, subnormal and overflowing products round as the eager ops round them, bit
    for bit, and NaN stays NaN where eager's is (its bits differ: a bfloat16 NaN is 0x7fc0 here,
    the sign and payload are not kept); a 16-lane and a scalar head size."""
    for heads, kv_heads, head_dim in [(2, 1, 64), (2, 1, 6)]:
        qkv = _qkv(3, heads, kv_heads, head_dim, dtype, seed=7)
        special = [float("nan"), float("inf"), -float("inf"), 1e-39, -3e-41, 3.3e38, -3.3e38]
        for i, value in enumerate(special):
            qkv[i % 3, (5 * i) % (heads * head_dim)] = value
        cos, sin = _tables(16, head_dim)
        positions = torch.tensor([1, 5, 9])
        qk_width = (heads + kv_heads) * head_dim
        qk = qkv[:, :qk_width].view(3, heads + kv_heads, head_dim)
        expected = _rotate(qk, cos[positions].to(dtype)[:, None], sin[positions].to(dtype)[:, None])
        cpu_ops.rope_qk(qkv, positions, cos, sin, heads, kv_heads, head_dim)
        bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
        nan = qk.isnan()
        assert torch.equal(nan, expected.isnan()) and nan.any()
        assert torch.equal(qk[~nan].view(bits), expected[~nan].view(bits))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rope_qk_stores_k_and_v_like_write_kv_cache(dtype):
    heads, kv_heads, head_dim, block_size, tokens = 6, 2, 32, 4, 7
    qkv = _qkv(tokens, heads, kv_heads, head_dim, dtype, seed=1)
    cos, sin = _tables(64, head_dim)
    positions = torch.arange(10, 10 + tokens)
    slots = torch.tensor([5, 6, 7, 8, 20, 21, 2])
    shape = (8, block_size, kv_heads, head_dim)
    k_cache, v_cache = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    ref_k, ref_v = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
    reference = qkv.clone()
    cpu_ops.rope_qk(reference, positions, cos, sin, heads, kv_heads, head_dim)
    qk_width = (heads + kv_heads) * head_dim
    k = reference[:, heads * head_dim : qk_width].view(tokens, kv_heads, head_dim)
    v = reference[:, qk_width:].view(tokens, kv_heads, head_dim)
    write_kv_cache(k, v, ref_k, ref_v, slots)
    cpu_ops.rope_qk(qkv, positions, cos, sin, heads, kv_heads, head_dim, k_cache, v_cache, slots)
    assert torch.equal(qkv, reference)
    assert torch.equal(k_cache, ref_k)
    assert torch.equal(v_cache, ref_v)


def test_rope_qk_skips_padding_slots_and_rejects_out_of_range():
    heads, kv_heads, head_dim = 2, 1, 8
    qkv = _qkv(2, heads, kv_heads, head_dim, torch.float32, seed=2)
    cos, sin = _tables(16, head_dim)
    k_cache = torch.zeros(2, 4, kv_heads, head_dim)
    v_cache = torch.zeros(2, 4, kv_heads, head_dim)
    slots = torch.tensor([-1, 3])
    cpu_ops.rope_qk(qkv, torch.tensor([0, 1]), cos, sin, 2, 1, 8, k_cache, v_cache, slots)
    assert k_cache.view(-1, head_dim)[3].abs().sum() > 0
    assert k_cache.view(-1, head_dim)[[0, 1, 2, 4, 5, 6, 7]].abs().sum() == 0
    before = qkv.clone()
    with pytest.raises(IndexError):
        cpu_ops.rope_qk(qkv, torch.tensor([0, 16]), cos, sin, heads, kv_heads, head_dim)
    with pytest.raises(IndexError):  # slot 8 is past a cache of 2 blocks of 4
        cpu_ops.rope_qk(qkv, torch.tensor([0, 1]), cos, sin, 2, 1, 8, k_cache, v_cache, slots + 5)
    assert torch.equal(qkv, before)  # checked before anything is written


def exact_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, residual=None):
    """fused_ops.c's add_rms_norm, one float32 operation at a time in its order: the residual
    add (rounded to x's dtype), the sum of squares in eight lanes (element 8k + l into lane l in
    order of k, the rest after), 1 / sqrt(mean + eps), the scaled row rounded to the dtype
    before the weight multiply. Returns (out, new residual)."""
    f, bf16 = np.float32, x.dtype == torch.bfloat16
    row = x.float().numpy()
    if residual is not None:
        row = row + residual.float().numpy()
        if bf16:
            row = torch.from_numpy(row).bfloat16().float().numpy()
    dim = row.shape[1]
    lanes = np.zeros((row.shape[0], 8), dtype=np.float32)
    whole = dim // 8 * 8
    for k in range(0, whole, 8):
        lanes = lanes + row[:, k : k + 8] * row[:, k : k + 8]
    tail = np.zeros(row.shape[0], dtype=np.float32)
    for i in range(whole, dim):
        tail = tail + row[:, i] * row[:, i]
    total = (
        ((lanes[:, 0] + lanes[:, 4]) + (lanes[:, 1] + lanes[:, 5]))
        + ((lanes[:, 2] + lanes[:, 6]) + (lanes[:, 3] + lanes[:, 7]))
        + tail
    )
    inv = f(1.0) / np.sqrt(total / f(dim) + f(eps))
    normed = torch.from_numpy(row * inv[:, None])
    if bf16:
        normed = normed.bfloat16().float()
    out = (normed * weight.float()).to(x.dtype)
    return out, None if residual is None else torch.from_numpy(row).to(x.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", [1, 3, 4, 5, 9])
@pytest.mark.parametrize("dim", [64, 576, 1000])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_is_the_exact_steps(dtype, rows, dim, with_residual):
    """Rows one at a time or several side by side (the 16-lane code, dims of whole vectors), and
    the scalar code elsewhere: the bits of the same float32 steps, residual included."""
    g = torch.Generator().manual_seed(rows * dim)
    x = (torch.randn(rows, dim, generator=g) * 3).to(dtype)
    x.view(-1)[:5] = torch.tensor([0.0, -0.0, 1e-40, 1e-30, -2.5]).to(dtype)
    weight = torch.randn(dim, generator=g).to(dtype)
    residual = torch.randn(rows, dim, generator=g).to(dtype) if with_residual else None
    want, want_res = exact_rms_norm(x, weight, 1e-5, residual)
    got_res = None if residual is None else residual.clone()
    got = cpu_ops.add_rms_norm(x, weight, 1e-5, got_res)
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(got.view(bits), want.view(bits))
    if with_residual:
        assert torch.equal(got_res.view(bits), want_res.view(bits))


def exact_silu_mul(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """fused_ops.c's SiLU * up, one float32 operation at a time as the C code does them (numpy
    rounds each to float32, as the C code without FMA contraction does): exp_approx's Cephes
    steps, silu = g / (1 + exp(-g)) rounded to bfloat16 for bfloat16 rows, times up."""
    f = np.float32
    g = gate.float().numpy()
    with np.errstate(all="ignore"):
        x = -g
        x = np.where(x < f(-87.33654), f(-87.33654), np.where(x > f(88.72283), f(88.72283), x))
        n = np.floor(x * f(1.44269504088896341) + f(0.5))
        r = x - n * f(0.693359375)
        r = r - n * f(-2.12194440e-4)
        p = np.full_like(r, f(1.9875691500e-4))
        for c in (1.3981999507e-3, 8.3334519073e-3, 4.1665795894e-2, 1.6666665459e-1,
                  5.0000001201e-1):  # fmt: skip
            p = p * r + f(c)
        p = p * (r * r) + r + f(1.0)
        scale = ((n.astype(np.int32) + 127) << 23).view(np.float32)
        silu = g / (f(1.0) + p * scale)
    out = torch.from_numpy(silu)
    if gate.dtype == torch.bfloat16:
        out = out.bfloat16().float()  # torch's cast rounds to nearest even, as f32_to_bf16
    return (out * up.float()).to(gate.dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("intermediate", [1, 15, 16, 17, 63, 64, 65, 100, 1536])
def test_silu_mul_is_the_exact_steps_at_every_width(dtype, intermediate):
    """Every width (the 16-lane code's whole groups of 4 vectors, single vectors and a masked
    last one; the scalar code elsewhere) gives the bits of the same float32 steps, with
    infinities, NaN, subnormal and overflowing values among the inputs."""
    g = torch.Generator().manual_seed(intermediate)
    gate_up = (torch.randn(3, 2 * intermediate, generator=g) * 6).to(dtype)
    special = torch.tensor([0.0, -0.0, float("inf"), -float("inf"), float("nan"), 1e-40, -1e-40,
                            100.0, -100.0, 88.8, -88.8, 3e38, -3e38])  # fmt: skip
    flat = gate_up.view(-1)
    flat[: special.numel()] = special.to(dtype)[: flat.numel()]
    flat[-special.numel() :] = special.flip(0).to(dtype)[-flat.numel() :]
    gate, up = gate_up.split(intermediate, dim=-1)
    got, want = cpu_ops.silu_mul(gate_up, intermediate), exact_silu_mul(gate, up)
    assert torch.equal(got.isnan(), want.isnan())
    bits = torch.int16 if dtype == torch.bfloat16 else torch.int32
    assert torch.equal(got.view(bits)[~got.isnan()], want.view(bits)[~want.isnan()])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens,intermediate", [(1, 1536), (3, 13), (8, 100), (2, 9000)])
def test_silu_mul_matches_eager(dtype, tokens, intermediate):
    g = torch.Generator().manual_seed(tokens * intermediate)
    gate_up = (torch.randn(tokens, 2 * intermediate, generator=g) * 4).to(dtype)
    gate, up = gate_up.split(intermediate, dim=-1)
    expected = F.silu(gate) * up
    assert_close_ulp(cpu_ops.silu_mul(gate_up, intermediate), expected)


def test_supports_only_cpu_float32_and_bfloat16():
    assert cpu_ops.supports(torch.zeros(2, dtype=torch.float32))
    assert cpu_ops.supports(torch.zeros(2, dtype=torch.bfloat16))
    assert not cpu_ops.supports(torch.zeros(2, dtype=torch.float16))
    cpu_ops.enabled = False
    try:
        assert not cpu_ops.supports(torch.zeros(2))
    finally:
        cpu_ops.enabled = True


def _forward_logits(runner, rows) -> tuple[torch.Tensor, torch.Tensor]:
    ids, pos, meta = runner.prepare_rows(rows)
    with torch.inference_mode():
        logits = runner.model.compute_logits(runner.model(ids, pos, meta))
    return logits, runner.kv_cache.clone()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_model_forward_fused_matches_eager(tiny_model, dtype):
    """The whole model (prefill, then a batched decode step) with the fused ops vs without."""
    from common.config import EngineConfig
    from common.model.model_runner import ModelRunner

    family, hf_model, _ = tiny_model
    config = EngineConfig(model="tiny", dtype=dtype, kv_cache_memory="2MiB", block_size=8)
    runner = ModelRunner(config, hf_model.config, hf_model.state_dict().items())
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(2, 250, (n,), generator=g).tolist() for n in (11, 3, 17)]
    tables = [[0, 1], [2], [3, 4, 5]]
    prefill = [(p, 0, t) for p, t in zip(prompts, tables)]
    decode = [([7], len(p), t) for p, t in zip(prompts, tables)]
    results = {}
    for fused in (False, True):
        cpu_ops.enabled = fused
        runner.kv_cache.zero_()  # each mode starts from the same (empty) cache
        try:
            results[fused] = [_forward_logits(runner, prefill), _forward_logits(runner, decode)]
        finally:
            cpu_ops.enabled = True
    # float32: ulp-level differences (RMSNorm's sum order, SiLU's exp); bfloat16: a few
    # bf16 rounding flips, amplified through two layers, on logits of magnitude ~10
    tol = dict(rtol=1e-4, atol=1e-4) if dtype == "float32" else dict(rtol=0.05, atol=0.1)
    for (eager_logits, eager_kv), (fused_logits, fused_kv) in zip(results[False], results[True]):
        torch.testing.assert_close(fused_logits.float(), eager_logits.float(), **tol)
        torch.testing.assert_close(fused_kv.float(), eager_kv.float(), **tol)
        if dtype == "float32":
            assert torch.equal(fused_logits.argmax(-1), eager_logits.argmax(-1)), family


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_sized_ops_give_the_same_bits_on_any_thread_count(dtype):
    # from fused_ops.c's PARALLEL_MIN values on, an op's rows go across the threads: each row is
    # computed as alone, so the result is the one thread's, bit for bit
    g = torch.Generator().manual_seed(3)
    rows, dim, heads, kv_heads, head_dim = 96, 576, 9, 3, 64
    x = torch.randn(rows, dim, generator=g).to(dtype)
    residual = torch.randn(rows, dim, generator=g).to(dtype)
    weight = torch.randn(dim, generator=g).to(dtype)
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * head_dim, generator=g).to(dtype)
    positions = torch.randint(0, 500, (rows,), generator=g)
    angles = torch.randn(512, head_dim, generator=g)
    gate_up = torch.randn(rows, 2 * 1536, generator=g).to(dtype)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2):
            torch.set_num_threads(n)
            res = residual.clone()
            rotated = qkv.clone()
            cpu_ops.rope_qk(rotated, positions, angles.cos(), angles.sin(), heads, kv_heads,
                            head_dim)  # fmt: skip
            results.append((cpu_ops.add_rms_norm(x, weight, 1e-5, res), res, rotated,
                            cpu_ops.silu_mul(gate_up, 1536)))  # fmt: skip
    finally:
        torch.set_num_threads(threads)
    for one, two in zip(*results):
        assert torch.equal(one, two)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,n", [(1, 49152), (40, 3000), (3, 17), (2, 5), (4, 16)])
def test_argmax_matches_torch_max(dtype, rows, n):
    g = torch.Generator().manual_seed(rows * n)
    for trial in range(6):
        x = torch.randn(rows, n, generator=g).to(dtype)
        if trial % 2:
            x = (x * 2).round()  # many ties: the first index wins
        assert cpu_ops.argmax(x) == x.max(dim=-1).indices.tolist()
        x[0, (7 * trial) % n] = float("nan")  # NaN ranks highest: its first index
        x[0, n - 1] = float("nan")
        x[-1] = float("-inf")  # every value -inf: index 0
        if rows > 2:
            x[1] = 0.0
            x[1, n // 2] = -0.0  # -0 equals 0: the first of them
        assert cpu_ops.argmax(x) == x.max(dim=-1).indices.tolist()


def test_argmax_reads_strided_rows_and_refuses_bad_layouts():
    wide = torch.randn(6, 300)
    view = wide[:, :200]
    assert cpu_ops.argmax(view) == view.max(dim=-1).indices.tolist()
    with pytest.raises(ValueError, match="contiguous"):
        cpu_ops.argmax(wide.t())
    with pytest.raises(ValueError, match="contiguous"):
        cpu_ops.argmax(torch.randn(5))


def test_greedy_sampling_picks_through_it(monkeypatch):
    from common.engine import sampler

    logits = torch.randn(8, 1000).bfloat16()
    calls = []
    monkeypatch.setattr(cpu_ops, "argmax", lambda x: calls.append(x.shape) or [0] * len(x))
    assert sampler._argmax(logits) == [0] * 8 and calls == [(8, 1000)]
    monkeypatch.undo()
    assert sampler._argmax(logits) == logits.max(dim=-1).indices.tolist()
