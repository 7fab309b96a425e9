"""router/worker.py (the live index by load), the registry keeping it up to date, the prefix
index's holders, and the decode choices over them: against a look at every worker, through
random changes of load, refusals, drains, deaths and KV events."""

from __future__ import annotations

import random

from common.prefix_hash import block_keys, model_salt
from common.protocol import PROTOCOL_VERSION, Heartbeat, KVEvents, Register
from router.kv_index import PrefixIndex
from router.policy import PrefillPolicy, pick_decode, pick_decode_by_prefix
from router.registry import Registry
from router.worker import LiveWorkers, Worker, decode_order, prefill_order

BS = 4
SALT = model_salt("default", "float32", BS)


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def reg(worker_id: str, role: str = "decode", salt: bytes = SALT) -> Register:
    return Register(
        PROTOCOL_VERSION, role, worker_id, "default", BS, 1000, 4096, "float32", "h", "",
        ["tcp"], salt,
    )  # fmt: skip


def hb(worker_id: str, running: int = 0, draining: bool = False, queued: int = 0) -> Heartbeat:
    return Heartbeat(worker_id, running, 0, 100, 100, queued, draining=draining)


def brute_pick(workers: list[Worker], now_s: float) -> Worker | None:
    ready = [w for w in workers if w.refused_until_s <= now_s]
    return min(ready, key=decode_order) if ready else None


def brute_by_prefix(workers, now_s, prompt, index, slack):
    """The decode choice by prefix as it was, looking at every worker."""
    least = brute_pick(workers, now_s)
    if least is None:
        return None
    ready = sorted(
        (w for w in workers if w.refused_until_s <= now_s and w.info.kv_salt), key=decode_order
    )
    best, best_matched = least, 0
    for w in ready:
        if w.decode_load > least.decode_load + slack:
            break
        matched = index.match(w.worker_id, block_keys(prompt, BS, w.info.kv_salt))
        if matched > best_matched:
            best, best_matched = w, matched
    return best


def test_least_equals_a_look_at_every_worker_through_random_changes() -> None:
    rng = random.Random(7)
    clock = Clock()
    registry = Registry({"default"}, timeout_s=5.0, clock=clock)
    for i in range(40):
        registry.register(f"d{i}".encode(), reg(f"d{i}"))
    live = registry.live_index("decode")
    for step in range(2000):
        w = registry.get(f"d{rng.randrange(40)}")
        if w is None:
            continue
        kind = rng.random()
        if kind < 0.4:
            w.num_in_flight = max(0, w.num_in_flight + rng.choice((-1, 1)))
        elif kind < 0.7:
            registry.on_heartbeat(hb(w.worker_id, rng.randrange(6), draining=rng.random() < 0.1))
        elif kind < 0.8:
            w.refused_until_s = clock.now + rng.choice((0.0, 0.5))
        elif kind < 0.85:
            registry.mark_dead(w, "unreachable")
            registry.expire()
        elif kind < 0.9:  # a new worker, or one coming back
            wid = f"d{rng.randrange(40)}"
            if registry.get(wid) is None:
                registry.register(wid.encode(), reg(wid))
        clock.now += 0.01
        everyone = [x for x in registry.workers.values() if not x.draining and not x.dead_reason]
        assert sorted(registry.live("decode"), key=decode_order) == sorted(
            everyone, key=decode_order
        )
        assert pick_decode(live, clock.now) is brute_pick(everyone, clock.now), step
        assert len(live._heap) <= 2 * len(live) + 65  # stale entries do not pile up
        loads = [x.decode_load for x in everyone]
        assert live.load_range() == ((min(loads), max(loads)) if loads else None)
        if loads:
            assert live.at_load(min(loads)) == {
                x.worker_id for x in everyone if x.decode_load == min(loads)
            }
            some = everyone[0].worker_id
            assert live.load_range(exclude={some}) == (
                (min(x.decode_load for x in everyone[1:]), max(x.decode_load for x in everyone[1:]))
                if everyone[1:]
                else None
            )
        assert live.ids_in_order() == sorted(x.worker_id for x in everyone)
        assert all(live.ids_in_order()[live.position(x.worker_id)] == x.worker_id for x in everyone)
        assert len(live._low_loads) <= 2 * len(live._at_load) + 65


