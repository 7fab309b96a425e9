"""router/policy.py: the prefix policy on synthetic cache and load states."""

from __future__ import annotations

import itertools
import random

import pytest

from common.prefix_hash import block_keys, model_salt
from common.protocol import PROTOCOL_VERSION, KVEvents, Register
from router.kv_index import PrefixIndex
from router.policy import PrefillPolicy, PrefixParams, pick_decode_by_prefix
from router.registry import Registry, Worker

BS = 16
SALT = model_salt("default", "auto", BS)


def prefill_reg(worker_id: str, salt: bytes = SALT) -> Register:
    return Register(
        PROTOCOL_VERSION, "prefill", worker_id, "default", BS, 1000, 4096, "auto", "h", "",
        ["tcp"], salt,
    )  # fmt: skip


def worker(worker_id: str, load: int = 0, salt: bytes = SALT) -> Worker:
    w = Worker(info=prefill_reg(worker_id, salt), identity=worker_id.encode(), last_seen_s=0.0)
    w.queued_prefill_tokens = load
    return w


def tenant(t: int, n_blocks: int = 64) -> list[int]:
    """A tenant's system prompt: n_blocks full blocks of tokens unique to it."""
    return [1000 * (t + 1) + i for i in range(n_blocks * BS)]


def hold(index: PrefixIndex, worker_id: str, tokens: list[int], seq: int = 0) -> None:
    index.apply(KVEvents(worker_id, seq, block_keys(tokens, BS, SALT), [], reset=True))


def test_holder_of_the_prefix_wins_at_equal_load() -> None:
    index = PrefixIndex()
    hold(index, "p1", tenant(0))
    policy = PrefillPolicy("prefix", index)
    workers = [worker("p0"), worker("p1"), worker("p2")]
    prompt = tenant(0) + [7, 8, 9]
    for _ in range(3):  # not round robin: every time
        choice = policy.choose(workers, prompt)
        assert choice.worker.worker_id == "p1"
        assert choice.matched_tokens == 64 * BS
        assert len(choice.keys) == 64


def test_longer_match_beats_shorter() -> None:
    index = PrefixIndex()
    hold(index, "p0", tenant(0)[: 10 * BS])
    hold(index, "p1", tenant(0)[: 40 * BS])
    choice = PrefillPolicy("prefix", index).choose([worker("p0"), worker("p1")], tenant(0))
    assert (choice.worker.worker_id, choice.matched_tokens) == ("p1", 40 * BS)


def test_load_outweighs_a_match_only_beyond_its_size() -> None:
    index = PrefixIndex()
    hold(index, "p0", tenant(0))  # 1,024 tokens cached on p0
    policy = PrefillPolicy("prefix", index)
    prompt = tenant(0) + [1, 2]
    # Default weight 0.5: a cached 1,024-token prefix is worth 2,048 queued tokens.
    assert policy.pick([worker("p0", 1900), worker("p1", 0)], prompt).worker_id == "p0"
    assert policy.pick([worker("p0", 2200), worker("p1", 0)], prompt).worker_id == "p1"
    # Weight 1: worth exactly its own size in queued tokens.
    even = PrefillPolicy("prefix", index, PrefixParams(load_weight=1.0))
    assert even.pick([worker("p0", 900), worker("p1", 0)], prompt).worker_id == "p0"
    assert even.pick([worker("p0", 1100), worker("p1", 0)], prompt).worker_id == "p1"


