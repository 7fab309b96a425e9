"""common/kernels/cpu_dense.py (csrc/dense_amx.c): the bfloat16 matmul on AMX tiles against a
float64 reference, its layout, rows independent of each other, and what it refuses. Skipped
where the host (or a forced ISA level below amx) has no AMX-BF16."""

from __future__ import annotations

import pytest
import torch

from common.kernels import cpu_dense

needs_amx = pytest.mark.skipif(not cpu_dense.available(), reason="no AMX-BF16 here")


def test_pack_puts_each_pair_of_k_where_the_tile_reads_it() -> None:
    n, k = 32, 64
    weight = torch.arange(n * k, dtype=torch.float32).reshape(n, k).to(torch.bfloat16)
    packed = cpu_dense.pack(weight)
    assert packed.shape == (2, 2, 16, 16, 2)
    # panel p, tile t, pair row r, column c, element e: W[16p + c, 32t + 2r + e]
    for p, t, r, c, e in [(0, 0, 0, 0, 0), (1, 1, 15, 15, 1), (0, 1, 3, 7, 1), (1, 0, 9, 2, 0)]:
        assert packed[p, t, r, c, e] == weight[16 * p + c, 32 * t + 2 * r + e]
    with pytest.raises(ValueError, match="needs"):
        cpu_dense.pack(torch.zeros(20, 64))  # not whole panels
    with pytest.raises(ValueError, match="needs"):
        cpu_dense.pack(torch.zeros(32, 48))  # not whole tiles
    assert cpu_dense.supports(960, 576) and not cpu_dense.supports(8, 32)


@needs_amx
@pytest.mark.parametrize("m", [1, 3, 16, 33, 64, 130])
@pytest.mark.parametrize("n,k", [(48, 64), (96, 256), (960, 576)])  # 48: an odd panel count
def test_matmul_matches_float64(m, n, k) -> None:
    g = torch.Generator().manual_seed(m * n + k)
    x = torch.randn(m, k, generator=g).to(torch.bfloat16)
    weight = torch.randn(n, k, generator=g).to(torch.bfloat16)
    out = cpu_dense.matmul(x, cpu_dense.pack(weight))
    assert out.dtype == torch.bfloat16 and out.shape == (m, n)
    ref = x.double() @ weight.double().T
    # one rounding to bfloat16 (2^-9 relative) after float32 sums over k products (exact
    # products, k roundings of 2^-24): half a bfloat16 ulp of each output plus a sliver
    err = (out.double() - ref).abs()
    assert (err <= ref.abs() * 2**-8 + 1e-4 * ref.abs().max()).all(), err.max()


@needs_amx
def test_a_row_gives_the_same_bits_alone_and_in_a_batch() -> None:
    g = torch.Generator().manual_seed(5)
    x = torch.randn(70, 576, generator=g).to(torch.bfloat16)
    packed = cpu_dense.pack(torch.randn(960, 576, generator=g))
    batch = cpu_dense.matmul(x, packed)
    for row in (0, 31, 32, 69):  # in a whole 32-row block, at its edges, in the padded tail
        assert torch.equal(cpu_dense.matmul(x[row : row + 1], packed)[0], batch[row])
    strided = torch.randn(70, 700, generator=g).to(torch.bfloat16)[:, :576]  # rows 700 apart
    dense = strided.contiguous()
    assert torch.equal(cpu_dense.matmul(strided, packed), cpu_dense.matmul(dense, packed))


@needs_amx
def test_the_bits_do_not_depend_on_the_threads() -> None:
    """Panel pairs are shared out among the threads: whichever thread takes a pair, its outputs
    are the same bits as on one thread."""
    g = torch.Generator().manual_seed(6)
    x = torch.randn(70, 576, generator=g).to(torch.bfloat16)
    packed = cpu_dense.pack(torch.randn(1728, 576, generator=g))  # 108 panels: 54 pairs
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        alone = cpu_dense.matmul(x, packed)
        torch.set_num_threads(2)
        for _ in range(5):
            assert torch.equal(cpu_dense.matmul(x, packed), alone)
    finally:
        torch.set_num_threads(threads)


@needs_amx
def test_wrong_inputs_are_refused() -> None:
    packed = cpu_dense.pack(torch.zeros(32, 64))
    with pytest.raises(ValueError, match="bfloat16"):
        cpu_dense.matmul(torch.zeros(2, 64), packed)  # float32
    with pytest.raises(ValueError, match="bfloat16"):
        cpu_dense.matmul(torch.zeros(2, 32, dtype=torch.bfloat16), packed)  # K differs


