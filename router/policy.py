"""Which worker serves a request: the decode choice, the prefill choice and the KV transport.

Owns the routing decisions and nothing else: decode workers are chosen least loaded (running plus
reserved sequences), skipping any that refused a reservation moments ago; prefill workers by the
`--routing` policy. Called by `router.dispatch` (which asks `kvtransfer.choose_transport`
for the KV transport of each pair).

With `prefix` routing, a prompt prefilled on a decode worker (short prompts, colocated mode) goes
to the decode worker holding the longest prefix of it, among those running at most
`decode_slack` more sequences than the least loaded; else to the least loaded.

Prefill policies (load = prompt tokens a worker still has to compute, counted by the router from
the moment it dispatches a prompt until the first token comes back, so a burst cannot pile onto
one worker before its heartbeats catch up):
- `round_robin`: in turn.
- `least_loaded`: the smallest load.
- `prefix` (default): score = tokens of the prompt's leading blocks the worker holds (its KV
  events, `router.kv_index`) - `load_weight` x load; the highest score wins. Both terms are tokens
  of compute; with the default weight 0.5 a worker holding a 1,024-token prefix keeps getting it
  until it has 2,048 more tokens queued than another worker. A weight above 1 spreads a burst of
  one prefix over workers sooner (each then computes and caches it); below 1 keeps it together.
  When load is badly imbalanced (the most loaded worker has more than `balance_abs_tokens` over
  the least loaded AND more than `balance_rel` times its load), only the workers at or below the
  midpoint of the two are candidates, still chosen by score. Ties go to the lower load, then in
  turn (from a position that moves one worker on, in id order, with each request), so cold
  prefixes spread over the workers.
  With peer fetch on (`--kv-peer-fetch`, `router.prefill_leg.peer_hint`), blocks a worker lacks
  that a peer (any live worker, prefill or decode) has reported holding, in its cache or its
  tier, count too, at `fetch_weight` (`PEER_FETCH_WEIGHT`, 0.8) of a local block each: the
  worker will pull them rather than compute them. The score weighs load, local hits and
  fetchable hits; a lightly loaded worker then wins a prefix held elsewhere sooner, and the load
  spreads.

No choice looks at every worker: round robin indexes the live workers' sorted ids; the prefix
policy scores only the workers holding the prompt's first block (the rest score -`load_weight`
x load, so among them the least loaded wins, found in `LiveWorkers`' books, as are the lowest
and highest load for the balance test), and stops scoring holders once even a full match could
not beat the best so far.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from common.prefix_hash import block_keys
from router.kv_index import PrefixIndex
from router.worker import LiveWorkers, Worker, as_live, decode_order, prefill_order

ROUTING_POLICIES = ("round_robin", "least_loaded", "prefix")
PEER_FETCH_WEIGHT = 0.8  # PrefixParams.fetch_weight with peer fetch on


class PromptKeys:
    """A prompt's token ids and its block keys (`common.prefix_hash`) under each (block size,
    salt) asked for, each hashed on first use only."""

    __slots__ = ("token_ids", "_keys")

    def __init__(self, token_ids: Sequence[int]) -> None:
        self.token_ids = token_ids
        self._keys: dict[tuple[int, bytes], list[bytes]] = {}

    def __len__(self) -> int:
        return len(self.token_ids)

    def get(self, block_size: int, salt: bytes) -> list[bytes]:
        """The keys of the prompt's full blocks (do not modify)."""
        keys = self._keys.get((block_size, salt))
        if keys is None:
            keys = self._keys[(block_size, salt)] = block_keys(self.token_ids, block_size, salt)
        return keys


Prompt = Sequence[int] | PromptKeys  # token ids, or those and their keys


def as_keys(prompt: Prompt) -> PromptKeys:
    """`prompt` as a `PromptKeys` (token ids get one of their own, hashing afresh)."""
    return prompt if isinstance(prompt, PromptKeys) else PromptKeys(prompt)


def pick_decode(workers: Iterable[Worker] | LiveWorkers, now_s: float) -> Worker | None:
    """The least loaded decode worker that has not refused recently; None if every one has.
    Ties go to the lowest worker id."""
    return as_live(workers, decode_order).least(now_s)


