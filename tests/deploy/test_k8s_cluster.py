"""The base manifests' own command lines bring up a working cluster (as local processes).

Renders deploy/k8s/base, starts the router, prefill and decode Deployments' containers with the
command and environment the manifests give them (tests/deploy/local_pods.py: Service names ->
127.0.0.1, downward-API values filled in, volumes -> local directories), with two more
substitutions: PDSERVE_MODEL is a tiny random-weight model carrying the default model's tokenizer
(tests/tiny_models.py), and PDSERVE_KV_CACHE_MEMORY a KV cache sized for it (64 MiB, as the other
e2e tests use) instead of the 1 GiB the manifests give the real model, so that three processes
start quickly on a shared CPU. Then, on that one
cluster: a real request through the router; every metric the HPAs, the prometheus-adapter rules
and the Grafana dashboard query exists in its /metrics; the probes the manifests define answer,
and a worker's readiness goes false while it drains after SIGTERM.
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import time
from pathlib import Path

import httpx
import pytest

from common.runtime.launcher import PACKAGE_ROOT, parse_metrics
from tests.deploy.kustomize import render
from tests.deploy.local_pods import LocalPod, find, main_container, named_port
from tests.deploy.promql import queried_metrics
from tests.tiny_models import build_tiny_chat_model

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
STAGES = ("router", "prefill", "decode")
STARTUP_TIMEOUT_S = 120


class ManifestCluster:
    """The base's Deployments as local processes (one pod each), logs in `tmp`."""

    def __init__(self, tmp: Path, model: Path) -> None:
        self.tmp = tmp
        self.objects = render(ROOT / "deploy" / "k8s" / "base")
        self.pods = {
            f"pdserve-{stage}": LocalPod.of(
                find(self.objects, "Deployment", f"pdserve-{stage}"), f"pdserve-{stage}-0"
            )
            for stage in STAGES
        }
        secret_dir = tmp / "cluster-secret"
        secret_dir.mkdir()
        (secret_dir / "secret").write_text(secrets.token_hex(32))
        self.mounts = {
            "/cache": Path(os.environ.get("PDSERVE_CACHE", "~/.cache/pdserve")).expanduser(),
            "/etc/pdserve/cluster-secret": secret_dir,
        }
        self.model = model
        self.procs: dict[str, subprocess.Popen] = {}
        self.stopped: set[str] = set()  # stages a test stopped on purpose

    def pod(self, stage: str) -> LocalPod:
        return self.pods[f"pdserve-{stage}"]

    def env(self, stage: str) -> dict[str, str]:
        pod_env = self.pod(stage).env(self.objects, self.pods, self.mounts, secrets={})
        # The two substitutions beyond the cluster's (see the module docstring).
        pod_env["PDSERVE_MODEL"] = str(self.model)
        pod_env["PDSERVE_KV_CACHE_MEMORY"] = "64MiB"
        base = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
        return {**base, "PYTHONPATH": str(PACKAGE_ROOT), **pod_env}

    def start(self) -> None:
        for stage in STAGES:  # all at once, as Kubernetes would; workers retry registering
            log = open(self.tmp / f"{stage}.log", "wb")
            self.procs[stage] = subprocess.Popen(
                self.pod(stage).argv(), env=self.env(stage), stdout=log, stderr=subprocess.STDOUT
            )
            log.close()
        self.wait(lambda: self.probe("router", "readinessProbe") == 200, "router ready")

    def wait(self, condition, what: str, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for stage, proc in self.procs.items():
                if proc.poll() is not None and stage not in self.stopped:
                    pytest.fail(f"{stage} exited ({proc.returncode}):\n{self.log(stage)}")
            if condition():
                return
            time.sleep(0.1)
        logs = "\n".join(f"--- {s}\n{self.log(s)}" for s in STAGES)
        pytest.fail(f"timed out waiting for {what}\n{logs}")

    def log(self, stage: str) -> str:
        return (self.tmp / f"{stage}.log").read_text(errors="replace")[-3000:]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.pod('router').local_port('http')}"

    def probe(self, stage: str, kind: str) -> int | None:
        """The status of the manifests' `kind` probe (httpGet only), None if nothing answers."""
        container = main_container(self.pod(stage).deployment)
        get = container[kind]["httpGet"]
        port = self.pod(stage).local_port(named_port(container, get["port"]))
        try:
            return httpx.get(f"http://127.0.0.1:{port}{get['path']}", timeout=5).status_code
        except httpx.TransportError:
            return None

    def stop(self) -> None:
        for proc in self.procs.values():  # twice: the first makes workers drain, the second ends it
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        time.sleep(0.2)
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        for proc in self.procs.values():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("k8s-base")
    model = build_tiny_chat_model(tmp_path_factory.mktemp("tiny-chat"))
    c = ManifestCluster(tmp, model)
    try:
        c.start()
        c.wait(
            lambda: all(c.probe(s, "readinessProbe") == 200 for s in ("prefill", "decode")),
            "workers ready",
        )
        yield c
    finally:
        c.stop()


