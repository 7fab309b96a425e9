"""router/dispatch.py through a real router and fake workers on real sockets.

Which messages each worker receives (Reserve, Prefill, Generate, Abort) for short and long prompts,
refusals, silent workers, worker deaths and client disconnects.
"""

from __future__ import annotations

import json
import threading
import time

import httpx
import pytest

from common.prefix_hash import block_keys, model_salt
from common.protocol import (
    HEARTBEAT_TIMEOUT_S,
    Abort,
    Generate,
    KVEvents,
    KVResync,
    Prefill,
    Reserve,
)
from tests.router.fake_worker import RouterThread, default_tokenizer

LONG = list(range(1000, 1040))  # 40 prompt tokens (token-id prompts skip the tokenizer)
SHORT = [1000, 1001, 1002]


def complete(
    router: RouterThread, prompt: list[int], max_tokens: int = 4, timeout: float = 30
) -> httpx.Response:
    return httpx.post(
        router.url + "/v1/completions",
        json={"prompt": prompt, "max_tokens": max_tokens},
        timeout=timeout,
    )


def echo_text(prompt: list[int], n: int) -> str:
    return default_tokenizer().decode([prompt[i % len(prompt)] for i in range(n)])


@pytest.fixture
def router():
    with RouterThread(local_prefill_max_tokens=8, heartbeat_timeout_s=2.0) as r:
        yield r


def test_long_prompt_reserves_on_decode_then_prefills(router: RouterThread) -> None:
    d0 = router.worker("decode", "d0", num_cached_tokens=16)
    p0 = router.worker("prefill", "p0")
    r = complete(router, LONG)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == echo_text(LONG, 4)
    assert r.json()["usage"] == {"prompt_tokens": 40, "completion_tokens": 4, "total_tokens": 44}
    (reserve,) = d0.messages(Reserve)
    (prefill,) = p0.messages(Prefill)
    assert reserve.prompt_token_ids == LONG and not d0.messages(Generate)
    assert prefill.request_id == reserve.request_id
    assert prefill.prompt_token_ids == LONG
    assert prefill.decode_worker_id == "d0"
    assert prefill.decode_kv_address == d0.kv_address
    assert prefill.num_decode_cached_tokens == 16
    assert prefill.transport == "shm"  # same host, both list shm
    assert prefill.params.max_tokens == 4 and prefill.deadline_s > 0


def test_prefill_on_another_host_uses_tcp(router: RouterThread) -> None:
    router.worker("decode", "d0")
    p0 = router.worker("prefill", "p0", host="elsewhere")
    assert complete(router, LONG).status_code == 200
    assert p0.messages(Prefill)[0].transport == "tcp"


def test_workers_with_cuda_kv_on_one_host_use_cuda_ipc(router: RouterThread) -> None:
    # Workers advertise cuda_ipc only when their KV cache is on CUDA.
    router.worker("decode", "d0", transports=("tcp", "shm", "cuda_ipc"))
    p0 = router.worker("prefill", "p0", transports=("tcp", "shm", "cuda_ipc"))
    assert complete(router, LONG).status_code == 200
    assert p0.messages(Prefill)[0].transport == "cuda_ipc"


def test_short_prompt_is_prefilled_on_the_decode_worker(router: RouterThread) -> None:
    d0 = router.worker("decode", "d0")
    p0 = router.worker("prefill", "p0")
    r = complete(router, SHORT, max_tokens=5)
    assert r.json()["choices"][0]["text"] == echo_text(SHORT, 5)
    (generate,) = d0.messages(Generate)
    assert generate.prompt_token_ids == SHORT and generate.params.max_tokens == 5
    assert not d0.messages(Reserve) and not p0.messages(Prefill)


def test_without_prefill_workers_long_prompts_generate_locally() -> None:
    with RouterThread(local_prefill_max_tokens=0, colocated=True) as router:
        d0 = router.worker("decode", "d0")
        assert complete(router, LONG).status_code == 200
        assert len(d0.messages(Generate)) == 1 and not d0.messages(Reserve)


def test_refusing_decode_worker_is_skipped(router: RouterThread) -> None:
    d0 = router.worker("decode", "d0", reserve="refuse")
    d1 = router.worker("decode", "d1")
    p0 = router.worker("prefill", "p0")
    for _ in range(3):
        r = complete(router, LONG)
        assert r.status_code == 200, r.text
    assert d0.messages(Reserve)  # asked (it was least loaded), refused
    assert [p.decode_worker_id for p in p0.messages(Prefill)] == ["d1"] * 3
    assert len(d1.messages(Reserve)) == 3