def pick_decode_by_prefix(
    workers: Iterable[Worker] | LiveWorkers,
    now_s: float,
    prompt: Prompt,
    index: PrefixIndex,
    slack: int,
) -> tuple[Worker, list[bytes]] | None:
    """For a prompt the decode worker prefills itself: the worker holding the longest prefix of
    it among those running at most `slack` more sequences than the least loaded (the least
    loaded when none holds any; ties to the less loaded, then the lower id), with the prompt's
    block keys under its salt. Only the workers holding the prompt's first block are scored."""
    live = as_live(workers, decode_order)
    least = live.least(now_s)
    if least is None:
        return None
    limit = least.decode_load + slack
    best, best_matched = least, 0
    prompt_keys = as_keys(prompt)
    keys_by_salt: dict[bytes, list[bytes]] = {}
    for salt, block_size in list(live.salts):
        if not salt:
            continue  # a worker that reports no KV events
        keys = keys_by_salt[salt] = prompt_keys.get(block_size, salt)
        if not keys:
            continue
        holders = (live.get(worker_id) for worker_id in index.holders(keys[0]))
        ready = sorted(
            (
                w
                for w in holders
                if w is not None
                and w.info.kv_salt == salt
                and w.refused_until_s <= now_s
                and w.decode_load <= limit
            ),
            key=decode_order,
        )
        for w in ready:
            matched = index.match(w.worker_id, keys)
            if matched > best_matched or (
                matched == best_matched and matched and decode_order(w) < decode_order(best)
            ):
                best, best_matched = w, matched
    return best, keys_by_salt.get(best.info.kv_salt, [])


@dataclass
class PrefixParams:
    """The prefix policy's knobs (router flags --prefix-load-weight, --balance-*)."""

    load_weight: float = 0.5  # score = matched tokens - load_weight * queued prefill tokens
    balance_abs_tokens: int = 4096  # imbalance: max load - min load above this ...
    balance_rel: float = 2.0  # ... and max load above this times min load
    decode_slack: int = 4  # decode workers: a prefix holder may run this many more sequences
    # A block a peer holds (a worker may fetch it) is worth this share of one held locally: the
    # fetch costs a transfer and may fail (then the worker computes it). 0: no peer fetch (the
    # dispatcher sets PEER_FETCH_WEIGHT with --kv-peer-fetch on).
    fetch_weight: float = 0.0

    def __post_init__(self) -> None:
        if self.load_weight < 0:  # the least loaded non-holder would no longer score best
            raise ValueError("load_weight must be >= 0")
        if not 0 <= self.fetch_weight <= 1:  # above 1 a full local match could lose to a fetch
            raise ValueError("fetch_weight must be in [0, 1]")


@dataclass
class PrefillChoice:
    worker: Worker
    matched_tokens: int  # leading prompt tokens the worker holds (prefix policy; else 0)
    keys: list[bytes]  # the prompt's block keys under the worker's salt (prefix policy; else [])


