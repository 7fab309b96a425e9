"""Block pool and block manager: ref counts, prefix hits, LRU eviction, collisions, no leaks."""

from __future__ import annotations

import pytest

from common.engine.block_manager import BlockManager
from common.engine.block_pool import BlockPool
from common.engine.sequence import SequenceState
from common.prefix_hash import block_key, block_keys, model_salt
from common.sampling_params import SamplingParams

SALT = model_salt("test-model", "float32", 4)


def seq(tokens: list[int], rid: str = "r") -> SequenceState:
    return SequenceState(
        request_id=rid,
        token_ids=list(tokens),
        num_prompt_tokens=len(tokens),
        params=SamplingParams(),
    )


def compute(manager: BlockManager, s: SequenceState) -> None:
    """Pretend the model computed all of s's tokens: grow its table and register full blocks."""
    assert manager.ensure_slots(s, s.num_tokens)
    s.num_computed_tokens = s.num_tokens
    manager.commit(s)


def test_keys_chain_and_salt():
    a = block_keys(list(range(12)), 4, SALT)
    assert len(a) == 3 and len(set(a)) == 3
    # same block tokens under a different parent give a different key
    assert block_key(None, [4, 5, 6, 7], SALT) != a[1]
    assert block_key(a[0], [4, 5, 6, 7], SALT) == a[1]
    assert block_keys(list(range(12)), 4, model_salt("other", "float32", 4)) != a
    # continuing from a parent equals computing the whole chain
    assert block_keys(list(range(12)), 4, SALT, parent=a[0], start_block=1) == a[1:]
    assert len(a[0]) == 16  # 128-bit keys


def test_allocate_free_ref_counts():
    pool = BlockPool(4, 4)
    ids = pool.allocate(3)
    assert pool.num_free == 1
    pool.take(ids[:1])
    assert pool.blocks[ids[0]].ref_count == 2
    pool.free(ids)
    assert pool.num_free == 3
    pool.free(ids[:1])
    assert pool.num_free == 4
    with pytest.raises(RuntimeError):
        pool.free(ids[:1])
    with pytest.raises(ValueError):
        pool.allocate(5)


def test_prefix_hit_shares_blocks_and_counts_tokens():
    pool = BlockPool(16, 4)
    manager = BlockManager(pool, SALT)
    a = seq(list(range(10)), "a")
    assert manager.match_prefix(a) == 0
    compute(manager, a)
    b = seq(list(range(8)) + [50, 51, 52], "b")
    # 2 full blocks shared; both sequences hold them
    assert manager.match_prefix(b) == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert pool.blocks[a.block_table[0]].ref_count == 2
    assert (pool.query_tokens, pool.hit_tokens) == (10 + 11, 8)
    compute(manager, b)
    manager.free(a)
    manager.free(b)
    assert pool.num_free == pool.num_blocks


def test_whole_prompt_hit_leaves_one_token_to_compute():
    pool = BlockPool(16, 4)
    manager = BlockManager(pool, SALT)
    a = seq(list(range(8)))
    manager.match_prefix(a)
    compute(manager, a)
    manager.free(a)
    again = seq(list(range(8)))
    # both blocks are cached, but the last token must be recomputed to sample from it
    assert manager.match_prefix(again) == 4


def test_freed_blocks_stay_cached_until_evicted_lru():
    pool = BlockPool(4, 4)
    manager = BlockManager(pool, SALT)
    first = seq(list(range(9)), "first")  # 2 full blocks + 1 partial
    manager.match_prefix(first)
    compute(manager, first)
    table = list(first.block_table)
    manager.free(first)
    assert pool.num_free == 4
    # a hit after free takes the cached blocks back
    again = seq(list(range(9)), "again")
    assert manager.match_prefix(again) == 8
    assert again.block_table == table[:2]
    manager.free(again)
    # free order is tail first, so the first allocation evicts the prefix's end before its start
    order = pool.allocate(4)
    assert order.index(table[1]) < order.index(table[0])
    assert pool.cached_keys() == []
    pool.free(order)
    assert manager.match_prefix(seq(list(range(9)), "late")) == 0


def test_lru_keeps_recently_used_prefix():
    pool = BlockPool(4, 4)
    manager = BlockManager(pool, SALT)
    old, new = seq([1, 2, 3, 4, 5], "old"), seq([9, 9, 9, 9, 5], "new")
    for s in (old, new):
        manager.match_prefix(s)
        compute(manager, s)
    manager.free(old)
    manager.free(new)
    # free list: old's blocks (freed first), then new's; taking 3 evicts all of old's
    taken = pool.allocate(3)
    assert manager.match_prefix(seq([9, 9, 9, 9, 7], "probe")) == 4
    assert manager.match_prefix(seq([1, 2, 3, 4, 7], "probe2")) == 0
    pool.free(taken)


def test_collision_guard_compares_tokens():
    pool = BlockPool(8, 4)
    manager = BlockManager(pool, SALT)
    a = seq([1, 2, 3, 4, 5])
    manager.match_prefix(a)
    compute(manager, a)
    manager.free(a)
    # forge a collision: the cached block claims the key of a different token block
    forged_key = block_key(None, [7, 7, 7, 7], SALT)
    cached_id = pool.lookup(block_keys([1, 2, 3, 4], 4, SALT), [[1, 2, 3, 4]])[0]
    block = pool.blocks[cached_id]
    pool._cached[forged_key] = cached_id
    assert pool.lookup([forged_key], [[7, 7, 7, 7]]) == []
    assert block.tokens == (1, 2, 3, 4)


def test_no_leak_across_many_sequences():
    pool = BlockPool(32, 4)
    manager = BlockManager(pool, SALT)
    live = []
    for i in range(40):
        s = seq([i % 3] * 6 + [i], f"s{i}")
        manager.match_prefix(s)
        if not manager.ensure_slots(s, s.num_tokens):
            manager.free(s)
            for old in live:
                manager.free(old)
            live = []
            continue
        s.num_computed_tokens = s.num_tokens
        manager.commit(s)
        live.append(s)
    for s in live:
        manager.free(s)
    assert pool.num_free == pool.num_blocks
    assert all(b.ref_count == 0 for b in pool.blocks)
