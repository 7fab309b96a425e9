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


def test_engine_step_pairs_time_a_real_decode_step_each_after_its_limit(
    tiny_llama, monkeypatch
) -> None:
    from common.config import EngineConfig
    from common.engine.engine import Engine

    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))  # as the script runs: step_profile
    vs = load_script("vs_llamacpp")
    engine = Engine(
        EngineConfig(
            model=str(tiny_llama[1]), dtype="float32", kv_cache_memory="16MiB", max_model_len=256
        )  # fmt: skip
    )
    limits = iter([1.0, 2.0, 3.0])
    pairs = vs.engine_step_pairs(engine, 40, lambda: next(limits), iters=2, pairs=3)
    assert [lim for _, lim in pairs] == [1.0, 2.0, 3.0]  # one limit measured per timing
    assert all(0 < ms < 10_000 for ms, _ in pairs)


def test_the_batch_1_step_is_judged_against_the_limit_measured_beside_it() -> None:
    vs = load_script("vs_llamacpp")
    row = {"phase": "s1", "metric": "ITL p50 ms", "limit": 2.0, "llama": 10.0,
           "colocated": 4.0, "colocated_rounds": [4.0, 5.0, 3.0],
           "colocated_vs_llama": 0.4}  # fmt: skip
    floors = {"step_1": {"limit_ms": 2.0, "engine_ms": 2.6,
                         "engine_pairs": [(2.6, 2.0), (3.5, 2.5), (4.0, 2.0)],
                         "limit_ms_rounds": {"colocated": [2.0, 4.0, 2.5]}}}  # fmt: skip
    args = SimpleNamespace(systems=["llama", "colocated"])
    by_target = {(g["system"], g["target"]): g for g in vs.targets([row], args, floors)}
    engine = by_target[("engine (in-process)", "batch-1 step <= 1.5x its limit")]
    assert engine["value"] == pytest.approx(1.4) and engine["met"] is True  # 1.3, 1.4, 2.0
    served = by_target[("colocated", "batch-1 step <= 1.5x its limit")]
    assert served["value"] == pytest.approx(1.25) and served["met"] is True  # 2.0, 1.25, 1.2
    assert "4.00 / 2.00 ms, 5.00 / 4.00 ms, 3.00 / 2.50 ms" in served["shown"]
    # a round short (an interrupted run): the median against the first limit, as without rounds
    floors["step_1"]["limit_ms_rounds"] = {"colocated": [2.0, 4.0]}
    by_target = {(g["system"], g["target"]): g for g in vs.targets([row], args, floors)}
    assert by_target[("colocated", "batch-1 step <= 1.5x its limit")]["value"] == 2.0


FLOORS = {  # what report_rows reads of measure_floors' result
    "step_1": {"limit_ms": 2.0, "dtypes": ["int8"]},
    "step_n": {"limit_ms": 4.0, "dtypes": ["int8"]},
    "prefill_1_ms": 10.0,
    "ceiling_1_tok_s": 1000.0,
    "ceiling_n_tok_s": 2000.0,
}


def _summary(tok_s: float, itl: float, ttft: float, errors: int = 0) -> dict:
    return {"output_token_throughput": tok_s, "itl_p50_ms": itl, "ttft_p50_ms": ttft,
            "errors": errors, "first_errors": ["boom"] * errors, "raw": []}  # fmt: skip


def test_rounds_give_medians_and_the_median_of_each_rounds_own_ratio() -> None:
    vs = load_script("vs_llamacpp")
    # the host drifts: round 2 is slow for both systems, round 3 fast for both
    llama = [{"s1": _summary(100, 10.0, 50)}, {"s1": _summary(60, 20.0, 90)},
             {"s1": _summary(120, 8.0, 40)}]  # fmt: skip
    ours = [{"s1": _summary(400, 5.0, 20)}, {"s1": _summary(200, 9.0, 45, errors=1)},
            {"s1": _summary(500, 6.0, 16)}]  # fmt: skip
    results = {"llama": vs.combine_rounds(llama), "colocated": vs.combine_rounds(ours)}
    s1 = results["colocated"]["s1"]
    assert s1["itl_p50_ms"] == 6.0 and s1["output_token_throughput"] == 400
    assert s1["per_round"]["itl_p50_ms"] == [5.0, 9.0, 6.0]
    assert s1["errors"] == 1 and s1["first_errors"] == ["boom"]
    args = SimpleNamespace(concurrency=16, systems=["llama", "colocated"], rounds=3)
    rows = vs.report_rows(results, FLOORS, args)
    itl = next(r for r in rows if (r["phase"], r["metric"]) == ("s1", "ITL p50 ms"))
    # the rounds' own ratios 0.5, 0.45, 0.75: their median 0.5, not the medians' 6.0 / 10.0
    assert itl["colocated_vs_llama"] == pytest.approx(0.5)
    assert itl["colocated_vs_llama_rounds"] == pytest.approx([0.5, 0.45, 0.75])
    ttft = next(r for r in rows if (r["phase"], r["metric"]) == ("s1", "TTFT p50 ms"))
    assert ttft["colocated_vs_llama"] == pytest.approx(0.4)  # 0.4, 0.5, 0.4 (medians: 0.4)
    goals = vs.targets(rows, args)
    shown = next(g["shown"] for g in goals if g["target"].startswith("1 stream(s) ITL"))
    assert "median of rounds 0.50x, 0.45x, 0.75x" in shown


