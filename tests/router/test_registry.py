"""router/registry.py, router/policy.py and router/metrics.py, mostly without sockets; the
control plane's integrity (router/control.py) against real sockets at the end."""

from __future__ import annotations

import time

import httpx
import pytest
import zmq
from prometheus_client.parser import text_string_to_metric_families

from common import protocol
from common.protocol import PROTOCOL_VERSION, Heartbeat, KVEvents, Register
from router.metrics import RouterMetrics
from router.policy import PrefillPolicy, pick_decode
from router.registry import Registry
from tests.router.fake_worker import FakeWorker, RouterThread


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def reg(worker_id: str, role: str = "decode", **kw) -> Register:
    fields = dict(
        version=PROTOCOL_VERSION,
        role=role,
        worker_id=worker_id,
        model="default",
        block_size=16,
        num_blocks=100,
        max_model_len=2048,
        dtype="float32",
        host="h1",
        kv_address=f"tcp://h1:{len(worker_id)}" if role == "decode" else "",
        transports=["tcp", "shm"],
    )
    fields.update(kw)
    return Register(**fields)


def hb(worker_id: str, running: int = 0, waiting: int = 0, free: int = 100, queued: int = 0):
    return Heartbeat(worker_id, running, waiting, free, 100, queued, {"x_total": 1.0})


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def registry(clock: Clock) -> Registry:
    return Registry({"default"}, timeout_s=5.0, clock=clock)


def register(registry: Registry, msg: Register):
    return registry.register(msg.worker_id.encode(), msg)


def test_register_accepts_and_lists_by_role(registry: Registry) -> None:
    assert register(registry, reg("d0")).accepted
    assert register(registry, reg("p0", "prefill")).accepted
    assert [w.worker_id for w in registry.live("decode")] == ["d0"]
    assert [w.worker_id for w in registry.live("prefill")] == ["p0"]
    assert registry.max_model_len() == 2048


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(version=PROTOCOL_VERSION + 1), "protocol version"),
        (dict(model="other"), "model"),
        (dict(block_size=32), "block size"),
    ],
)
def test_register_refuses_mismatches(registry: Registry, change: dict, words: str) -> None:
    assert register(registry, reg("d0")).accepted
    ack = register(registry, reg("d1", **change))
    assert not ack.accepted and words in ack.reason
    assert registry.get("d1") is None  # ignored


def test_register_refuses_identity_mismatch_and_role_change(registry: Registry) -> None:
    assert not registry.register(b"someone-else", reg("d0")).accepted
    assert register(registry, reg("d0")).accepted
    assert not register(registry, reg("d0", "prefill")).accepted


def test_block_size_flag_is_enforced(clock: Clock) -> None:
    registry = Registry({"default"}, block_size=32, clock=clock)
    assert not register(registry, reg("d0")).accepted
    assert register(registry, reg("d0", block_size=32)).accepted


def test_reregister_keeps_the_worker_and_its_load(registry: Registry) -> None:
    register(registry, reg("d0"))
    worker = registry.get("d0")
    worker.num_in_flight = 3
    assert register(registry, reg("d0", num_blocks=200)).accepted
    assert registry.get("d0") is worker and worker.num_in_flight == 3
    assert worker.info.num_blocks == 200


def test_heartbeats_keep_workers_alive_and_silence_kills(registry: Registry, clock: Clock) -> None:
    register(registry, reg("d0"))
    register(registry, reg("d1"))
    clock.now += 4
    registry.on_heartbeat(hb("d0", running=2, waiting=1, free=25))
    clock.now += 2
    dead = registry.expire()
    assert [w.worker_id for w in dead] == ["d1"]
    worker = registry.get("d0")
    assert worker.decode_load == 3 and worker.kv_cache_usage == pytest.approx(0.75)
    assert registry.on_heartbeat(hb("d1")) is None  # dead workers must register again
    clock.now += 6
    assert [w.worker_id for w in registry.expire()] == ["d0"]
    assert registry.max_model_len() is None


def test_pick_decode_least_loaded_skipping_refusers(registry: Registry) -> None:
    for name in ("d0", "d1", "d2"):
        register(registry, reg(name))
    d0, d1, d2 = (registry.get(n) for n in ("d0", "d1", "d2"))
    d0.num_in_flight, d1.num_in_flight, d2.num_in_flight = 2, 1, 1
    d2.heartbeat = hb("d2", running=5)  # the worker knows of more than the router sent it
    assert pick_decode(registry.live("decode"), now_s=0) is d1
    d1.refused_until_s = 10
    assert pick_decode(registry.live("decode"), now_s=5) is d0
    assert pick_decode(registry.live("decode"), now_s=10) is d1
    d0.refused_until_s = d2.refused_until_s = 10
    assert pick_decode(registry.live("decode"), now_s=5) is None


