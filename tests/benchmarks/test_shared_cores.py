"""benchmarks/shared_cores.py runs against the current engine: a tiny int4 model's batch-1 step
timed alone and beside its co-runner, for libgomp's spin and a short one, each in its own
process; the table has a row per setting with the co-runner's CPU counted."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def test_shared_cores_runs(tiny_llama) -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "shared_cores.py"), "--model",
         str(tiny_llama[1]), "--quantization", "int4", "--context", "32", "--spins",
         "default,50", "--burst-us", "2000", "--period-us", "500", "--steps", "1000",
         "--rounds", "1"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
        env={k: v for k, v in os.environ.items() if k != "PDSERVE_OMP_SPIN_US"},
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in out.stdout.splitlines() if line.startswith("| ")]
    assert [r[0].strip() for r in rows[1:]] == ["default", "50"], out.stdout
    default, short = rows[1], rows[2]
    assert default[1].strip() == "-"  # libgomp's own spin: no count set
    assert int(short[1]) > 0  # 50 us turned into this CPU's GOMP_SPINCOUNT
    for row in (default, short):
        alone, loaded, co_cpu, extra, loss = (float(row[i]) for i in (3, 4, 5, 6, 7))
        assert alone > 0 and loaded > 0
        assert co_cpu > 0  # the co-runner burned 80% of a core beside the steps
        assert extra == pytest.approx(loaded - alone, abs=0.011)  # the printed columns' rounding
        # extra's rounding (0.005 ms) over the co-runner's CPU, and loss's own
        assert loss == pytest.approx(extra / co_cpu, rel=0.01, abs=0.005 / co_cpu + 0.006)
