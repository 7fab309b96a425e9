"""common/runtime/kv_events.py: a worker's KV events per tier (device cache, host RAM, disk), cut
into bounded messages, and full snapshots that reset every tier the worker has; and the worker's
numbering of them (`WorkerBase.publish_kv_events`)."""

from __future__ import annotations

from types import SimpleNamespace

from common.protocol import KVEvents, decode_control, encode
from common.runtime import kv_events
from common.runtime.worker import WorkerBase
from tests.common.engine.test_engine import GREEDY, make_engine, prompts


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def test_changes_are_cut_into_messages_per_tier():
    changes = {
        "device": ([k(1), k(2), k(3)], [k(4)]),
        "cpu": ([], []),  # nothing: no message
        "disk": ([k(5)], [k(6), k(7), k(8), k(9), k(10)]),
    }
    messages = kv_events.change_messages("w", changes, chunk=2)
    got = [(m.tier, m.stored, m.evicted, m.reset) for m in messages]
    assert got == [
        ("device", [k(1), k(2)], [k(4)], False),
        ("device", [k(3)], [], False),
        ("disk", [k(5)], [k(6), k(7)], False),
        ("disk", [], [k(8), k(9)], False),
        ("disk", [], [k(10)], False),
    ]
    for m in messages:  # they cross the wire as they are
        assert decode_control(encode(m)) == m


def test_a_snapshot_resets_every_tier_even_an_empty_one():
    keys = {"device": [k(1), k(2), k(3)], "cpu": [], "disk": [k(4)]}
    messages = kv_events.snapshot_messages("w", keys, chunk=2)
    got = [(m.tier, m.stored, m.reset) for m in messages]
    assert got == [
        ("device", [k(1), k(2)], True),
        ("device", [k(3)], False),  # the rest of the device snapshot adds to the reset
        ("cpu", [], True),
        ("disk", [k(4)], True),
    ]


def test_an_engine_reports_its_tier(tiny_llama):
    hf_model, _ = tiny_llama
    engine = make_engine(
        hf_model, max_model_len=128, kv_cache_memory=str(16 * 8 * 512), kv_offload_memory="1MiB"
    )
    engine.pool.track_events = engine.tier.track_events = True
    assert kv_events.chunk_keys(engine) == kv_events.MIN_CHUNK_KEYS
    for prompt in prompts(5, seed=30, lengths=(40,)):
        engine.generate([prompt], GREEDY)
    changes = kv_events.drain_changes(engine)
    assert list(changes) == ["device", "cpu"]
    offloaded, dropped = changes["cpu"]
    assert offloaded and not dropped  # 1 MiB holds every block evicted here
    assert set(offloaded) == set(engine.tier.ram.keys())
    device_stored, device_evicted = changes["device"]
    assert set(offloaded) <= set(device_evicted)  # what left the cache went to RAM
    snap = kv_events.snapshot(engine)
    assert set(snap["device"]) == set(engine.pool.cached_keys())
    assert set(snap["cpu"]) == set(offloaded)
    assert kv_events.drain_changes(engine) == {"device": ([], []), "cpu": ([], [])}
    engine.tier.close()


class _Control:
    def __init__(self) -> None:
        self.sent: list[KVEvents] = []

    def send(self, message: KVEvents) -> None:
        self.sent.append(message)


def test_the_worker_numbers_every_message_per_router(tiny_llama):
    hf_model, _ = tiny_llama
    engine = make_engine(
        hf_model, max_model_len=128, kv_cache_memory=str(16 * 8 * 512), kv_offload_memory="1MiB"
    )
    engine.pool.track_events = engine.tier.track_events = True
    links = {
        name: SimpleNamespace(kv_events_seq=-1, kv_snapshot_due=True, control=_Control())
        for name in ("a", "b")
    }
    worker = SimpleNamespace(worker_id="w", engine=engine, links=links)
    WorkerBase.publish_kv_events(worker)  # both: snapshots of the two tiers
    links["b"].kv_snapshot_due = False
    for prompt in prompts(5, seed=31, lengths=(40,)):
        engine.generate([prompt], GREEDY)
    WorkerBase.publish_kv_events(worker)
    links["a"].kv_snapshot_due = True
    WorkerBase.publish_kv_events(worker)
    a, b = links["a"].control.sent, links["b"].control.sent
    assert [m.seq for m in a] == list(range(len(a))) and [m.seq for m in b] == list(range(len(b)))
    assert [(m.tier, m.reset) for m in a[:2]] == [("device", True), ("cpu", True)]
    assert {m.tier for m in b[2:]} == {"device", "cpu"} and not any(m.reset for m in b[2:])
    assert [(m.tier, m.reset) for m in a[-2:]] == [("device", True), ("cpu", True)]
    assert set(a[-1].stored) == set(engine.tier.ram.keys())
    engine.tier.close()