def test_prefill_policies(registry: Registry) -> None:
    for name in ("p0", "p1", "p2"):
        register(registry, reg(name, "prefill"))
    workers = registry.live("prefill")
    rr = PrefillPolicy("round_robin")
    assert [rr.pick(workers, [1]).worker_id for _ in range(4)] == ["p0", "p1", "p2", "p0"]
    ll = PrefillPolicy("least_loaded")
    registry.get("p0").queued_prefill_tokens = 500
    registry.get("p1").queued_prefill_tokens = 300
    # The router counts from dispatch; a worker reporting more has load other routers placed
    registry.get("p1").heartbeat = hb("p1", queued=900)
    registry.get("p2").queued_prefill_tokens = 100
    registry.get("p2").heartbeat = hb("p2", queued=40)  # less than this router's own count
    assert ll.pick(workers, [1]).worker_id == "p2"
    assert ll.pick(workers, [1], exclude={"p2"}).worker_id == "p0"
    assert registry.get("p1").prefill_load == 900 and registry.get("p2").prefill_load == 100
    assert PrefillPolicy("prefix").pick(workers, [1]).worker_id == "p2"
    assert ll.pick(workers, [1], exclude={"p0", "p1", "p2"}) is None
    with pytest.raises(ValueError):
        PrefillPolicy("random")


def test_metrics_text_parses(registry: Registry) -> None:
    register(registry, reg("d0"))
    beat = hb("d0", running=1, free=40)
    beat.counters.update(
        spec_decode_num_drafts_total=4.0, spec_decode_num_accepted_tokens_total=6.0
    )
    registry.on_heartbeat(beat)
    metrics = RouterMetrics()
    timer = metrics.start_request()
    timer.dispatched()
    timer.tokens(0, 1)
    timer.tokens(0, 2)
    timer.finished(7, 3, ["length"])
    metrics.start_request().failed(503)
    text = metrics.render(2, 1, registry.workers.values())
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    assert samples[("pdserve:num_requests_running", ())] == 2
    assert samples[("pdserve:num_requests_waiting", ())] == 1
    assert samples[("pdserve:prompt_tokens_total", ())] == 7
    assert samples[("pdserve:generation_tokens_total", ())] == 3
    assert samples[("pdserve:request_success_total", (("finished_reason", "length"),))] == 1
    assert samples[("pdserve:time_to_first_token_seconds_count", ())] == 1
    assert samples[("pdserve:inter_token_latency_seconds_count", ())] == 2
    assert samples[("pdserve:e2e_request_latency_seconds_count", ())] == 1
    assert samples[("pdserve:request_errors_total", (("code", "503"),))] == 1
    labels = (("role", "decode"), ("worker", "d0"))
    assert samples[("pdserve:num_free_blocks", labels)] == 40
    assert samples[("pdserve:num_blocks", labels)] == 100
    assert samples[("pdserve:kv_cache_usage_perc", labels)] == pytest.approx(0.6)
    assert samples[("pdserve:x_total", labels)] == 1.0
    assert samples[("pdserve:spec_decode_mean_accepted_length", labels)] == 2.5


# ---- integrity: the KV layout, liveness from progress, unreachable workers ----------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("dtype", "bfloat16"),
        ("dtype", "int8"),  # --kv-cache-dtype int8 on one stage only
        ("dtype", "float8_e4m3fn"),
        ("num_layers", 3),
        ("num_kv_heads", 1),
        ("head_dim", 8),
    ],
)
def test_register_refuses_a_kv_layout_the_other_role_cannot_use(
    registry: Registry, field: str, value
) -> None:
    layout = dict(dtype="float32", num_layers=2, num_kv_heads=2, head_dim=16)
    assert register(registry, reg("d0", **layout)).accepted
    ack = register(registry, reg("p0", "prefill", **{**layout, field: value}))
    assert not ack.accepted and f"KV cache {field}" in ack.reason and "d0" in ack.reason
    assert registry.get("p0") is None
    assert register(registry, reg("p1", "prefill", **layout)).accepted


