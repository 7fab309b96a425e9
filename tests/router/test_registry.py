"""router/registry.py, router/policy.py and router/metrics.py, without sockets."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from common.protocol import PROTOCOL_VERSION, Heartbeat, Register
from router.metrics import RouterMetrics
from router.policy import PrefillPolicy, pick_decode
from router.registry import Registry


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
    # A heartbeat's count is not the load: the router counts from dispatch.
    registry.get("p1").heartbeat = hb("p1", queued=900)
    registry.get("p2").queued_prefill_tokens = 100
    assert ll.pick(workers, [1]).worker_id == "p2"
    assert ll.pick(workers, [1], exclude={"p2"}).worker_id == "p1"
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