def test_every_decode_worker_refusing_gives_503_after_queueing() -> None:
    with RouterThread(local_prefill_max_tokens=0, queue_timeout_s=0.6) as router:
        router.worker("decode", "d0", reserve="refuse")
        router.worker("prefill", "p0")
        start = time.monotonic()
        r = complete(router, LONG)
        assert r.status_code == 503
        assert r.json()["error"]["type"] == "service_unavailable"
        assert time.monotonic() - start >= 0.5  # it queued before giving up


def test_silent_decode_worker_times_out_to_the_next() -> None:
    with RouterThread(local_prefill_max_tokens=0, reserve_timeout_s=0.3) as router:
        d0 = router.worker("decode", "d0", reserve="silent")
        router.worker("decode", "d1")
        p0 = router.worker("prefill", "p0")
        assert complete(router, LONG).status_code == 200
        (reserve,) = d0.messages(Reserve)
        d0.wait_for(Abort, lambda m: m.request_id == reserve.request_id)  # no leaked reservation
        (prefill,) = p0.messages(Prefill)
        assert prefill.decode_worker_id == "d1" and prefill.request_id != reserve.request_id


def test_prefill_load_counts_from_dispatch(router: RouterThread) -> None:
    router.worker("decode", "d0")
    p0 = router.worker("prefill", "p0", prefill="silent")
    p1 = router.worker("prefill", "p1", prefill="silent")
    body = {"prompt": LONG, "max_tokens": 4, "stream": True}
    with httpx.Client(base_url=router.url, timeout=10) as client:
        with client.stream("POST", "/v1/completions", json=body) as r0:
            with client.stream("POST", "/v1/completions", json=body) as r1:
                assert r0.status_code == r1.status_code == 200
                # neither has produced a token, yet the second prompt went to the other worker
                p0.wait_for(Prefill)
                p1.wait_for(Prefill)
                assert len(p0.messages(Prefill)) == len(p1.messages(Prefill)) == 1


def test_prefill_worker_death_redispatches_to_another(router: RouterThread) -> None:
    d0 = router.worker("decode", "d0")
    p0 = router.worker("prefill", "p0", prefill="silent")  # takes the prompt, never delivers
    result: dict = {}

    def request() -> None:
        result["r"] = complete(router, LONG)

    thread = threading.Thread(target=request)
    thread.start()
    first = p0.wait_for(Prefill)
    p1 = router.worker("prefill", "p1")
    p0.die()
    thread.join(10)
    r = result["r"]
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == echo_text(LONG, 4)
    (again,) = p1.messages(Prefill)
    assert again.request_id == first.request_id  # same reservation on the decode worker
    assert again.decode_worker_id == "d0" and len(d0.messages(Reserve)) == 1


def test_last_prefill_worker_death_falls_back_to_local_prefill(router: RouterThread) -> None:
    d0 = router.worker("decode", "d0")
    p0 = router.worker("prefill", "p0", prefill="silent")
    result: dict = {}
    thread = threading.Thread(target=lambda: result.setdefault("r", complete(router, LONG)))
    thread.start()
    first = p0.wait_for(Prefill)
    p0.die()
    thread.join(10)
    assert result["r"].status_code == 200, result["r"].text
    d0.wait_for(Abort, lambda m: m.request_id == first.request_id)  # reservation released
    (generate,) = d0.messages(Generate)
    assert generate.prompt_token_ids == LONG


def stream_in_thread(router: RouterThread, body: dict, lines: list[str]) -> threading.Thread:
    """A started thread streaming `body`'s completion into `lines` (SSE lines as they come)."""

    def stream() -> None:
        with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=30) as r:
            lines.extend(r.iter_lines())

    thread = threading.Thread(target=stream)
    thread.start()
    return thread