def test_workers_get_the_wiring_the_manifests_give(cluster: ManifestCluster) -> None:
    # What the run below depends on, read back from the environment the processes got.
    decode = cluster.env("decode")
    assert decode["PDSERVE_WORKER_ID"] == "pdserve-decode-0"  # the pod name (downward API)
    assert decode["PDSERVE_KV_ADVERTISE_HOST"] == "127.0.0.1"  # the pod IP (downward API)
    control = cluster.pod("router").local_port("control")
    for stage in ("prefill", "decode"):
        assert cluster.env(stage)["PDSERVE_ROUTER"] == f"tcp://127.0.0.1:{control}"


def test_request_through_the_router(cluster: ManifestCluster) -> None:
    models = httpx.get(cluster.url + "/v1/models", timeout=10).json()["data"]
    body = {
        "model": models[0]["id"],
        "messages": [{"role": "user", "content": "Hello there, how are you today?"}],
        "max_tokens": 8,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = httpx.post(cluster.url + "/v1/chat/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["usage"]["completion_tokens"] == 8
    assert out["choices"][0]["finish_reason"] == "length"
    # A bad request too, so the error counters the dashboard shows exist.
    bad = httpx.post(cluster.url + "/v1/chat/completions", json={**body, "max_tokens": -1})
    assert bad.status_code == 400


def test_every_queried_metric_exists(cluster: ManifestCluster) -> None:
    queried = queried_metrics()
    assert queried, "no PromQL found"
    samples: list = []

    def scraped() -> bool:  # per-worker series start with the worker's first heartbeat
        samples[:] = parse_metrics(httpx.get(cluster.url + "/metrics", timeout=10).text)
        return {name for name, _, _ in samples} >= queried.keys()

    deadline = time.monotonic() + 10
    while not scraped() and time.monotonic() < deadline:
        time.sleep(0.2)
    exposed = {name for name, _, _ in samples}
    missing = {name: where for name, where in queried.items() if name not in exposed}
    assert not missing, f"queried but not in /metrics: {missing}"
    # The per-worker series the HPAs use are labelled with the worker pods' names.
    for name in ("pdserve:prefill_queued_tokens", "pdserve:kv_cache_usage_perc"):
        workers = {labels.get("worker") for n, labels, _ in samples if n == name}
        assert workers & {"pdserve-prefill-0", "pdserve-decode-0"}, name


def test_probes_answer_and_readiness_drops_while_draining(cluster: ManifestCluster) -> None:
    for stage in ("prefill", "decode"):
        assert cluster.probe(stage, "livenessProbe") == 200
        assert cluster.probe(stage, "startupProbe") == 200
        assert cluster.probe(stage, "readinessProbe") == 200  # registered
    # SIGTERM (what the kubelet sends): the prefill worker drains, and is not ready meanwhile.
    cluster.stopped.add("prefill")
    cluster.procs["prefill"].send_signal(signal.SIGTERM)
    cluster.wait(lambda: cluster.probe("prefill", "readinessProbe") == 503, "not ready", 10)
    assert cluster.probe("prefill", "livenessProbe") == 200  # draining is alive
    assert cluster.procs["prefill"].wait(timeout=30) == 0  # idle: drained and exited
    assert cluster.probe("decode", "readinessProbe") == 200
