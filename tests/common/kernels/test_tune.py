"""common/kernels/tune.py: the tune cache is written, reused without measuring again, and
invalidated by the CPU flags, threads, layer shapes, activation mode, the dense path's permission
and x dtype; the path each
batch range gets is the one measured fastest there (a fake timer: deterministic), a path that
does not apply falls to the next in measured order; --kernel-choice forces a path or the fixed
table and measures nothing; the startup log names each range's kernel with its times; a tiny
engine tunes at its start."""

from __future__ import annotations

import argparse
import json
import logging

import pytest
import torch
from torch import nn

from common.config import EngineConfig, add_engine_args, config_from_args
from common.kernels import cpu_qgemm, cpu_quant, tune
from common.kernels.quant_weight import QuantWeight
from common.model.quant import QuantLinear, kernel_weights, quantize_rtn

# built here, from the kernel cache the tests below move away
if not (cpu_quant.c_available() and cpu_qgemm.available()):
    pytest.skip("the C kernels could not be built", allow_module_level=True)


@pytest.fixture(autouse=True)
def cache(monkeypatch, tmp_path):
    monkeypatch.setenv("PDSERVE_CACHE", str(tmp_path))
    cpu_quant.tuned.clear()
    yield tmp_path / "kernels"
    cpu_quant.tuned.clear()
    cpu_quant.kernel_choice = "auto"


def qlayer(n: int, k: int, bits: int = 4, group: int = 32) -> QuantLinear:
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(n + k))
    return QuantLinear(quantize_rtn(w, bits, group))


def model(hidden: int = 64, head_bits: int = 8) -> nn.Module:
    """A decoder layer's projections (int4) and an LM head (int8 per group)."""
    m = nn.Module()
    m.qkv, m.o = qlayer(3 * hidden, hidden), qlayer(hidden, hidden)
    m.gate_up, m.down = qlayer(4 * hidden, hidden), qlayer(hidden, 2 * hidden)
    m.head = qlayer(256, hidden, head_bits)
    return m


class FakeTimer:
    """Seconds per call from a rule of (path, M), counting calls."""

    def __init__(self, rule=None) -> None:
        self.calls = 0
        self.rule = rule or (lambda path, m: {"c": 1.0, "dequant": 3.0}.get(path, 2.0) * m)

    def __call__(self, path: str, w: QuantWeight, x: torch.Tensor) -> float:
        self.calls += 1
        return 1e-3 * self.rule(path, x.shape[0])


def test_cache_written_then_reused(cache):
    timer = FakeTimer()
    tables = tune.prepare("auto", torch.float32, kernel_weights([model()]), timer)
    files = list(cache.glob("tune-*.json"))
    assert len(files) == 1 and timer.calls > 0
    body = json.loads(files[0].read_text())
    assert body["key"]["threads"] == torch.get_num_threads()
    assert [p["m"] for p in body["tables"]["4"]] == list(tune.M_POINTS)
    calls = timer.calls
    cpu_quant.tuned.clear()  # a new process
    assert tune.prepare("auto", torch.float32, kernel_weights([model()]), timer) == tables
    assert timer.calls == calls  # read, not measured
    assert set(cpu_quant.tuned) == {(4, torch.float32, "auto"), (8, torch.float32, "auto")}


@pytest.mark.parametrize(
    "change", ["flags", "threads", "shapes", "activations", "dtype", "dense"]
)
def test_cache_invalidated(cache, monkeypatch, change):
    timer = FakeTimer()
    tune.prepare("auto", torch.float32, kernel_weights([model()]), timer)
    calls, dtype, hidden = timer.calls, torch.float32, 64
    if change == "flags":
        monkeypatch.setattr(tune.isa, "cpu_flags", lambda: frozenset({"sse2", "avx2"}))
    elif change == "threads":
        threads = torch.get_num_threads()
        torch.set_num_threads(threads + 1 if threads == 1 else threads - 1)
    elif change == "shapes":
        hidden = 96
    elif change == "activations":
        monkeypatch.setattr(cpu_quant, "activations", "float")
    elif change == "dense":
        monkeypatch.setattr(cpu_quant, "dense_weights", not cpu_quant.dense_weights)
    else:
        dtype = torch.bfloat16
    try:
        tune.prepare("auto", dtype, kernel_weights([model(hidden)]), timer)
    finally:
        if change == "threads":
            torch.set_num_threads(threads)
    assert timer.calls > calls
    assert len(list(cache.glob("tune-*.json"))) == 2