def test_a_worker_leaves_the_index_when_it_drains_dies_or_expires() -> None:
    clock = Clock()
    registry = Registry({"default"}, timeout_s=5.0, clock=clock)
    for wid in ("d0", "d1", "d2"):
        registry.register(wid.encode(), reg(wid))
    registry.register(b"p0", reg("p0", "prefill"))
    assert registry.has_live("prefill") and len(registry.live_index("decode")) == 3
    registry.on_heartbeat(hb("d0", draining=True))
    registry.mark_dead(registry.get("d1"), "unreachable")
    assert [w.worker_id for w in registry.live("decode")] == ["d2"]
    registry.on_heartbeat(hb("d0"))  # no longer draining
    assert {w.worker_id for w in registry.live("decode")} == {"d0", "d2"}
    clock.now += 10  # everyone silent
    dead = registry.expire()
    assert {w.worker_id for w in dead} == {"d0", "d1", "d2", "p0"}
    assert not registry.has_live("decode") and not registry.has_live("prefill")
    assert pick_decode(registry.live_index("decode"), clock.now) is None
    dead[0].num_in_flight += 1  # a flight released after its worker died: not filed again
    assert len(registry.live_index("decode")) == 0


def test_a_worker_tells_its_watcher_what_changed() -> None:
    """The load fields tell the watcher `load_only`; a heartbeat does too unless it starts or
    stops a drain; liveness and registration do not; the other fields tell nothing."""
    w = Worker(info=reg("d0"), identity=b"d0", last_seen_s=0.0)
    seen: list[bool] = []
    w.watch(lambda worker, load_only: seen.append(load_only) if worker is w else None)
    w.num_in_flight += 1
    w.queued_prefill_tokens = 64
    w.heartbeat = hb("d0", 3)
    w.heartbeat = hb("d0", 4)
    assert seen == [True] * 4
    w.heartbeat = hb("d0", 4, draining=True)
    w.heartbeat = hb("d0", 4, draining=True)
    w.heartbeat = hb("d0", 4)
    w.dead_reason = "unreachable"
    w.info = reg("d0")
    assert seen[4:] == [False, True, False, False, False]
    del seen[:]
    w.last_seen_s, w.progress_s, w.refused_until_s = 1.0, 1.0, 1.0
    w.num_prefill_dispatched += 1
    w.prefix_matched_tokens += 16
    assert seen == []
    w.watch(None)
    w.num_in_flight -= 1
    assert seen == [] and w.num_in_flight == 0 and w.decode_load == 4


def test_a_load_change_refiles_only_a_live_worker() -> None:
    registry = Registry({"default"})
    for wid in ("d0", "d1"):
        registry.register(wid.encode(), reg(wid))
    live = registry.live_index("decode")
    d0, d1 = registry.get("d0"), registry.get("d1")
    d0.num_in_flight = 2
    assert pick_decode(live, 0.0) is d1
    d1.num_in_flight = 3
    assert pick_decode(live, 0.0) is d0 and live.load_range() == (2, 3)
    registry.on_heartbeat(hb("d0", 1, draining=True))
    d0.num_in_flight = 0  # a draining worker's request finished: still not taking new work
    assert [w.worker_id for w in registry.live("decode")] == ["d1"]
    assert live.load_range() == (3, 3) and pick_decode(live, 0.0) is d1
    registry.on_heartbeat(hb("d0", 1))  # its drain called off: back, under its load now
    assert pick_decode(live, 0.0) is d0 and live.load_range() == (1, 3)


