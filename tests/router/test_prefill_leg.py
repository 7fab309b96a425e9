"""router/prefill_leg.py: the peer-fetch hint a Prefill carries, on synthetic index states."""

from __future__ import annotations

from common.prefix_hash import block_keys, model_salt
from common.protocol import PROTOCOL_VERSION, KVEvents, Register
from router.kv_index import PrefixIndex
from router.prefill_leg import PEER_FETCH_TIMEOUT_S, peer_hint
from router.registry import Worker

BS = 16
SALT = model_salt("default", "auto", BS)
PROMPT = [1000 + i for i in range(20 * BS + 5)]  # 20 full blocks and a part


def worker(worker_id: str, role: str = "prefill", host: str = "h", salt: bytes = SALT,
           kv_address: str = "tcp://127.0.0.1:9") -> Worker:  # fmt: skip
    info = Register(
        PROTOCOL_VERSION, role, worker_id, "default", BS, 1000, 4096, "auto", host, kv_address,
        ["tcp", "shm"], salt,
    )  # fmt: skip
    return Worker(info=info, identity=worker_id.encode(), last_seen_s=Registry.now_s)


def hold(index: PrefixIndex, worker_id: str, n_blocks: int, tier: str = "device") -> None:
    keys = block_keys(PROMPT[: n_blocks * BS], BS, SALT)
    index.apply(KVEvents(worker_id, 0, keys, [], reset=True, tier=tier))


def hint_for(workers: dict[str, Worker], index: PrefixIndex, chosen: str, matched_blocks: int = 0):
    registry = Registry(workers)
    return peer_hint(registry, index, workers[chosen], PROMPT, matched_blocks * BS, [])  # type: ignore[arg-type]


class Registry(dict):
    """What peer_hint reads of `router.registry.Registry`: workers by id and the clock."""

    now_s = 100.0

    def clock(self) -> float:
        return self.now_s


def test_the_peer_holding_most_beyond_the_chosen_worker_is_named() -> None:
    index = PrefixIndex()
    workers = {w.worker_id: w for w in (worker("p0"), worker("p1"), worker("d0", "decode"),
                                        worker("p2", host="other"))}  # fmt: skip
    hold(index, "p1", 12)
    hold(index, "d0", 20)
    hint = hint_for(workers, index, "p0")
    assert hint is not None
    assert (hint.worker_id, hint.num_blocks, hint.transport) == ("d0", 20, "shm")
    assert hint.kv_address == workers["d0"].info.kv_address
    assert hint.timeout_s == PEER_FETCH_TIMEOUT_S
    # As many blocks on a prefill worker as on the decode worker: the prefill worker serves.
    hold(index, "p1", 20)
    hint = hint_for(workers, index, "p0")
    assert hint is not None and (hint.worker_id, hint.num_blocks) == ("p1", 20)
    # A peer whose heartbeats are late (stuck, not yet declared dead) is not named.
    workers["p1"].last_seen_s = Registry.now_s - 2.5
    assert hint_for(workers, index, "p0").worker_id == "d0"
    # The chosen worker already holding as much as any peer: no hint.
    hold(index, "p0", 20)
    assert hint_for(workers, index, "p0", matched_blocks=20) is None


def test_a_peer_on_another_host_is_fetched_from_over_tcp_and_tier_blocks_count() -> None:
    index = PrefixIndex()
    workers = {w.worker_id: w for w in (
        worker("p0", kv_address="tcp://10.0.0.1:8100"),
        worker("p2", host="other", kv_address="tcp://10.0.0.2:8100"),
        worker("p3", host="other"),  # its KV receiver is bound to its loopback: out of reach
    )}  # fmt: skip
    hold(index, "p2", 8, tier="cpu")  # in its host-RAM tier only
    hold(index, "p3", 12)
    hint = hint_for(workers, index, "p0")
    assert hint is not None and (hint.worker_id, hint.num_blocks, hint.transport) == (
        "p2", 8, "tcp"
    )
    # The asker's own KV receiver bound to its loopback: a peer elsewhere could not answer it.
    workers["p0"] = worker("p0", kv_address="tcp://127.0.0.1:7")
    assert hint_for(workers, index, "p0") is None


def test_no_hint_from_other_models_dead_or_addressless_workers_or_pending_prompts() -> None:
    index = PrefixIndex()
    other_salt = model_salt("other", "auto", BS)
    dead = worker("p3")
    dead.dead_reason = "gone"
    workers = {w.worker_id: w for w in (worker("p0"), worker("p1", salt=other_salt), dead,
                                        worker("p4", kv_address=""))}  # fmt: skip
    for wid in ("p1", "p3", "p4"):
        hold(index, wid, 20)
    index.add_pending("p5", block_keys(PROMPT, BS, SALT))  # dispatched, not reported: may not exist
    workers["p5"] = worker("p5")
    assert hint_for(workers, index, "p0") is None


def test_the_last_prompt_token_is_never_asked_for() -> None:
    index = PrefixIndex()
    workers = {w.worker_id: w for w in (worker("p0"), worker("p1"))}
    global PROMPT
    saved, PROMPT = PROMPT, PROMPT[: 20 * BS]  # exactly 20 blocks: the last one is computed
    try:
        hold(index, "p1", 20)
        hint = hint_for(workers, index, "p0")
        assert hint is not None and hint.num_blocks == 19
    finally:
        PROMPT = saved
