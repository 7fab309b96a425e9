"""common/runtime/health.py: the workers' /healthz and /readyz, against a stand-in worker.

The stand-in has the attributes the probes read (`common.runtime.worker.WorkerBase` has them; a
test below checks that), so no engine is loaded; tests/deploy/test_k8s_cluster.py probes real
workers started from the Kubernetes manifests.
"""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import httpx
import zmq

from common.runtime.health import HealthServer, WorkerHealth, start_health_server
from common.runtime.worker import WorkerBase


class FakeHeartbeater:
    def __init__(self) -> None:
        self.reregister = threading.Event()


class FakeWorker:
    def __init__(self) -> None:
        self.progress = 0
        self.draining = False
        self.registered = False
        self.heartbeat = FakeHeartbeater()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_readiness_follows_registration_drain_and_reregistration() -> None:
    worker = FakeWorker()
    health = WorkerHealth(worker)
    assert health.readiness() == (False, "registering")
    worker.registered = True
    assert health.readiness() == (True, "ok")
    worker.heartbeat.reregister.set()  # the router forgot this worker
    assert health.readiness() == (False, "re-registering")
    worker.heartbeat.reregister.clear()
    worker.draining = True
    assert health.readiness() == (False, "draining")


def test_liveness_fails_only_when_the_loop_stops_turning() -> None:
    worker, clock = FakeWorker(), Clock()
    health = WorkerHealth(worker, stall_timeout_s=60, clock=clock)
    clock.now += 59  # still registering, loop not started: within the window
    assert health.liveness() == (True, "ok")
    worker.progress = 5
    clock.now += 30  # moved since the last probe: the window starts again
    assert health.liveness() == (True, "ok")
    clock.now += 60
    assert health.liveness() == (True, "ok")
    clock.now += 1
    ok, reason = health.liveness()
    assert not ok and reason.startswith("stalled")
    worker.progress = 6  # it recovered
    assert health.liveness() == (True, "ok")
    worker.draining = True  # a draining worker is alive
    assert health.liveness() == (True, "ok")


def test_http_endpoints() -> None:
    worker = FakeWorker()
    server = HealthServer(worker, "127.0.0.1", 0, stall_timeout_s=60).start()
    try:
        url = f"http://127.0.0.1:{server.port}"
        r = httpx.get(url + "/readyz")
        assert (r.status_code, r.text) == (503, "registering\n")
        worker.registered = True
        assert httpx.get(url + "/readyz").status_code == 200
        assert httpx.get(url + "/readyz?verbose=1").status_code == 200
        r = httpx.get(url + "/healthz")
        assert (r.status_code, r.text) == (200, "ok\n")
        worker.draining = True
        assert httpx.get(url + "/readyz").status_code == 503
        assert httpx.get(url + "/nothing").status_code == 404
    finally:
        server.stop()


def test_off_by_default() -> None:
    assert start_health_server(FakeWorker(), "127.0.0.1", 0, 60) is None


def test_worker_base_has_what_the_probes_read() -> None:
    # WorkerBase touches only the engine's block pool, KV tier and model counter: a stand-in
    model = SimpleNamespace(layers_run=0)
    runner = SimpleNamespace(model=model)
    pool = SimpleNamespace(track_events=False)
    engine = SimpleNamespace(pool=pool, tier=None, runner=runner, num_steps=0)
    worker = WorkerBase(engine, "tcp://127.0.0.1:1", "w", zmq.Context())  # connects lazily
    try:
        health = WorkerHealth(worker)
        assert health.readiness() == (False, "registering")
        assert health.liveness() == (True, "ok")
        model.layers_run = 30  # a long step's layers move the progress the probes read
        assert worker.progress == 30
        worker.registered = True  # what WorkerBase.run sets once the router accepted it
        assert health.readiness() == (True, "ok")
    finally:
        worker.close()
        worker.context.term()


def test_worker_cli_flags() -> None:
    import argparse

    from common.runtime.worker_cli import add_worker_args

    parser = argparse.ArgumentParser()
    add_worker_args(parser)
    args = parser.parse_args([])
    assert args.health_port == 0  # off unless asked
    args = parser.parse_args(["--health-port", "8080", "--health-stall-timeout-s", "5"])
    assert (args.health_port, args.health_stall_timeout_s) == (8080, 5.0)


def test_a_loop_that_turns_while_work_waits_and_nothing_runs_makes_no_progress() -> None:
    # The PD deadlock kept the loop turning with sequences waiting: the loop count moved, so no
    # check ever fired. Only steps that ran, layers, and turns with no work count now.
    waiting = SimpleNamespace(has_work=True, ran=False)

    def step() -> list:
        if waiting.ran:
            engine.num_steps += 1
        return []

    model = SimpleNamespace(layers_run=0)
    engine = SimpleNamespace(
        pool=SimpleNamespace(
            track_events=False, drain_events=lambda: ([], []), cached_keys=list, num_blocks=8
        ),
        runner=SimpleNamespace(model=model),
        tier=None,
        num_steps=0,
        has_unfinished=lambda: waiting.has_work,
        reserved={},
    )
    worker = WorkerBase(engine, "tcp://127.0.0.1:1", "w", zmq.Context())
    worker.step, worker.is_idle = step, lambda: not waiting.has_work
    worker.control.poll = lambda timeout_ms: []
    worker.control.send = lambda message: None
    try:
        health = WorkerHealth(worker, stall_timeout_s=0.05)
        for _ in range(5):
            worker.turn()
        assert worker.progress == 0  # turned 5 times, work waiting, nothing ran
        time.sleep(0.1)
        alive, reason = health.liveness()
        assert not alive and reason.startswith("stalled")
        waiting.ran = True  # steps run again
        worker.turn()
        assert worker.progress == 1 and health.liveness() == (True, "ok")
        waiting.has_work, waiting.ran = False, False  # idle turns count
        worker.turn()
        assert worker.progress == 2
        waiting.has_work = True  # work waits for KV on its way: a wait, not a stall
        engine.reserved["r"] = object()
        worker.turn()
        assert worker.progress == 3
    finally:
        worker.close()
        worker.context.term()
