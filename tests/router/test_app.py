"""router/app.py and router/streaming.py over real HTTP (the openai SDK and httpx) and fake workers.

The fake decode worker echoes the prompt's tokens back, so every expected text is known.
"""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.protocol import HEARTBEAT_TIMEOUT_S, Abort, Generate
from tests.router.fake_worker import FakeWorker, RouterThread, default_tokenizer

PROMPT = "The quick brown fox jumps over the lazy dog"


@pytest.fixture(scope="module")
def router():
    with RouterThread(colocated=True, served_model_name=["default", "alias"]) as r:
        r.decode = r.worker("decode", "d0")
        yield r


@pytest.fixture(scope="module")
def client(router: RouterThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)


def echo(ids: list[int], n: int) -> str:
    return default_tokenizer().decode([ids[i % len(ids)] for i in range(n)])


def prompt_ids(text: str = PROMPT) -> list[int]:
    return default_tokenizer().encode(text)


def chat_ids(content: str) -> list[int]:
    return default_tokenizer().apply_chat_template([{"role": "user", "content": content}])


def last_generate(worker: FakeWorker) -> Generate:
    return worker.messages(Generate)[-1]


def test_completion(client: openai.OpenAI) -> None:
    r = client.completions.create(model="default", prompt=PROMPT, max_tokens=5)
    assert r.object == "text_completion" and r.model == "default"
    assert r.choices[0].text == echo(prompt_ids(), 5)
    assert r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(prompt_ids()), 5)


def test_chat(client: openai.OpenAI) -> None:
    r = client.chat.completions.create(
        model="alias", messages=[{"role": "user", "content": "Hi"}], max_tokens=6
    )
    ids = chat_ids("Hi")
    assert r.object == "chat.completion" and r.model == "alias"
    assert r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == echo(ids, 6)
    assert (r.usage.prompt_tokens, r.usage.completion_tokens) == (len(ids), 6)


def test_chat_stream_with_usage(client: openai.OpenAI) -> None:
    chunks = list(
        client.chat.completions.create(
            messages=[{"role": "user", "content": "Hi"}],
            model="default",
            max_tokens=6,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == echo(chat_ids("Hi"), 6)
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6
    assert chunks[-1].usage.prompt_tokens == len(chat_ids("Hi"))


def test_completion_stream_ends_with_done(router: RouterThread) -> None:
    body = {"prompt": PROMPT, "max_tokens": 4, "stream": True}
    r = httpx.post(router.url + "/v1/completions", json=body, timeout=10)
    assert r.headers["content-type"].startswith("text/event-stream")
    events = [e for e in r.text.split("\n\n") if e]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e.removeprefix("data: ")) for e in events[:-1]]
    assert all(c["object"] == "text_completion" for c in chunks)
    assert "".join(c["choices"][0]["text"] for c in chunks) == echo(prompt_ids(), 4)
    assert "usage" not in chunks[-1]  # not asked for


def test_n_choices_get_distinct_seeds(client: openai.OpenAI, router: RouterThread) -> None:
    r = client.completions.create(model="default", prompt=PROMPT, max_tokens=3, n=2, seed=7)
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 6 and r.usage.prompt_tokens == len(prompt_ids())
    seeds = sorted(g.params.seed for g in router.decode.messages(Generate)[-2:])
    assert seeds == [7, 8]
    stream = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Hi"}], max_tokens=3, n=2,
        stream=True,
    )  # fmt: skip
    texts = {0: "", 1: ""}
    for chunk in stream:
        for c in chunk.choices:
            texts[c.index] += c.delta.content or ""
    assert texts[0] == texts[1] == echo(chat_ids("Hi"), 3)


def test_sampling_fields_reach_the_worker(client: openai.OpenAI, router: RouterThread) -> None:
    client.completions.create(
        model="default",
        prompt=PROMPT,
        max_tokens=4,
        temperature=0.5,
        top_p=0.9,
        presence_penalty=0.5,
        frequency_penalty=0.25,
        seed=3,
        extra_body={
            "top_k": 5,
            "min_p": 0.1,
            "repetition_penalty": 1.2,
            "ignore_eos": True,
            "min_tokens": 2,
            "stop_token_ids": [7],
        },
    )
    p = last_generate(router.decode).params
    assert (p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (0.5, 0.9, 5, 0.1, 3)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, 0.25, 1.2)
    assert p.ignore_eos and p.min_tokens == 2 and p.stop_token_ids == [7] and p.max_tokens == 4


