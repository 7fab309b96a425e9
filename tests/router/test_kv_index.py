"""router/kv_index.py: KV events in and out of order, gaps, resync, pending keys, removal."""

from __future__ import annotations

from common.engine.block_pool import BlockPool
from common.prefix_hash import block_keys, model_salt
from common.protocol import KVEvents, decode_control, encode
from router.kv_index import PrefixIndex

SALT = model_salt("m", "float32", 4)
KEYS = block_keys(list(range(40)), 4, SALT)  # 10 chained block keys


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def ev(seq: int, stored=(), evicted=(), reset: bool = False, worker: str = "p0") -> KVEvents:
    msg = KVEvents(worker, seq, list(stored), list(evicted), reset)
    return decode_control(encode(msg))  # what the router really gets


def test_in_order_events_build_the_index() -> None:
    index = PrefixIndex()
    assert not index.apply(ev(0, KEYS[:3], reset=True))
    assert not index.apply(ev(1, KEYS[3:6]))
    assert index.match("p0", KEYS) == 6
    assert not index.apply(ev(2, evicted=[KEYS[4]]))
    assert index.match("p0", KEYS) == 4  # a hole ends the leading run
    assert index.num_keys("p0") == 5
    assert index.match("p1", KEYS) == 0


def test_duplicates_and_stale_messages_are_ignored() -> None:
    index = PrefixIndex()
    index.apply(ev(0, KEYS[:2], reset=True))
    index.apply(ev(1, KEYS[2:4]))
    index.apply(ev(2, evicted=KEYS[2:4]))
    assert not index.apply(ev(1, KEYS[2:4]))  # replayed: must not resurrect evicted keys
    assert index.match("p0", KEYS) == 2
    assert index.num_resyncs_asked == 0


def test_gap_asks_for_a_snapshot_once_and_the_snapshot_replaces_everything() -> None:
    clock = Clock()
    index = PrefixIndex(resync_interval_s=2.0, clock=clock)
    index.apply(ev(0, KEYS[:2], reset=True))
    assert index.apply(ev(2, KEYS[2:4]))  # seq 1 was lost
    assert index.match("p0", KEYS) == 4  # best effort: events after a gap are still applied
    assert not index.apply(ev(3, KEYS[4:5]))  # asked a moment ago: not again yet
    clock.now = 5.0
    assert index.apply(ev(4, KEYS[5:6]))  # still unsynced after the interval: ask again
    assert index.num_resyncs_asked == 2
    # The snapshot (seq 5) says what is really there; the old set is gone.
    assert not index.apply(ev(5, KEYS[:1] + KEYS[7:8], reset=True))
    assert index.num_keys("p0") == 2
    assert index.match("p0", KEYS) == 1
    assert not index.apply(ev(6, KEYS[1:3]))  # in order again
    assert index.match("p0", KEYS) == 3
    assert not index.apply(ev(4, KEYS[:10], reset=True))  # an older snapshot arriving late
    assert index.match("p0", KEYS) == 3


def test_heartbeat_notices_a_lost_last_message() -> None:
    clock = Clock()
    index = PrefixIndex(resync_interval_s=0.0, clock=clock)
    index.apply(ev(0, KEYS[:1], reset=True))
    assert not index.on_heartbeat("p0", 0)
    assert not index.on_heartbeat("p0", 1)  # seq 1 may still be on its way
    index.apply(ev(1, KEYS[1:2]))
    assert not index.on_heartbeat("p0", 2)  # seq 2 sent just now
    assert index.on_heartbeat("p0", 2)  # a heartbeat later, seq 2 never came: lost
    # A worker whose snapshot never arrived is asked for one.
    assert index.on_heartbeat("p9", 3)
    assert not index.on_heartbeat("p8", -1)  # has sent nothing yet