def winner(path_at_m):
    """A rule that makes `path_at_m(m)` 2x faster than every other path at M."""
    return lambda path, m: (1.0 if path == path_at_m(m) else 2.0) * m


def test_each_range_gets_the_path_measured_fastest(monkeypatch):
    monkeypatch.setattr(cpu_quant, "activations", "float")  # a8's availability varies by host
    fastest = lambda m: "c" if m <= 2 else ("dequant" if m <= 32 else "f32tiles")  # noqa: E731
    tables = tune.prepare(
        "auto", torch.float32, kernel_weights([model()]), FakeTimer(winner(fastest))
    )
    for bits in (4, 8):
        for m, order, ms in tables[bits]:
            assert order[0] == fastest(m) and ms[order[0]] == min(ms.values())
    layer = qlayer(64, 64)
    for m in (1, 2, 3, 4, 31, 32, 33, 64, 256, 300):
        # M takes the first point >= M: 3 -> 4, 33 -> 64, 300 -> 256
        want = fastest(next((p for p in tune.M_POINTS if p >= m), 256))
        assert cpu_quant.choose(layer.kernel_weight(), torch.randn(m, 64)) == want, m


def test_a_path_that_does_not_apply_falls_to_the_next_measured(monkeypatch):
    monkeypatch.setattr(cpu_quant, "activations", "float")
    order = ["int8pack", "dequant", "c", "f32tiles"]  # int8pack: int8 per channel only
    rule = lambda path, m: order.index(path) + 1.0 if path in order else 9.0  # noqa: E731
    # a per-channel int8 head: int8pack is measured (and wins) for bits 8
    head = qlayer(256, 64, 8, group=64)
    tables = tune.prepare(
        "auto", torch.bfloat16, kernel_weights([model(), nn.ModuleList([head])]), FakeTimer(rule)
    )
    assert tables[8][0][1][:2] == ["int8pack", "dequant"]
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    assert cpu_quant.choose(head.to(torch.bfloat16).kernel_weight(), x) == "int8pack"
    grouped = qlayer(256, 64, 8, group=32).to(torch.bfloat16)  # int8pack does not apply
    assert cpu_quant.choose(grouped.kernel_weight(), x) == "dequant"


@pytest.mark.parametrize("choice", ["c", "dequant", "table"])
def test_kernel_choice_forces_and_measures_nothing(cache, monkeypatch, choice):
    monkeypatch.setattr(cpu_quant, "activations", "float")
    timer = FakeTimer()
    assert tune.prepare(choice, torch.float32, kernel_weights([model()]), timer) == {}
    assert timer.calls == 0 and not cache.exists()
    layer = qlayer(64, 64)
    for m in (1, 8, 200):
        path = cpu_quant.choose(layer.kernel_weight(), torch.randn(m, 64))
        if choice == "table":  # the float table: the C kernel, then the tiles
            assert path == ("c" if m < 128 else "f32tiles")
        else:
            assert path == choice
    cpu_quant.set_kernel_choice("int8pack")  # does not apply to int4: the table's order
    assert cpu_quant.choose(layer.kernel_weight(), torch.randn(1, 64)) == "c"


def test_kernel_choice_flag():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert config_from_args(parser.parse_args([])).kernel_choice == "auto"
    args = parser.parse_args(["--kernel-choice", "f32tiles"])
    assert config_from_args(args).kernel_choice == "f32tiles"
    with pytest.raises(ValueError, match="--kernel-choice must be one of auto, table, c,"):
        EngineConfig(kernel_choice="fastest").validate()
    with pytest.raises(ValueError, match="kernel choice must be one of"):
        cpu_quant.set_kernel_choice("fastest")


