"""Real multi-process clusters for end-to-end tests: router, prefill and decode workers.

Each stage is a separate `python -m common.cli ...` process on loopback ports; `Cluster` starts
them, waits for /health, and always stops every process it started.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Cluster:
    """router + prefill + decode processes for one model; use as a context manager."""

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
        self.model, self.tmp, self.dtype = model, tmp, dtype
        self.engine_flags = list(engine_flags)
        self.router_flags = list(router_flags)
        self.port, self.control_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.control = f"tcp://127.0.0.1:{self.control_port}"
        self.num_prefill, self.num_decode = prefill, decode
        self.procs: dict[str, subprocess.Popen] = {}

    def _spawn(self, name: str, args: list[str]) -> subprocess.Popen:
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        log = open(self.tmp / f"{name}.log", "wb")
        proc = subprocess.Popen(
            [sys.executable, "-m", "common.cli", *args],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
        )
        self.procs[name] = proc
        return proc

    def start_router(self) -> None:
        colocated = ["--colocated"] if self.num_prefill == 0 else []
        self._spawn(
            "router",
            [
                "router",
                "--port",
                str(self.port),
                "--control-port",
                str(self.control_port),
                "--model",
                self.model,
                *colocated,
                *self.router_flags,
            ],
        )

    def start_worker(self, role: str, name: str, extra: tuple[str, ...] = ()) -> None:
        args = [
            role,
            "--router",
            self.control,
            "--worker-id",
            name,
            "--model",
            self.model,
            "--dtype",
            self.dtype,
            "--num-threads",
            "1",
            "--kv-cache-memory",
            "64MiB",
            *self.engine_flags,
            *extra,
        ]
        self._spawn(name, args)

    def __enter__(self) -> Cluster:
        try:
            self.start_router()
            for i in range(self.num_prefill):
                self.start_worker("prefill", f"prefill-{i}")
            for i in range(self.num_decode):
                self.start_worker("decode", f"decode-{i}")
            self.wait_workers(self.num_prefill, self.num_decode)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        time.sleep(0.1)
        for proc in self.procs.values():  # a second SIGTERM: workers skip draining
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()

    def kill(self, name: str) -> None:
        self.procs[name].kill()
        self.procs[name].wait()

    def logs(self) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-3000:]}" for p in self.tmp.glob("*.log")
        )

    def metrics(self) -> str:
        return httpx.get(self.url + "/metrics", timeout=10).text

    def worker_gauge(self, name: str, worker: str) -> float | None:
        pattern = re.compile(
            rf'^pdserve:{name}\{{[^}}]*worker="{re.escape(worker)}"[^}}]*\}} (\S+)$', re.M
        )
        m = pattern.search(self.metrics())
        return float(m.group(1)) if m else None

    def wait_workers(self, prefill: int, decode: int, timeout_s: float = 180) -> None:
        """Until /health is 200 and the router lists the expected live workers' gauges."""
        deadline = time.monotonic() + timeout_s
        names = [f"prefill-{i}" for i in range(prefill)] + [f"decode-{i}" for i in range(decode)]
        while time.monotonic() < deadline:
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{dead} exited during startup\n{self.logs()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200 and all(
                    self.worker_gauge("num_blocks", n) is not None for n in names
                ):
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"cluster not healthy in {timeout_s} s\n{self.logs()}")

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
