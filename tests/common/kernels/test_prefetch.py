"""common/kernels/prefetch.py: the a8 kernel's weight prefetch level, set in both libraries that
hold the kernel, never changing a result, and chosen by the sweeps' times."""

from __future__ import annotations

import logging

import pytest
import torch

from common.kernels import cpu_layer, cpu_qgemm, prefetch, tune
from common.model.quant import quantize_rtn

if not cpu_qgemm.available():
    pytest.skip("the int8-activation GEMM could not be built", allow_module_level=True)


@pytest.fixture(autouse=True)
def default_level():
    yield
    prefetch.set_level(prefetch.L1)


def packed(n: int, k: int, bits: int = 4, seed: int = 0) -> cpu_qgemm.PackedWeight:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed))
    return cpu_qgemm.pack(quantize_rtn(w, bits, 32).kernel_weight())


def test_the_level_is_set_in_both_libraries_and_bad_levels_are_refused():
    libs = [cpu_qgemm._LIB.get()]
    if cpu_layer.enabled and cpu_layer.available():
        libs.append(cpu_layer._LIB.get())
    for level in (prefetch.L2, prefetch.L1):
        prefetch.set_level(level)
        assert [lib.qgemm_prefetch() for lib in libs] == [level] * len(libs)
    for bad in (0, 3, -1):
        assert cpu_qgemm._LIB.get().qgemm_set_prefetch(bad) == 1
    assert cpu_qgemm._LIB.get().qgemm_prefetch() == prefetch.L1


@pytest.mark.parametrize("m", [1, 3, 7, 16])
def test_both_levels_give_the_same_bits(m):
    w = packed(16 * 9, 256)  # 9 panels: pairs that prefetch their next, and a last lone panel
    x = torch.randn(m, 256, generator=torch.Generator().manual_seed(m)).bfloat16()
    prefetch.set_level(prefetch.L1)
    one = cpu_qgemm.matmul_a8(x, w)
    prefetch.set_level(prefetch.L2)
    two = cpu_qgemm.matmul_a8(x, w)
    assert torch.equal(one, two)


def big_weights() -> list[cpu_qgemm.PackedWeight]:
    ws = [packed(4096, 576, seed=1)]  # 1.5 MB of codes and scales: copies past MIN_BYTES
    return ws * (prefetch.MIN_BYTES // prefetch.packed_bytes(ws) + 1)


@pytest.mark.parametrize("l2_share, chosen", [(0.8, prefetch.L2), (0.99, prefetch.L1),
                                              (1.3, prefetch.L1)])  # fmt: skip
def test_l2_replaces_the_default_only_when_clearly_faster(l2_share, chosen):
    ws = big_weights()
    seen = []

    def timer(weights, xs):
        level = cpu_qgemm._LIB.get().qgemm_prefetch()
        seen.append(level)
        assert len(xs) == len(weights) and all(x.shape == (1, w.k) for x, w in zip(xs, weights))
        return 0.01 * (l2_share if level == prefetch.L2 else 1.0)

    level, medians = prefetch.choose(ws, torch.bfloat16, timer)
    assert level == chosen
    assert cpu_qgemm._LIB.get().qgemm_prefetch() == chosen
    assert medians == pytest.approx({prefetch.L1: 0.01, prefetch.L2: 0.01 * l2_share})
    # both levels timed alike, alternated: a busy moment of the host hits each
    assert seen.count(prefetch.L1) == seen.count(prefetch.L2) == prefetch.ROUNDS + 1
    assert seen[:4] == [prefetch.L1, prefetch.L2, prefetch.L2, prefetch.L1]
    assert f"into L{chosen}" in prefetch.describe(level, medians, ws)


def test_weights_that_fit_in_cache_are_not_timed_and_get_the_default():
    prefetch.set_level(prefetch.L2)
    ws = [packed(64, 256)]

    def timer(weights, xs):
        raise AssertionError("timed")

    assert prefetch.choose(ws, torch.bfloat16, timer) == (prefetch.L1, {})
    assert cpu_qgemm._LIB.get().qgemm_prefetch() == prefetch.L1


def test_a_real_sweep_times_both_and_sets_one():
    ws = big_weights()
    level, medians = prefetch.choose(ws, torch.bfloat16)
    assert level in (prefetch.L1, prefetch.L2) and set(medians) == {prefetch.L1, prefetch.L2}
    assert all(s > 0 for s in medians.values())
    assert cpu_qgemm._LIB.get().qgemm_prefetch() == level


def test_an_engine_start_chooses_over_the_weights_a8_serves_one_row_of(monkeypatch, caplog):
    """tune.choose_prefetch hands prefetch.choose the a8 packing of each weight that a8 serves at
    one row in an engine (the 2-row order), and logs the choice."""
    names = [("layers.0.mlp.down_proj", quantize_rtn(torch.randn(4096, 576), 4, 32)),
             ("lm_head", quantize_rtn(torch.randn(2048, 576), 8, 32))]  # fmt: skip
    weights = [(name, qt.kernel_weight()) for name, qt in names]
    got = []

    def fake_choose(ws, dtype, timer=None):
        got.extend(ws)
        return prefetch.L2, {prefetch.L1: 0.004, prefetch.L2: 0.003}

    def fake_path(w, x):
        assert x.shape == (2, w.k)  # an engine's single rows take the 2-row order
        return "a8" if w.bits == 4 else "c"

    monkeypatch.setattr(prefetch, "choose", fake_choose)
    monkeypatch.setattr(tune.cpu_quant, "choose", fake_path)
    with caplog.at_level(logging.INFO, logger="common.kernels.tune"):
        assert tune.choose_prefetch(weights, torch.bfloat16) == prefetch.L2
    assert [(w.n, w.k, w.bits) for w in got] == [(4096, 576, 4)]
    assert "a8 weight prefetch: into L2" in caplog.text and "L1 4.00 ms, L2 3.00 ms" in caplog.text


def test_an_engine_whose_single_rows_take_another_path_measures_nothing(monkeypatch):
    w = quantize_rtn(torch.randn(4096, 576), 4, 32).kernel_weight()
    weights = [("layers.0.mlp.down_proj", w)]

    def fake_choose(ws, dtype, timer=None):
        raise AssertionError("measured")

    monkeypatch.setattr(prefetch, "choose", fake_choose)
    monkeypatch.setattr(tune.cpu_quant, "choose", lambda w, x: "c")
    assert tune.choose_prefetch(weights, torch.bfloat16) == prefetch.L1
