"""common/bench/limits.py: the floors' arithmetic, the model's shapes, small real measurements."""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig

from common.bench import limits


@pytest.fixture
def fresh_cache(monkeypatch):
    """Each test measures anew: the module keeps its figures for the process otherwise."""
    monkeypatch.setattr(limits, "_CACHE", {})


def tiny_config() -> LlamaConfig:
    return LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_attention_heads=4,
        num_key_value_heads=2,
        num_hidden_layers=2,
        vocab_size=256,
    )


def test_shapes_come_from_the_config():
    assert limits.linear_shapes(tiny_config()) == [
        ("qkv", 64 + 2 * 2 * 16, 64),
        ("o", 64, 64),
        ("gate_up", 2 * 96, 64),
        ("down", 64, 96),
        ("lm_head", 256, 64),
    ]


def test_read_bandwidth_and_read_floor(fresh_cache):
    bandwidth = limits.read_bandwidth(16 << 20, repeats=2)
    assert 1e8 < bandwidth < 1e13
    assert limits.read_bandwidth(16 << 20) == bandwidth  # cached in the process
    assert limits.copy_bandwidth(16 << 20, repeats=2) > 1e8
    lim = limits.Limits(read_bytes_per_s=bandwidth)
    assert lim.read_floor_s(3e9) == pytest.approx(3e9 / bandwidth)


def test_read_bandwidth_now_measures_every_call(fresh_cache, monkeypatch):
    buf = limits.read_buffer(16 << 20)
    assert buf.nbytes == 16 << 20
    assert 1e8 < limits.read_bandwidth_now(buf, repeats=2) < 1e13
    times = iter([0.5, 0.25])  # two timings of the sum: a host that got faster between them
    monkeypatch.setattr(limits, "_best_s", lambda fn, repeats, sync: next(times))
    assert limits.read_bandwidth_now(buf) == buf.nbytes / 0.5
    assert limits.read_bandwidth_now(buf) == buf.nbytes / 0.25  # not the first figure again


def test_compute_floor_uses_the_dtype_given():
    rates = {("float32", 1): 1e9, ("float32", 8): 2e9, ("float32", 64): 3e9}
    rates |= {("bfloat16", 1): 1e9, ("bfloat16", 8): 8e9, ("bfloat16", 64): 4e9}
    lim = limits.Limits(read_bytes_per_s=10e9, rates=rates)
    assert lim.compute_floor_s(6e9, "float32", 8) == pytest.approx(2.0)
    assert lim.compute_floor_s(8e9, torch.bfloat16, 8) == pytest.approx(1.0)
    # m rows take the best rate measured at M >= m; past the largest M, that M's
    assert lim.rate("float32", 1) == 3e9 and lim.rate("float32", 1000) == 3e9
    assert lim.rate("bfloat16", 5) == 8e9 and lim.rate("bfloat16", 64) == 4e9
    # a step's limit is the larger floor; the ceiling is the batch over it
    assert lim.step_floor_s(1e9, 6e9, "float32", 8) == pytest.approx(2.0)
    assert lim.step_floor_s(100e9, 6e9, "float32", 8) == pytest.approx(10.0)
    assert lim.ceiling_tokens_per_s(1e9, 1e9, "bfloat16", 8) == pytest.approx(8 / 1.0)
    assert lim.ceiling_tokens_per_s(100e9, 1e9, "bfloat16", 8) == pytest.approx(8 / 10.0)
    with pytest.raises(ValueError, match="int8"):
        lim.rate("int8", 8)


def test_matmul_rate_caps_a_call(fresh_cache, monkeypatch):
    monkeypatch.setattr(limits, "MAX_CALL_FLOP", 2 * 8 * 64 * 16)
    limits.matmul_rate("float32", 8, 64, 4096)
    assert [k for k in limits._CACHE if k[0] == "matmul"][0][4] == 16  # N cut to 16 rows


