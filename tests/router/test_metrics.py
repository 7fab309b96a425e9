"""router/metrics.py without processes: a request's timings on a hand-set clock, and the /metrics
text (parsed back with prometheus_client) for router series and workers' heartbeats."""

from __future__ import annotations

import math

import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.protocol import PROTOCOL_VERSION, Heartbeat, HistogramSnapshot, KVEvents, Register
from router.kv_index import PrefixIndex
from router.metrics import RouterMetrics
from router.registry import Worker


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
    success = fams["pdserve:request_success"]
    assert samples(success, "pdserve:request_success_total") == [({"finished_reason": "length"}, 1)]
    errors = fams["pdserve:request_errors"]
    assert samples(errors, "pdserve:request_errors_total") == [({"code": "504"}, 1.0)]
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
    assert "kv_cache_usage_perc" not in text
