"""The compose `monitoring` profile and the Grafana dashboard, checked with no Docker engine.

`docker-compose --profile monitoring config` (and `docker compose ...` where installed) validates
the profile; the structural checks: Prometheus scrapes every router's /metrics, Grafana gets that
Prometheus as its data source and the dashboard from deploy/grafana/pdserve.json, both publish on
loopback only, and a plain `up` starts neither. The dashboard itself: well-formed panels, and
queries that cover what operators watch (latency percentiles, token throughput, load, KV usage and
prefix hits per worker, KV transfer, speculation). That every queried metric exists in a running
cluster's /metrics is tests/deploy/test_k8s_cluster.py's job.
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.deploy.promql import (
    DASHBOARD,
    ROUTER_COUNTED,
    combined_over_routers,
    dashboard_exprs,
    metric_names,
)
from tests.deploy.test_compose import COMPOSE, _compose_v2_available, env, interpolate

DEPLOY = COMPOSE.parent
MONITORING = ("prometheus", "grafana")


@pytest.fixture(scope="module")
def compose() -> dict:
    return interpolate(yaml.safe_load(COMPOSE.read_text()))


def _config(cmd: list[str]) -> dict:
    result = subprocess.run(
        [*cmd, "-f", str(COMPOSE), "--profile", "monitoring", "config"],
        capture_output=True,
        text=True,
        cwd=DEPLOY.parent,
    )
    assert result.returncode == 0, result.stderr
    return yaml.safe_load(result.stdout)


@pytest.mark.skipif(shutil.which("docker-compose") is None, reason="docker-compose not installed")
def test_monitoring_profile_valid_docker_compose_v1() -> None:
    config = _config(["docker-compose"])
    assert set(MONITORING) <= set(config["services"])


@pytest.mark.skipif(not _compose_v2_available(), reason="docker compose v2 not installed")
def test_monitoring_profile_valid_docker_compose_v2() -> None:
    config = _config(["docker", "compose"])
    assert set(MONITORING) <= set(config["services"])


def _bind_mounts(svc: dict) -> dict[str, Path]:
    """container path -> the host path (relative to deploy/) of each bind mount."""
    out = {}
    for volume in svc.get("volumes", []):
        source, target = volume.split(":")[:2]
        if source.startswith("."):
            out[target] = (DEPLOY / source).resolve()
    return out


def test_monitoring_only_with_its_profile(compose: dict) -> None:
    for name, svc in compose["services"].items():
        if name in MONITORING:
            assert svc["profiles"] == ["monitoring"], name
        else:
            assert "profiles" not in svc, name  # pdserve itself starts with or without it
        for port in svc.get("ports", []) if name in MONITORING else []:
            assert str(port).startswith("127.0.0.1:"), (name, port)


def test_prometheus_scrapes_every_router(compose: dict) -> None:
    prometheus = compose["services"]["prometheus"]
    mounts = _bind_mounts(prometheus)
    config_flag = next(a for a in prometheus["command"] if a.startswith("--config.file="))
    config = yaml.safe_load(mounts[config_flag.split("=", 1)[1]].read_text())
    (job,) = config["scrape_configs"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    # One target per router replica (DNS service discovery on the service name): a static
    # `router:8000` would scrape whichever replica the name gave that time.
    assert "static_configs" not in job
    (sd,) = job["dns_sd_configs"]
    router_port = env(compose["services"]["router"])["PDSERVE_PORT"]
    assert sd["names"] == ["router"] and sd.get("type", "SRV") == "A"
    assert str(sd["port"]) == router_port
    assert "router" in prometheus["depends_on"]


def test_grafana_provisions_prometheus_and_the_dashboard(compose: dict) -> None:
    grafana = compose["services"]["grafana"]
    mounts = _bind_mounts(grafana)
    for path in mounts.values():
        assert path.exists(), path
    (datasource,) = yaml.safe_load(
        (mounts["/etc/grafana/provisioning/datasources"] / "prometheus.yml").read_text()
    )["datasources"]
    assert datasource["type"] == "prometheus"
    assert datasource["url"] == "http://prometheus:9090" and datasource["isDefault"]
    (provider,) = yaml.safe_load(
        (mounts["/etc/grafana/provisioning/dashboards"] / "pdserve.yml").read_text()
    )["providers"]
    folder = provider["options"]["path"]
    dashboards = {t: p for t, p in mounts.items() if t.startswith(folder + "/")}
    assert list(dashboards.values()) == [DASHBOARD]


def test_dashboard_is_well_formed() -> None:
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] == "pdserve"
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dashboard["panels"]:
        grid = panel["gridPos"]
        assert 0 <= grid["x"] and grid["x"] + grid["w"] <= 24, panel["title"]
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        assert panel["targets"], panel["title"]
        refs = [t["refId"] for t in panel["targets"]]
        assert len(refs) == len(set(refs)), panel["title"]


def test_dashboard_covers_the_issue() -> None:
    queried: dict[str, set[str]] = {}
    for title, expr in dashboard_exprs():
        for name in metric_names(expr):
            queried.setdefault(name, set()).add(title)
    required = {
        "pdserve:time_to_first_token_seconds_bucket",
        "pdserve:inter_token_latency_seconds_bucket",
        "pdserve:e2e_request_latency_seconds_bucket",
        "pdserve:generation_tokens_total",
        "pdserve:num_requests_running",
        "pdserve:num_requests_waiting",
        "pdserve:kv_cache_usage_perc",
        "pdserve:prefix_cache_hits_total",
        "pdserve:prefix_cache_queries_total",
        "pdserve:kv_transfer_bytes_total",
        "pdserve:kv_transfer_seconds_bucket",
        "pdserve:kv_transfer_failures_total",
        "pdserve:spec_decode_num_accepted_tokens_total",
        "pdserve:spec_decode_num_draft_tokens_total",
    }
    assert required <= queried.keys(), required - queried.keys()
    exprs = " ".join(e for _, e in dashboard_exprs())
    for q in ("0.5", "0.9", "0.99"):  # percentiles of the latency histograms
        assert f"histogram_quantile({q}, " in exprs
    # KV usage and prefix hit rate are shown per worker: one series each, named after it.
    panels = json.loads(DASHBOARD.read_text())["panels"]
    for title in ("KV cache usage per worker", "Prefix cache hit rate per worker"):
        (panel,) = [p for p in panels if p["title"] == title]
        assert all(t["legendFormat"] == "{{worker}}" for t in panel["targets"]), title


def test_dashboard_combines_the_routers_series_rightly() -> None:
    # Every router is scraped and reports every worker: a router's own counts add up over
    # routers, a worker's heartbeat values (and the live-worker count) are the same from each and
    # are taken once, or a panel would show them doubled with two routers.
    for title, expr in dashboard_exprs():
        for name in metric_names(expr):
            expected = "sum" if name in ROUTER_COUNTED else "max"
            assert combined_over_routers(expr, name) == expected, (title, name, expr)