def test_a_worker_whose_loop_stands_still_with_work_is_dead(clock: Clock) -> None:
    registry = Registry({"default"}, timeout_s=5.0, clock=clock, stall_timeout_s=10.0)
    for worker_id in ("stuck", "idle", "busy", "uncounted"):
        assert register(registry, reg(worker_id)).accepted

    def beat(worker_id: str, loop_count: int, running: int) -> None:
        registry.on_heartbeat(Heartbeat(worker_id, running, 0, 100, 100, loop_count=loop_count))

    for second in range(13):  # heartbeats keep coming (a thread of their own) all along
        clock.now += 1.0
        beat("stuck", 7, running=1)  # work, the loop stands still
        beat("idle", 7, running=0)  # no work: a still loop is no stall
        beat("busy", second, running=1)  # the loop turns
        beat("uncounted", -1, running=1)  # an old worker that counts nothing
        dead = [w.worker_id for w in registry.expire()]
        assert dead == (["stuck"] if second == 11 else []), second  # 10 s after its first beat
    assert sorted(registry.workers) == ["busy", "idle", "uncounted"]


def test_the_routers_own_count_of_requests_is_work_too(clock: Clock) -> None:
    registry = Registry({"default"}, timeout_s=5.0, clock=clock, stall_timeout_s=2.0)
    assert register(registry, reg("d0")).accepted
    registry.on_heartbeat(Heartbeat("d0", 0, 0, 100, 100, loop_count=3))
    registry.get("d0").num_in_flight = 1  # dispatched; the worker never took it in
    clock.now += 3.0
    registry.on_heartbeat(Heartbeat("d0", 0, 0, 100, 100, loop_count=3))
    assert [w.worker_id for w in registry.expire()] == ["d0"]


def test_a_worker_marked_dead_takes_no_work_and_goes_at_the_next_expire(
    registry: Registry,
) -> None:
    assert register(registry, reg("d0")).accepted
    registry.mark_dead(registry.get("d0"), "is unreachable")
    assert registry.live("decode") == []
    assert [w.worker_id for w in registry.expire()] == ["d0"]
    assert registry.get("d0") is None


# ---- integrity against real sockets: a router in a thread, fake workers, a rogue connection -----


def rogue(address: str, identity: bytes) -> zmq.Socket:
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock


def received(sock: zmq.Socket, wait_s: float = 1.0) -> list:
    """Every message that reached `sock` within `wait_s`."""
    out, deadline = [], time.monotonic() + wait_s
    while time.monotonic() < deadline:
        if sock.poll(50):
            out.append(protocol.decode_control(sock.recv()))
    return out


def complete(router: RouterThread) -> httpx.Response:
    body = {"model": "default", "prompt": "Hello there", "max_tokens": 3}
    return httpx.post(router.url + "/v1/completions", json=body, timeout=15)


def test_a_second_connection_under_a_live_workers_id_gets_nothing_and_changes_nothing() -> None:
    with RouterThread(colocated=True, heartbeat_timeout_s=30) as router:
        d0 = router.worker("decode", "d0")
        thief = rogue(router.control, b"d0")
        try:
            time.sleep(0.3)
            thief.send(protocol.encode(d0.registration))
            thief.send(protocol.encode(Heartbeat("d0", 0, 0, 1000, 1000, draining=True)))
            r = complete(router)
            assert r.status_code == 200, r.text
            assert received(thief) == []  # no RegisterAck, no prompt
            assert d0.messages(protocol.Generate)  # the real worker served it
            worker = router.server.registry.get("d0")
            assert worker is not None and not worker.heartbeat.draining
        finally:
            thief.close()
        time.sleep(0.3)  # after the thief is gone, the worker still serves
        assert complete(router).status_code == 200
        assert len(d0.messages(protocol.Generate)) == 2


def test_heartbeats_from_another_connection_are_ignored() -> None:
    with RouterThread(colocated=True, heartbeat_timeout_s=30) as router:
        d0 = router.worker("decode", "d0")
        d0.heartbeats_on = False  # its own beats would undo a spoof's effect within 0.2 s
        spoof = rogue(router.control, b"d0#heartbeat")
        try:
            for _ in range(3):
                spoof.send(protocol.encode(Heartbeat("d0", 0, 0, 1000, 1000, draining=True)))
            time.sleep(0.5)
            assert httpx.get(router.url + "/health").status_code == 200
            assert [w.worker_id for w in router.server.registry.live("decode")] == ["d0"]
        finally:
            spoof.close()


