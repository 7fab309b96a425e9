"""router/cli.py: the `pdserve router` process, started as `pdserve up` starts it, loads no torch.

The router needs the tokenizer and a few config values, never the model: torch (about 200 MiB of
RSS and a second of start-up per router replica) must not come in with them. A fake decode worker
(tests/router/fake_worker.py) answers the requests; the router's /proc/<pid>/maps says whether
torch's libraries were ever loaded (a loaded library is not unloaded).
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from common.runtime.launcher import LocalCluster
from tests.router.fake_worker import FakeWorker

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
        },
    }
]
USER = {"role": "user", "content": "Hi there 👋 <|im_start|>"}
CALL = {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
# What the router does itself (tokenize, render, detokenize, logprobs, echo), no grammar.
PLAIN = {
    "chat": ("/v1/chat/completions", {"messages": [USER], "max_tokens": 4}),
    "chat streamed, logprobs": (
        "/v1/chat/completions",
        {"messages": [USER], "max_tokens": 4, "stream": True, "logprobs": True, "top_logprobs": 2},
    ),
    "tool history, tool_choice none": (
        "/v1/chat/completions",
        {
            "messages": [
                USER,
                {"role": "assistant", "content": "", "tool_calls": [CALL]},
                {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
            ],
            "tools": TOOLS,
            "tool_choice": "none",
            "max_tokens": 4,
        },
    ),
    "completion, echo, logprobs": (
        "/v1/completions",
        {"prompt": "Hello 日本語", "max_tokens": 4, "echo": True, "logprobs": 1},
    ),
    "completion of ids, n=2": ("/v1/completions", {"prompt": [1, 2, 3], "max_tokens": 3, "n": 2}),
    "tokenize chat": ("/tokenize", {"messages": [USER]}),
    "detokenize": ("/detokenize", {"tokens": [1, 2, 3, 9690]}),
}
# Grammars: the router compiles them to check a request before dispatch.
GRAMMAR = {
    "tools auto": ("/v1/chat/completions", {"messages": [USER], "tools": TOOLS, "max_tokens": 4}),
    "response_format json_schema": (
        "/v1/chat/completions",
        {
            "messages": [USER],
            "max_tokens": 4,
            "response_format": {
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object"}},
            },
        },
    ),
}


@pytest.fixture
def router() -> Iterator[LocalCluster]:
    """A router process on the default model (`python -m common.cli router`, as `up` starts it)
    with one fake decode worker registered; it never refuses work for a late event loop (a
    busy test host)."""
    cluster = LocalCluster("default", router_flags=["--max-loop-lag-s", "0"])
    cluster.start_router()
    worker = FakeWorker(cluster.control, "decode", "decode-0", token_delay_s=0.001)
    try:
        assert worker.wait_registered().accepted
        yield cluster
    finally:
        worker.close()
        cluster.stop()


class TorchLoaded(Exception):
    """The router process has torch's libraries mapped (the test's failure, named)."""


def assert_no_torch(cluster: LocalCluster) -> None:
    maps = Path(f"/proc/{cluster.procs['router'].pid}/maps").read_text().splitlines()
    libraries = sorted({line.split()[-1] for line in maps if "/torch/" in line})
    if libraries:
        raise TorchLoaded(libraries)


def serve(cluster: LocalCluster, requests: dict[str, tuple[str, dict]]) -> None:
    for name, (path, body) in requests.items():
        r = httpx.post(cluster.url + path, json={"model": "default", **body}, timeout=60)
        assert r.status_code == 200, (name, r.text)


def test_the_router_starts_and_serves_without_torch(router: LocalCluster) -> None:
    assert httpx.get(router.url + "/health").status_code == 200
    assert_no_torch(router)
    serve(router, PLAIN)
    assert httpx.get(router.url + "/metrics").status_code == 200
    assert_no_torch(router)


def test_grammar_requests_load_no_torch(router: LocalCluster) -> None:
    serve(router, GRAMMAR)
    assert_no_torch(router)
