"""The base manifests' own command lines bring up a working cluster (as local processes).

Renders deploy/k8s/base, starts the router, prefill and decode Deployments' containers with the
command and environment the manifests give them, as many pods as each Deployment's replicas (two
routers, one worker of each stage; tests/deploy/local_pods.py: Service names -> 127.0.0.1, the
routers' headless Service -> every router pod's address, downward-API values filled in, volumes ->
local directories), with two more
substitutions: PDSERVE_MODEL is a tiny random-weight model carrying the default model's tokenizer
(tests/tiny_models.py), and PDSERVE_KV_CACHE_MEMORY a KV cache sized for it (64 MiB, as the other
e2e tests use) instead of the 1 GiB the manifests give the real model, so that three processes
start quickly on a shared CPU. Then, on that one
cluster: every router gets both workers and turns ready; a real request through each router, which
counts it in its own /metrics only while both report the workers' heartbeats; every metric the
HPAs, the prometheus-adapter rules and the Grafana dashboard query exists in /metrics; the probes
the manifests define answer, and a worker's readiness goes false while it drains after SIGTERM.
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
    """The base's Deployments as local processes (a pod per replica, named pdserve-<stage>-<i>),
    logs in `tmp`. Pods are named by their name; `stage` arguments mean the stage's first pod."""

    def __init__(self, tmp: Path, model: Path) -> None:
        self.tmp = tmp
        self.objects = render(ROOT / "deploy" / "k8s" / "base")
        self.pods: dict[str, LocalPod] = {}
        for stage in STAGES:
            deployment = find(self.objects, "Deployment", f"pdserve-{stage}")
            for i in range(deployment["spec"].get("replicas", 1)):
                name = f"pdserve-{stage}-{i}"
                self.pods[name] = LocalPod.of(deployment, name)
        secret_dir = tmp / "cluster-secret"
        secret_dir.mkdir()
        (secret_dir / "secret").write_text(secrets.token_hex(32))
        self.mounts = {
            "/cache": Path(os.environ.get("PDSERVE_CACHE", "~/.cache/pdserve")).expanduser(),
            "/etc/pdserve/cluster-secret": secret_dir,
        }
        self.model = model
        self.procs: dict[str, subprocess.Popen] = {}
        self.stopped: set[str] = set()  # pods a test stopped on purpose

    def _name(self, pod: str) -> str:
        return pod if pod in self.pods else f"pdserve-{pod}-0"

    def pod(self, pod: str) -> LocalPod:
        return self.pods[self._name(pod)]

    def routers(self) -> list[str]:
        return [name for name in self.pods if name.startswith("pdserve-router-")]

    def env(self, pod: str) -> dict[str, str]:
        pod_env = self.pod(pod).env(self.objects, self.pods, self.mounts, secrets={})
        # The two substitutions beyond the cluster's (see the module docstring).
        pod_env["PDSERVE_MODEL"] = str(self.model)
        pod_env["PDSERVE_KV_CACHE_MEMORY"] = "64MiB"
        base = {k: v for k, v in os.environ.items() if not k.startswith("PDSERVE_")}
        return {**base, "PYTHONPATH": str(PACKAGE_ROOT), **pod_env}

    def start(self) -> None:
        for name, pod in self.pods.items():  # all at once, as Kubernetes would; workers retry
            log = open(self.tmp / f"{name}.log", "wb")
            self.procs[name] = subprocess.Popen(
                pod.argv(), env=self.env(name), stdout=log, stderr=subprocess.STDOUT
            )
            log.close()
        self.wait(
            lambda: all(self.probe(r, "readinessProbe") == 200 for r in self.routers()),
            "every router ready (workers registered with each)",
        )

    def wait(self, condition, what: str, timeout_s: float = STARTUP_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for name, proc in self.procs.items():
                if proc.poll() is not None and name not in self.stopped:
                    pytest.fail(f"{name} exited ({proc.returncode}):\n{self.log(name)}")
            if condition():
                return
            time.sleep(0.1)
        logs = "\n".join(f"--- {name}\n{self.log(name)}" for name in self.pods)
        pytest.fail(f"timed out waiting for {what}\n{logs}")

    def log(self, pod: str) -> str:
        return (self.tmp / f"{self._name(pod)}.log").read_text(errors="replace")[-3000:]

    def url_of(self, pod: str) -> str:
        return f"http://127.0.0.1:{self.pod(pod).local_port('http')}"

    @property
    def url(self) -> str:
        return self.url_of("router")

    def probe(self, pod: str, kind: str) -> int | None:
        """The status of the manifests' `kind` probe (httpGet only), None if nothing answers."""
        container = main_container(self.pod(pod).deployment)
        get = container[kind]["httpGet"]
        port = self.pod(pod).local_port(named_port(container, get["port"]))
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
    for stage in ("prefill", "decode"):  # every worker's KV receiver: prompts' KV, peer fetches
        kv_port = cluster.pod(stage).local_port("kv")
        assert cluster.env(stage)["PDSERVE_KV_PORT"] == str(kv_port), stage
        assert cluster.env(stage)["PDSERVE_KV_ADVERTISE_HOST"] == "127.0.0.1", stage
    routers = cluster.routers()
    assert len(routers) >= 2  # the Deployment's replicas
    controls = [f"tcp://127.0.0.1:{cluster.pod(r).local_port('control')}" for r in routers]
    for stage in ("prefill", "decode"):  # every router, as the headless Service's name resolves
        assert cluster.env(stage)["PDSERVE_ROUTER"] == ",".join(controls)
    secrets_read = {cluster.env(p)["PDSERVE_CLUSTER_SECRET_FILE"] for p in cluster.pods}
    assert len(secrets_read) == 1  # one cluster secret for every router and worker


def _metric(samples: list, name: str, **labels: str) -> float:
    values = [v for n, lab, v in samples if n == name and labels.items() <= lab.items()]
    return sum(values)


def test_every_router_serves_and_counts_only_its_own(cluster: ManifestCluster) -> None:
    routers = cluster.routers()
    body = {"prompt": "The capital of France is", "max_tokens": 6, "temperature": 0,
            "ignore_eos": True}  # fmt: skip
    for router in routers:
        assert cluster.probe(router, "readinessProbe") == 200  # workers registered with each
    for router in routers:
        before = {
            r: parse_metrics(httpx.get(cluster.url_of(r) + "/metrics", timeout=10).text)
            for r in routers
        }
        model = httpx.get(cluster.url_of(router) + "/v1/models", timeout=10).json()["data"][0]
        reply = httpx.post(
            cluster.url_of(router) + "/v1/completions", json={**body, "model": model["id"]},
            timeout=60,
        )  # fmt: skip
        assert reply.status_code == 200, (router, reply.text)
        assert reply.json()["usage"]["completion_tokens"] == 6
        after = {
            r: parse_metrics(httpx.get(cluster.url_of(r) + "/metrics", timeout=10).text)
            for r in routers
        }
        for other in routers:  # the tokens count on the router that served them, only there
            gained = _metric(after[other], "pdserve:generation_tokens_total") - _metric(
                before[other], "pdserve:generation_tokens_total"
            )
            assert gained == (6 if other == router else 0), (router, other, gained)
    # Every router reports every worker's heartbeat series: the same worker, once per router. A
    # worker starved of CPU on a loaded host can miss its heartbeat deadline on one router and
    # rejoin a moment later (its series then comes back): wait a few heartbeats for it.
    for router in routers:
        deadline = time.monotonic() + 15
        while True:
            text = httpx.get(cluster.url_of(router) + "/metrics", timeout=10).text
            workers = {lab.get("worker") for n, lab, _ in parse_metrics(text)
                       if n == "pdserve:num_blocks"}  # fmt: skip
            if workers == {"pdserve-prefill-0", "pdserve-decode-0"} or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert workers == {"pdserve-prefill-0", "pdserve-decode-0"}, (router, workers)


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
    cluster.stopped.add("pdserve-prefill-0")
    cluster.procs["pdserve-prefill-0"].send_signal(signal.SIGTERM)
    cluster.wait(lambda: cluster.probe("prefill", "readinessProbe") == 503, "not ready", 10)
    assert cluster.probe("prefill", "livenessProbe") == 200  # draining is alive
    assert cluster.procs["pdserve-prefill-0"].wait(timeout=30) == 0  # idle: drained and exited
    assert cluster.probe("decode", "readinessProbe") == 200
