"""Triton W4A16 / W8A16 dequantize-GEMM against the dequantized torch reference.

Tests `common/kernels/triton_quant.py`. Without a GPU the kernel runs in the Triton interpreter,
which must be switched on before triton is first imported; shapes stay small so that is fast.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from common.kernels.triton_quant import (  # noqa: E402
    QuantMatmulConfig,
    choose_config,
    quant_matmul,
)
from common.model.quant import QuantizedTensor  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_quantized(n: int, k: int, bits: int, group_size: int, with_zero: bool,
                     seed: int = 0) -> QuantizedTensor:
    gen = torch.Generator().manual_seed(seed)
    groups = k // group_size
    if bits == 4:
        qweight = torch.randint(0, 256, (n, k // 2), generator=gen, dtype=torch.uint8)
    else:
        qweight = torch.randint(-128, 128, (n, k), generator=gen, dtype=torch.int8)
    scale = torch.rand(n, groups, generator=gen) * 0.02 + 0.001
    zero = torch.randn(n, groups, generator=gen) * 0.05 if with_zero else None
    return QuantizedTensor(bits=bits, group_size=group_size, qweight=qweight, scale=scale,
                           zero=zero, shape=(n, k))


def run(qt: QuantizedTensor, x: torch.Tensor, config: QuantMatmulConfig | None = None):
    zero = qt.zero.to(DEVICE) if qt.zero is not None else None
    return quant_matmul(x.to(DEVICE), qt.qweight.to(DEVICE), qt.scale.to(DEVICE), zero,
                        qt.bits, qt.group_size, config=config).cpu()


# (M, N, K, group_size): decode batch sizes, a ragged N tail, channel-wise (group = K) and a
# K long enough that the heuristic splits it.
SHAPES = [(1, 64, 128, 32), (3, 80, 256, 64), (17, 48, 128, 128), (5, 32, 512, 128)]


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("with_zero", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_dequantized_reference_fp32(bits, with_zero, shape):
    m, n, k, group_size = shape
    qt = random_quantized(n, k, bits, group_size, with_zero)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(1))
    ref = x.double() @ qt.dequantize(torch.float64).T
    out = run(qt, x)
    assert out.shape == (m, n) and out.dtype == torch.float32
    # fp32 products of exactly representable dequantized weights: only summation order differs.
    torch.testing.assert_close(out.double(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bits", [4, 8])
def test_bf16_input_rounds_like_bf16_matmul(bits):
    m, n, k, group_size = 4, 64, 256, 64
    qt = random_quantized(n, k, bits, group_size, with_zero=True, seed=2)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    out = run(qt, x)
    assert out.dtype == torch.bfloat16
    w = qt.dequantize(torch.float64)
    ref = x.double() @ w.T
    # Each weight may be rounded to bf16 before the product (2^-9 relative; the compiled kernel
    # does, the interpreter keeps fp32) and the fp32 sum is rounded to bf16 (2^-9 of |out|): the
    # error is at most 2^-8 * sum_k |x_k w_k| per output, plus fp32 accumulation noise.
    bound = 2 ** -8 * (x.double().abs() @ w.abs().T) + 1e-4
    assert ((out.double() - ref).abs() <= bound).all()


@pytest.mark.parametrize("split_k", [1, 2, 4])
def test_split_k_gives_the_same_product(split_k):
    m, n, k = 2, 32, 512
    qt = random_quantized(n, k, 4, 64, with_zero=True, seed=4)
    x = torch.randn(m, k, generator=torch.Generator().manual_seed(5))
    cfg = QuantMatmulConfig(block_m=16, block_n=32, block_k=64, split_k=split_k)
    ref = x.double() @ qt.dequantize(torch.float64).T
    torch.testing.assert_close(run(qt, x, cfg).double(), ref, rtol=1e-4, atol=1e-4)


def test_leading_dims_and_empty_batch():
    qt = random_quantized(32, 64, 8, 32, with_zero=False)
    x = torch.randn(2, 3, 64)
    out = run(qt, x)
    assert out.shape == (2, 3, 32)
    torch.testing.assert_close(out, x @ qt.dequantize().T, rtol=1e-4, atol=1e-4)
    assert run(qt, torch.randn(0, 64)).shape == (0, 32)


def test_choose_config_splits_k_only_for_small_grids():
    # Batch 1 on an H200 (132 SMs): 32 N tiles of 64 fill a quarter of the GPU, so K is split.
    small = choose_config(1, 2048, 8192, 4, 128, num_sms=132)
    assert small.split_k > 1 and small.block_k == 128
    assert choose_config(1, 32768, 2048, 4, 128, num_sms=132).split_k == 1
    # At M=64 the fp32 partials would rival the weight bytes: no split.
    assert choose_config(64, 2048, 2048, 4, 128, num_sms=132).split_k == 1
    assert choose_config(1, 64, 128, 4, 32).block_k == 32


def test_rejects_bad_shapes():
    qt = random_quantized(32, 64, 4, 32, with_zero=False)
    x = torch.randn(1, 64)
    with pytest.raises(ValueError, match="bits"):
        quant_matmul(x, qt.qweight, qt.scale, None, 3, 32)
    with pytest.raises(ValueError, match="qweight"):
        quant_matmul(torch.randn(1, 128), qt.qweight, qt.scale, None, 4, 32)
    with pytest.raises(ValueError, match="group_size 24"):
        quant_matmul(torch.randn(1, 48), torch.zeros(32, 24, dtype=torch.uint8),
                     torch.ones(32, 2), None, 4, 24)


def test_bf16_scales_and_zeros():
    # Layers may keep scale/zero in the model dtype (QuantizedTensor after .to(bfloat16)).
    qt = random_quantized(48, 128, 4, 32, with_zero=True, seed=6)
    qt.scale, qt.zero = qt.scale.to(torch.bfloat16), qt.zero.to(torch.bfloat16)
    x = torch.randn(3, 128, generator=torch.Generator().manual_seed(7))
    ref = x.double() @ qt.dequantize(torch.float64).T
    torch.testing.assert_close(run(qt, x).double(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("bits", [4, 8])
def test_weights_from_a_compressed_tensors_checkpoint(bits):
    """The loader's QuantizedTensor (asymmetric, zero = -zp * s) feeds the kernel unchanged."""
    from common.model.compressed_tensors import WeightScheme, pack_int32, to_quantized_tensor

    gen = torch.Generator().manual_seed(bits)
    n, k, group_size = 40, 128, 64
    q = torch.randint(-(1 << (bits - 1)), 1 << (bits - 1), (n, k), generator=gen).to(torch.int8)
    zp = torch.randint(-4, 4, (n, k // group_size), generator=gen).to(torch.int8)
    scale = torch.rand(n, k // group_size, generator=gen) * 0.05
    parts = {"weight_packed": pack_int32(q, bits), "weight_scale": scale,
             "weight_zero_point": pack_int32(zp, bits, dim=0),
             "weight_shape": torch.tensor([n, k], dtype=torch.int32)}
    scheme = WeightScheme(bits, "group", group_size, False, "pack-quantized", ("Linear",))
    qt = to_quantized_tensor(parts, scheme, "layer")
    x = torch.randn(2, k, generator=gen)
    w = ((q.double().view(n, -1, group_size) - zp.double()[:, :, None])
         * scale.double()[:, :, None]).view(n, k)
    torch.testing.assert_close(run(qt, x).double(), x.double() @ w.T, rtol=1e-4, atol=1e-4)
