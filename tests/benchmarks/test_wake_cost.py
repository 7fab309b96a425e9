"""benchmarks/wake_cost.py runs: both hops, back to back and paced, with a spinning process beside
them; the table has a row per (path, busy, gap), the sender's call timed, and a delay only where
the receiver waits for each message."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_wake_cost_runs() -> None:
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "wake_cost.py"), "--paths", "pipe,zmq",
         "--gaps", "0,2000", "--busy", "0,1", "--messages", "30"],
        capture_output=True, text=True, timeout=300, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    rows = [line.split("|")[1:-1] for line in out.stdout.splitlines() if line.startswith("| ")]
    header, body = rows[0], rows[1:]  # the separator row starts "|-"
    assert [c.strip() for c in header[:3]] == ["path", "busy processes", "gap"]
    keys = [tuple(c.strip() for c in r[:3]) for r in body]
    busy, paths, gaps = ("0", "1"), ("pipe", "zmq"), ("0", "2000")
    assert keys == [(p, b, g) for b in busy for p in paths for g in gaps]
    for row in body:
        wall, cpu, p50, p99 = (float(c) for c in row[3:])
        assert wall > 0 and cpu > 0
        if row[2].strip() == "0":  # back to back: the receiver's queue, not a wake
            assert math.isnan(p50) and math.isnan(p99)
        else:  # the message was stamped before the call, so it arrives after
            assert 0 < p50 <= p99
