"""benchmarks/step_profile.py still runs against the current model code.

The profiler patches the model's building blocks by name (Linear, QuantLinear, RMSNorm, the
attention backends), so a refactor that moves one breaks it silently; this runs it once on a tiny
model per weight format and checks that every part of its table is filled.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("quantization", ["none", "int4"])
def test_step_profile_runs(tiny_llama, quantization: str) -> None:
    tiny_model_path = tiny_llama[1]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "step_profile.py"), "--model",
         str(tiny_model_path), "--dtype", "float32", "--quantization", quantization,
         "--batches", "1,2", "--context", "32", "--iters", "1", "--repeats", "1",
         "--threads", "1"],
        capture_output=True, text=True, timeout=240, env=env, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    rows = {
        line.split("|")[1].strip(): line.split("|")[2:4]
        for line in out.stdout.splitlines()
        if line.startswith("| ") and not line.startswith("| part")
    }
    for part in ["step", "linear", "attention kernel", "norm + residual", "% of limit"]:
        eager, fused = (float(v.strip().rstrip("%")) for v in rows[part])
        assert eager > 0 and fused > 0, (part, out.stdout)
    assert f"weights {quantization}" in out.stdout
