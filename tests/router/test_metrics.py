"""router/metrics.py without processes: a request's timings on a hand-set clock, and the /metrics
text (parsed back with prometheus_client) for router series and workers' heartbeats. Then a fresh
in-process router's first scrapes (tests/router/fake_worker.py): every metric name that deploy/
queries (Grafana dashboard, prometheus-adapter rules and HPAs, alert and recording rules; read
out of those files) and that the README documents is there before any request."""

from __future__ import annotations

import math
import re
import time
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from common.protocol import PROTOCOL_VERSION, Heartbeat, HistogramSnapshot, KVEvents, Register
from common.runtime.launcher import parse_metrics
from router.kv_index import PrefixIndex
from router.metrics import RouterMetrics
from router.registry import Worker
from tests.deploy.promql import ROOT, metric_names, queried_metrics
from tests.router.fake_worker import RouterThread


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def worker(worker_id: str, role: str, heartbeat: Heartbeat | None = None, **load) -> Worker:
    info = Register(
        version=PROTOCOL_VERSION,
        role=role,
        worker_id=worker_id,
        model="m",
        block_size=16,
        num_blocks=100,
        max_model_len=2048,
        dtype="float32",
        host="h",
    )
    return Worker(info=info, identity=worker_id.encode(), last_seen_s=0.0, heartbeat=heartbeat,
                  **load)  # fmt: skip


def families(text: str) -> dict:
    return {f.name: f for f in text_string_to_metric_families(text)}


def samples(family, name: str | None = None, **labels) -> list[tuple[dict, float]]:
    """(labels, value) of a family's samples named `name` (default: the family) with `labels`."""
    name = name or family.name
    return [
        (s.labels, s.value)
        for s in family.samples
        if s.name == name and all(s.labels.get(k) == v for k, v in labels.items())
    ]


def test_request_timer_observes_queue_ttft_itl_and_e2e() -> None:
    clock = Clock()
    metrics = RouterMetrics(clock=clock)
    timer = metrics.start_request()  # arrives at 0
    clock.now = 0.25
    timer.dispatched()
    clock.now = 0.5
    timer.tokens(0, 1)  # the request's first token
    clock.now = 0.9
    timer.tokens(0, 2)  # two tokens in one message: 0.2 s each
    clock.now = 1.0
    timer.tokens(1, 1)  # choice 1's first token: not a TTFT again, no gap to measure yet
    timer.tokens(1, 0)  # no tokens: nothing observed
    clock.now = 2.0
    timer.finished(prompt_tokens=7, completion_tokens=4, finish_reasons=["length", "stop"])
    assert (metrics.queue_time.count, metrics.queue_time.sum) == (1, 0.25)
    assert (metrics.ttft.count, metrics.ttft.sum) == (1, 0.5)
    assert metrics.itl.count == 2 and metrics.itl.sum == pytest.approx(0.4)
    assert (metrics.e2e.count, metrics.e2e.sum) == (1, 2.0)
    assert (metrics.prompt_tokens_total, metrics.generation_tokens_total) == (7, 4)
    assert dict(metrics.request_success_total) == {"length": 1, "stop": 1}
    metrics.start_request().failed(503)
    metrics.start_request().failed(503)
    metrics.start_request().failed(400)
    assert dict(metrics.request_errors_total) == {503: 2, 400: 1}