def test_measure_on_a_tiny_model(fresh_cache):
    cfg = tiny_config()
    lim = limits.measure(cfg, nbytes=16 << 20, batch_rows=(1, 8), repeats=2)
    assert limits.measure(cfg, nbytes=16 << 20, batch_rows=(1, 8), repeats=2) is lim
    names = [name for name, _, _ in limits.linear_shapes(cfg)]
    measured = ["float32", "bfloat16"] + (["int8"] if "int8" not in lim.unavailable else [])
    for dtype in measured:
        for m in (1, 8):
            per_shape = [lim.shape_rates[(dtype, m, name)] for name in names]
            assert min(per_shape) > 0 and lim.rates[(dtype, m)] == max(per_shape)
    if "int8" in lim.unavailable:
        assert "_int_mm" in lim.unavailable["int8"]
    table = lim.describe()
    assert "read" in table and "| float32 |" in table and "| int8 |" in table
    # one thread's figures too, the thread count restored after measuring them
    assert torch.get_num_threads() == lim.threads
    assert 1e8 < lim.one_core_read_bytes_per_s < 1e13
    assert set(lim.one_core_rates) == set(measured)
    assert all(rate > 0 for rate in lim.one_core_rates.values())
    assert "one thread: read" in table
    assert lim.as_dict()["one_core"]["read_GB_s"] == lim.one_core_read_bytes_per_s / 1e9


def test_cores_floor_adds_the_reading_and_computing_each_core_can_do():
    lim = limits.Limits(
        read_bytes_per_s=20e9,
        rates={("bfloat16", 512): 2e12},
        threads=2,
        one_core_read_bytes_per_s=10e9,
        one_core_rates={"bfloat16": 1e12, "int8": 4e12},
    )
    # 1 GB at 10 GB/s a core (0.1 s) + 1 TFLOP at 1 TFLOP/s a core (1 s), shared by 2 cores
    assert lim.core_floor_s(1e9, {"bfloat16": 1e12}) == pytest.approx(1.1 / 2)
    assert lim.core_floor_s(1e9, {"bfloat16": 1e12, torch.int8: 4e12}) == pytest.approx(2.1 / 2)
    assert lim.core_floor_s(1e9, {}) == pytest.approx(0.1 / 2)
    # a dtype with no one-thread rate, or no one-thread figures at all: no cores' floor
    assert lim.core_floor_s(1e9, {"float32": 1e9}) == 0.0
    assert limits.Limits(read_bytes_per_s=20e9, threads=2).core_floor_s(1e9, {}) == 0.0
    # a one-thread figure measured at a busy moment counts as 1 / threads of the threads' own
    busy = limits.Limits(
        read_bytes_per_s=20e9,
        rates={("bfloat16", 512): 2e12},
        threads=2,
        one_core_read_bytes_per_s=1e9,
        one_core_rates={"bfloat16": 0.1e12},
    )
    assert busy.core_floor_s(1e9, {"bfloat16": 1e12}) == pytest.approx(1.1 / 2)
    # two threads read 2x one thread's rate: reading takes both cores
    assert lim.read_share() == pytest.approx(1.0)
    assert lim.reads_take_the_cores()
    many = limits.Limits(read_bytes_per_s=40e9, threads=16, one_core_read_bytes_per_s=10e9)
    assert not many.reads_take_the_cores()  # 4 of 16 cores reach the bandwidth
    assert not limits.Limits(read_bytes_per_s=1e9, threads=2).reads_take_the_cores()


def test_int8_reported_unavailable(fresh_cache, monkeypatch):
    def refuse(a, b):
        raise RuntimeError("_int_mm: not implemented for 'CPU'")

    monkeypatch.setattr(torch, "_int_mm", refuse)
    lim = limits.measure(tiny_config(), nbytes=8 << 20, batch_rows=(1,), repeats=1)
    assert "not implemented" in lim.unavailable["int8"]
    assert not any(d == "int8" for d, _ in lim.rates)
    assert "| int8 | unavailable" in lim.describe()
    with pytest.raises(ValueError, match="not implemented"):
        lim.rate("int8", 1)
