"""router/kv_index.py with workers' KV tiers: keys in a worker's host RAM or disk tier count as held
(matching), a tier's reset replaces that tier only, `tiers_of` says where each block is,
the numbering is shared with the device cache's messages, and a removed worker holds nothing."""

from __future__ import annotations

from common.protocol import KVEvents
from router.kv_index import PrefixIndex


def k(i: int) -> bytes:
    return i.to_bytes(16, "little")


def ev(seq, stored=(), evicted=(), reset=False, tier="device", worker="p0") -> KVEvents:
    return KVEvents(worker, seq, list(stored), list(evicted), reset, tier)


def test_tier_keys_count_as_held():
    index = PrefixIndex()
    assert not index.apply(ev(0, [k(1), k(2)], reset=True))
    assert not index.apply(ev(1, [], reset=True, tier="cpu"))
    assert not index.apply(ev(2, [k(3)], [k(1), k(2)]))  # the cache dropped 1, 2 ...
    assert not index.apply(ev(3, [k(1), k(2)], tier="cpu"))  # ... into RAM
    assert index.match("p0", [k(1), k(2), k(3), k(4)]) == 3
    assert index.tiers_of("p0", [k(1), k(2), k(3), k(4)]) == ["cpu", "cpu", "device"]
    assert not index.apply(ev(4, [k(2)], tier="disk"))
    assert not index.apply(ev(5, [], [k(2)], tier="cpu"))  # RAM dropped 2: still on disk
    assert index.tiers_of("p0", [k(1), k(2)]) == ["cpu", "disk"]
    assert not index.apply(ev(6, [], [k(2)], tier="disk"))
    assert index.match("p0", [k(1), k(2)]) == 1


def test_a_tier_reset_replaces_that_tier_only():
    index = PrefixIndex()
    index.apply(ev(0, [k(1)], reset=True))
    index.apply(ev(1, [k(2), k(3)], reset=True, tier="cpu"))
    index.apply(ev(2, [k(4)], reset=True, tier="disk"))
    index.apply(ev(3, [k(5)], reset=True, tier="cpu"))
    assert index.tiers_of("p0", [k(1), k(5), k(4)]) == ["device", "cpu", "disk"]
    assert index.match("p0", [k(2)]) == 0
    assert index.num_keys("p0") == 1  # reported cache keys


def test_a_lost_tier_message_asks_for_a_snapshot():
    t = [0.0]
    index = PrefixIndex(clock=lambda: t[0])
    index.apply(ev(0, [k(1)], reset=True))
    assert index.apply(ev(2, [k(2)], tier="cpu"))  # seq 1 was lost
    assert index.match("p0", [k(1), k(2)]) == 2  # applied, best effort
    assert not index.apply(ev(2, [k(2)], tier="cpu"))  # a duplicate
    index.apply(ev(3, [k(1)], reset=True))
    index.apply(ev(4, [k(7)], reset=True, tier="cpu"))
    assert index.tiers_of("p0", [k(1), k(7)]) == ["device", "cpu"]
    assert index.match("p0", [k(1), k(2)]) == 1


def test_removing_a_worker_forgets_its_tiers():
    index = PrefixIndex()
    index.apply(ev(0, [], reset=True))
    index.apply(ev(1, [k(1)], reset=True, tier="disk"))
    assert index.match("p0", [k(1)]) == 1
    index.remove("p0")
    assert index.match("p0", [k(1)]) == 0 and index.tiers_of("p0", [k(1)]) == []
