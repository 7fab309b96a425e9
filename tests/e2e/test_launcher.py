"""The one launcher: routers on ports from the OS, metrics parsing, everything stopped."""

from __future__ import annotations

import time

import httpx

from common.runtime.launcher import LocalCluster, parse_metrics


def test_parse_metrics() -> None:
    text = (
        "# HELP pdserve:num_blocks KV blocks (heartbeat).\n"
        "# TYPE pdserve:num_blocks gauge\n"
        'pdserve:num_blocks{role="decode",worker="decode-0"} 512.0\n'
        'pdserve:num_blocks{role="prefill",worker="a \\"b\\""} 64\n'
        "pdserve:requests_total 3\n"
    )
    assert parse_metrics(text) == [
        ("pdserve:num_blocks", {"role": "decode", "worker": "decode-0"}, 512.0),
        ("pdserve:num_blocks", {"role": "prefill", "worker": 'a "b"'}, 64.0),
        ("pdserve:requests_total", {}, 3.0),
    ]


def test_routers_get_distinct_ports_from_the_os_and_stop(chat_model_dir, tmp_path) -> None:
    a = LocalCluster(str(chat_model_dir), log_dir=tmp_path, name="a")
    b = LocalCluster(str(chat_model_dir), log_dir=tmp_path, name="b")
    try:
        routers = [a.start_router(), b.start_router()]
        assert len({a.port, b.port, a.control_port, b.control_port}) == 4
        for cluster in (a, b):
            assert cluster.port > 0 and cluster.control_port > 0
            r = httpx.get(cluster.url + "/v1/models", timeout=10)
            assert r.status_code == 200, cluster.logs()
            assert not cluster.healthy()  # no workers yet
    finally:
        a.stop()
        b.stop()
    assert all(p.poll() is not None for p in routers)
    assert a.dead() == ["router"] and b.dead() == ["router"]


def test_workers_lend_idle_cores_to_each_other(chat_model_dir, tmp_path) -> None:
    """With a core ledger (`pdserve up` makes one), the prefill worker computes a lone prompt on
    both threads while the decode worker idles, and the decode worker then decodes on both
    (common.runtime.cores); each says so in its counters."""
    from tests.e2e.cluster import Cluster

    cluster = Cluster(
        str(chat_model_dir), tmp_path, router_flags=("--local-prefill-max-tokens", "0")
    )
    cluster.lend_cores = 2  # what `up` passes on a 2-core machine
    with cluster:
        cluster.wait_workers(prefill=1, decode=1)
        body = {"model": str(chat_model_dir), "prompt": "Tell me a story " * 8,
                "max_tokens": 24, "temperature": 0, "ignore_eos": True}  # fmt: skip
        r = httpx.post(cluster.url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["usage"]["completion_tokens"] == 24
        borrowed: dict[str, float] = {}
        for _ in range(100):  # the counters come with the workers' heartbeats
            samples = parse_metrics(httpx.get(cluster.url + "/metrics", timeout=10).text)
            borrowed = {
                labels["worker"]: value
                for name, labels, value in samples
                if name == "pdserve:cpu_borrowed_thread_steps_total"
            }
            if borrowed.get("decode-0", 0) >= 20 and borrowed.get("prefill-0", 0) >= 1:
                break
            time.sleep(0.1)
        assert borrowed.get("decode-0", 0) >= 20, (borrowed, cluster.logs())
        assert borrowed.get("prefill-0", 0) >= 1, (borrowed, cluster.logs())
        assert (cluster._scratch / "cores.ledger").exists()
