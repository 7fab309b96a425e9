"""The e2e tests' cluster: `common.runtime.launcher.LocalCluster` with the tests' defaults.

Workers are named prefill-<i> / decode-<i>, run the given model in float32 on one thread with a
64 MiB KV cache, and log to the test's tmp directory; the router and workers get ports from the OS.
"""

from __future__ import annotations

import time
from pathlib import Path

from common.runtime.launcher import LocalCluster, WorkerSpec


class Cluster(LocalCluster):
    """router + `prefill` prefill and `decode` decode processes; use as a context manager."""

    def __init__(
        self,
        model: str,
        tmp: Path,
        prefill: int = 1,
        decode: int = 1,
        dtype: str = "float32",
        engine_flags: tuple[str, ...] = (),
        router_flags: tuple[str, ...] = (),
    ) -> None:
        self.dtype, self.engine_flags = dtype, list(engine_flags)
        workers = [self.spec("prefill", f"prefill-{i}") for i in range(prefill)]
        workers += [self.spec("decode", f"decode-{i}") for i in range(decode)]
        super().__init__(
            model,
            workers,
            router_flags=router_flags,
            log_dir=tmp,
            env={"OMP_NUM_THREADS": "1"},
            startup_timeout_s=180,
        )

    def spec(self, role: str, name: str, extra: tuple[str, ...] = ()) -> WorkerSpec:
        flags = ["--dtype", self.dtype, "--num-threads", "1", "--kv-cache-memory", "64MiB"]
        return WorkerSpec(role, name, [*flags, *self.engine_flags, *extra])

    def start_worker(self, role, name: str = "", extra: tuple[str, ...] = ()):  # type: ignore[override]
        """`start_worker("decode", "decode-1")` with the tests' flags, or a WorkerSpec as is."""
        if isinstance(role, WorkerSpec):
            return super().start_worker(role)
        return super().start_worker(self.spec(role, name, extra))

    def wait_workers(self, prefill: int, decode: int, timeout_s: float = 180) -> None:
        """Until /health is 200 and the router lists prefill-0.. and decode-0.. as live."""
        names = [f"prefill-{i}" for i in range(prefill)] + [f"decode-{i}" for i in range(decode)]
        self.wait_ready(timeout_s, worker_ids=names)

    def wait_blocks_free(self, workers: list[str], timeout_s: float = 10) -> dict[str, tuple]:
        """Poll /metrics until each worker reports all blocks free; returns (free, total) each."""
        deadline = time.monotonic() + timeout_s
        state: dict[str, tuple] = {}
        while time.monotonic() < deadline:
            state = {
                w: (self.worker_gauge("num_free_blocks", w), self.worker_gauge("num_blocks", w))
                for w in workers
            }
            if all(f is not None and f == t for f, t in state.values()):
                return state
            time.sleep(0.3)
        return state