def _rows(m: int, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    return torch.zeros(m, 256, dtype=dtype)


def _check_row_limits(path: str, weight) -> None:
    """cpu_quant's `path` takes `weight` for bfloat16 rows from MIN_ROWS + 1 to MAX_ROWS on an
    AMX-BF16 host, never elsewhere, never for float32 rows."""
    from common.kernels import cpu_quant

    limits = (1, cpu_dense.MIN_ROWS, cpu_dense.MIN_ROWS + 1, cpu_dense.MAX_ROWS)
    tried = (*limits, cpu_dense.MAX_ROWS + 1)
    served = [m for m in tried if cpu_quant.applies(path, weight, _rows(m))]
    assert served == (list(limits[2:]) if cpu_dense.available() else [])
    assert not cpu_quant.applies(path, weight, _rows(64, torch.float32))


def test_the_quant_path_serves_between_its_row_limits(monkeypatch) -> None:
    """cpu_quant's amxbf16: bfloat16 rows from MIN_ROWS + 1 to MAX_ROWS, within the dense
    copies' budget, on an AMX-BF16 host."""
    from common.kernels import cpu_quant
    from common.model.quant import QuantLinear, quantize_rtn

    monkeypatch.setattr(cpu_quant, "dense_weights", True)
    weight = QuantLinear(quantize_rtn(torch.randn(96, 256), 4, 32)).kernel_weight()
    _check_row_limits("amxbf16", weight)
    monkeypatch.setattr(cpu_quant, "dense_weights", False)
    assert not cpu_quant.applies("amxbf16", weight, _rows(64))


def _int4_weight(n: int, k: int, group: int, zero: bool, seed: int):
    from common.kernels.quant_weight import QuantWeight

    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8, generator=g)
    scale = (torch.rand(n, k // group, generator=g) * 0.02).to(torch.float16)
    zeros = (torch.randn(n, k // group, generator=g) * 0.01).to(torch.float16) if zero else None
    return QuantWeight(4, group, codes, scale, zeros, n, k)


def test_pack_int4_puts_each_pair_of_codes_where_its_tile_row_is() -> None:
    w = _int4_weight(32, 128, 64, True, 0)
    codes, scale, zero = cpu_dense.pack_int4(w)
    assert codes.shape == (2, 4, 16, 16) and codes.dtype == torch.uint8
    # panel p, tile t, pair row r, column c: the byte of W[16p + c] holding K 32t + 2r, + 1
    for p, t, r, c in [(0, 0, 0, 0), (1, 3, 15, 15), (0, 2, 7, 9), (1, 1, 4, 3)]:
        assert codes[p, t, r, c] == w.qweight[16 * p + c, 16 * t + r]
    assert scale.shape == zero.shape == (2, 2, 16) and scale.dtype == torch.float32
    assert scale[1, 1, 5] == w.scale[21, 1].float() and zero[0, 1, 2] == w.zero[2, 1].float()
    assert cpu_dense.supports_int4(w)
    assert not cpu_dense.supports_int4(_int4_weight(32, 128, 16, False, 0))  # group < a tile
    with pytest.raises(ValueError, match="does not take"):
        cpu_dense.pack_int4(_int4_weight(20, 128, 32, False, 0))  # not whole panels


@needs_amx
@pytest.mark.parametrize("zero", [False, True])
@pytest.mark.parametrize("group", [32, 64, 128])
@pytest.mark.parametrize("n,k", [(48, 128), (960, 576)])  # 48: an odd panel count
def test_int4_gives_the_dense_copys_bits(zero, group, n, k) -> None:
    """Each panel made from the codes as it is used is the dense copy's panel, bit for bit:
    (q - 8) * s + z rounded as QuantWeight.dequantize rounds it, then to bfloat16."""
    if k % group:
        pytest.skip("K not a whole number of groups")
    w = _int4_weight(n, k, group, zero, n + k + group)
    dense, packed = cpu_dense.pack(w.dequantize(torch.bfloat16)), cpu_dense.pack_int4(w)
    g = torch.Generator().manual_seed(group)
    for m in (1, 3, 17, 32, 64, 65, 130):
        x = torch.randn(m, k, generator=g).to(torch.bfloat16)
        out = cpu_dense.matmul_int4(x, packed, group)
        assert torch.equal(out, cpu_dense.matmul(x, dense)), m
    with pytest.raises(ValueError, match="bfloat16"):
        cpu_dense.matmul_int4(torch.zeros(2, k), packed, group)  # float32


def test_the_int4_quant_path_serves_between_its_row_limits() -> None:
    """cpu_quant's amx4: bfloat16 rows from MIN_ROWS + 1 to MAX_ROWS on an AMX-BF16 host, with
    no dense-copy budget needed; a group below 32 columns is not taken."""
    from common.kernels import cpu_quant
    from common.model.quant import QuantLinear, quantize_rtn

    weight = QuantLinear(quantize_rtn(torch.randn(96, 256), 4, 32)).kernel_weight()
    _check_row_limits("amx4", weight)  # it keeps no dense copy: no budget to ask
    small = QuantLinear(quantize_rtn(torch.randn(96, 256), 4, 16)).kernel_weight()
    assert not cpu_quant.applies("amx4", small, _rows(64))
    if cpu_dense.available():
        x = torch.randn(40, 256).to(torch.bfloat16)
        reference = cpu_quant.run_path("amxbf16", x, weight)
        assert torch.equal(cpu_quant.run_path("amx4", x, weight), reference)