def test_oversize_heartbeats_and_kv_events_are_dropped(caplog: pytest.LogCaptureFixture) -> None:
    with RouterThread(colocated=True, heartbeat_timeout_s=30) as router:
        d0 = router.worker("decode", "d0")  # 1000 blocks
        d0.heartbeats_on = False
        counters = {f"c{i}_total": 1.0 for i in range(100_000)}  # ~1.5 MB
        d0.send(Heartbeat("d0", 0, 0, 1000, 1000, counters=counters))
        many = [i.to_bytes(16, "little") for i in range(10_000)]  # more keys than blocks
        d0.send(KVEvents("d0", 0, many, [], reset=True))
        d0.send(Heartbeat("d0", 0, 0, 1000, 1000, counters={"fine_total": 2.0}, kv_events_seq=0))
        deadline = time.monotonic() + 5
        worker = router.server.registry.get("d0")
        while worker.heartbeat is None or "fine_total" not in worker.heartbeat.counters:
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert len(worker.heartbeat.counters) == 1
        assert router.server.prefix_index.num_keys("d0") == 0
        assert "heartbeat message of" in caplog.text and "exceeds its limit" in caplog.text


def test_an_unreachable_worker_is_dead_at_once_and_its_request_fails_over() -> None:
    with RouterThread(colocated=True, heartbeat_timeout_s=30) as router:
        d0 = router.worker("decode", "d0")
        d1 = router.worker("decode", "d1")
        d0.die()  # its connection closes; its heartbeats would be missed only after 30 s
        time.sleep(0.3)
        for _ in range(2):  # least loaded: one of these picks d0 first
            r = complete(router)
            assert r.status_code == 200, r.text
        deadline = time.monotonic() + 2
        while router.server.registry.get("d0") is not None:
            assert time.monotonic() < deadline, "d0 is still registered"
            time.sleep(0.05)
        assert len(d1.messages(protocol.Generate)) == 2
        d1.die()
        time.sleep(0.3)
        assert complete(router).status_code == 503
        deadline = time.monotonic() + 2
        while httpx.get(router.url + "/health").status_code != 503:
            assert time.monotonic() < deadline, "/health still says 200"
            time.sleep(0.05)


# ---- authentication: the cluster secret ----------------------------------------------------------


def test_a_worker_without_the_cluster_secret_cannot_register(tmp_path) -> None:
    from common.runtime.auth import ClusterKeys
    from common.runtime.worker import ControlConnection
    from common.runtime.worker import register as register_worker

    (tmp_path / "secret").write_text("s3cret\n")
    with RouterThread(colocated=True, cluster_secret_file=str(tmp_path / "secret")) as router:
        outsider = FakeWorker(router.control, "decode", "d0")  # plain ZeroMQ, no keys
        try:
            time.sleep(1.0)
            assert outsider.acks == [] and router.server.registry.workers == {}
        finally:
            outsider.close()
        wrong = ControlConnection(
            router.control, "d1", zmq.Context.instance(), ClusterKeys.from_secret(b"guess")
        )
        member = ControlConnection(
            router.control, "d2", zmq.Context.instance(), ClusterKeys.from_secret(b"s3cret")
        )
        try:
            with pytest.raises(RuntimeError, match="no answer"):
                register_worker(wrong, reg("d1"), timeout_s=1.5)
            register_worker(member, reg("d2"), timeout_s=5)  # knows the secret: accepted
            assert list(router.server.registry.workers) == ["d2"]
        finally:
            wrong.close()
            member.close()


def test_without_a_secret_the_control_socket_binds_loopback_only(monkeypatch) -> None:
    from router.server import RouterConfig, RouterServer
    from tests.router.fake_worker import default_tokenizer

    monkeypatch.delenv("PDSERVE_CLUSTER_SECRET", raising=False)
    monkeypatch.delenv("PDSERVE_CLUSTER_SECRET_FILE", raising=False)
    with pytest.raises(ValueError, match="without a cluster secret"):
        RouterServer(RouterConfig(control_host="0.0.0.0"), default_tokenizer(), 2048)
    monkeypatch.setenv("PDSERVE_CLUSTER_SECRET", "s3cret")
    RouterServer(RouterConfig(control_host="0.0.0.0"), default_tokenizer(), 2048)  # no error