def test_imbalance_restricts_to_lightly_loaded_workers_preferring_their_match() -> None:
    index = PrefixIndex()
    hold(index, "p0", tenant(0))
    hold(index, "p2", tenant(0)[: 8 * BS])
    # Even a weight of 0 (match only) cannot pile onto an overloaded holder.
    params = PrefixParams(load_weight=0.0, balance_abs_tokens=4096, balance_rel=2.0)
    policy = PrefillPolicy("prefix", index, params)
    workers = [worker("p0", 20000), worker("p1", 100), worker("p2", 300)]
    choice = policy.choose(workers, tenant(0))
    assert choice.worker.worker_id == "p2"  # lightly loaded, and holds part of the prefix
    assert choice.matched_tokens == 8 * BS
    # Not imbalanced by the relative test (20000 < 2 x 12000): the best match wins.
    workers = [worker("p0", 20000), worker("p1", 12000), worker("p2", 12000)]
    assert policy.pick(workers, tenant(0)).worker_id == "p0"
    # Not imbalanced by the absolute test (difference under 4,096 tokens).
    workers = [worker("p0", 4000), worker("p1", 0), worker("p2", 0)]
    assert policy.pick(workers, tenant(0)).worker_id == "p0"


def test_ties_spread_cold_prompts_and_prefer_lower_load() -> None:
    policy = PrefillPolicy("prefix", PrefixIndex())
    workers = [worker("p0"), worker("p1"), worker("p2")]
    picked = [policy.pick(workers, tenant(t)).worker_id for t in range(6)]
    assert sorted(picked) == ["p0", "p0", "p1", "p1", "p2", "p2"]  # no match anywhere: spread
    workers = [worker("p0", 50), worker("p1", 10), worker("p2", 50)]
    assert {policy.pick(workers, tenant(9)).worker_id for _ in range(3)} == {"p1"}


def test_dispatched_prompt_counts_as_held_before_its_events_arrive() -> None:
    index = PrefixIndex()
    policy = PrefillPolicy("prefix", index)
    workers = [worker("p0"), worker("p1")]
    first = policy.choose(workers, tenant(3) + [1])
    index.add_pending(first.worker.worker_id, first.keys)  # what the dispatcher does
    first.worker.queued_prefill_tokens += 1025
    # The second request of the tenant follows the first, although p0 is now busier.
    second = policy.choose(workers, tenant(3) + [2])
    assert second.worker is first.worker
    assert second.matched_tokens == 64 * BS


def test_workers_with_another_salt_never_match() -> None:
    index = PrefixIndex()
    hold(index, "p0", tenant(0))  # keys under SALT, but p0 now says it uses another salt
    other = worker("p0", salt=model_salt("other", "auto", BS))
    choice = PrefillPolicy("prefix", index).choose([other], tenant(0))
    assert choice.matched_tokens == 0


def test_exclude_and_empty() -> None:
    policy = PrefillPolicy("prefix", PrefixIndex())
    assert policy.pick([worker("p0")], [1, 2], exclude={"p0"}) is None
    assert policy.pick([], [1, 2]) is None
    assert policy.pick([worker("p0")], [1, 2]).worker_id == "p0"  # shorter than a block


def decode_worker(worker_id: str, running: int = 0, salt: bytes = SALT) -> Worker:
    w = worker(worker_id, salt=salt)
    w.info.role = "decode"
    w.num_in_flight = running
    return w


def test_decode_choice_by_prefix_within_the_slack() -> None:
    index = PrefixIndex()
    hold(index, "d1", tenant(0))
    prompt = tenant(0) + [4, 2]
    d0, d1, d2 = decode_worker("d0", 0), decode_worker("d1", 3), decode_worker("d2", 1)
    worker_, keys = pick_decode_by_prefix([d0, d1, d2], 0.0, prompt, index, slack=4)
    assert worker_ is d1 and len(keys) == 64  # 3 more sequences than d0: within the slack
    worker_, _ = pick_decode_by_prefix([d0, d1, d2], 0.0, prompt, index, slack=2)
    assert worker_ is d0  # beyond it: the least loaded
    worker_, keys = pick_decode_by_prefix([d0, d1, d2], 0.0, tenant(5), index, slack=4)
    assert worker_ is d0 and len(keys) == 64  # nobody holds it: least loaded, keys for pending
    d1.refused_until_s = 10.0
    assert pick_decode_by_prefix([d0, d1, d2], 5.0, prompt, index, slack=4)[0] is d0
    unsalted = decode_worker("d1", 0, salt=b"")
    assert pick_decode_by_prefix([unsalted], 0.0, prompt, index, slack=4) == (unsalted, [])
    assert pick_decode_by_prefix([], 0.0, prompt, index, slack=4) is None


