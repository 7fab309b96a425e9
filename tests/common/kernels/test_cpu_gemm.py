"""common/kernels/cpu_gemm.py: float32 GEMMs over tiles of a weight's rows, and the 16-bit dense
linear layers of prefill batches that take them (common.model.layers.Linear)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from common.kernels import cpu_gemm
from common.model.layers import Linear


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tile_rows", [7, 1000])  # a short last tile; one tile
def test_dense_matmul_is_the_float32_product_rounded_once(monkeypatch, dtype, tile_rows) -> None:
    monkeypatch.setattr(cpu_gemm, "TILE_BYTES", tile_rows * 4 * 96)
    torch.manual_seed(tile_rows)
    w, b = torch.randn(50, 96).to(dtype), torch.randn(50).to(dtype)
    rows = cpu_gemm.MIN_ROWS_DENSE
    x = torch.randn(3, rows, 96).to(dtype)  # [batch, tokens, hidden] keeps its shape
    got = cpu_gemm.dense_matmul(x, w, b)
    ref = (x.float() @ w.float().t() + b.float()).to(dtype)
    assert got.shape == (3, rows, 50) and got.dtype == dtype
    # one rounding of a float32 sum: within half a 16-bit step of the exact product, at most
    # 2^-8 (bfloat16) or 2^-11 (float16) of it, plus the float32 sum's own error, far below
    exact = x.double() @ w.double().t() + b.double()
    half_step = 2.0**-8 if dtype == torch.bfloat16 else 2.0**-11
    err = (got.double() - exact).abs()
    assert (err <= half_step * exact.abs() + 1e-5 * exact.abs().max()).all()
    assert torch.allclose(got.float(), ref.float(), rtol=2 * half_step, atol=1e-5)


def test_only_16_bit_cpu_batches_from_min_rows_apply() -> None:
    w = torch.randn(8, 16, dtype=torch.bfloat16)
    big, small = cpu_gemm.MIN_ROWS_DENSE, cpu_gemm.MIN_ROWS_DENSE - 1
    assert cpu_gemm.applies_dense(torch.randn(big, 16, dtype=torch.bfloat16), w)
    assert cpu_gemm.applies_dense(torch.randn(2, big // 2, 16, dtype=torch.bfloat16), w)
    assert not cpu_gemm.applies_dense(torch.randn(small, 16, dtype=torch.bfloat16), w)
    assert not cpu_gemm.applies_dense(torch.randn(big, 16), w.float())  # float32: sgemm already
    assert not cpu_gemm.applies_dense(torch.randn(big, 16), w)  # mixed dtypes: F.linear's error
    trained = w.clone().requires_grad_()
    x = torch.randn(big, 16, dtype=torch.bfloat16)
    assert not cpu_gemm.applies_dense(x, trained)  # autograd needs F.linear
    with torch.no_grad():
        assert cpu_gemm.applies_dense(x, trained)


def test_the_tile_buffer_serves_in_and_out_of_inference_mode() -> None:
    w = torch.randn(8, 16, dtype=torch.bfloat16)
    x = torch.randn(cpu_gemm.MIN_ROWS_DENSE, 16, dtype=torch.bfloat16)
    cpu_gemm._tiles.__dict__.clear()
    with torch.inference_mode():
        first = cpu_gemm.dense_matmul(x, w)  # the buffer is made here
    assert torch.equal(cpu_gemm.dense_matmul(x, w), first)


def test_linear_takes_the_tiles_for_a_prefill_batch_only(monkeypatch) -> None:
    torch.manual_seed(0)
    layer = Linear(96, 40, bias=True).to(torch.bfloat16)
    x = torch.randn(cpu_gemm.MIN_ROWS_DENSE, 96).to(torch.bfloat16)
    calls: list[int] = []
    tiles = cpu_gemm.dense_matmul

    def spy(x, weight, bias=None):
        calls.append(x.shape[0])
        return tiles(x, weight, bias)

    monkeypatch.setattr(cpu_gemm, "dense_matmul", spy)
    with torch.inference_mode():
        assert torch.equal(layer(x), tiles(x, layer.weight, layer.bias))
        fewer = x[:-1]  # one row short of the threshold: torch's own 16-bit matmul
        assert torch.equal(layer(fewer), F.linear(fewer, layer.weight, layer.bias))
    assert calls == [cpu_gemm.MIN_ROWS_DENSE]  # the prefill batch went through the tiles, only it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows", [1, 64, 300])
def test_a_split_linear_packs_its_parts_and_fuses_silu_mul(dtype, rows) -> None:
    """A dense gate/up Linear with `split` set packs its two parts apart: its plain output is
    both parts, and silu_mul is SiLU(gate) * up with oneDNN's post-ops doing the SiLU and the
    product (float32: its exp and summation order, 1e-4 of the scale; bfloat16: x, the gate
    and the output each rounded to bfloat16, 2%)."""
    torch.manual_seed(rows)
    inter, k = 40, 96
    layer = Linear(k, 2 * inter, bias=False).to(dtype)
    layer.split = inter
    layer.pack_for_cpu()
    if layer.packed is None:
        pytest.skip("no oneDNN packed form for this dtype on this CPU")
    assert isinstance(layer.packed, tuple)
    x = torch.randn(rows, k).to(dtype)
    plain = x.float() @ layer.weight.float().T
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    both = layer(x)
    assert both.shape == (rows, 2 * inter)
    assert (both.float() - plain).abs().max() <= tol * plain.abs().max()
    gate, up = plain.split(inter, dim=1)
    ref = F.silu(gate) * up
    got = layer.silu_mul(x)
    assert got.dtype == dtype and got.shape == (rows, inter)
    assert (got.float() - ref).abs().max() <= tol * ref.abs().max()
    whole = Linear(k, 2 * inter, bias=True).to(dtype)  # a bias: packed whole, no fused path
    whole.split = inter
    whole.pack_for_cpu()
    assert not isinstance(whole.packed, tuple) and whole.silu_mul(x) is None