def test_logprobs_shapes(client: openai.OpenAI) -> None:
    r = client.completions.create(model="default", prompt=PROMPT, max_tokens=3, logprobs=2)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 3
    assert all(len(t) == 2 for t in lp.top_logprobs) and lp.token_logprobs[0] == -0.5
    r = client.chat.completions.create(
        model="default", messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
        logprobs=True, top_logprobs=2,
    )  # fmt: skip
    content = r.choices[0].logprobs.content
    assert len(content) == 3 and all(len(c.top_logprobs) == 2 for c in content)
    assert all(isinstance(c.bytes, list) for c in content)
    chunks = list(
        client.completions.create(
            model="default", prompt=PROMPT, max_tokens=3, logprobs=1, stream=True
        )
    )
    streamed = [t for c in chunks for t in (c.choices[0].logprobs.tokens if c.choices else [])]
    assert streamed == lp.tokens
    offsets = [o for c in chunks for o in c.choices[0].logprobs.text_offset]
    assert offsets == lp.text_offset


def test_stop_string_cuts_text_and_aborts_the_worker() -> None:
    words = default_tokenizer().encode(" one two three four five six seven eight")
    with RouterThread(colocated=True) as router:
        w = router.worker("decode", "d0", output_token_ids=words, token_delay_s=0.03)
        c = openai.OpenAI(base_url=router.url + "/v1", api_key="x", max_retries=0)
        for stream in (False, True):
            r = c.completions.create(
                model="default", prompt=PROMPT, max_tokens=50, stop=[" four"], stream=stream,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            if stream:
                chunks = list(r)
                text = "".join(ch.choices[0].text for ch in chunks)
                reason = chunks[-1].choices[0].finish_reason
            else:
                text, reason = r.choices[0].text, r.choices[0].finish_reason
            assert (text, reason) == (" one two three", "stop")
            rid = w.messages(Generate)[-1].request_id
            w.wait_for(Abort, lambda m, rid=rid: m.request_id == rid, timeout_s=3)


def test_models(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == ["default", "alias"]


def test_model_retrieve(client: openai.OpenAI, router: RouterThread) -> None:
    alias = client.models.retrieve("alias")  # every --served-model-name, as OpenAI's object
    assert (alias.id, alias.object, alias.owned_by) == ("alias", "model", "pdserve")
    assert alias.model_dump() == client.models.list().data[1].model_dump()
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert e.value.body["type"] == "model_not_found" and e.value.body["param"] == "model"
    r = httpx.get(router.url + "/v1/models/org/unknown")  # a slash in the id is still an id
    assert r.status_code == 404 and "org/unknown" in r.json()["error"]["message"]


def test_health_follows_worker_liveness() -> None:
    with RouterThread() as router:
        assert httpx.get(router.url + "/health").status_code == 503
        d0 = router.worker("decode", "d0")
        r = httpx.get(router.url + "/health")
        assert r.status_code == 503 and "prefill" in r.json()["error"]["message"]
        router.worker("prefill", "p0")
        assert httpx.get(router.url + "/health").status_code == 200
        d0.die()
        start = time.monotonic()
        while httpx.get(router.url + "/health").status_code == 200:
            assert time.monotonic() - start < HEARTBEAT_TIMEOUT_S + 1
            time.sleep(0.1)
        assert time.monotonic() - start > HEARTBEAT_TIMEOUT_S - 1.5  # not before it fell silent


def test_metrics(client: openai.OpenAI, router: RouterThread) -> None:
    client.completions.create(model="default", prompt=PROMPT, max_tokens=2)
    text = httpx.get(router.url + "/metrics").text
    families = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "num_requests_running",
        "num_requests_waiting",
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "prompt_tokens",  # the parser drops _total
        "generation_tokens",
        "request_success",
        "num_free_blocks",
        "num_blocks",
        "kv_cache_usage_perc",
        "fake_steps",  # a worker's own counter, passed through
    ):
        assert "pdserve:" + name in families, name
    success = families["pdserve:request_success"].samples
    assert any(s.labels == {"finished_reason": "length"} and s.value >= 1 for s in success)
    blocks = families["pdserve:num_blocks"].samples
    assert any(s.labels.get("worker") == "d0" and s.value == 1000 for s in blocks)


def test_tokenize_detokenize_round_trip(router: RouterThread) -> None:
    r = httpx.post(router.url + "/tokenize", json={"model": "default", "prompt": PROMPT})
    assert r.status_code == 200 and r.json()["tokens"] == prompt_ids()
    assert r.json()["count"] == len(prompt_ids())
    r2 = httpx.post(router.url + "/detokenize", json={"tokens": r.json()["tokens"]})
    assert r2.json()["prompt"] == PROMPT
    r3 = httpx.post(
        router.url + "/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}
    )
    assert r3.json()["tokens"] == chat_ids("Hi")
    bad = httpx.post(router.url + "/detokenize", json={"tokens": [-1]})
    assert bad.status_code == 400 and "error" in bad.json()


def test_api_key() -> None:
    with RouterThread(colocated=True, api_key="sekrit") as router:
        router.worker("decode", "d0")
        assert httpx.get(router.url + "/v1/models").status_code == 401
        r = httpx.post(router.url + "/v1/completions", json={"prompt": "x"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
        wrong = openai.OpenAI(base_url=router.url + "/v1", api_key="nope", max_retries=0)
        with pytest.raises(openai.AuthenticationError):
            wrong.models.list()
        right = openai.OpenAI(base_url=router.url + "/v1", api_key="sekrit", max_retries=0)
        assert right.completions.create(model="default", prompt="x", max_tokens=2).choices
        assert httpx.get(router.url + "/health").status_code == 200  # not behind the key


BAD_BODIES = [
    ("/v1/completions", {}, 400, "prompt"),  # missing prompt
    ("/v1/chat/completions", {"model": "default"}, 400, "messages"),
    ("/v1/completions", {"prompt": 5}, 400, "prompt"),
    ("/v1/completions", {"prompt": "x", "temperature": "hot"}, 400, "temperature"),
    ("/v1/completions", {"prompt": "x", "max_tokens": -1}, 400, "max_tokens"),
    ("/v1/completions", {"prompt": "x", "n": "two"}, 400, "n"),
    ("/v1/completions", {"model": "nope", "prompt": "x"}, 404, "model"),
    ("/v1/completions", {"prompt": "word " * 9000}, 400, "prompt"),  # beyond the context
    ("/v1/completions", {"prompt": "x", "max_tokens": 10**6}, 400, "max_tokens"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "x"}]}, 400, None),
    ("/v1/completions", [1, 2], 400, None),
]


