"""The metric names that deploy/ queries: PromQL in the dashboard, the adapter rules and the HPAs.

Owns a small PromQL reader (`metric_names`): it drops string literals, label matchers `{...}`,
range and subquery brackets `[...]`, grouping clauses (`by (...)`, `on (...)`, ...), numbers and
durations, then every identifier left that is not a keyword and not followed by `(` (a function or
an aggregation) is a metric name. And `queried_metrics`, which collects them from
deploy/grafana/pdserve.json (every target's `expr`), deploy/k8s/autoscaling's
prometheus-adapter-values.yaml (`seriesQuery`, and `metricsQuery` with `<<.Series>>` filled in) and
hpa.yaml (each Pods metric, through the adapter rule that names it).
With several routers every router pod is scraped: `ROUTER_COUNTED` names the series a router
counts itself (add them up over routers); every other series comes from the workers' heartbeats
or the registry, the same from each router (take it once: `max`). `combined_over_routers` says
which of the two an expression does to a metric.

Used by tests/deploy/test_k8s.py (static checks) and test_k8s_cluster.py (each name exists in a
running cluster's /metrics).
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "deploy" / "grafana" / "pdserve.json"
AUTOSCALING = ROOT / "deploy" / "k8s" / "autoscaling"
ADAPTER_VALUES = AUTOSCALING / "prometheus-adapter-values.yaml"
HPA = AUTOSCALING / "hpa.yaml"

_STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`')
_BRACES = re.compile(r"\{[^{}]*\}")
_BRACKETS = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_NUMBER = re.compile(r"(?<![A-Za-z0-9_:])(?:0x[0-9a-fA-F]+|\d+(?:\.\d*)?(?:[eE][+-]?\d+)?\w*)")
_IDENT = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan", "atan2", "by", "without", "on",
             "ignoring", "group_left", "group_right"}  # fmt: skip


# What a router counts itself (router.metrics.RouterMetrics and, per worker, its own dispatches).
ROUTER_COUNTED = {
    *(f"pdserve:{name}_{suffix}" for name in ("time_to_first_token_seconds",
      "inter_token_latency_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds")
      for suffix in ("bucket", "sum", "count")),
    "pdserve:prompt_tokens_total", "pdserve:generation_tokens_total",
    "pdserve:request_success_total", "pdserve:request_errors_total",
    "pdserve:num_requests_running", "pdserve:num_requests_waiting",
    "pdserve:num_requests_admitted_waiting", "pdserve:num_requests_rejected_total",
    "pdserve:kv_index_resyncs_total", "pdserve:worker_num_requests_in_flight",
    "pdserve:prefill_dispatched_total", "pdserve:prefix_routing_matched_tokens_total",
    "pdserve:prefill_queued_tokens",
}  # fmt: skip


def combined_over_routers(expr: str, metric: str) -> str | None:
    """How `expr` first aggregates `metric` (directly or over its rate/increase): 'sum', 'max'
    or None when it reads the metric without an aggregation around it."""
    m = re.search(
        r"\b(sum|max)\s*(?:by\s*\([^()]*\)\s*)?\(\s*(?:(?:rate|irate|increase)\s*\(\s*)?"
        + re.escape(metric)
        + r"(?![A-Za-z0-9_:])",
        expr,
    )
    return m.group(1) if m else None


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads."""
    text = _STRING.sub(" ", expr)
    text = text.replace("$__rate_interval", "1m").replace("$__interval", "1m")
    while True:  # innermost first: matchers, ranges and grouping lists hold no metric names
        stripped = _GROUPING.sub(" ", _BRACKETS.sub(" ", _BRACES.sub(" ", text)))
        if stripped == text:
            break
        text = stripped
    text = _NUMBER.sub(" ", text)
    names = set()
    for m in _IDENT.finditer(text):
        word = m.group(0)
        if word.lower() in _KEYWORDS or text[m.end() :].lstrip().startswith("("):
            continue
        names.add(word)
    return names


def adapter_rules() -> list[dict]:
    return yaml.safe_load(ADAPTER_VALUES.read_text())["rules"]["custom"]


def adapter_metric(rule: dict) -> tuple[str, str]:
    """(series name in Prometheus, metric name in the custom metrics API) of an adapter rule."""
    (series,) = metric_names(rule["seriesQuery"])
    api_name = re.sub(
        rule["name"]["matches"], rule["name"]["as"].replace("${", "\\g<").replace("}", ">"), series
    )
    return series, api_name


def hpa_metrics() -> list[tuple[str, str]]:
    """(HPA name, custom metric name) for every Pods metric of every HPA in hpa.yaml."""
    out = []
    for hpa in yaml.safe_load_all(HPA.read_text()):
        for metric in hpa["spec"]["metrics"]:
            out.append((hpa["metadata"]["name"], metric[metric["type"].lower()]["metric"]["name"]))
    return out


def dashboard_exprs() -> list[tuple[str, str]]:
    """(panel title, expr) for every query in the Grafana dashboard."""
    dashboard = json.loads(DASHBOARD.read_text())
    out = []
    for panel in dashboard["panels"]:
        for target in panel.get("targets", []):
            out.append((panel["title"], target["expr"]))
    return out


def queried_metrics() -> dict[str, str]:
    """Every metric name deploy/ queries -> where (for messages)."""
    found: dict[str, str] = {}
    for title, expr in dashboard_exprs():
        for name in metric_names(expr):
            found.setdefault(name, f"dashboard panel {title!r}")
    api_to_series = {}
    for rule in adapter_rules():
        series, api_name = adapter_metric(rule)
        api_to_series[api_name] = series
        metrics_query = rule["metricsQuery"].replace("<<.Series>>", series)
        metrics_query = metrics_query.replace("<<.LabelMatchers>>", 'a="b"')
        metrics_query = metrics_query.replace("<<.GroupBy>>", "pod")
        for name in metric_names(rule["seriesQuery"]) | metric_names(metrics_query):
            found.setdefault(name, f"adapter rule for {series}")
    for hpa, metric in hpa_metrics():
        if metric not in api_to_series:
            raise ValueError(f"HPA {hpa}: no prometheus-adapter rule serves {metric}")
        found.setdefault(api_to_series[metric], f"HPA {hpa} ({metric})")
    return found
