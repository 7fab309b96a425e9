"""The KV tier on a real 1-prefill, 1-decode cluster: a prompt whose blocks the prefill worker's
small cache evicted is served again from its host-RAM and disk tier (not recomputed), with the same
greedy completion; the tier's counters reach the router's /metrics; the books balance."""

from __future__ import annotations

import random

import httpx

from tests.e2e.cluster import Cluster

# float32, 2 layers x K, V x 2 KV heads x 16: 512 bytes a token, 8 KiB a block of 16; 40 blocks
FLAGS = ("--max-model-len", "512", "--kv-cache-memory", "320KiB")


def prompt(seed: int) -> list[int]:
    return random.Random(seed).sample(range(300, 20000), 300)  # 18 full blocks and a part


def complete(cluster: Cluster, model: str, tokens: list[int]) -> dict:
    body = {"model": model, "prompt": tokens, "max_tokens": 4, "temperature": 0}
    r = httpx.post(cluster.url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def test_an_evicted_prefix_comes_back_from_the_tier(chat_model_dir, tmp_path):
    model = str(chat_model_dir)
    tier = ("--kv-offload-memory", "64KiB", "--kv-offload-dir", str(tmp_path / "kv"),
            "--kv-offload-disk", "4MiB")  # fmt: skip
    router_flags = ("--local-prefill-max-tokens", "0", "--heartbeat-timeout-s", "120")
    with Cluster(
        model, tmp_path, engine_flags=(*FLAGS, *tier), router_flags=router_flags
    ) as cluster:
        first = complete(cluster, model, prompt(0))
        for seed in range(1, 5):  # 4 x 19 blocks through a 40-block cache
            complete(cluster, model, prompt(seed))
        again = complete(cluster, model, prompt(0))
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        hits = cluster.wait_counter(
            "external_prefix_cache_hits_total", 16 * 10, timeout_s=10, worker="prefill-0"
        )
        assert hits >= 16 * 10, cluster.metrics()
        stored = (cluster.sample("kv_offload_cpu_block_store_total", worker="prefill-0") or 0) + (
            cluster.sample("kv_offload_disk_block_store_total", worker="prefill-0") or 0
        )
        assert stored >= 18
        usage = cluster.sample("kv_offload_cpu_usage_bytes", worker="prefill-0")
        assert usage is not None and 0 < usage <= 64 * 1024
        assert cluster.sample("kv_cache_bytes_per_token", worker="prefill-0") == 512
        state = cluster.wait_blocks_free(["prefill-0", "decode-0"])
        assert all(f == t for f, t in state.values()), state