def test_render_router_series() -> None:
    clock = Clock()
    metrics = RouterMetrics(clock=clock)
    timer = metrics.start_request()
    clock.now = 0.03
    timer.tokens(0, 1)
    clock.now = 3.0
    timer.finished(5, 1, ["length"])
    metrics.start_request().failed(504)
    text = metrics.render(num_running=2, num_waiting=1, workers=[])
    assert text.endswith("\n")
    assert "# HELP pdserve:time_to_first_token_seconds Request arrival to first token." in text
    assert "# TYPE pdserve:time_to_first_token_seconds histogram" in text
    fams = families(text)
    assert samples(fams["pdserve:num_requests_running"]) == [({}, 2.0)]
    assert samples(fams["pdserve:num_requests_waiting"]) == [({}, 1.0)]
    ttft = fams["pdserve:time_to_first_token_seconds"]
    buckets = {s.labels["le"]: s.value for s in ttft.samples if s.name.endswith("_bucket")}
    # Cumulative: 0.03 s falls in le=0.04 and every bucket above, not in le=0.02.
    assert (buckets["0.02"], buckets["0.04"], buckets["640.0"], buckets["+Inf"]) == (0, 1, 1, 1)
    assert samples(ttft, ttft.name + "_count") == [({}, 1.0)]
    assert samples(ttft, ttft.name + "_sum")[0][1] == pytest.approx(0.03)
    assert samples(fams["pdserve:prompt_tokens"], "pdserve:prompt_tokens_total") == [({}, 5.0)]
    # Every finish reason and error code is a series from the start, at 0 until counted.
    success = fams["pdserve:request_success"]
    assert sorted(
        (labels["finished_reason"], value)
        for labels, value in samples(success, "pdserve:request_success_total")
    ) == [("length", 1), ("stop", 0), ("tool_calls", 0)]
    errors = fams["pdserve:request_errors"]
    errors_by_code = {
        labels["code"]: value for labels, value in samples(errors, "pdserve:request_errors_total")
    }
    assert errors_by_code["504"] == 1.0
    assert {v for c, v in errors_by_code.items() if c != "504"} == {0.0}
    assert {"400", "429", "503"} <= errors_by_code.keys()
    workers = fams["pdserve:num_workers"]
    assert sorted((s.labels["role"], s.value) for s in workers.samples) == [
        ("decode", 0),
        ("prefill", 0),
    ]
    assert "pdserve:kv_index_resyncs" not in fams  # no index, no series


def test_render_workers_from_heartbeats_and_the_prefix_index() -> None:
    transfer = HistogramSnapshot(buckets=[0.01, 0.1], counts=[3, 1, 0], sum=0.08, count=4)
    broken = HistogramSnapshot(buckets=[0.01, 0.1], counts=[3], sum=0.0, count=3)
    hb = Heartbeat(
        worker_id="d0",
        num_running=3,
        num_waiting=1,
        num_free_blocks=25,
        num_blocks=100,
        counters={
            "num_preemptions_total": 2.0,
            "spec_decode_num_drafts_total": 4.0,
            "spec_decode_num_accepted_tokens_total": 6.0,
            "odd.name-here": 1.5,  # not a metric name: sanitized
            "9lives": 1.0,  # cannot start with a digit: dropped
        },
        histograms={"kv_transfer_seconds": transfer, "broken_seconds": broken},
    )
    decode = worker("d0", "decode", hb, num_in_flight=4)
    prefill = worker("p0", "prefill", num_prefill_dispatched=6, prefix_matched_tokens=32)
    quoted = worker('p"1\\', "prefill")  # label values are escaped
    index = PrefixIndex()
    index.apply(KVEvents(worker_id="p0", seq=0, stored=[b"a", b"b"], evicted=[], reset=True))
    fams = families(RouterMetrics().render(0, 0, [quoted, decode, prefill], index))

    d0 = {"worker": "d0", "role": "decode"}
    assert samples(fams["pdserve:kv_cache_usage_perc"]) == [(d0, 0.75)]
    assert samples(fams["pdserve:num_free_blocks"]) == [(d0, 25.0)]
    assert samples(fams["pdserve:worker_num_requests_running"]) == [(d0, 3.0)]
    assert samples(fams["pdserve:worker_num_requests_in_flight"], worker="d0") == [(d0, 4.0)]
    preempt = fams["pdserve:num_preemptions"]
    assert preempt.type == "counter"
    assert samples(preempt, "pdserve:num_preemptions_total") == [(d0, 2.0)]
    assert fams["pdserve:odd_name_here"].type == "gauge"  # no _total: a gauge
    assert not any("9lives" in name for name in fams)
    # 1 + accepted / drafts: 1 + 6 / 4
    assert samples(fams["pdserve:spec_decode_mean_accepted_length"]) == [(d0, 2.5)]
    kv = fams["pdserve:kv_transfer_seconds"]
    assert kv.type == "histogram"
    assert [v for _, v in samples(kv, kv.name + "_bucket")] == [3, 4, 4]  # cumulative
    assert "pdserve:broken_seconds" not in fams  # counts do not fit the buckets

    p0 = {"worker": "p0", "role": "prefill"}
    dispatched = fams["pdserve:prefill_dispatched"]
    assert samples(dispatched, dispatched.name + "_total", worker="p0") == [(p0, 6.0)]
    matched = fams["pdserve:prefix_routing_matched_tokens"]
    assert samples(matched, matched.name + "_total", worker="p0") == [(p0, 32.0)]
    assert samples(fams["pdserve:kv_index_blocks"], worker="p0") == [(p0, 2.0)]
    assert samples(fams["pdserve:kv_index_blocks"], worker="d0") == [(d0, 0.0)]
    # p0 sent no heartbeat yet: it has no heartbeat series.
    assert samples(fams["pdserve:num_free_blocks"], worker="p0") == []
    quoted_labels = {"worker": 'p"1\\', "role": "prefill"}  # escaped, and parsed back whole
    assert samples(fams["pdserve:worker_num_requests_in_flight"], worker='p"1\\') == [
        (quoted_labels, 0.0)
    ]
    roles = {s.labels["role"]: s.value for s in fams["pdserve:num_workers"].samples}
    assert roles == {"prefill": 2, "decode": 1}
    assert samples(fams["pdserve:kv_index_resyncs"], "pdserve:kv_index_resyncs_total") == [
        ({}, 0.0)
    ]