def test_prefill_least_loaded_from_the_index_with_exclusions() -> None:
    registry = Registry({"default"})
    for wid in ("p0", "p1", "p2"):
        registry.register(wid.encode(), reg(wid, "prefill"))
    live = registry.live_index("prefill")
    policy = PrefillPolicy("least_loaded")
    assert policy.pick(live, [1, 2]).worker_id == "p0"
    registry.get("p0").queued_prefill_tokens = 50
    registry.on_heartbeat(hb("p1", queued=20))  # load another router placed
    assert policy.pick(live, [1, 2]).worker_id == "p2"
    assert policy.pick(live, [1, 2], exclude={"p2"}).worker_id == "p1"
    registry.get("p2").num_in_flight = 1  # same queued tokens: fewer requests first
    registry.get("p0").queued_prefill_tokens = 0
    assert policy.pick(live, [1, 2]).worker_id == "p0"
    assert policy.pick(live, [1, 2], exclude={"p0", "p1", "p2"}) is None
    assert min(live, key=prefill_order).worker_id == "p0"


def test_holders_follow_events_pending_prompts_and_removal() -> None:
    clock = Clock()
    index = PrefixIndex(pending_ttl_s=5.0, clock=clock)
    a = block_keys(list(range(40)), BS, SALT)
    b = block_keys(list(range(100, 140)), BS, SALT)
    index.apply(KVEvents("w0", 0, a[:5], [], reset=True))
    index.apply(KVEvents("w1", 0, a[:2], [], reset=True))
    assert index.holders(a[0]) == {"w0", "w1"} and index.holders(a[4]) == {"w0"}
    index.apply(KVEvents("w1", 1, [], a[:1]))  # evicted
    assert index.holders(a[0]) == {"w0"}
    index.apply(KVEvents("w0", 1, b[:3], [], reset=True))  # a snapshot replaces the set
    assert index.holders(a[0]) == set() and index.holders(b[0]) == {"w0"}
    index.add_pending("w2", b)
    assert index.holders(b[0]) == {"w0", "w2"} and index.match("w2", b) == len(b)
    clock.now += 6  # expired: `match` says so, and the holder goes
    assert index.match("w2", b) == 0 and index.holders(b[0]) == {"w0"}
    index.add_pending("w2", a)
    index.apply(KVEvents("w2", 0, a[:1], [], reset=True))  # confirmed: held, not pending
    assert index.holders(a[0]) == {"w2"} and not index._pending_roots
    for worker_id in ("w0", "w1", "w2"):
        index.remove(worker_id)
    assert not index._holders and not index._pending_roots


def test_decode_choice_by_prefix_equals_a_look_at_every_worker() -> None:
    rng = random.Random(3)
    registry = Registry({"default"})
    index = PrefixIndex()
    prompts = [[1000 * t + i for i in range(BS * 6)] for t in range(4)]
    for i in range(30):
        wid = f"d{i}"
        registry.register(wid.encode(), reg(wid, salt=b"" if i % 10 == 9 else SALT))
    workers = list(registry.workers.values())
    for round_ in range(300):
        w = rng.choice(workers)
        kind = rng.random()
        if kind < 0.4:
            w.num_in_flight = rng.randrange(8)
        elif kind < 0.7:
            prompt = rng.choice(prompts)
            keys = block_keys(prompt, BS, SALT)[: rng.randrange(7)]
            index.apply(KVEvents(w.worker_id, round_ + 1, keys, [], reset=True))
        elif kind < 0.8:
            index.add_pending(w.worker_id, block_keys(rng.choice(prompts), BS, SALT))
        else:
            w.refused_until_s = rng.choice((0.0, 1e9))
        prompt = rng.choice(prompts) + [7]
        slack = rng.randrange(4)
        got = pick_decode_by_prefix(registry.live_index("decode"), 0.0, prompt, index, slack)
        want = brute_by_prefix(workers, 0.0, prompt, index, slack)
        assert (got[0] if got else None) is want, round_
        if got is not None:
            salted = bool(got[0].info.kv_salt)
            assert got[1] == (block_keys(prompt, BS, SALT) if salted else [])


def test_a_list_of_workers_is_indexed_on_the_spot() -> None:
    workers = [Worker(info=reg(f"d{i}"), identity=b"x", last_seen_s=0.0) for i in range(3)]
    workers[0].num_in_flight = 2
    live = LiveWorkers(decode_order, workers)
    assert live.least(0.0).worker_id == "d1" and pick_decode(workers, 0.0).worker_id == "d1"