@pytest.mark.parametrize("url, body, status, param", BAD_BODIES)
def test_bad_requests_get_openai_errors(
    router: RouterThread, url: str, body: object, status: int, param: str | None
) -> None:
    r = httpx.post(router.url + url, json=body, timeout=10)
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert {"message", "type", "param", "code"} <= set(error)
    if param is not None:
        assert error["param"] == param


def test_malformed_http_gets_openai_errors(router: RouterThread) -> None:
    r = httpx.post(
        router.url + "/v1/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "JSON" in r.json()["error"]["message"]
    r = httpx.post(router.url + "/v1/completions", content=b"\xff\xfe")
    assert r.status_code == 400
    r = httpx.get(router.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["code"] == 404
    r = httpx.get(router.url + "/v1/completions")
    assert r.status_code == 405 and "error" in r.json()
    # and it still serves
    r = httpx.post(router.url + "/v1/completions", json={"prompt": "x", "max_tokens": 2})
    assert r.status_code == 200


def test_debug_block_books_asks_every_worker(router: RouterThread) -> None:
    """/debug/block_books sends each worker a BlockBooksQuery and reports its reply."""
    import threading

    from common.protocol import BlockBooksQuery, BlockBooksReply

    result: dict = {}
    url = router.url + "/debug/block_books"
    fetch = threading.Thread(target=lambda: result.update(httpx.get(url, timeout=10).json()))
    fetch.start()
    query = router.decode.wait_for(BlockBooksQuery)
    router.decode.send(BlockBooksReply("d0", query.query_id, 10, 6, 2, 2, 0, 0, ["block 3 ..."]))
    fetch.join(10)
    books = result["workers"]["d0"]
    assert (books["free"], books["cached"], books["running"], books["total"]) == (6, 2, 2, 10)
    assert books["ok"] is False and books["errors"] == ["block 3 ..."]