def test_number_format_of_infinities_and_nan() -> None:
    hb = Heartbeat(
        worker_id="d0",
        num_running=0,
        num_waiting=0,
        num_free_blocks=0,
        num_blocks=0,  # no blocks: no usage ratio to report
        counters={"up_gauge": math.inf, "down_gauge": -math.inf, "unknown_gauge": math.nan},
    )
    text = RouterMetrics().render(0, 0, [worker("d0", "decode", hb)])
    assert 'pdserve:up_gauge{worker="d0",role="decode"} +Inf' in text
    assert 'pdserve:down_gauge{worker="d0",role="decode"} -Inf' in text
    assert 'pdserve:unknown_gauge{worker="d0",role="decode"} NaN' in text
    assert "pdserve:kv_cache_usage_perc{" not in text  # HELP and TYPE only


def test_worker_counters_are_the_workers_totals_never_summed() -> None:
    """Each heartbeat replaces a worker's counters: a request's prefix-cache query counts once
    however many heartbeats and scrapes pass."""
    metrics = RouterMetrics()

    def queries(total: float) -> list:
        hb = Heartbeat("p0", 0, 0, 10, 10, 0, {"prefix_cache_queries_total": total})
        fams = families(metrics.render(0, 0, [worker("p0", "prefill", hb)]))
        family = fams["pdserve:prefix_cache_queries"]
        return [v for _, v in samples(family, "pdserve:prefix_cache_queries_total")]

    assert queries(100.0) == [100.0]
    assert queries(100.0) == [100.0]  # scraped again: the same
    assert queries(150.0) == [150.0]


def _rule_exprs() -> dict[str, str]:
    """expr -> where, of every Prometheus alerting or recording rule under deploy/ (rule files and
    PrometheusRule objects alike: any mapping with `expr` beside `alert` or `record`)."""
    found: dict[str, str] = {}

    def walk(node: object, path: Path) -> None:
        if isinstance(node, dict):
            if isinstance(node.get("expr"), str) and ("alert" in node or "record" in node):
                found[node["expr"]] = f"{path.name} rule {node.get('alert') or node['record']}"
            for value in node.values():
                walk(value, path)
        elif isinstance(node, list):
            for value in node:
                walk(value, path)

    for path in sorted((ROOT / "deploy").rglob("*.y*ml")):
        try:
            docs = list(yaml.safe_load_all(path.read_text()))
        except yaml.YAMLError:
            continue  # not plain YAML (a Helm template): its rules are not ours to read
        for doc in docs:
            walk(doc, path)
    return found


