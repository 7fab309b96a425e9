"""Prefixes fetched from peers on a real 2-prefill, 1-decode cluster (`kvtransfer.peer_fetch`).

Round-robin routing sends a prompt's second coming to the prefill worker that does not hold it,
so the router hints it at the one that does. The decode worker keeps no prefix cache here, so the
only peer holding the prefix is that prefill worker (the one the tests freeze or kill). Outputs are
greedy, so the same prompt must complete with the same text whether its prefix was computed,
fetched, or fetched in vain and then computed. Every live worker's block books balance at the end.
"""

from __future__ import annotations

import random
import signal
import threading
import time

import httpx

from tests.e2e.cluster import Cluster

PROMPT = random.Random(5).sample(range(300, 20000), 300)  # 18 blocks of 16 and a part
PREFILL = ("prefill-0", "prefill-1")
ROUTER_FLAGS = ("--local-prefill-max-tokens", "0", "--routing", "round_robin",
                "--heartbeat-timeout-s", "120", "--worker-stall-timeout-s", "0")  # fmt: skip


def cluster_for(model: str, tmp_path, router_flags: tuple[str, ...] = ()) -> Cluster:
    cluster = Cluster(model, tmp_path, prefill=2, decode=0,
                      router_flags=(*ROUTER_FLAGS, *router_flags))  # fmt: skip
    # no prefix cache on the decode worker: the prefill worker holding a prefix is its only peer
    cluster.workers.append(cluster.spec("decode", "decode-0", ("--no-enable-prefix-caching",)))
    return cluster


def complete(cluster: Cluster, model: str, prompt: list[int]) -> str:
    body = {"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0}
    r = httpx.post(cluster.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def counter(cluster: Cluster, name: str, worker: str) -> float:
    return cluster.sample(name, worker=worker) or 0.0


def computed_by(cluster: Cluster, worker: str) -> float:
    """The prompt tokens `worker` computed, once the router has heard of all of PROMPT's (up to
    10 s): counters travel with heartbeats, so the one that counted the failed fetch may have left
    before the recompute was counted."""
    return cluster.wait_counter("prefill_kv_computed_tokens_total", len(PROMPT), timeout_s=10,
                                worker=worker)  # fmt: skip


def computed_first(cluster: Cluster, model: str) -> tuple[str, str, str]:
    """Complete PROMPT once; (its text, the prefill worker that computed it, the other one),
    once the router's index has that worker's blocks of it (its KV events arrived)."""
    text = complete(cluster, model, PROMPT)
    deadline = time.monotonic() + 15
    while True:
        done = {w: counter(cluster, "prefill_kv_computed_tokens_total", w) for w in PREFILL}
        holder = max(done, key=lambda w: done[w])
        if done[holder] == len(PROMPT) and (
            cluster.worker_gauge("kv_index_blocks", holder) or 0
        ) >= 18:
            break
        assert time.monotonic() < deadline, cluster.metrics()
        time.sleep(0.2)
    assert sum(done.values()) == len(PROMPT), done
    return text, holder, PREFILL[1 - PREFILL.index(holder)]


def assert_books_balance(cluster: Cluster, workers: list[str]) -> None:
    state = cluster.wait_blocks_free(workers, timeout_s=20)
    assert all(f == t for f, t in state.values()), state


def test_a_fetched_prefix_completes_as_computed_with_fewer_prefill_tokens(
    chat_model_dir, tmp_path
):
    model = str(chat_model_dir)
    with cluster_for(model, tmp_path) as cluster:
        computed, holder, asker = computed_first(cluster, model)
        fetched = complete(cluster, model, PROMPT)  # round robin: the asker, hinted at holder
        assert fetched == computed
        tokens = cluster.wait_counter("kv_peer_fetched_tokens_total", 18 * 16, timeout_s=10,
                                      worker=asker)  # fmt: skip
        assert tokens == 18 * 16, cluster.metrics()
        assert cluster.wait_counter("kv_peer_served_tokens_total", 18 * 16, timeout_s=10,
                                    worker=holder) == 18 * 16  # fmt: skip
        # the asker computed the 12-token tail only
        assert cluster.wait_counter("prefill_kv_computed_tokens_total", len(PROMPT) - 18 * 16,
                                    timeout_s=10, worker=asker) == len(PROMPT) - 18 * 16
        assert counter(cluster, "kv_peer_fetch_failures_total", asker) == 0
        assert_books_balance(cluster, ["prefill-0", "prefill-1", "decode-0"])


def test_a_peer_killed_during_the_fetch_means_recompute_with_the_same_output(
    chat_model_dir, tmp_path
):
    model = str(chat_model_dir)
    with cluster_for(model, tmp_path) as cluster:
        computed, holder, asker = computed_first(cluster, model)
        peer = cluster.procs[holder]
        peer.send_signal(signal.SIGSTOP)  # it takes the fetch in (the kernel does) and answers not
        try:
            with httpx.Client(timeout=120) as client:
                body = {"model": model, "prompt": PROMPT, "max_tokens": 8, "temperature": 0}
                started = time.monotonic()
                # the request goes to the asker; the peer dies while its fetch is in flight
                killer = threading.Timer(1.0, cluster.kill, args=(holder,))
                killer.start()
                r = client.post(cluster.url + "/v1/completions", json=body)
                killer.join()
        finally:
            if peer.poll() is None:
                peer.kill()
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == computed
        assert time.monotonic() - started >= 1.0
        assert cluster.wait_counter("kv_peer_fetch_failures_total", 1, timeout_s=10,
                                    worker=asker) == 1  # fmt: skip
        assert counter(cluster, "kv_peer_fetched_tokens_total", asker) == 0
        assert computed_by(cluster, asker) == len(PROMPT)
        assert_books_balance(cluster, [asker, "decode-0"])


def test_a_peer_that_never_answers_means_recompute_and_its_late_answer_is_refused(
    chat_model_dir, tmp_path
):
    model = str(chat_model_dir)
    with cluster_for(model, tmp_path) as cluster:
        computed, holder, asker = computed_first(cluster, model)
        peer = cluster.procs[holder]
        peer.send_signal(signal.SIGSTOP)
        try:
            started = time.monotonic()
            assert complete(cluster, model, PROMPT) == computed  # the asker, after the timeout
            assert time.monotonic() - started >= 3.0  # router.prefill_leg.PEER_FETCH_TIMEOUT_S
        finally:
            peer.send_signal(signal.SIGCONT)  # it now answers the fetch: too late, refused
        assert cluster.wait_counter("kv_peer_fetch_failures_total", 1, timeout_s=10,
                                    worker=asker) == 1  # fmt: skip
        assert computed_by(cluster, asker) == len(PROMPT)
        assert_books_balance(cluster, ["prefill-0", "prefill-1", "decode-0"])


def test_peer_fetch_off_sends_no_hint(chat_model_dir, tmp_path):
    model = str(chat_model_dir)
    with cluster_for(model, tmp_path, ("--kv-peer-fetch", "off")) as cluster:
        computed, _, asker = computed_first(cluster, model)
        assert complete(cluster, model, PROMPT) == computed
        assert cluster.wait_counter("prefill_kv_computed_tokens_total", len(PROMPT),
                                    timeout_s=10, worker=asker) == len(PROMPT)  # fmt: skip
        for name in ("kv_peer_fetched_tokens_total", "kv_peer_fetch_failures_total",
                     "kv_peer_fetch_declined_total"):  # fmt: skip
            assert counter(cluster, name, asker) == 0, name  # a hint would have moved one
        assert_books_balance(cluster, ["prefill-0", "prefill-1", "decode-0"])
