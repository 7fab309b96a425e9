"""The one launcher of local clusters: a router and prefill / decode workers as child processes.

Owns starting `python -m common.cli router|prefill|decode ...` processes, learning the router's
ports, waiting until the cluster serves, reading its /metrics, and stopping every process it
started (SIGTERM twice, so workers skip draining, then SIGKILL for any that hang). With
`supervise=True` (`pdserve up`), `poll` restarts a worker that died (`common.runtime.supervise`:
backoff, a restart limit, a line on stderr) while the others keep serving. Used by
`pdserve up` (`common.runtime.up`), the end-to-end tests (`tests/e2e/cluster.py`) and the
benchmarks. It spawns processes and imports nothing of `router`, `prefill` or `decode`.

Ports: the router binds port 0 (unless given one) and writes the ports the OS gave it to a ready
file (`pdserve router --ready-file`); workers connect to the address read from it, and decode
workers bind their KV port 0 themselves. No port is picked by the launcher and released before a
child binds it, so parallel clusters cannot race for one. A restarted router binds the ports the
first one had, so that its workers find it again.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import common
from common.runtime import cores
from common.runtime.supervise import RestartPolicy, Supervisor

# Where `common` lives: children get it on PYTHONPATH, so `python -m common.cli` works from any
# directory whether or not pdserve is installed.
PACKAGE_ROOT = Path(common.__file__).resolve().parents[1]

_SAMPLE = re.compile(r"^([^\s{]+)(?:\{(.*)\})?\s+(\S+)$")
_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')


@dataclass
class WorkerSpec:
    """One worker to start: `role` prefill or decode, its flags after the router's address.

    `worker_id` (also the process's name in `LocalCluster.procs` and its log file) is passed as
    --worker-id when set; `threads` sets OMP_NUM_THREADS for the process."""

    role: str
    worker_id: str = ""
    flags: list[str] = field(default_factory=list)
    threads: int | None = None


def _unescape(value: str) -> str:
    """A label value as written in the text format (backslash escapes) -> the value."""
    return re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), value)


def parse_metrics(text: str) -> list[tuple[str, dict[str, str], float]]:
    """Prometheus text -> (name, labels, value) for every sample."""
    samples = []
    for line in text.splitlines():
        m = _SAMPLE.match(line)
        if m is None or line.startswith("#"):
            continue
        try:
            value = float(m.group(3))
        except ValueError:
            continue
        labels = {k: _unescape(v) for k, v in _LABEL.findall(m.group(2) or "")}
        samples.append((m.group(1), labels, value))
    return samples


class LocalCluster:
    """A router plus `workers`, each a child process; a context manager that starts and stops all.

    `log_dir`: each process writes `<name>-<process>.log` there (else they share this process's
    stdout and stderr). `port` / `control_port` 0: whatever the OS gives the router. `env`: extra
    environment for every process. `supervise`: `poll` restarts dead workers under `restart_policy`.
    """

    def __init__(
        self,
        model: str,
        workers: Sequence[WorkerSpec] = (),
        *,
        router_flags: Sequence[str] = (),
        host: str = "127.0.0.1",
        port: int = 0,
        control_port: int = 0,
        colocated: bool | None = None,
        log_dir: Path | None = None,
        name: str = "",
        env: Mapping[str, str] | None = None,
        startup_timeout_s: float = 600.0,
        supervise: bool = False,
        restart_policy: RestartPolicy | None = None,
        num_routers: int = 1,
        lend_cores: int = 0,
    ) -> None:
        """`num_routers`: router processes serving the same workers ("router", "router-1", ...;
        the first on `port` / `control_port`, the others on ports the OS gives). `lend_cores`:
        the cores the workers share, lending idle ones to each other (common.runtime.cores: a
        ledger file in the cluster's scratch directory); 0: no lending."""
        self.model, self.workers = model, list(workers)
        self.num_routers = num_routers
        self.router_ports: list[tuple[int, int]] = []  # (http, control) of each router started
        self.router_info: dict = {}  # the first router's ready file (its ports and settings)
        self.startup_timeout_s = startup_timeout_s  # what `with` gives `start`
        self.router_flags = list(router_flags)
        self.host, self.port, self.control_port = host, port, control_port
        # No prefill worker: the router must not wait for one to be healthy.
        self.colocated = (
            colocated if colocated is not None else not any(w.role == "prefill" for w in workers)
        )
        self.log_dir, self.name = log_dir, name
        self.env = dict(env or {})
        self.procs: dict[str, subprocess.Popen] = {}
        self._scratch: Path | None = None  # holds the router's ready file; made on first start
        self._num_unnamed = 0
        self._specs: dict[str, WorkerSpec] = {}  # each worker process's name -> how to start it
        self.supervisor = Supervisor(restart_policy or RestartPolicy()) if supervise else None
        self.lend_cores = lend_cores
        self._ledger: Path | None = None

    # ---- addresses ------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        """The router's HTTP base URL (known once the router has started)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.port}"

    @property
    def control(self) -> str:
        """The control address workers connect to (every router's, comma-separated)."""
        ports = [c for _, c in self.router_ports] or [self.control_port]
        return ",".join(f"tcp://127.0.0.1:{port}" for port in ports)

    def router_url(self, index: int) -> str:
        """The HTTP base URL of router `index` (0: `url`)."""
        host = "127.0.0.1" if self.host in ("0.0.0.0", "") else self.host
        return f"http://{host}:{self.router_ports[index][0]}"

    @staticmethod
    def router_name(index: int) -> str:
        return "router" if index == 0 else f"router-{index}"

    # ---- starting -------------------------------------------------------------------------------

    def __enter__(self) -> LocalCluster:
        try:
            self.start(self.startup_timeout_s)
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def start(self, timeout_s: float = 600.0) -> None:
        """The router, then every worker; returns once all serve (see `wait_ready`)."""
        deadline = time.monotonic() + timeout_s
        for index in range(self.num_routers):
            self.start_router(max(deadline - time.monotonic(), 1.0), index)
        for spec in self.workers:
            self.start_worker(spec)
        self.wait_ready(max(deadline - time.monotonic(), 1.0))

    def start_router(self, timeout_s: float = 120.0, index: int = 0) -> subprocess.Popen:
        """Start router `index` (0: the first; again: a restart on its ports) and wait for its
        ready file: then its `url` and `control` address are known."""
        if self._scratch is None:
            self._scratch = Path(tempfile.mkdtemp(prefix="pdserve-cluster-"))
        name = self.router_name(index)
        ready = self._scratch / f"{name}.ready"
        ready.unlink(missing_ok=True)
        if index < len(self.router_ports):
            port, control_port = self.router_ports[index]
        else:
            port, control_port = (self.port, self.control_port) if index == 0 else (0, 0)
        args = [
            "router",
            "--host", self.host,
            "--port", str(port),
            "--control-host", "127.0.0.1",
            "--control-port", str(control_port),
            "--model", self.model,
            "--ready-file", str(ready),
        ]  # fmt: skip
        if self.colocated:
            args.append("--colocated")
        proc = self._spawn(name, args + self.router_flags)
        deadline = time.monotonic() + timeout_s
        while not ready.exists():
            if proc.poll() is not None:
                raise RuntimeError(f"{name} exited with {proc.returncode}\n{self.logs()}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} did not start in {timeout_s} s\n{self.logs()}")
            time.sleep(0.05)
        bound = json.loads(ready.read_text())
        ports = (int(bound["http_port"]), int(bound["control_address"].rsplit(":", 1)[1]))
        if index < len(self.router_ports):
            self.router_ports[index] = ports
        else:
            self.router_ports.append(ports)
        if index == 0:
            self.port, self.control_port = ports
            self.router_info = bound
        return proc

    def start_worker(self, spec: WorkerSpec) -> subprocess.Popen:
        """Start one worker connected to the router (which must be started)."""
        if not self.control_port:
            raise RuntimeError("start the router before its workers")
        name = spec.worker_id
        if not name:
            name = f"{spec.role}-{self._num_unnamed}"
            self._num_unnamed += 1
        if not any(s is spec for s in self.workers):  # a worker added after `start`
            self.workers.append(spec)
        self._specs[name] = spec
        proc = self._spawn_worker(name)
        if self.supervisor is not None:
            self.supervisor.started(name)
        return proc

    def restart_worker(self, name: str) -> subprocess.Popen:
        """Start the worker process `name` again, with the flags it was first started with."""
        return self._spawn_worker(name)

    def _spawn_worker(self, name: str) -> subprocess.Popen:
        spec = self._specs[name]
        args = [spec.role, "--router", self.control]
        if spec.worker_id:
            args += ["--worker-id", spec.worker_id]
        args += ["--model", self.model, *spec.flags]
        extra = {"OMP_NUM_THREADS": str(spec.threads)} if spec.threads else {}
        if self.lend_cores > 0:
            extra[cores.LEDGER_ENV] = str(self._core_ledger())
        return self._spawn(name, args, extra)

    def _core_ledger(self) -> Path:
        """The workers' core ledger, made on first use (a slot per worker, restarts reuse the
        dead one's, room for workers added later)."""
        if self._ledger is None:
            if self._scratch is None:
                self._scratch = Path(tempfile.mkdtemp(prefix="pdserve-cluster-"))
            self._ledger = self._scratch / "cores.ledger"
            cores.create_ledger(self._ledger, self.lend_cores, max(16, 2 * len(self.workers)))
        return self._ledger

    def _spawn(
        self, name: str, args: list[str], env: Mapping[str, str] | None = None
    ) -> subprocess.Popen:
        path = os.pathsep.join(p for p in (str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")) if p)
        child_env = {**os.environ, "PYTHONUNBUFFERED": "1", **self.env, **(env or {})}
        child_env["PYTHONPATH"] = path
        out = None
        if self.log_dir is not None:
            prefix = f"{self.name}-" if self.name else ""
            out = open(self.log_dir / f"{prefix}{name}.log", "ab")  # noqa: SIM115 (child owns it)
        try:
            proc = subprocess.Popen(
                [sys.executable, "-m", "common.cli", *args],
                env=child_env,
                stdout=out,
                stderr=subprocess.STDOUT if out is not None else None,
            )
        finally:
            if out is not None:
                out.close()  # the child has its own descriptor
        self.procs[name] = proc
        return proc

    # ---- waiting --------------------------------------------------------------------------------

    def dead(self) -> list[str]:
        """Names of the processes that have exited."""
        return [n for n, p in self.procs.items() if p.poll() is not None]

    def poll(self) -> bool:
        """One look at the children: False when the cluster is over (the router died, or without
        supervision any process died, or with restarts off a worker died). With supervision, dead
        workers are restarted (after their backoff) and the cluster goes on; call this every few
        tenths of a second."""
        dead = self.dead()
        if "router" in dead:
            return False
        if self.supervisor is None:
            return not dead
        return self.supervisor.check(
            {n: self.procs[n].returncode for n in dead if n in self._specs}, self.restart_worker
        )

    def healthy(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=2) as resp:
                return resp.status == 200
        except (OSError, urllib.error.URLError):
            return False

    def wait_ready(self, timeout_s: float = 180.0, worker_ids: Sequence[str] | None = None) -> None:
        """Until /health answers 200 and the router reports the gauges of the workers named in
        `worker_ids` (default: every started worker with an id, and at least as many workers as
        were started). RuntimeError when a process exits meanwhile, TimeoutError after timeout_s."""
        at_least = 0
        if worker_ids is None:
            worker_ids = [w.worker_id for w in self.workers if w.worker_id]
            at_least = len(self.workers)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            dead = self.dead()
            if dead:
                raise RuntimeError(f"{dead} exited during startup\n{self.logs()}")
            if self.healthy():
                try:
                    live = {
                        labels.get("worker")
                        for name, labels, _ in parse_metrics(self.metrics())
                        if name == "pdserve:num_blocks"
                    }
                except OSError:
                    live = set()
                if set(worker_ids) <= live and len(live) >= at_least:
                    return
            time.sleep(0.3)
        raise TimeoutError(f"cluster not ready in {timeout_s} s\n{self.logs()}")

    # ---- metrics --------------------------------------------------------------------------------

    def metrics(self) -> str:
        """The router's /metrics text (behind the router's --api-key, when it has one)."""
        flags = self.router_flags
        key = flags[flags.index("--api-key") + 1] if "--api-key" in flags[:-1] else ""
        headers = {"Authorization": f"Bearer {key}"} if key else {}
        request = urllib.request.Request(self.url + "/metrics", headers=headers)
        with urllib.request.urlopen(request, timeout=10) as resp:
            return resp.read().decode()

    def sample(self, name: str, **labels: str) -> float | None:
        """pdserve:<name> summed over the series matching `labels`; None if there is none."""
        values = [
            value
            for n, have, value in parse_metrics(self.metrics())
            if n == "pdserve:" + name and all(have.get(k) == v for k, v in labels.items())
        ]
        return sum(values) if values else None

    def worker_gauge(self, name: str, worker: str) -> float | None:
        return self.sample(name, worker=worker)

    def wait_counter(self, name: str, at_least: float, timeout_s: float = 5.0, **labels) -> float:
        """Poll a worker counter until it reaches `at_least` (they travel with heartbeats)."""
        deadline = time.monotonic() + timeout_s
        while True:
            value = self.sample(name, **labels) or 0.0
            if value >= at_least or time.monotonic() > deadline:
                return value
            time.sleep(0.3)

    # ---- stopping -------------------------------------------------------------------------------

    def kill(self, name: str) -> None:
        """SIGKILL one process (a crash) and reap it."""
        self.procs[name].kill()
        self.procs[name].wait()

    def stop(self, timeout_s: float = 15.0) -> None:
        """Stop every process started, router included: SIGTERM, a second SIGTERM a moment later
        (workers then skip draining), SIGKILL for any still alive after timeout_s."""
        for _ in range(2):
            for proc in self.procs.values():
                if proc.poll() is None:
                    proc.terminate()
            time.sleep(0.1)
        deadline = time.monotonic() + timeout_s
        for proc in self.procs.values():
            try:
                proc.wait(timeout=max(deadline - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
            self._ledger = None

    def logs(self, chars: int = 3000) -> str:
        """The tail of every process's log (empty without a log_dir)."""
        if self.log_dir is None:
            return ""
        prefix = f"{self.name}-" if self.name else ""
        return "\n".join(
            f"--- {p.name}\n{p.read_text(errors='replace')[-chars:]}"
            for p in sorted(self.log_dir.glob(f"{prefix}*.log"))
        )