def _documented() -> dict[str, str]:
    """Metric names the README's Metrics section names -> where."""
    readme = (ROOT / "README.md").read_text()
    section = readme.split("### Metrics", 1)[1].split("\n#", 1)[0]
    names = re.findall(r"`(?:pdserve:)?([a-z][a-z0-9_]*)(?:\{[^}`]*\})?`", section)
    # (a label such as `worker` has no underscore; every metric name here has one)
    return {f"pdserve:{name}": "README's Metrics section" for name in names if "_" in name}


def _wanted() -> dict[str, str]:
    wanted = queried_metrics()
    for expr, where in _rule_exprs().items():
        for name in metric_names(expr):
            wanted.setdefault(name, where)
    for name, where in _documented().items():
        wanted.setdefault(name, where)
    return wanted


def _family(name: str, types: dict[str, str]) -> str | None:
    """The family a sample name belongs to (a histogram's _bucket / _sum / _count)."""
    if name in types:
        return name
    base = re.sub(r"_(bucket|sum|count)$", "", name)
    return base if types.get(base) == "histogram" else None


def test_a_fresh_routers_first_scrape_has_every_queried_and_documented_metric() -> None:
    wanted = _wanted()
    assert "pdserve:request_errors_total" in wanted and "pdserve:kv_cache_usage_perc" in wanted
    with RouterThread() as router:
        text = httpx.get(router.url + "/metrics", timeout=10).text  # the very first scrape
        types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
        helps = set(re.findall(r"^# HELP (\S+) ", text, re.M))
        missing = {n: w for n, w in wanted.items() if _family(n, types) not in helps}
        assert not missing, f"no HELP/TYPE on the first scrape: {missing}"
        # With no worker yet, every series that needs none has its zero sample already.
        sampled = {name for name, _, _ in parse_metrics(text)}
        for name in (
            "request_errors_total",
            "request_success_total",
            "prompt_tokens_total",
            "num_requests_running",
            "num_workers",
            "time_to_first_token_seconds_bucket",
        ):
            assert "pdserve:" + name in sampled, name

        # A prefill and a decode worker whose heartbeats carry none of the documented counters
        # (the fake's): from their first heartbeat every queried name has a sample.
        router.worker("prefill", "p0")
        router.worker("decode", "d0")
        deadline = time.monotonic() + 10
        while True:
            text = httpx.get(router.url + "/metrics", timeout=10).text
            samples_ = parse_metrics(text)
            beating = {lb.get("worker") for n, lb, _ in samples_ if n == "pdserve:num_blocks"}
            if beating >= {"p0", "d0"} or time.monotonic() > deadline:
                break
            time.sleep(0.1)
        assert beating >= {"p0", "d0"}
        types = dict(re.findall(r"^# TYPE (\S+) (\S+)$", text, re.M))
        sampled = {name for name, _, _ in samples_}
        sampled |= {_family(name, types) for name in sampled}  # a histogram's family name too
        queried = {
            n: w for n, w in wanted.items() if n != "pdserve:spec_decode_mean_accepted_length"
        }
        missing = {n: w for n, w in queried.items() if n not in sampled}
        assert not missing, f"no sample with a prefill and a decode worker live: {missing}"


def test_a_large_clusters_scrape_renders_off_the_event_loop(monkeypatch) -> None:
    """Past METRICS_INLINE_WORKERS the render runs on the router's thread pool (at 1,000 workers
    it took a quarter of a second, every stream waiting): the same text comes back."""
    import router.app

    monkeypatch.setattr(router.app, "METRICS_INLINE_WORKERS", 0)
    with RouterThread(colocated=True) as r:
        r.worker("decode", "d0")
        state = r.server.state
        offloaded = []
        pool = state.offload

        async def spy(fn, *args):
            offloaded.append(getattr(fn, "__name__", ""))
            return await pool(fn, *args)

        state.offload = spy
        text = httpx.get(r.url + "/metrics").text
        assert offloaded == ["render"]
        names = {f.name for f in text_string_to_metric_families(text)}
        assert "pdserve:worker_num_requests_in_flight" in names
        assert 'worker="d0"' in text