class PrefillPolicy:
    """Chooses a prefill worker for a prompt; holds the round-robin position."""

    def __init__(
        self,
        routing: str = "least_loaded",
        index: PrefixIndex | None = None,
        params: PrefixParams | None = None,
    ) -> None:
        if routing not in ROUTING_POLICIES:
            raise ValueError(f"--routing must be one of {', '.join(ROUTING_POLICIES)}")
        self.routing = routing
        self.index = index if index is not None else PrefixIndex()
        self.params = params or PrefixParams()
        self._turn = itertools.count()

    def pick(
        self,
        workers: Iterable[Worker] | LiveWorkers,
        prompt: Prompt,
        exclude: Collection[str] = (),
    ) -> Worker | None:
        choice = self.choose(workers, prompt, exclude)
        return choice.worker if choice is not None else None

    def choose(
        self,
        workers: Iterable[Worker] | LiveWorkers,
        prompt: Prompt,
        exclude: Collection[str] = (),
    ) -> PrefillChoice | None:
        """The worker for this prompt (None if no candidate), with what it already holds."""
        if self.routing == "least_loaded":  # the index's order, without a look at every worker
            best = as_live(workers, prefill_order).least(
                math.inf, (lambda w: w.worker_id not in exclude) if exclude else None
            )
            return PrefillChoice(best, 0, []) if best is not None else None
        live = as_live(workers, prefill_order)
        if self.routing == "round_robin":
            ids = live.ids_in_order()
            if exclude:  # a retry after a failed send: rare
                ids = [worker_id for worker_id in ids if worker_id not in exclude]
            if not ids:
                return None
            worker = live.get(ids[next(self._turn) % len(ids)])
            assert worker is not None
            return PrefillChoice(worker, 0, [])
        bounds = live.load_range(exclude)
        if bounds is None:
            return None
        return self._by_prefix(live, as_keys(prompt), exclude, bounds, next(self._turn))

    def _by_prefix(
        self,
        live: LiveWorkers,
        prompt: PromptKeys,
        exclude: Collection[str],
        bounds: tuple[float, float],
        turn: int,
    ) -> PrefillChoice | None:
        p = self.params
        low, high = bounds
        limit = math.inf
        if high - low > p.balance_abs_tokens and high > p.balance_rel * low:
            limit = (low + high) / 2
        n = len(live.ids_in_order())
        # Highest score, then lowest load, then in turn: the smallest (-score, load, rotation).
        best_key: tuple[float, float, int] | None = None
        best: Worker | None = None
        best_matched = 0
        held: set[str] = set()  # holders in range, scored or not (a pruned one cannot win)
        keys_by_salt: dict[bytes, list[bytes]] = {}
        fetchable_by_salt: dict[bytes, int] = {}  # tokens the best-stocked peer reported holding
        for salt, block_size in list(live.salts):
            keys = keys_by_salt[salt] = prompt.get(block_size, salt) if salt else []
            if not keys:
                continue  # a worker that reports no KV events, or a prompt under one block
            fetchable = self._fetchable(keys, exclude) * block_size if p.fetch_weight else 0
            fetchable_by_salt[salt] = fetchable
            holders = []
            for worker_id in self.index.holders(keys[0]):
                w = live.get(worker_id)
                if w is None or worker_id in exclude or w.info.kv_salt != salt:
                    continue
                load = w.prefill_load
                if load <= limit:
                    held.add(worker_id)
                    holders.append((load, (live.position(worker_id) - turn) % n, w))
            holders.sort(key=lambda h: h[:2])
            full_tokens = len(keys) * block_size
            for load, rotation, w in holders:
                if best_key is not None and p.load_weight * load - full_tokens > best_key[0]:
                    break  # even the whole prompt held could not beat the best: nor can the rest
                matched = self.index.match(w.worker_id, keys) * block_size
                worth = matched + p.fetch_weight * max(fetchable - matched, 0)
                key = (p.load_weight * load - worth, load, rotation)
                if best_key is None or key < best_key:
                    best_key, best, best_matched = key, w, matched
        # The rest score -load_weight x load: the least loaded of them, then the next in turn.
        rest = live.least(
            math.inf, lambda w: w.worker_id not in held and w.worker_id not in exclude
        )
        if rest is not None and rest.prefill_load <= limit:
            load = rest.prefill_load
            rotation, worker_id = _next_in_turn(live, live.at_load(load), held, exclude, turn)
            worth = p.fetch_weight * fetchable_by_salt.get(rest.info.kv_salt, 0)
            key = (p.load_weight * load - worth, load, rotation)
            if best_key is None or key < best_key:
                best = live.get(worker_id)
                best_key, best_matched = key, 0
        if best is None:
            return None
        return PrefillChoice(best, best_matched, keys_by_salt.get(best.info.kv_salt, []))

    def _fetchable(self, keys: list[bytes], exclude: Collection[str]) -> int:
        """The most leading blocks of `keys` any worker (not excluded) has reported holding, in
        its cache or its tier (pending prompts' blocks may not exist yet: not counted)."""
        best = 0
        for worker_id in self.index.holders(keys[0]):
            if worker_id not in exclude:
                best = max(best, len(self.index.tiers_of(worker_id, keys)))
                if best == len(keys):
                    break
        return best


def _next_in_turn(
    live: LiveWorkers, peers: set[str], held: set[str], exclude: Collection[str], turn: int
) -> tuple[int, str]:
    """The first of `peers` (not held, not excluded; one at least) at or after position `turn`
    in the live workers' id order, and how many places after it."""
    ids = live.ids_in_order()
    n = len(ids)
    if len(peers) <= 64:
        return min(
            ((live.position(i) - turn) % n, i) for i in peers if i not in held and i not in exclude
        )
    # Many equals (a cold start): the next of them in turn is a few steps away.
    for step in range(n):
        worker_id = ids[(turn + step) % n]
        if worker_id in peers and worker_id not in held and worker_id not in exclude:
            return step, worker_id
    raise ValueError("no peer to choose")
