"""A router and workers as separate processes, each stage with its own flags, for benchmarks.

`pdserve up` gives every worker the same engine flags; the routing and interference benchmarks
need per-stage settings (a prefill worker's KV cache size, a worker's thread count), so this starts
`python -m common.cli router|prefill|decode` itself, on free loopback ports, waits for /health
and the workers' gauges, reads /metrics, and always stops everything it started.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ProcCluster:
    """router + workers; `workers` is a list of (role, worker id, extra flags)."""

    def __init__(
        self,
        name: str,
        model: str,
        router_flags: list[str],
        workers: list[tuple[str, str, list[str]]],
        log_dir: Path,
    ) -> None:
        self.name, self.model, self.log_dir = name, model, log_dir
        self.port, self.control_port = free_port(), free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.router_flags, self.workers = router_flags, workers
        self.procs: dict[str, subprocess.Popen] = {}

    def _spawn(self, name: str, args: list[str], threads: int = 1) -> None:
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS=str(threads))
        out = open(self.log_dir / f"{self.name}-{name}.log", "wb")
        self.procs[name] = subprocess.Popen(
            [sys.executable, "-m", "common.cli", *args],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def start(self, timeout_s: float = 900) -> None:
        log(f"{self.name}: starting router + {len(self.workers)} workers")
        control = f"tcp://127.0.0.1:{self.control_port}"
        colocated = [] if any(role == "prefill" for role, _, _ in self.workers) else ["--colocated"]
        self._spawn(
            "router",
            ["router", "--port", str(self.port), "--control-port", str(self.control_port),
             "--model", self.model, *colocated, *self.router_flags],
        )  # fmt: skip
        for role, worker_id, flags in self.workers:
            threads = 1
            if "--num-threads" in flags:
                threads = int(flags[flags.index("--num-threads") + 1])
            self._spawn(
                worker_id,
                [role, "--router", control, "--worker-id", worker_id, "--model", self.model,
                 *flags],
                threads,
            )  # fmt: skip
        t0 = time.monotonic()
        while time.monotonic() - t0 < timeout_s:
            dead = [n for n, p in self.procs.items() if p.poll() is not None]
            if dead:
                raise RuntimeError(f"{self.name}: {dead} exited during startup\n{self.logs()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200 and all(
                    self.sample("num_blocks", worker=w) is not None for _, w, _ in self.workers
                ):
                    log(f"{self.name}: ready after {time.monotonic() - t0:.0f} s at {self.url}")
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise TimeoutError(f"{self.name}: not ready in {timeout_s} s\n{self.logs()}")

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        for proc in self.procs.values():  # a second SIGTERM: no draining
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log(f"{self.name}: stopped")

    def __enter__(self) -> ProcCluster:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    def logs(self, chars: int = 3000) -> str:
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-chars:]}"
            for p in sorted(self.log_dir.glob(f"{self.name}-*.log"))
        )

    def samples(self) -> list:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        return [s for f in text_string_to_metric_families(text) for s in f.samples]

    def sample(self, name: str, **labels: str) -> float | None:
        """pdserve:<name> summed over the series matching `labels`; None if there is none."""
        values = [
            s.value
            for s in self.samples()
            if s.name == "pdserve:" + name and all(s.labels.get(k) == v for k, v in labels.items())
        ]
        return sum(values) if values else None

    def wait_counter(self, name: str, at_least: float, timeout_s: float = 5.0, **labels) -> float:
        """Poll a worker counter until it reaches `at_least` (they travel with heartbeats)."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.sample(name, **labels) or 0.0
            if value >= at_least or time.monotonic() > deadline:
                return value
            time.sleep(0.3)
