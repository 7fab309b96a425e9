"""A worker's HTTP health endpoint, for Kubernetes probes: `/healthz` (alive) and `/readyz` (ready).

Owns a tiny stdlib HTTP server in a daemon thread (`--health-port`, off by default) that reads the
state of a `WorkerBase` and never touches its engine:
- `/healthz` (liveness, and the startup probe): 200 while the worker makes progress (main-loop
  turns, and decoder layers inside a long step: `WorkerBase.progress`); 503 once it has not moved
  for `stall_timeout_s` (a stuck step or a deadlock; the heartbeat thread would go on beating, so
  heartbeats alone cannot tell).
- `/readyz` (readiness): 200 once the router accepted the worker's registration, 503 before that,
  while it drains (after SIGTERM: it takes no new work) and while it re-registers with a router
  that forgot it.

An HTTP endpoint rather than an exec probe: the state lives in the worker process, kubelet probes
it without starting a process in the container (a `python` exec every few seconds would compete
with the engine for the CPU), and the same endpoint serves any orchestrator. The bodies are one
word of plain text (`ok`, `draining`, ...), so a person can `curl` it too.

Started by `prefill.cli` and `decode.cli` when `--health-port` is given.
"""

from __future__ import annotations

import http.server
import logging
import threading
import time
from collections.abc import Callable
from typing import Protocol

log = logging.getLogger(__name__)

DEFAULT_STALL_TIMEOUT_S = 60.0


class _Event(Protocol):
    def is_set(self) -> bool: ...


class _Heartbeater(Protocol):
    reregister: _Event


class ProbedWorker(Protocol):
    """What the probes read of a worker (`common.runtime.worker.WorkerBase` has all of it)."""

    progress: int  # turns of the main loop plus decoder layers run
    draining: bool
    registered: bool
    heartbeat: _Heartbeater


class WorkerHealth:
    """Liveness and readiness of one worker, as (ok, one-word reason)."""

    def __init__(
        self,
        worker: ProbedWorker,
        stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.worker = worker
        self.stall_timeout_s = stall_timeout_s
        self.clock = clock
        self._lock = threading.Lock()  # the server answers from several threads
        self._seen_count = worker.progress
        self._seen_s = clock()  # when the loop count last moved (or the probes started)

    def liveness(self) -> tuple[bool, str]:
        with self._lock:
            now, count = self.clock(), self.worker.progress
            if count != self._seen_count:
                self._seen_count, self._seen_s = count, now
            stalled_s = now - self._seen_s
        if stalled_s > self.stall_timeout_s:
            return False, f"stalled {stalled_s:.0f}s"
        return True, "ok"

    def readiness(self) -> tuple[bool, str]:
        w = self.worker
        if w.draining:
            return False, "draining"
        if not w.registered:
            return False, "registering"
        if w.heartbeat.reregister.is_set():  # the router forgot us; the main loop re-registers
            return False, "re-registering"
        return True, "ok"


class _Handler(http.server.BaseHTTPRequestHandler):
    health: WorkerHealth  # set on the subclass HealthServer makes

    def do_GET(self) -> None:  # noqa: N802 (the http.server API)
        path = self.path.split("?", 1)[0]
        if path == "/healthz":
            ok, reason = self.health.liveness()
        elif path == "/readyz":
            ok, reason = self.health.readiness()
        else:
            ok, reason = False, "not found"
        code = 200 if ok else 503 if path in ("/healthz", "/readyz") else 404
        body = (reason + "\n").encode()
        self.send_response(code)
        self.send_header("Content-Type", "text/plain; charset=utf-8")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args) -> None:  # probes every few seconds: not logged
        pass


class HealthServer:
    """`/healthz` and `/readyz` for `worker` on host:port (port 0: any free port), in a thread."""

    def __init__(
        self,
        worker: ProbedWorker,
        host: str,
        port: int,
        stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
    ) -> None:
        self.health = WorkerHealth(worker, stall_timeout_s)
        handler = type("HealthHandler", (_Handler,), {"health": self.health})
        self.server = http.server.ThreadingHTTPServer((host, port), handler)
        self.server.daemon_threads = True
        self.port = self.server.server_address[1]
        self._thread = threading.Thread(
            target=self.server.serve_forever, name="health", daemon=True
        )

    def start(self) -> HealthServer:
        self._thread.start()
        log.info("health endpoint on port %d (/healthz, /readyz)", self.port)
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def start_health_server(
    worker: ProbedWorker, host: str, port: int, stall_timeout_s: float
) -> HealthServer | None:
    """The running health server for `--health-port` (None when the port is 0: off)."""
    if port <= 0:
        return None
    return HealthServer(worker, host, port, stall_timeout_s).start()
