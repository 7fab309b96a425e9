"""Cores lent between the CPU workers `pdserve up` runs on one machine.

`up` gives each worker `cores // workers` torch threads, so that together they never
oversubscribe the cores. A worker with nothing to compute then leaves its cores idle while
another computes on its own few: with 1 prefill + 1 decode worker on 2 cores, one stream's
decode steps ran on one core while the prefill worker's core idled (inter-token latency 4.9 ms,
against 3.7 ms for the same model on both cores), and a lone prompt prefilled on one core.

The ledger is a small file (`LEDGER_ENV` names it to the workers; `up` makes it with
`create_ledger`) with a slot per worker process: its pid, its own threads, whether it is
computing (`busy`), and how many threads it borrowed for its current step (`extra`). Before each
step a worker with work (`CoreLender.before_step`) marks itself busy and borrows what nobody else
claims, total - own - (for each other live worker: its own threads if busy, plus its extra), and
runs the step on own + extra torch threads. A worker that turns busy while others hold some of
its cores waits until they give them back, for at most `GIVE_BACK_WAIT_S`, then runs anyway. Each
borrower gives them back before its next step, and also between the layers of a step
(`give_back`, the model's `between_layers`): a lender waits a layer at most, not a whole long
prefill. An idle worker clears both fields. A slot whose process is gone counts as idle, so a
killed borrower lends nothing forever.

Each field has one writer (its worker) and is one aligned 8-byte store; a reader may see a value
one step old, so two workers turning busy at the same moment can both borrow for one step, and
the next step corrects it: lending never blocks a worker for long and never loses work; at worst
the cores are oversubscribed for one step. The kernel choice (common.kernels.tune) stays the one
measured at the worker's own thread count. Owned here: the file's layout, slot claims, the
borrowing rule. Used by common.runtime.worker (per turn) and common.runtime.launcher (the file).

Also owned here: how many cores a process may use (`usable_cores`: its CPU affinity capped by
the tightest cgroup CPU quota over its cgroup and its ancestors, v2 or v1), which `up` divides
among its workers and `fit_threads` caps torch's threads at where no count was asked for
(common.model.model_runner).
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import time
from collections.abc import Callable, Mapping
from pathlib import Path

import numpy as np

log = logging.getLogger(__name__)

LEDGER_ENV = "PDSERVE_CORE_LEDGER"
MAGIC = 0x7064636F726573  # "pdcores"
HEADER = 4  # int64s: magic, total cores, slots, (unused)
FIELDS = 4  # int64s per slot: pid, own threads, busy, extra threads
PID, OWN, BUSY, EXTRA = range(FIELDS)
GIVE_BACK_WAIT_S = 0.05  # the longest a worker turning busy waits for its cores to come back
POLL_S = 0.0002


CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")  # "id:controllers:path" per hierarchy


def _quota_at(v2: Path | None, v1: Path | None) -> int | None:
    """The quota set on one cgroup directory, in cores rounded up (--cpus 1.5: 2); None if none.
    v2: cpu.max is "quota period" or "max period"; v1: cpu.cfs_quota_us is -1 without one."""
    try:
        if v2 is not None and (v2 / "cpu.max").exists():
            quota, period = (v2 / "cpu.max").read_text().split()[:2]
            return None if quota == "max" else max(1, -(-int(quota) // int(period)))
        if v1 is not None and (v1 / "cpu.cfs_quota_us").exists():
            quota_us = int((v1 / "cpu.cfs_quota_us").read_text())
            period_us = int((v1 / "cpu.cfs_period_us").read_text())
            return None if quota_us <= 0 or period_us <= 0 else max(1, -(-quota_us // period_us))
    except (OSError, ValueError):
        pass
    return None


def _cgroup_dirs() -> list[tuple[Path | None, Path | None]]:
    """(v2 dir, None) and (None, v1 cpu dir) of this process's cgroup and each ancestor up to
    the hierarchy's mount point (inside a container's cgroup namespace, its own cgroup)."""
    v2_path = v1_path = None
    try:
        for line in PROC_CGROUP.read_text().splitlines():
            hid, controllers, path = line.split(":", 2)
            if hid == "0" and controllers == "":
                v2_path = path
            elif "cpu" in controllers.split(","):
                v1_path = path
    except (OSError, ValueError):
        pass
    mounts = [CGROUP_ROOT / name for name in ("cpu", "cpu,cpuacct", "cpuacct,cpu")]
    v1_mount = next((m for m in mounts if m.is_dir()), None)
    dirs: list[tuple[Path | None, Path | None]] = []
    for root, path, v2 in ((CGROUP_ROOT, v2_path, True), (v1_mount, v1_path, False)):
        if root is None:
            continue
        here = root / (path or "/").lstrip("/")
        for d in (here, *here.parents):
            if d == root.parent:
                break
            dirs.append((d, None) if v2 else (None, d))
    return dirs


def _quota_cores() -> int | None:
    """The tightest cgroup CPU quota over this process's cgroup and its ancestors (v2 or v1), in
    cores rounded up; None without one."""
    quotas = [q for v2, v1 in _cgroup_dirs() if (q := _quota_at(v2, v1)) is not None]
    return min(quotas, default=None)


def usable_cores() -> int:
    """The cores this process may run on: its CPU affinity (taskset, a cpuset), capped by a
    cgroup CPU quota (a container's --cpus, a pod's CPU limit; v2 or v1), rounded up."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    quota = _quota_cores()
    if quota is not None:
        cores = min(cores or 1, quota)
    return max(1, cores or 1)


