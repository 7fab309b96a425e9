"""benchmarks/vs_llamacpp.py: how its targets are judged (the batch-1 step both as served and as
the engine's own step in-process), and that the in-process step timing runs on a real engine.
The servers themselves (llama-server, `pdserve up`) are the benchmark's to run, not the suite's."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from tests.benchmarks.scripts import load_script

ROOT = Path(__file__).resolve().parents[2]


def test_the_batch_1_step_is_judged_served_and_in_process() -> None:
    vs = load_script("vs_llamacpp")
    row = {"phase": "s1", "metric": "ITL p50 ms", "limit": 2.0, "llama": 10.0,
           "colocated": 4.0, "colocated_vs_llama": 0.4}  # fmt: skip
    args = SimpleNamespace(systems=["llama", "colocated"])
    goals = vs.targets([row], args, {"step_1": {"limit_ms": 2.0, "engine_ms": 2.8}})
    by_target = {(g["system"], g["target"]): g for g in goals}
    itl = by_target[("colocated", "1 stream(s) ITL p50 ms <= 0.5x llama-server")]
    assert itl["value"] == 0.4 and itl["met"] is True
    served = by_target[("colocated", "batch-1 step <= 1.5x its limit")]
    assert served["value"] == 2.0 and served["met"] is False  # 4.0 ms served / 2.0
    engine = by_target[("engine (in-process)", "batch-1 step <= 1.5x its limit")]
    assert engine["value"] == pytest.approx(1.4) and engine["met"] is True
    assert "2.80 / 2.00 ms" in engine["shown"]
    # without the in-process timing (older JSON, a failed load) only the served figure is judged
    assert not [g for g in vs.targets([row], args) if g["system"] == "engine (in-process)"]


def test_engine_step_ms_times_a_real_decode_step(tiny_llama, monkeypatch) -> None:
    from common.config import EngineConfig
    from common.engine.engine import Engine

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # as the script runs: step_profile
    vs = load_script("vs_llamacpp")
    engine = Engine(
        EngineConfig(
            model=str(tiny_llama[1]), dtype="float32", kv_cache_memory="16MiB", max_model_len=256
        )  # fmt: skip
    )
    ms = vs.engine_step_ms(engine, 40, iters=2, repeats=2)
    assert 0 < ms < 10_000
