"""How long an engine's OpenMP threads spin before they sleep, given as a time
(`PDSERVE_OMP_SPIN_US`) and set once per process, at start, as libgomp's count for this CPU.

Between two parallel regions, libgomp's threads (torch's and the C kernels', one pool) spin on
the word that starts the next region, then sleep on a futex. Without `OMP_WAIT_POLICY` they spin
`GOMP_SPINCOUNT` iterations, 300,000 by default. An iteration is a load and a `pause`, whose cost
depends on the core: 25 ns on a 2-core AMD EPYC Zen 4 (7.5 ms of spinning), some tens of ns on
Intel cores since Skylake, a few on older ones. So a count tuned on one host spins for another
time on the next; a time does not.

Workers that share cores on all threads each (docker compose's default; deploy/README.md, "CPU
threads") need a short spin: libgomp's default held the cores another worker needed. For them
`PDSERVE_OMP_SPIN_US` gives the spin in microseconds, and each engine process (the workers,
`pdserve run-batch`, `pdserve tune`) turns it into `GOMP_SPINCOUNT` before torch loads libgomp,
dividing by an iteration's time measured here (`csrc/spin.c`).

Unset, libgomp's default stays: `pdserve up` gives each worker its own cores, and there a short
spin did not pay (measured on the Zen 4 host above, benchmarks/README.md, "OpenMP threads that
sleep between steps": 1 stream within noise, colocated and 1P1D; 16 streams about 3% fewer
output tokens/s, as an earlier Intel host's 8%). Nothing is changed where the environment sets
`GOMP_SPINCOUNT` or `OMP_WAIT_POLICY` too (theirs wins), where libgomp is already loaded (it reads
the count once, at load), or where the probe cannot be built; `describe` says which. Called by
common.cli; logged by common.runtime.worker_cli and common.runtime.run_batch.
"""

from __future__ import annotations

import ctypes
import math
import os
import statistics
import sys
from collections.abc import Callable, MutableMapping
from pathlib import Path

from common.kernels.cbuild import CLibrary

SPIN_ENV = "PDSERVE_OMP_SPIN_US"
_LEFT_ALONE = ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY")  # set by the user: theirs to choose
PROBE_SPINS = 20_000  # iterations per timing (about 0.5 ms at 25 ns)
PROBE_ROUNDS = 5  # the median of these

_LIB = CLibrary(
    Path(__file__).parents[1] / "kernels" / "csrc" / "spin.c",
    ["-O2"],
    {"spin_ns": [ctypes.c_long, ctypes.POINTER(ctypes.c_double)]},
    "the OpenMP spin probe",
)
_summary: str | None = None  # what configure did, for the start-up log


def iteration_ns() -> float | None:
    """Nanoseconds per iteration of libgomp's spin on this CPU (median of `PROBE_ROUNDS`
    timings); None when the probe cannot be built."""
    if not _LIB.available():
        return None
    ns = ctypes.c_double()
    times = []
    for _ in range(PROBE_ROUNDS):
        if _LIB.get().spin_ns(PROBE_SPINS, ctypes.byref(ns)) != 0:
            raise RuntimeError("spin_ns refused its count")
        times.append(ns.value)
    return statistics.median(times)


def spin_count(spin_us: float, ns: float) -> int:
    """libgomp's count for spinning `spin_us` at `ns` per iteration (at least 1)."""
    if spin_us < 0 or ns <= 0:
        raise ValueError(f"a spin of {spin_us} us at {ns} ns per iteration")
    return max(1, round(spin_us * 1e3 / ns))


def configure(
    environ: MutableMapping[str, str] = os.environ,
    measure: Callable[[], float | None] = iteration_ns,
    loaded: bool | None = None,
) -> str | None:
    """Set `GOMP_SPINCOUNT` in `environ` for the spin `PDSERVE_OMP_SPIN_US` asks for, unless a
    case in the module's docstring leaves it; returns (and keeps for `describe`) one line saying
    what it did, None when the variable is unset. `loaded`: libgomp already in the process
    (default: torch imported)."""
    global _summary
    _summary = None
    if environ.get(SPIN_ENV, "") == "":
        return None
    try:
        spin_us = float(environ[SPIN_ENV])
    except ValueError:
        spin_us = -1.0
    if not 0 <= spin_us < math.inf:
        raise ValueError(f"{SPIN_ENV} must be microseconds >= 0, got {environ[SPIN_ENV]!r}")
    mine = [name for name in _LEFT_ALONE if name in environ]
    loaded = "torch" in sys.modules if loaded is None else loaded
    if mine:
        _summary = f"OpenMP spin: as {', '.join(mine)} sets it (not {SPIN_ENV})"
    elif loaded:
        _summary = f"OpenMP spin: libgomp's default (loaded before {SPIN_ENV} could be applied)"
    else:
        ns = measure()
        if ns is None:
            _summary = "OpenMP spin: libgomp's default (the spin probe could not be built)"
        else:
            count = spin_count(spin_us, ns)
            environ["GOMP_SPINCOUNT"] = str(count)
            _summary = (
                f"OpenMP spin: {spin_us:g} us before sleeping (GOMP_SPINCOUNT={count}, "
                f"{ns:.1f} ns per iteration here)"
            )
    return _summary


def describe() -> str | None:
    """The line `configure` returned in this process, or None before it ran."""
    return _summary
