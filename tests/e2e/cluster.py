"""The e2e tests' cluster: `common.runtime.launcher.LocalCluster` with the tests' defaults.

Workers are named prefill-<i> / decode-<i>, run the given model in float32 on one thread with a
64 MiB KV cache, and log to the test's tmp directory; the router and workers get ports from the OS.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx

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
        routers: int = 1,
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
            num_routers=routers,
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

    def block_books(self) -> dict[str, dict | None]:
        """Each worker's KV block audit, asked now (`GET /debug/block_books`); None: no answer."""
        return httpx.get(self.url + "/debug/block_books", timeout=15).json()["workers"]

    def wait_blocks_free(self, workers: list[str], timeout_s: float = 10) -> dict[str, tuple]:
        """Ask the workers for their block books until each has every block free (or cached) and
        its books balance; returns (free, total) each, or (errors, total) where they do not balance.

        The workers answer between steps, after the request: unlike a heartbeat gauge, the answer
        never predates what the test just did.
        """
        deadline = time.monotonic() + timeout_s
        state: dict[str, tuple] = {}
        while time.monotonic() < deadline:
            books = self.block_books()
            state = {}
            for w in workers:
                b = books.get(w)
                if b is None:
                    state[w] = (None, None)
                elif b["errors"]:
                    state[w] = (b["errors"], b["total"])
                else:
                    state[w] = (b["free"] + b["cached"], b["total"])
            if all(f is not None and f == t for f, t in state.values()):
                return state
            time.sleep(0.3)
        return state