def brute_prefix_choice(policy: PrefillPolicy, workers: list[Worker], prompt, turn: int):
    """The prefix policy as it was, scoring every worker: (worker, matched tokens, key)."""
    p = policy.params
    candidates = sorted(workers, key=lambda w: w.worker_id)
    loads = {w.worker_id: w.prefill_load for w in candidates}
    low, high = min(loads.values()), max(loads.values())
    if high - low > p.balance_abs_tokens and high > p.balance_rel * low:
        candidates = [w for w in candidates if loads[w.worker_id] <= (low + high) / 2]
    scored = []
    for i, w in enumerate(candidates):
        keys = block_keys(prompt, BS, w.info.kv_salt) if w.info.kv_salt else []
        matched = policy.index.match(w.worker_id, keys) * BS
        load = loads[w.worker_id]
        scored.append(((-(matched - p.load_weight * load), load, (i - turn) % len(candidates)), w))
    key, w = min(scored, key=lambda t: t[0])
    return w, key


def test_prefix_choice_equals_scoring_every_worker_through_random_changes() -> None:
    rng = random.Random(11)
    registry = Registry({"default"})
    index = PrefixIndex()
    prompts = [tenant(t, 6) for t in range(5)]
    for i in range(40):
        wid = f"p{i:02d}"
        registry.register(wid.encode(), prefill_reg(wid, salt=b"" if i % 13 == 12 else SALT))
    workers = list(registry.workers.values())
    live = registry.live_index("prefill")
    for weight, balance in ((0.5, 4096), (0.0, 4096), (2.0, 4096), (0.5, 300)):
        params = PrefixParams(load_weight=weight, balance_abs_tokens=balance)
        policy = PrefillPolicy("prefix", index, params)
        for round_ in range(300):
            w = rng.choice(workers)
            kind = rng.random()
            if kind < 0.4:
                w.queued_prefill_tokens = rng.choice((0, 0, 16, 50, 200, 1000))
            elif kind < 0.7:
                keys = block_keys(rng.choice(prompts), BS, SALT)[: rng.randrange(7)]
                index.apply(KVEvents(w.worker_id, round_ + 1, keys, [], reset=True))
            elif kind < 0.8:
                index.add_pending(w.worker_id, block_keys(rng.choice(prompts), BS, SALT))
            prompt = rng.choice(prompts) + [7]
            turn = policy._turn
            n_turn = next(turn)
            policy._turn = itertools.count(n_turn)  # the same turn for both
            want, want_key = brute_prefix_choice(policy, workers, prompt, n_turn)
            got = policy.choose(live, prompt)
            got_key = (
                params.load_weight * got.worker.prefill_load - got.matched_tokens,
                got.worker.prefill_load,
            )
            assert got_key == want_key[:2], round_  # the same score and load, always
            loads = [x.prefill_load for x in workers]
            if max(loads) - min(loads) <= balance or max(loads) <= 2 * min(loads):
                assert got.worker is want, round_  # no balance cut: the same rotation too
            keys = block_keys(prompt, BS, SALT) if got.worker.info.kv_salt else []
            assert got.keys == keys


