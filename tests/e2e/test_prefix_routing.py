"""Prefix-aware routing and /metrics on a real 2-prefill, 1-decode cluster.

A prompt prefix goes to the prefill worker whose KV events say it holds it; once that worker is
overloaded (frozen with SIGSTOP, so its queue cannot drain), prompts with the same prefix go to
the other one. /metrics carries every series DESIGN.md section 8 lists, with the right types.
"""

from __future__ import annotations

import random
import signal
import threading
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.e2e.cluster import Cluster

PREFIX = random.Random(0).sample(range(300, 20000), 320)  # 20 blocks of 16 tokens
PREFILL = ("prefill-0", "prefill-1")


def suffix(i: int, n: int) -> list[int]:
    return random.Random(1000 + i).sample(range(300, 20000), n)


def complete(cluster: Cluster, model: str, prompt: list[int], max_tokens: int = 3) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    r = httpx.post(cluster.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def dispatched(cluster: Cluster) -> dict[str, int]:
    return {w: int(cluster.worker_gauge("prefill_dispatched_total", w) or 0) for w in PREFILL}


def wait_for(predicate, timeout_s: float, what: str, cluster: Cluster) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"{what}\n{cluster.metrics()}\n{cluster.logs()}"
        time.sleep(0.1)


def test_prefix_goes_to_its_holder_until_the_holder_is_overloaded(chat_model_dir, tmp_path):
    model = str(chat_model_dir)
    router_flags = ("--local-prefill-max-tokens", "0", "--heartbeat-timeout-s", "120")
    with Cluster(model, tmp_path, prefill=2, decode=1, router_flags=router_flags) as cluster:
        complete(cluster, model, PREFIX + suffix(0, 20))
        holder = max(PREFILL, key=lambda w: dispatched(cluster)[w])
        other = PREFILL[1 - PREFILL.index(holder)]
        # The holder's KV events reach the router's index (the 20 prefix blocks and more).
        wait_for(
            lambda: (cluster.worker_gauge("kv_index_blocks", holder) or 0) >= 20,
            10, "the holder's KV events never reached the index", cluster,
        )  # fmt: skip
        assert (cluster.worker_gauge("kv_index_blocks", other) or 0) == 0
        hits_before = cluster.worker_gauge("prefix_cache_hits_total", holder) or 0

        # 1. The same prefix with new questions: every one goes to the holder, and hits there.
        before = dispatched(cluster)
        for i in range(1, 5):
            complete(cluster, model, PREFIX + suffix(i, 10 + 7 * i))
        after = dispatched(cluster)
        assert after[holder] - before[holder] == 4, (before, after)
        assert after[other] == before[other]
        wait_for(
            lambda: (cluster.worker_gauge("prefix_cache_hits_total", holder) or 0)
            >= hits_before + 4 * len(PREFIX),
            10, "the holder's prefix cache hits did not grow", cluster,
        )  # fmt: skip

        # 2. The holder stops draining its queue: each prompt sent to it adds its 200 uncached
        # tokens to its load, until computing the whole prompt elsewhere scores better.
        cluster.procs[holder].send_signal(signal.SIGSTOP)
        results: dict[int, dict] = {}
        threads = []
        try:
            routed = []
            for i in range(8):
                before = dispatched(cluster)

                def run(i: int = i) -> None:
                    results[i] = complete(cluster, model, PREFIX + suffix(100 + i, 200))

                t = threading.Thread(target=run, daemon=True)
                t.start()
                threads.append(t)
                wait_for(
                    lambda before=before: sum(dispatched(cluster).values()) > sum(before.values()),
                    20, "a prompt was not dispatched", cluster,
                )  # fmt: skip
                now = dispatched(cluster)
                routed.append(holder if now[holder] > before[holder] else other)
                if routed[-1] == other:
                    break
            assert routed[0] == holder, routed  # lightly loaded, it still gets its prefix
            assert routed[-1] == other, routed  # then the load moves the prefix elsewhere
            # ... and that prompt is served while the holder is still frozen.
            threads[-1].join(timeout=60)
            assert len(routed) - 1 in results
            assert all(i not in results for i in range(len(routed) - 1))
        finally:
            cluster.procs[holder].send_signal(signal.SIGCONT)
        for t in threads:
            t.join(timeout=120)
        assert sorted(results) == list(range(len(routed)))
        assert all(r["usage"]["completion_tokens"] >= 1 for r in results.values())
        state = cluster.wait_blocks_free([*PREFILL, "decode-0"])
        assert all(f == t for f, t in state.values()), state
        # the block books answer at once; worker counters travel with the next heartbeat
        wait_for(
            lambda: all(
                (cluster.worker_gauge("kv_transfer_seconds_count", w) or 0) >= 1 for w in PREFILL
            )
            and cluster.worker_gauge("kv_cache_usage_perc", "decode-0") == 0.0,
            10, "the workers' last heartbeats never reached the router", cluster,
        )  # fmt: skip
        check_metrics(cluster.metrics())


# DESIGN.md section 8: name -> Prometheus type (parser family names: counters lose "_total").
DESIGN_METRICS = {
    "time_to_first_token_seconds": "histogram",
    "inter_token_latency_seconds": "histogram",
    "e2e_request_latency_seconds": "histogram",
    "request_queue_time_seconds": "histogram",
    "prompt_tokens": "counter",
    "generation_tokens": "counter",
    "num_requests_running": "gauge",
    "num_requests_waiting": "gauge",
    "kv_cache_usage_perc": "gauge",
    "num_preemptions": "counter",
    "prefix_cache_queries": "counter",
    "prefix_cache_hits": "counter",
    "spec_decode_num_draft_tokens": "counter",
    "spec_decode_num_accepted_tokens": "counter",
    "kv_transfer_bytes": "counter",
    "kv_transfer_seconds": "histogram",
    "kv_transfer_failures": "counter",
    "request_success": "counter",
}


def check_metrics(text: str) -> None:
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name, kind in DESIGN_METRICS.items():
        family = families.get("pdserve:" + name)
        assert family is not None, f"pdserve:{name} missing from /metrics"
        assert family.type == kind, (name, family.type)

    def value(name: str, **labels: str) -> float:
        """A sample summed over the labels not given (e.g. over workers)."""
        return sum(
            s.value
            for family in families.values()
            for s in family.samples
            if s.name == "pdserve:" + name and all(s.labels.get(k) == v for k, v in labels.items())
        )

    # Counters moved with the requests that ran (1 + 4 + the overload phase's).
    assert value("prompt_tokens_total") >= 5 * len(PREFIX)
    assert value("generation_tokens_total") >= 5
    assert value("request_success_total", finished_reason="length") >= 5
    assert value("prefix_cache_hits_total") >= 4 * len(PREFIX)
    assert value("prefix_cache_queries_total") >= value("prefix_cache_hits_total")
    assert value("kv_transfer_bytes_total") > 0
    assert value("time_to_first_token_seconds_count") >= 5
    # The worker-side histogram is per worker: both prefill workers pushed KV.
    for w in PREFILL:
        assert value("kv_transfer_seconds_count", worker=w) >= 1
    assert value("kv_cache_usage_perc", worker="decode-0") == 0.0


def test_colocated_prefix_goes_to_the_decode_worker_that_holds_it(chat_model_dir, tmp_path):
    """decode-1 gets the prefix while decode-0 is busy; idle again, decode-0 would win a tie on
    load, yet the prefix keeps going to decode-1."""
    model = str(chat_model_dir)
    with Cluster(model, tmp_path, prefill=0, decode=2) as cluster:

        def queries(w: str) -> float:
            return cluster.worker_gauge("prefix_cache_queries_total", w) or 0

        body = {"model": model, "prompt": suffix(99, 8), "max_tokens": 2000, "ignore_eos": True,
                "stream": True}  # fmt: skip
        with httpx.stream("POST", cluster.url + "/v1/completions", json=body, timeout=60) as r:
            lines = r.iter_lines()
            next(lines)  # streaming: decode-0 (a tie on load goes to the first id) is busy
            wait_for(lambda: queries("decode-0") > 0, 10, "the stream never started", cluster)
            complete(cluster, model, PREFIX + suffix(0, 20))
        wait_for(lambda: queries("decode-1") > 0, 10, "the prefix did not go to decode-1", cluster)
        wait_for(
            lambda: (cluster.worker_gauge("kv_index_blocks", "decode-1") or 0) >= 20
            and cluster.worker_gauge("worker_num_requests_running", "decode-0") == 0,
            10, "decode-1's KV events never reached the index, or decode-0 stayed busy", cluster,
        )  # fmt: skip
        before = queries("decode-0")
        for i in range(1, 4):
            complete(cluster, model, PREFIX + suffix(i, 10 + i))
        wait_for(
            lambda: (cluster.worker_gauge("prefix_cache_hits_total", "decode-1") or 0)
            >= 3 * len(PREFIX),
            10, "no prefix hits on decode-1", cluster,
        )  # fmt: skip
        assert queries("decode-0") == before  # decode-0 saw none of them