def test_pending_keys_count_until_they_expire_or_are_confirmed() -> None:
    clock = Clock()
    index = PrefixIndex(pending_ttl_s=10.0, clock=clock)
    index.add_pending("p0", KEYS[:5])
    assert index.match("p0", KEYS) == 5
    index.apply(ev(0, KEYS[:3], reset=True))  # confirmed: no longer expire
    clock.now = 11.0
    assert index.match("p0", KEYS) == 3  # the unconfirmed two expired
    index.add_pending("p0", KEYS[:6])
    index.apply(ev(1, evicted=KEYS[3:4]))  # evicted before it was ever confirmed
    assert index.match("p0", KEYS) == 3


def test_removed_worker_is_forgotten() -> None:
    index = PrefixIndex()
    index.apply(ev(0, KEYS, reset=True, worker="p0"))
    index.apply(ev(0, KEYS[:2], reset=True, worker="p1"))
    index.remove("p0")
    assert index.match("p0", KEYS) == 0
    assert index.worker_ids() == ["p1"]
    # Back again (a new process with the same id): starts from its own snapshot.
    assert not index.apply(ev(0, KEYS[:1], reset=True, worker="p0"))
    assert index.match("p0", KEYS) == 1


def test_block_pool_events_are_the_net_change() -> None:
    pool = BlockPool(4, 4, track_events=True)
    ids = pool.allocate(2)
    pool.register(ids[0], KEYS[0], range(4))
    pool.register(ids[1], KEYS[1], range(4, 8))
    assert pool.drain_events() == ([KEYS[0], KEYS[1]], [])
    assert pool.drain_events() == ([], [])
    pool.free(ids)
    pool.allocate(4)  # evicts both cached blocks
    assert sorted(pool.drain_events()[1]) == sorted(KEYS[:2])
    # Stored then evicted between two drains: only the eviction is news.
    pool2 = BlockPool(1, 4, track_events=True)
    (b,) = pool2.allocate(1)
    pool2.register(b, KEYS[0], range(4))
    pool2.free([b])
    pool2.allocate(1)
    assert pool2.drain_events() == ([], [KEYS[0]])
    # A second block with an already cached key is no event.
    pool3 = BlockPool(2, 4, track_events=True)
    x, y = pool3.allocate(2)
    pool3.register(x, KEYS[0], range(4))
    pool3.register(y, KEYS[0], range(4))
    assert pool3.drain_events() == ([KEYS[0]], [])
    assert BlockPool(2, 4).drain_events() == ([], [])  # not tracking: nothing recorded


def test_expired_pending_keys_are_dropped_as_new_ones_come() -> None:
    """Prompts whose KV never gets reported (failed prefills) leave their keys pending only
    for one TTL, however few each worker has (they once stayed until a worker had 65,536)."""
    clock = Clock()
    index = PrefixIndex(pending_ttl_s=10.0, clock=clock)
    for second in range(60):  # 100 distinct 10-block prompts a second over 10 workers
        clock.now = float(second)
        for i in range(100):
            keys = block_keys(
                list(range(second * 1000 + i * 40, second * 1000 + i * 40 + 40)), 4, SALT
            )
            index.add_pending(f"w{i % 10}", keys)
    pending = sum(len(w.pending) for w in index._workers.values())
    assert pending <= 11 * 100 * 10  # the last 11 seconds' keys, not 60 seconds'
    assert len(index._expiries) <= 11 * 100 * 10
    assert sum(len(w.roots) for w in index._workers.values()) <= 11 * 100
    assert len(index._pending_roots) <= 11 * 100


def test_a_pending_key_filed_again_lives_on_and_expires_once() -> None:
    clock = Clock()
    index = PrefixIndex(pending_ttl_s=10.0, clock=clock)
    index.add_pending("p0", KEYS[:2])
    clock.now = 8.0
    index.add_pending("p0", KEYS[:2])  # the same prompt again: good until 18
    clock.now = 12.0
    index.add_pending("p1", KEYS[5:6])  # time passes; the first filing's time is up
    assert index.match("p0", KEYS) == 2
    assert len(index._expiries) == 3  # one entry per pending key, never a duplicate
    clock.now = 19.0
    index.add_pending("p1", KEYS[6:7])
    assert index.match("p0", KEYS) == 0 and index.holders(KEYS[0]) == set()