def test_a_thousand_workers_score_only_the_holders_and_the_least_loaded() -> None:
    registry = Registry({"default"})
    index = PrefixIndex()
    for i in range(1000):
        wid = f"p{i:04d}"
        registry.register(wid.encode(), prefill_reg(wid))
        registry.get(wid).queued_prefill_tokens = 100 + i % 97
    hold(index, "p0500", tenant(0))
    hold(index, "p0007", tenant(0)[: 10 * BS])
    registry.get("p0500").queued_prefill_tokens = 1000  # busier, but holds 1,024 tokens
    calls = []
    match = index.match
    index.match = lambda worker_id, keys: calls.append(worker_id) or match(worker_id, keys)
    policy = PrefillPolicy("prefix", index)
    live = registry.live_index("prefill")
    choice = policy.choose(live, tenant(0) + [1])
    assert choice.worker.worker_id == "p0500" and choice.matched_tokens == 64 * BS
    assert sorted(calls) == ["p0007", "p0500"]  # not 1,000 look-ups
    # Cold prompts: the least loaded (load 100: p0000, p0097, ... p0970), each counted busier
    # once chosen (as the dispatcher does), so the next goes to the next of them.
    picked = []
    for t in range(1, 12):
        w = policy.pick(live, tenant(t))
        assert w.prefill_load == 100
        w.queued_prefill_tokens += 1000
        picked.append(w.worker_id)
    assert sorted(picked) == [f"p{i:04d}" for i in range(0, 1000, 97)]
    calls.clear()
    assert policy.pick(live, tenant(99)).prefill_load == 101 and not calls
    # Round robin: every worker once in 1,000 turns, in id order.
    rr = PrefillPolicy("round_robin")
    assert [rr.pick(live, [1]).worker_id for _ in range(1000)] == sorted(registry.workers)
    assert rr.pick(live, [1], exclude={"p0000"}).worker_id == "p0002"  # turn 1000 of 999


def test_round_robin_in_id_order_with_exclusions() -> None:
    policy = PrefillPolicy("round_robin")
    workers = [worker("p2"), worker("p0"), worker("p1")]
    assert [policy.pick(workers, [1]).worker_id for _ in range(4)] == ["p0", "p1", "p2", "p0"]
    assert policy.pick(workers, [1], exclude={"p1"}).worker_id == "p0"  # turn 4 of [p0, p2]
    assert policy.pick(workers, [1], exclude={"p0", "p1", "p2"}) is None


def test_negative_load_weight_is_refused() -> None:
    with pytest.raises(ValueError):
        PrefixParams(load_weight=-1.0)


def test_fetchable_blocks_count_at_their_weight_beside_local_hits_and_load() -> None:
    # d0 (a decode worker, say) reported all 64 blocks of the tenant's prefix; p0 holds 16 of
    # them locally, p1 none. With peer fetch every worker may pull the rest from d0.
    index = PrefixIndex()
    hold(index, "d0", tenant(0))
    hold(index, "p0", tenant(0)[: 16 * BS])
    prompt = tenant(0) + [1, 2]
    workers = [worker("p0", 400), worker("p1", 0)]
    without = PrefillPolicy("prefix", index)  # fetch_weight 0: p0's 256 local tokens win ...
    assert without.pick(workers, prompt).worker_id == "p0"  # ... 256 - 200 > 0 - 0
    fetch = PrefillPolicy("prefix", index, PrefixParams(fetch_weight=0.8))
    # p0: 256 + 0.8 x 768 - 0.5 x 400 = 670; p1: 0.8 x 1024 - 0 = 819: the idle one wins
    choice = fetch.choose(workers, prompt)
    assert (choice.worker.worker_id, choice.matched_tokens) == ("p1", 0)  # what it holds itself
    # At equal load the local hits still decide.
    assert fetch.pick([worker("p0", 0), worker("p1", 0)], prompt).worker_id == "p0"
    # Blocks only dispatched (pending), not reported, cannot be fetched: they do not count (p1
    # would have 819 with them; it has 0.8 x 256 of p0's blocks, below p0's own 256).
    pending = PrefixIndex()
    pending.add_pending("d0", block_keys(tenant(0), BS, SALT))
    hold(pending, "p0", tenant(0)[: 16 * BS])
    policy = PrefillPolicy("prefix", pending, PrefixParams(fetch_weight=0.8))
    assert policy.pick([worker("p0", 0), worker("p1", 0)], prompt).worker_id == "p0"