def test_an_unfinished_round_falls_back_to_the_ratio_of_medians() -> None:
    vs = load_script("vs_llamacpp")
    results = {
        "llama": vs.combine_rounds([{"s1": _summary(100, 10.0, 50)}]),
        "colocated": vs.combine_rounds(
            [{"s1": _summary(400, 4.0, 20)}, {"s1": _summary(300, 6.0, 30)}]
        ),  # fmt: skip
    }
    report = load_script("vs_llamacpp_report")
    per_round = {n: r["s1"]["per_round"]["itl_p50_ms"] for n, r in results.items()}
    assert report.round_ratios(per_round["colocated"], per_round["llama"]) == []
    rows = vs.report_rows(results, FLOORS, SimpleNamespace(concurrency=16))
    itl = next(r for r in rows if (r["phase"], r["metric"]) == ("s1", "ITL p50 ms"))
    assert itl["colocated_vs_llama"] == pytest.approx(0.5)  # median 5.0 / 10.0
    assert "colocated_vs_llama_rounds" not in itl


def test_each_round_starts_with_the_next_system_on_fresh_prompts() -> None:
    vs = load_script("vs_llamacpp")
    names = ["llama", "colocated", "disagg"]
    assert [vs.rotated(names, r) for r in range(4)] == [
        names,
        ["colocated", "disagg", "llama"],
        ["disagg", "llama", "colocated"],
        names,
    ]
    args = SimpleNamespace(concurrency=16, seed=0, warmup=2, requests_1=8, requests_n=64)
    first, second = vs.phases(args, 0), vs.phases(args, 1)
    assert [p[0] for p in first] == ["warmup", "s1", "s16"]
    assert [p[0] for p in second] == ["s1", "s16"]  # warmed up once
    seeds = [p[3] for p in first] + [p[3] for p in second]
    assert len(set(seeds)) == len(seeds)


def test_systems_start_once_and_are_measured_in_rotated_turns(monkeypatch, tmp_path) -> None:
    vs = load_script("vs_llamacpp")
    started: list[str] = []
    measured: list[tuple[str, int]] = []

    def start(name, args, engine_args, log_dir, gguf, stack):
        if name == "disagg":
            raise RuntimeError("no prefill worker")
        started.append(name)
        return f"http://{name}", None

    def measure(name, url, args, rnd):
        assert url == f"http://{name}"
        measured.append((name, rnd))
        if (name, rnd) == ("colocated", 2):
            raise KeyboardInterrupt  # SIGTERM mid-run: what was measured is reported
        return {"s1": _summary(100.0 + rnd, 5.0, 20.0)}

    monkeypatch.setattr(vs, "start_system", start)
    monkeypatch.setattr(vs, "measure_system", measure)
    limits = iter([3.0, 2.0, 4.0])
    round_limits: dict[str, list[float]] = {}
    args = SimpleNamespace(systems=["llama", "colocated", "disagg"], rounds=3)
    results = vs.run_systems(args, [], tmp_path, tmp_path, lambda: next(limits), round_limits)
    assert started == ["llama", "colocated"]  # each started once, before any measuring
    assert measured == [("llama", 0), ("colocated", 0), ("colocated", 1), ("llama", 1),
                        ("llama", 2), ("colocated", 2)]  # fmt: skip
    # measured just before each pdserve turn (not llama-server's), kept for finished turns
    assert round_limits == {"colocated": [3.0, 2.0]}
    assert results["disagg"] == {"failed": "no prefill worker"}
    assert results["llama"]["s1"]["per_round"]["output_token_throughput"] == [100, 101, 102]
    assert results["colocated"]["s1"]["per_round"]["output_token_throughput"] == [100, 101]
    assert list(results) == ["llama", "colocated", "disagg"]