def test_a_dead_decode_workers_streams_move_to_another_without_an_error() -> None:
    with RouterThread(colocated=True) as router:  # the real heartbeat timeout
        d0 = router.worker("decode", "d0", token_delay_s=0.05)
        d1 = router.worker("decode", "d1", token_delay_s=0.05)
        body = {"prompt": SHORT, "max_tokens": 100, "stream": True}
        lines: dict[str, list[str]] = {"a": [], "b": []}
        threads = [stream_in_thread(router, body, lines["a"])]
        d0.wait_for(Generate)  # least loaded: the first goes to d0, the second to d1
        threads.append(stream_in_thread(router, body, lines["b"]))
        d1.wait_for(Generate)
        time.sleep(0.3)
        d0.die()
        # d1 gets a's prompt and the tokens relayed so far, and goes on from there
        moved = d1.wait_for(
            Generate, lambda m: m.num_output_tokens > 0, timeout_s=HEARTBEAT_TIMEOUT_S + 3
        )
        assert 0 < moved.num_output_tokens < 100
        assert moved.prompt_token_ids[: len(SHORT)] == SHORT
        for thread in threads:
            thread.join(30)
        for name in lines:  # both whole, no error: the client saw a pause
            assert lines[name][-2] == "data: [DONE]", lines[name][-3:]
            assert not any('"error"' in line for line in lines[name]), name
            assert '"finish_reason": "length"' in lines[name][-4]
        texts = [
            "".join(json.loads(x[6:])["choices"][0]["text"] for x in lines[name][:-2] if x)
            for name in lines
        ]
        assert texts[0] == texts[1]  # the same echo text as the undisturbed stream
        assert router.server.dispatcher.num_migrations == 1
        assert complete(router, SHORT).status_code == 200  # new requests go to the survivor


def test_a_stream_fails_once_its_migrations_are_spent(monkeypatch) -> None:
    from router import migration

    monkeypatch.setattr(migration, "MAX_MIGRATIONS", 0)  # fail as before migration existed
    with RouterThread(colocated=True) as router:
        d0 = router.worker("decode", "d0", token_delay_s=0.05)
        router.worker("decode", "d1", token_delay_s=0.05)
        body = {"prompt": SHORT, "max_tokens": 100, "stream": True}
        lines: list[str] = []
        thread = stream_in_thread(router, body, lines)
        d0.wait_for(Generate)
        time.sleep(0.3)
        d0.die()
        thread.join(HEARTBEAT_TIMEOUT_S + 3)
        assert any('"error"' in line and "d0" in line for line in lines), lines[-3:]
        assert lines[-2] == "data: [DONE]"


def test_worker_failure_becomes_a_503(router: RouterThread) -> None:
    router.worker("decode", "d0", generate="fail")
    r = complete(router, SHORT)
    assert r.status_code == 503 and "injected failure" in r.json()["error"]["message"]
    body = {"prompt": SHORT, "max_tokens": 4, "stream": True}
    r = httpx.post(router.url + "/v1/completions", json=body, timeout=10)
    events = [line for line in r.text.split("\n\n") if line]
    assert '"error"' in events[-2] and events[-1] == "data: [DONE]"


def test_prefill_failure_releases_the_reservation(router: RouterThread) -> None:
    d0 = router.worker("decode", "d0")
    router.worker("prefill", "p0", prefill="fail")
    r = complete(router, LONG)
    assert r.status_code == 503 and "prefill failed" in r.json()["error"]["message"]
    (reserve,) = d0.messages(Reserve)
    d0.wait_for(Abort, lambda m: m.request_id == reserve.request_id)


def test_client_disconnect_aborts_on_decode_and_prefill(router: RouterThread) -> None:
    d0 = router.worker("decode", "d0", token_delay_s=0.02)
    p0 = router.worker("prefill", "p0", prefill="silent")
    body = {"prompt": SHORT, "max_tokens": 1000, "stream": True}
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=10) as r:
        for i, _ in enumerate(r.iter_lines()):
            if i > 5:
                break  # hang up mid-stream
    rid = d0.messages(Generate)[0].request_id
    d0.wait_for(Abort, lambda m: m.request_id == rid, timeout_s=3)
    # Still prefilling when the client leaves: both the prefill and the decode worker hear of it.
    body["prompt"] = LONG
    with httpx.stream("POST", router.url + "/v1/completions", json=body, timeout=10) as r:
        assert r.status_code == 200
    rid = p0.wait_for(Prefill).request_id
    p0.wait_for(Abort, lambda m: m.request_id == rid, timeout_s=3)
    d0.wait_for(Abort, lambda m: m.request_id == rid, timeout_s=3)


def test_client_gone_before_a_whole_response_aborts() -> None:
    # The abort once came only after the whole generation: Job.next_event's cancellation was
    # swallowed when a token arrived at the same moment (tests/router/test_job.py). A long
    # heartbeat timeout too: on a loaded CI machine the fake worker (a thread of this process)
    # once went 2 s without a heartbeat and was reaped; liveness has its own tests.
    with RouterThread(local_prefill_max_tokens=8, heartbeat_timeout_s=30.0) as router:
        d0 = router.worker("decode", "d0", token_delay_s=0.02)
        with pytest.raises(httpx.TimeoutException):
            complete(router, SHORT, max_tokens=1000, timeout=0.5)
        rid = d0.wait_for(Generate).request_id
        d0.wait_for(Abort, lambda m: m.request_id == rid, timeout_s=10)