def test_startup_log_one_line_per_range(caplog, monkeypatch):
    monkeypatch.setattr(cpu_quant, "activations", "float")
    fastest = lambda m: "c" if m <= 8 else "f32tiles"  # noqa: E731
    with caplog.at_level(logging.INFO, logger="common.kernels.tune"):
        tune.prepare("auto", torch.float32, kernel_weights([model()]), FakeTimer(winner(fastest)))
    lines = [r.getMessage().strip() for r in caplog.records]
    assert lines[0].startswith("kernel choice (measured, activations float,")
    assert lines[1:] == [
        "int4 x float32 M 1-8: c (M=1: c 4, f32tiles 8, int4pack 8 ms; "
        "M=8: c 32, f32tiles 64, int4pack 64 ms)",
        "int4 x float32 M 9+: f32tiles (M=16: f32tiles 64, c 128, int4pack 128 ms; "
        "M=256: f32tiles 1.02e+03, c 2.05e+03, int4pack 2.05e+03 ms)",
        "int8 x float32 M 1-8: c (M=1: c 1, f32tiles 2, dequant 2 ms; "
        "M=8: c 8, f32tiles 16, dequant 16 ms)",
        "int8 x float32 M 9+: f32tiles (M=16: f32tiles 16, c 32, dequant 32 ms; "
        "M=256: f32tiles 256, c 512, dequant 512 ms)",
    ]
    caplog.clear()
    cpu_quant.tuned.clear()
    with caplog.at_level(logging.INFO, logger="common.kernels.tune"):
        tune.prepare("auto", torch.float32, kernel_weights([model()]), FakeTimer())
    assert caplog.records[0].getMessage().startswith("kernel choice (cached,")


def test_real_timings_rank_every_applicable_path(monkeypatch):
    monkeypatch.setattr(tune, "M_POINTS", (1, 4))
    tables = tune.measure(
        [qlayer(64, 64).kernel_weight(), qlayer(32, 64, 8).kernel_weight()], torch.bfloat16
    )
    allowed = tune.allowed_paths(torch.bfloat16)  # amx4 takes 17+ rows only: none here
    assert set(tables[4][0][1]) == {p for p in allowed if p not in ("int8pack", "amx4")}
    assert set(tables[8][0][1]) == {
        p for p in allowed if p not in ("int4pack", "int8pack", "amx4")
    }
    assert all(t > 0 for _, _, ms in tables[4] for t in ms.values())


def test_a_slow_path_stops_being_timed():
    rule = lambda path, m: 1.0 if path == "c" else (300.0 if path == "dequant" else 2.0)  # noqa: E731
    timer = FakeTimer(rule)
    tables = tune.measure([qlayer(64, 64).kernel_weight()], torch.float32, timer)
    first, last = tables[4][0], tables[4][-1]
    assert "dequant" in first[2] and "dequant" not in last[2]  # 300x the fastest: dropped
    assert last[1][-1] == "dequant"  # still ranked, last


def test_layer_outside_an_engine_tunes_on_first_use(cache):
    layer = qlayer(64, 64)
    out = layer(torch.randn(3, 64))
    assert out.shape == (3, 64) and (4, torch.float32, "auto") in cpu_quant.tuned
    assert len(list(cache.glob("tune-*.json"))) == 1


def test_noisy_timings_are_not_cached(cache, caplog):
    seen = set()

    def timer(path, layer, x):  # each run's first call 2x faster than all the others
        run = (path, id(layer), x.shape[0])
        first = run not in seen
        seen.add(run)
        return 1e-3 if first else 2e-3

    tune.prepare("auto", torch.float32, kernel_weights([model()]), timer)
    assert not list(cache.glob("tune-*.json")) and "too noisy to cache" in caplog.text
    assert (4, torch.float32, "auto") in cpu_quant.tuned  # served by this process all the same


