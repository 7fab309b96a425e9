"""Supervision of a local cluster's workers: restart a dead worker with backoff, up to a limit.

Owns the restart policy (`RestartPolicy`: backoff doubling from `backoff_s` to `max_backoff_s`,
the count of restarts in a row forgiven once a worker has stayed up for `stable_s`) and the
bookkeeping per worker (`Supervisor`). A worker that dies is started again from its `WorkerSpec`
while the other workers keep serving. After `max_restarts` crashes in a row it is still retried,
every `max_backoff_s` (a stage that is down for a while, say its port or memory was taken, comes
back by itself instead of leaving the cluster answering 503 forever); `max_restarts=0` means no
restarts at all: `check` then reports the cluster over, so `pdserve up` exits non-zero and an
outer supervisor acts. The router is never restarted here: its death ends the cluster.
`common.runtime.launcher.LocalCluster.poll` drives it (with `supervise=True`, as `pdserve up`
runs it); it spawns nothing itself but calls back into the launcher.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class RestartPolicy:
    """When and how often a dead worker is started again."""

    backoff_s: float = 1.0  # wait before the first restart; doubled for each one in a row
    max_backoff_s: float = 30.0
    max_restarts: int = 5  # fast restarts in a row (no `stable_s` of uptime between); 0: none
    stable_s: float = 60.0  # a worker up this long has its restart count forgiven

    def delay_s(self, attempt: int) -> float:
        """The wait before restart number `attempt` (1-based) of a run of crashes: doubling, and
        the longest backoff once past `max_restarts`."""
        if attempt > self.max_restarts:
            return self.max_backoff_s
        return min(self.backoff_s * 2 ** max(attempt - 1, 0), self.max_backoff_s)


@dataclass
class _Watch:
    started_s: float
    restarts: int = 0  # in a row
    restart_at_s: float | None = None  # a restart is due then
    total: int = 0  # restarts over the cluster's life (for `restarts`)


@dataclass
class Supervisor:
    """Per-worker restart state. `check` is called every few tenths of a second with the names of
    the workers that are dead now; it restarts those whose backoff has passed."""

    policy: RestartPolicy = field(default_factory=RestartPolicy)
    clock: Callable[[], float] = time.monotonic
    _watches: dict[str, _Watch] = field(default_factory=dict)

    def started(self, name: str) -> None:
        """A worker (re)started now."""
        watch = self._watches.get(name)
        if watch is None:
            self._watches[name] = _Watch(started_s=self.clock())
        else:
            watch.started_s, watch.restart_at_s = self.clock(), None

    def restarts(self, name: str) -> int:
        """How many times `name` was restarted so far."""
        watch = self._watches.get(name)
        return watch.total if watch is not None else 0

    def check(
        self,
        dead: dict[str, int | None],
        restart: Callable[[str], None],
    ) -> bool:
        """`dead`: worker name -> exit code of each dead worker. Schedules and runs restarts;
        False when a worker died that is not to be restarted (`max_restarts=0`)."""
        now = self.clock()
        for name, code in dead.items():
            watch = self._watches.setdefault(name, _Watch(started_s=now))
            if self.policy.max_restarts == 0:
                _say(f"worker {name} exited with {code}; restarts are off: stopping the cluster")
                return False
            if watch.restart_at_s is None:  # newly found dead
                if now - watch.started_s >= self.policy.stable_s:
                    watch.restarts = 0
                watch.restarts += 1
                delay = self.policy.delay_s(watch.restarts)
                watch.restart_at_s = now + delay
                if watch.restarts > self.policy.max_restarts:
                    _say(
                        f"worker {name} exited with {code}; it died {watch.restarts} times in a "
                        f"row: retrying every {delay:.0f} s (the other workers keep serving)"
                    )
                else:
                    _say(
                        f"worker {name} exited with {code}; restarting it in {delay:.1f} s "
                        f"(restart {watch.restarts} of {self.policy.max_restarts} in a row)"
                    )
            if now >= watch.restart_at_s:
                watch.total += 1
                try:
                    restart(name)
                except Exception as exc:  # could not even spawn: count it as another crash
                    watch.restart_at_s = None
                    watch.started_s = now
                    _say(f"restarting worker {name} failed: {exc}")
                    continue
                self.started(name)
        return True


def _say(line: str) -> None:
    """Supervision events go to the launcher's stderr: what `pdserve up`'s user sees."""
    print(f"pdserve: {line}", file=sys.stderr, flush=True)
