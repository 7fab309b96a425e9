"""common/runtime/malloc.py: an engine process keeps what a step frees instead of faulting it in
again; the environment's own thresholds win (the router's pinning, which goes through the same
call, is tested in tests/router/test_memory.py).

The page faults are counted in fresh processes: the thresholds are process-wide."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from common.runtime import malloc

ROOT = Path(__file__).resolve().parents[3]

# Rounds of a step's worth of activations: 12 buffers of 16 MiB (each under glibc's largest mmap
# threshold) written, then all freed. Prints the page faults of the rounds after the second.
_STEPS_SCRIPT = """
import resource, sys
from common.runtime.malloc import keep_step_buffers
if sys.argv[1] == "keep":
    assert keep_step_buffers()
def step():
    live = [bytearray(16 << 20) for _ in range(12)]
    for b in live:
        b[::4096] = b"x" * len(b[::4096])
    del live
step(); step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    step()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""


def _faults(mode: str) -> int:
    env = {k: v for k, v in os.environ.items() if k != "GLIBC_TUNABLES"}
    env = {k: v for k, v in env.items() if not k.startswith("MALLOC_")}
    env["PYTHONPATH"] = str(ROOT)
    out = subprocess.run(
        [sys.executable, "-c", _STEPS_SCRIPT, mode],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
        check=True,
    )
    return int(out.stdout)


@pytest.mark.skipif(malloc.libc_function("mallopt") is None, reason="needs glibc")
def test_kept_step_buffers_are_not_faulted_in_again():
    pages = 4 * 12 * (16 << 20) // 4096  # what four rounds touch
    kept, default = _faults("keep"), _faults("default")
    assert kept < pages // 20, f"{kept} page faults in four rounds with the buffers kept"
    # the scenario is the one the setting is for: glibc's own thresholds fault most of it in
    assert default > pages // 2, f"only {default} faults without the setting: not reproduced"


def test_the_environment_keeps_its_own_thresholds(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert malloc.environment_sets_thresholds()
    assert malloc.keep_step_buffers() is False
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_")
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=65536")
    assert malloc.set_thresholds(1 << 20, 1 << 20) is False
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.cpu.hwcaps=-AVX512F")  # not a malloc tunable
    assert not malloc.environment_sets_thresholds()


def test_no_glibc_sets_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("GLIBC_TUNABLES", "MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_"):
        monkeypatch.delenv(name, raising=False)  # so only the missing glibc can say no
    assert not malloc.environment_sets_thresholds()
    monkeypatch.setattr(malloc, "libc_function", lambda name: None)
    assert malloc.set_thresholds(1 << 20, 1 << 20) is False
    assert malloc.keep_step_buffers() is False
