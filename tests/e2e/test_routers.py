"""Two routers, one cluster: both serve the same 1P1D workers with the same greedy output; a
router killed with SIGKILL mid-traffic fails only its own streams (at once), the other router's
streams finish, and no KV block is left behind on any worker."""

from __future__ import annotations

import json
import threading
import time

import httpx

from tests.e2e.cluster import Cluster

BODY = {"prompt": "The quick brown fox jumps over the lazy dog and then", "temperature": 0}
WORKERS = ["prefill-0", "decode-0"]


def wait_healthy(url: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        assert time.monotonic() < deadline, f"{url} never became healthy"
        time.sleep(0.2)


def stream(url: str, model: str, max_tokens: int, events: list, errors: list, started) -> None:
    body = {**BODY, "model": model, "max_tokens": max_tokens, "stream": True, "ignore_eos": True}
    body["stream_options"] = {"include_usage": True}
    try:
        with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line)
                    started.set()
    except httpx.HTTPError as exc:
        errors.append((time.monotonic(), exc))
    started.set()


def test_two_routers_share_a_cluster_and_one_dies_alone(chat_model_dir, tmp_path):
    model = str(chat_model_dir)
    flags = ("--local-prefill-max-tokens", "0")  # every prompt through the prefill worker
    with Cluster(model, tmp_path, prefill=1, decode=1, router_flags=flags, routers=2) as cluster:
        urls = [cluster.router_url(0), cluster.router_url(1)]
        wait_healthy(urls[1])
        body = {**BODY, "model": model, "max_tokens": 24}
        texts = [httpx.post(u + "/v1/completions", json=body, timeout=60).json() for u in urls]
        assert texts[0]["choices"][0]["text"] == texts[1]["choices"][0]["text"]
        assert texts[0]["usage"]["completion_tokens"] == 24

        runs = []
        for index in (0, 0, 0, 1, 1, 1):
            events, errors, started = [], [], threading.Event()
            args = (urls[index], model, 300, events, errors, started)
            thread = threading.Thread(target=stream, args=args, daemon=True)
            thread.start()
            runs.append((index, events, errors, started, thread))
        for _, _, _, started, _ in runs:
            assert started.wait(60)
        killed_at = time.monotonic()
        cluster.procs["router-1"].kill()
        cluster.procs["router-1"].wait()
        for _, _, _, _, thread in runs:
            thread.join(120)
        for index, events, errors, _, _ in runs:
            if index == 1:  # its clients see the connection go at once, not a timeout
                assert errors and errors[0][0] - killed_at < 5, (events[-1:], errors)
            else:  # the other router's streams run to the end
                assert not errors, errors
                assert events[-1] == "data: [DONE]"
                usage = json.loads(events[-2].removeprefix("data: "))["usage"]
                assert usage["completion_tokens"] == 300
        # the workers still serve the surviving router, and hold no block for the dead one's
        again = httpx.post(urls[0] + "/v1/completions", json=body, timeout=60).json()
        assert again["choices"][0]["text"] == texts[0]["choices"][0]["text"]
        state = cluster.wait_blocks_free(WORKERS, timeout_s=30)
        assert all(f == t for f, t in state.values()), state
