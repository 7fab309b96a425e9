"""common/runtime/omp_spin.py: an engine process turns PDSERVE_OMP_SPIN_US into libgomp's spin
count from this CPU's measured iteration, before torch loads libgomp; unset, nothing changes;
the environment's own settings win, and so does a libgomp already loaded. That libgomp honours
the count is checked in fresh processes, by the CPU time its idle threads burn after each
parallel region."""

from __future__ import annotations

import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

from common import cli
from common.runtime import omp_spin

ROOT = Path(__file__).resolve().parents[3]


def test_the_probe_times_an_iteration():
    ns = omp_spin.iteration_ns()
    if ns is None:
        pytest.skip("no C compiler")
    # a load and a pause: from about a nanosecond to a few hundred on any core
    assert math.isfinite(ns) and 0.1 < ns < 2000, ns


def test_the_count_is_the_time_over_an_iteration():
    assert omp_spin.spin_count(100, 25.0) == 4000
    assert omp_spin.spin_count(100, 2.5) == 40000
    assert omp_spin.spin_count(0, 25.0) == 1  # libgomp's least: one look before sleeping
    with pytest.raises(ValueError):
        omp_spin.spin_count(-1, 25.0)
    with pytest.raises(ValueError):
        omp_spin.spin_count(100, 0.0)


def test_configure_sets_the_count_for_the_spin_time():
    env = {omp_spin.SPIN_ENV: "100"}
    line = omp_spin.configure(env, measure=lambda: 20.0, loaded=False)
    assert env["GOMP_SPINCOUNT"] == "5000"  # 100 us at 20 ns
    assert line == omp_spin.describe()
    assert "100 us" in line and "GOMP_SPINCOUNT=5000" in line and "20.0 ns" in line
    env = {omp_spin.SPIN_ENV: "2.5"}
    omp_spin.configure(env, measure=lambda: 25.0, loaded=False)
    assert env["GOMP_SPINCOUNT"] == "100"
    for bad in ("-5", "soon", "nan", "inf"):
        with pytest.raises(ValueError, match=omp_spin.SPIN_ENV):
            omp_spin.configure({omp_spin.SPIN_ENV: bad}, measure=lambda: 20.0, loaded=False)


def test_unset_leaves_libgomp_s_default():
    for env in ({}, {omp_spin.SPIN_ENV: ""}):
        line = omp_spin.configure(env, measure=lambda: pytest.fail("measured"), loaded=False)
        assert line is None
        assert omp_spin.describe() is None and "GOMP_SPINCOUNT" not in env


@pytest.mark.parametrize("name", ["GOMP_SPINCOUNT", "OMP_WAIT_POLICY"])
def test_the_environment_s_own_setting_wins(name):
    env = {omp_spin.SPIN_ENV: "100", name: "passive" if name == "OMP_WAIT_POLICY" else "123"}
    before = dict(env)
    line = omp_spin.configure(env, measure=lambda: pytest.fail("measured"), loaded=False)
    assert env == before and name in line


def test_nothing_changes_once_libgomp_is_loaded_or_without_the_probe():
    env = {omp_spin.SPIN_ENV: "100"}
    line = omp_spin.configure(env, measure=lambda: pytest.fail("measured"), loaded=True)
    assert "GOMP_SPINCOUNT" not in env and "loaded before" in line
    assert "torch" in sys.modules  # this process: what the default looks at
    assert "loaded before" in omp_spin.configure(env, measure=lambda: 20.0)
    line = omp_spin.configure(env, measure=lambda: None, loaded=False)
    assert "GOMP_SPINCOUNT" not in env and "could not be built" in line


@pytest.mark.parametrize("command", ["decode", "prefill", "run-batch"])
def test_engine_commands_configure_before_they_load(monkeypatch, command):
    calls: list[str] = []
    monkeypatch.setattr(cli, "_engine_process", lambda: calls.append("spin"))
    target = {
        "decode": ("decode.cli", "cmd_decode"),
        "prefill": ("prefill.cli", "cmd_prefill"),
        "run-batch": ("common.runtime.run_batch", "run_batch_command"),
    }[command]
    module = __import__(target[0], fromlist=[target[1]])
    monkeypatch.setattr(module, target[1], lambda args: calls.append("run") or 0)
    handler = {"decode": cli.cmd_decode, "prefill": cli.cmd_prefill,
               "run-batch": cli.cmd_run_batch}[command]  # fmt: skip
    assert handler(None) == 0
    assert calls == ["spin", "run"]


# After each of 21 parallel regions the main thread sleeps 20 ms; prints the process's CPU
# milliseconds over those sleeps: what the other OpenMP thread spent spinning.
_IDLE_SCRIPT = """
import resource, sys, time
if sys.argv[1] == "configure":
    from common.runtime import omp_spin
    print(omp_spin.configure(), file=sys.stderr)
import torch
torch.set_num_threads(2)
x = torch.ones(1 << 22)
def cpu():
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime
idle = 0.0
for _ in range(21):
    x.sum()
    t = cpu()
    time.sleep(0.02)
    idle += cpu() - t
print(round(idle * 1e3, 1))
"""


def _idle_cpu_ms(mode: str) -> float:
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")}
    env["PYTHONPATH"] = str(ROOT)
    env[omp_spin.SPIN_ENV] = "100"
    if mode == "long":
        env["GOMP_SPINCOUNT"] = "300000"  # libgomp's own default, named: it wins
    out = subprocess.run(
        [sys.executable, "-c", _IDLE_SCRIPT, mode],
        capture_output=True, text=True, timeout=120, env=env, check=True,
    )  # fmt: skip
    return float(out.stdout)


@pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="needs two cores for two threads")
def test_libgomp_sleeps_after_the_configured_spin():
    if omp_spin.iteration_ns() is None:
        pytest.skip("no C compiler")
    long_ms, short_ms = _idle_cpu_ms("long"), _idle_cpu_ms("configure")
    # 300,000 iterations spin for milliseconds after each region (7.5 ms at 25 ns), 100 us for
    # a tenth of one: 21 regions burn over 20 ms against a few
    assert long_ms > 20, f"libgomp's default spun only {long_ms} ms in 21 idle gaps"
    assert short_ms < long_ms / 3, (short_ms, long_ms)