def fit_threads(
    get: Callable[[], int],
    set_threads: Callable[[int], None],
    environ: Mapping[str, str] = os.environ,
) -> int | None:
    """Where no thread count was asked for (no `--num-threads`, no `OMP_NUM_THREADS` in
    `environ`: an explicit count is kept, as asked): cap torch's (`get`, `set_threads`) at the
    usable cores. torch starts with one thread per core of its CPU affinity, which a CPU quota
    does not narrow: in a container limited to 2 of a host's 64 cores a worker would run 64
    threads, and the quota would stop them all whenever they had used 2 cores' worth of a period
    (measured on a small scale in benchmarks/README.md, "Threads past a CPU quota"). Returns the
    new count, None if unchanged."""
    if environ.get("OMP_NUM_THREADS"):
        return None
    cores = usable_cores()
    if get() <= cores:
        return None
    set_threads(cores)
    log.info("%d torch threads: the cores this process may use (CPU affinity, quota)", cores)
    return cores


def create_ledger(path: Path, total_cores: int, slots: int) -> None:
    """A fresh ledger for `total_cores` shared by up to `slots` worker processes (written whole,
    then renamed into place: a worker never sees half of it)."""
    if total_cores < 1 or slots < 1:
        raise ValueError("a core ledger needs at least one core and one slot")
    table = np.zeros(HEADER + FIELDS * slots, dtype=np.int64)
    table[:3] = (MAGIC, total_cores, slots)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(table.tobytes())
    os.replace(tmp, path)


def _alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process: alive
        return True
    return True