def test_prefix_index_routes_resyncs_and_forgets_dead_workers() -> None:
    salt = model_salt("default", "float32", 16)
    keys = block_keys(LONG, 16, salt)  # LONG's 2 full blocks
    with RouterThread(local_prefill_max_tokens=8, heartbeat_timeout_s=1.0) as router:
        index = router.server.prefix_index
        router.worker("decode", "d0")
        p0 = router.worker("prefill", "p0", kv_salt=salt)
        p1 = router.worker("prefill", "p1", kv_salt=salt)
        p1.send(KVEvents("p1", 0, keys, [], reset=True))
        deadline = time.monotonic() + 5
        while index.match("p1", keys) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        for _ in range(3):  # the holder gets the prompt every time
            assert complete(router, LONG).status_code == 200
        assert len(p1.messages(Prefill)) == 3 and not p0.messages(Prefill)
        assert index.match("p0", keys) == 0  # pending keys went to p1 only
        # A gap in p1's events (seq 1 lost): the router asks for a snapshot.
        p1.send(KVEvents("p1", 2, [], keys[1:]))
        assert "gap" in p1.wait_for(KVResync).reason
        # p0's heartbeats say it sent seq 4, none of which arrived: a lost tail, same answer.
        p0.kv_events_seq = 4
        p0.wait_for(KVResync, timeout_s=3)
        # p1 dies: its index entries go with it.
        p1.die()
        deadline = time.monotonic() + 5
        while "p1" in index.worker_ids():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert 'worker="p1"' not in httpx.get(router.url + "/metrics").text


def test_a_stopping_router_lets_its_streams_finish_within_the_drain_timeout() -> None:
    router = RouterThread(colocated=True, drain_timeout_s=15)
    try:
        d0 = router.worker("decode", "d0", token_delay_s=0.05)  # 5 s of stream: > the old 2 s
        body = {"prompt": SHORT, "max_tokens": 100, "stream": True}
        lines: list[str] = []
        thread = stream_in_thread(router, body, lines)
        d0.wait_for(Generate)
        time.sleep(0.3)  # mid-stream: a few of 100 tokens relayed
        stopping = threading.Thread(target=router.server.stop)
        stopping.start()
        thread.join(15)
        assert lines[-2] == "data: [DONE]", lines[-3:]  # the whole stream, no error
        assert not any('"error"' in line for line in lines)
        with pytest.raises(httpx.HTTPError):  # meanwhile it took no new connection
            httpx.post(router.url + "/v1/completions", json=body, timeout=2)
    finally:
        router.stop()


def test_a_prompt_prefilled_on_a_decode_worker_carries_a_hint_at_the_peer_holding_it() -> None:
    salt = model_salt("default", "float32", 16)
    keys = block_keys(LONG, 16, salt)  # LONG's 2 full blocks (of 40 tokens: 2 may be fetched)
    with RouterThread(local_prefill_max_tokens=64, routing="least_loaded") as router:
        d0 = router.worker("decode", "d0", kv_salt=salt)
        d1 = router.worker("decode", "d1", kv_salt=salt)
        d1.send(KVEvents("d1", 0, keys, [], reset=True))
        deadline = time.monotonic() + 5
        while router.server.prefix_index.match("d1", keys) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert complete(router, LONG).status_code == 200  # least loaded, lowest id: d0
        (generate,) = d0.messages(Generate)
        assert generate.peer is not None
        assert (generate.peer.worker_id, generate.peer.num_blocks) == ("d1", 2)
        assert generate.peer.kv_address == d1.kv_address
    with RouterThread(local_prefill_max_tokens=64, routing="least_loaded",
                      kv_peer_fetch="off") as router:  # fmt: skip
        d0 = router.worker("decode", "d0", kv_salt=salt)
        d1 = router.worker("decode", "d1", kv_salt=salt)
        d1.send(KVEvents("d1", 0, keys, [], reset=True))
        deadline = time.monotonic() + 5
        while router.server.prefix_index.match("d1", keys) < 2:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert complete(router, LONG).status_code == 200
        assert d0.messages(Generate)[0].peer is None
