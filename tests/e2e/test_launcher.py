"""The one launcher: routers on ports from the OS, metrics parsing, everything stopped."""

from __future__ import annotations

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