class CoreLender:
    """This worker's slot in a ledger, and the borrowing rule run before each step."""

    def __init__(
        self, path: Path, own_threads: int, set_threads: Callable[[int], None],
        pid: int | None = None,
    ) -> None:  # fmt: skip
        """Claims a free slot (one never used, or one whose process is gone); `set_threads` is
        called when the step's thread count changes (torch.set_num_threads); `pid` for tests.
        ValueError when the file is not a ledger or every slot is taken."""
        self.own, self.set_threads = max(1, own_threads), set_threads
        self.pid = os.getpid() if pid is None else pid
        self._file = open(path, "r+b")  # noqa: SIM115 (kept open with the mapping)
        try:
            self._map = mmap.mmap(self._file.fileno(), 0)
            table = np.frombuffer(self._map, dtype=np.int64)
            if table.size < HEADER or table[0] != MAGIC or table.size != HEADER + FIELDS * table[2]:
                raise ValueError(f"{path} is not a core ledger")
            self.total = int(table[1])
            self._slots = table[HEADER:].reshape(-1, FIELDS)
            self.slot = self._claim()
        except BaseException:
            self.close()
            raise
        self.threads = self.own  # the thread count set last
        self.extra = 0
        self.borrowed_steps = 0  # steps run with borrowed threads
        self.wait_s = 0.0  # time spent waiting for lent cores to come back
        self.given_back = 0  # times borrowed threads were handed back inside a step

    def _claim(self) -> int:
        fcntl.flock(self._file, fcntl.LOCK_EX)
        try:
            for i, slot in enumerate(self._slots):
                if slot[PID] == self.pid or not _alive(int(slot[PID])):
                    slot[OWN], slot[BUSY], slot[EXTRA] = self.own, 0, 0
                    slot[PID] = self.pid
                    return i
        finally:
            fcntl.flock(self._file, fcntl.LOCK_UN)
        raise ValueError(f"every slot of the core ledger ({len(self._slots)}) is taken")

    def _others(self) -> tuple[int, int]:
        """(threads the other live workers claim, threads they borrowed)."""
        claimed = borrowed = 0
        for i, slot in enumerate(self._slots):
            busy, extra = int(slot[BUSY]), int(slot[EXTRA])
            if i == self.slot or not (busy or extra) or not _alive(int(slot[PID])):
                continue
            claimed += (int(slot[OWN]) if busy else 0) + extra
            borrowed += extra
        return claimed, borrowed

    def before_step(self, busy: bool) -> int:
        """Called before each turn's step with whether it computes; returns the threads the
        step runs on (after waiting, at most GIVE_BACK_WAIT_S, for lent cores to come back)."""
        mine = self._slots[self.slot]
        if not busy:
            if mine[BUSY] or mine[EXTRA]:
                mine[EXTRA] = 0
                mine[BUSY] = 0
                self.extra = 0
            return self.threads
        if not mine[BUSY]:
            mine[BUSY] = 1
        claimed, borrowed = self._others()
        if self.total - self.own - claimed < 0 and borrowed:
            start = time.monotonic()
            while self.total - self.own - claimed < 0 and borrowed:
                if time.monotonic() - start > GIVE_BACK_WAIT_S:
                    break
                time.sleep(POLL_S)
                claimed, borrowed = self._others()
            self.wait_s += time.monotonic() - start
        extra = max(0, self.total - self.own - claimed)
        if extra > self.extra:
            mine[EXTRA] = extra
            # a worker that turned busy meanwhile may not have seen it: look once more
            claimed, _ = self._others()
            extra = max(0, min(extra, self.total - self.own - claimed))
        self._use(extra)
        if extra:
            self.borrowed_steps += 1
        return self.threads

    def _use(self, extra: int) -> None:
        """Hold `extra` borrowed threads from now on: the ledger, and torch's thread count."""
        if extra != self.extra:
            self._slots[self.slot][EXTRA] = extra
            self.extra = extra
        if self.own + extra != self.threads:
            self.threads = self.own + extra
            self.set_threads(self.threads)

    def give_back(self) -> None:
        """Between the layers of a step: hand back at once the borrowed threads that a worker
        turned busy since the step began needs, instead of at this worker's next step. A
        borrower's prefill step runs for up to its budget (250 ms, longer on oversubscribed
        cores), and the lender, a decode worker with a stream to serve, waited for it
        (GIVE_BACK_WAIT_S, then ran beside the borrower's threads on oversubscribed cores): its
        streams stalled 0.2-1 s at a burst of requests (1P1D on 2 cores)."""
        if not self.extra:
            return
        claimed, _ = self._others()
        extra = max(0, min(self.extra, self.total - self.own - claimed))
        if extra < self.extra:
            self._use(extra)
            self.given_back += 1

    def counters(self) -> dict[str, float]:
        """For the worker's heartbeat."""
        return {
            "cpu_borrowed_thread_steps_total": float(self.borrowed_steps),
            "cpu_core_give_back_wait_seconds_total": self.wait_s,
            "cpu_cores_given_back_inside_a_step_total": float(self.given_back),
        }

    def close(self) -> None:
        """Give the slot up (idle, no pid) and unmap the file."""
        slots = getattr(self, "_slots", None)
        if slots is not None and getattr(self, "slot", None) is not None:
            slots[self.slot] = 0
        self._slots = None
        if getattr(self, "_map", None) is not None:
            try:
                self._map.close()
            except BufferError:  # a view still exported: the mapping goes with the process
                pass
            self._map = None
        self._file.close()


def from_env(own_threads: int, set_threads: Callable[[int], None]) -> CoreLender | None:
    """The lender for the ledger `LEDGER_ENV` names, or None (not set, or unusable: logged)."""
    path = os.environ.get(LEDGER_ENV)
    if not path:
        return None
    try:
        lender = CoreLender(Path(path), own_threads, set_threads)
    except (OSError, ValueError) as exc:
        log.warning("core lending off: %s", exc)
        return None
    log.info(
        "core lending: %d own threads, up to %d with the other workers' idle cores (slot %d)",
        lender.own,
        lender.total,
        lender.slot,
    )
    return lender