def test_engine_tunes_at_start(tiny_llama, cache, caplog):
    from common.engine.engine import Engine

    hf_model, _ = tiny_llama
    cfg = EngineConfig(model="tiny", dtype="float32", kv_cache_memory="4MiB", block_size=8,
                       quantization="int4")  # fmt: skip
    with caplog.at_level(logging.INFO, logger="common.kernels.tune"):
        Engine(cfg, hf_model.config, hf_model.state_dict().items())
    assert [r for r in caplog.records if r.getMessage().startswith("kernel choice (measured")]
    (file,) = cache.glob("tune-*.json")
    key = json.loads(file.read_text())["key"]
    assert key["dtype"] == "float32" and key["layers"][0][0] == 4
    assert (4, torch.float32, cpu_quant.activations) in cpu_quant.tuned


def test_pdserve_tune_prints_the_table(tiny_llama, cache, capsys):
    from common.cli import main

    _, path = tiny_llama
    args = ["tune", "--model", str(path), "--dtype", "float32", "--quantization", "int4"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "kernel choice, " in out and "int4 x float32 M 1" in out
    (file,) = cache.glob("tune-*.json")
    assert f"written to {file}" in out


@pytest.mark.parametrize("allowed", [True, False])
def test_the_dense_path_is_timed_only_where_allowed(monkeypatch, allowed):
    """Its copies allowed (the model runner's budget), dense is timed like any path and can win
    a range; not allowed, it is never timed nor chosen."""
    monkeypatch.setattr(cpu_quant, "activations", "float")
    monkeypatch.setattr(cpu_quant, "dense_weights", allowed)
    monkeypatch.setattr(cpu_quant, "dense_min_rows", 0)
    fastest = lambda m: "c" if m <= 16 else "dense"  # noqa: E731
    layers = [qlayer(64, 64).kernel_weight()]
    tables = tune.measure(layers, torch.float32, FakeTimer(winner(fastest)))
    firsts = {m: order[0] for m, order, _ in tables[4]}
    if allowed:
        assert firsts == {m: fastest(m) for m in tune.M_POINTS}
    else:
        assert all("dense" not in order for _, order, _ in tables[4])
        assert set(firsts.values()) == {"c"}


def test_the_dense_path_serves_only_above_its_least_rows(monkeypatch):
    """set_dense_weights(True, 16): batches of up to 16 rows (the C decode layers' batches in an
    engine) are never timed nor served by dense, even where it would be fastest."""
    monkeypatch.setattr(cpu_quant, "activations", "float")
    monkeypatch.setattr(cpu_quant, "dense_weights", True)
    monkeypatch.setattr(cpu_quant, "dense_min_rows", 16)
    layers = [qlayer(64, 64).kernel_weight()]
    tables = tune.measure(layers, torch.float32, FakeTimer(winner(lambda m: "dense")))
    for m, order, ms in tables[4]:
        assert ("dense" in ms) is (m > 16) and (order[0] == "dense") is (m > 16)
    tune.install(tables, torch.float32)
    w = layers[0]
    assert cpu_quant.choose(w, torch.randn(16, 64)) != "dense"
    assert cpu_quant.choose(w, torch.randn(17, 64)) == "dense"


def test_an_engine_gives_single_rows_the_two_row_order(monkeypatch):
    """Tuned c at 1 row and a8 from 2 (float vs int8 activations): with set_uniform_rows (what
    an engine sets) a single row takes a8 too, so a row computes alike alone or batched and a
    verify step's rows as decode steps do; without it, c."""
    if not cpu_quant.int8_activations():
        pytest.skip("no int8 activations on this host")
    w = qlayer(64, 64).kernel_weight()
    tables = {4: [(1, ["c", "a8"], {}), (2, ["a8", "c"], {}), (256, ["a8", "c"], {})]}
    tune.install(tables, torch.float32)
    x = torch.randn(1, 64)
    assert cpu_quant.choose(w, x) == "c"
    cpu_quant.set_uniform_rows(True)
    try:
        assert cpu_quant.choose(w, x) == "a8" and cpu_quant.path_for(w, x) == "a8"
        assert cpu_quant.choose(w, torch.randn(3, 64)) == "a8"
    finally:
        cpu_quant.set_uniform_rows(False)
    assert cpu_quant.path_for(w, x) == "c"  # the cached choice is keyed by the switch
