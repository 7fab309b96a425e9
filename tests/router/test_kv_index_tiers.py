"""router/kv_index.py with workers' KV tiers: keys in a worker's host RAM or disk tier count as held
(matching, holders), a tier's reset replaces that tier only, `tiers_of` says where each block is,
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


def test_tier_holders():
    """A worker holding a prompt's first block only in its tier is still among its holders (the
    policy scores only holders of the first block)."""
    index = PrefixIndex()
    index.apply(ev(0, [k(1)], reset=True))
    index.apply(ev(1, [k(2)], reset=True, tier="cpu"))
    index.apply(ev(2, [], [k(1)]))  # the cache dropped 1 ...
    index.apply(ev(3, [k(1)], tier="disk"))  # ... to disk
    assert index.holders(k(1)) == {"p0"} and index.holders(k(2)) == {"p0"}
    index.apply(ev(4, [k(1)], tier="cpu"))  # in both tiers now
    index.apply(ev(5, [], [k(1)], tier="disk"))
    assert index.holders(k(1)) == {"p0"}  # still in RAM
    index.apply(ev(6, [], reset=True, tier="cpu"))  # RAM emptied: 1 and 2 are gone
    assert index.holders(k(1)) == set() and index.holders(k(2)) == set()
    index.apply(ev(0, [], reset=True, worker="p1"))
    index.apply(ev(1, [k(3)], reset=True, tier="disk", worker="p1"))
    index.apply(ev(7, [k(3)], tier="cpu"))
    assert index.holders(k(3)) == {"p0", "p1"}
    index.remove("p1")
    assert index.holders(k(3)) == {"p0"}


def test_the_prefix_policy_routes_to_a_prefix_held_in_a_tier():
    from router.policy import PrefillPolicy
    from tests.router.test_policy import BS, SALT, block_keys, tenant, worker

    index = PrefixIndex()
    keys = block_keys(tenant(0), BS, SALT)
    index.apply(KVEvents("p1", 0, [], [], True))
    index.apply(KVEvents("p1", 1, keys[:20], [], True, "cpu"))  # evicted from its cache to RAM
    index.apply(KVEvents("p1", 2, keys[20:], [], False, "disk"))  # ... and further to disk
    choice = PrefillPolicy("prefix", index).choose([worker("p0"), worker("p1")], tenant(0))
    assert (choice.worker.worker_id, choice.matched_tokens) == ("p1", 64 * BS)


def test_a_decode_worker_holding_a_prefix_in_its_tier_is_chosen():
    """The decode choice scores only holders of the prompt's first block: tier holders count."""
    from router.policy import pick_decode_by_prefix
    from tests.router.test_policy import BS, SALT, block_keys, decode_worker, tenant

    index = PrefixIndex()
    keys = block_keys(tenant(0), BS, SALT)
    index.apply(KVEvents("d1", 0, [], [], True))
    index.apply(KVEvents("d1", 1, keys, [], True, "disk"))
    d0, d1 = decode_worker("d0", 0), decode_worker("d1", 2)
    chosen, chosen_keys = pick_decode_by_prefix([d0, d1], 0.0, tenant(0) + [4], index, slack=4)
    assert chosen is d1 and chosen_keys == keys
