"""common/model/row_passes.py: a long prefill's MLP in passes of rows, the same bits as one pass."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from common.kernels import cpu_qgemm, cpu_quant
from common.model import row_passes
from common.model.llama import MLP
from common.model.quant import QuantLinear, quantize_rtn

HIDDEN, INTER = 64, 96


def quantized_mlp() -> MLP:
    """An MLP whose two projections are int4 (groups of 32, with zeros), as the GGUF's are."""
    mlp = MLP(SimpleNamespace(hidden_size=HIDDEN, intermediate_size=INTER))
    g = torch.Generator().manual_seed(0)
    gate_up = quantize_rtn(torch.randn(2 * INTER, HIDDEN, generator=g), 4, 32)
    mlp.gate_up_proj = QuantLinear(gate_up, split=INTER)
    mlp.down_proj = QuantLinear(quantize_rtn(torch.randn(HIDDEN, INTER, generator=g), 4, 32))
    return mlp


def test_rows_per_pass_from_the_cache():
    assert row_passes.last_level_cache_bytes() > 0
    assert row_passes.rows_per_pass(1000, cache_bytes=32 << 20) == (32 << 20) // 4 // 1000
    assert row_passes.rows_per_pass(1 << 20, cache_bytes=32 << 20) == row_passes.MIN_ROWS


@pytest.mark.skipif(not cpu_qgemm.available(), reason="the int8-activation GEMM did not build")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_passes_give_the_bits_of_one_pass(dtype, monkeypatch):
    monkeypatch.setattr(cpu_quant, "activations", "int8")
    mlp = quantized_mlp()
    x = torch.randn(301, HIDDEN, generator=torch.Generator().manual_seed(1)).to(dtype)
    with torch.inference_mode():
        whole = mlp(x)  # 301 rows < 2 x MIN_ROWS: one pass
        assert row_passes.mlp_passes(mlp.gate_up_proj, mlp.down_proj, x) == [301]
        monkeypatch.setattr(row_passes, "MIN_ROWS", 16)
        # a cache that holds 100 rows' intermediates: 4 passes of 76 and 75 rows
        per_row = 3 * INTER * x.element_size() + 2 * HIDDEN * x.element_size() + HIDDEN + INTER
        monkeypatch.setattr(row_passes, "last_level_cache_bytes", lambda: 100 * per_row * 4)
        counts = row_passes.mlp_passes(mlp.gate_up_proj, mlp.down_proj, x)
        assert counts == [76, 75, 75, 75]
        seen: list[int] = []  # the rows of each call of the MLP's body: the forward takes passes
        body = mlp._forward
        monkeypatch.setattr(mlp, "_forward", lambda part: seen.append(len(part)) or body(part))
        passes = mlp(x)
    assert seen == counts
    assert torch.equal(passes, whole)
    # and each row is the row alone's: the passes cannot have mixed rows
    with torch.inference_mode():
        assert torch.equal(mlp(x[150:151]), whole[150:151])


def test_one_pass_where_rows_depend_on_the_call(monkeypatch):
    # float activations: the dequantized or float kernels, whose sums may follow the row count
    monkeypatch.setattr(cpu_quant, "activations", "float")
    monkeypatch.setattr(row_passes, "MIN_ROWS", 16)
    monkeypatch.setattr(row_passes, "last_level_cache_bytes", lambda: 1 << 16)
    mlp = quantized_mlp()
    x = torch.randn(301, HIDDEN)
    assert row_passes.mlp_passes(mlp.gate_up_proj, mlp.down_proj, x) == [301]
    # a dense MLP (no quantized weights) stays in one pass too
    dense = MLP(SimpleNamespace(hidden_size=HIDDEN, intermediate_size=INTER))
    assert row_passes.mlp_passes(dense.gate_up_proj, dense.down_proj, x) == [301]
