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
  turn, so cold prefixes spread over the workers.
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


def pick_decode(workers: Iterable[Worker] | LiveWorkers, now_s: float) -> Worker | None:
    """The least loaded decode worker that has not refused recently; None if every one has.
    Ties go to the lowest worker id."""
    return as_live(workers, decode_order).least(now_s)


def pick_decode_by_prefix(
    workers: Iterable[Worker] | LiveWorkers,
    now_s: float,
    prompt_token_ids: Sequence[int],
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
    keys_by_salt: dict[bytes, list[bytes]] = {}
    for salt, block_size in list(live.salts):
        if not salt:
            continue  # a worker that reports no KV events
        keys = keys_by_salt[salt] = block_keys(prompt_token_ids, block_size, salt)
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
        prompt_token_ids: Sequence[int],
        exclude: Collection[str] = (),
    ) -> Worker | None:
        choice = self.choose(workers, prompt_token_ids, exclude)
        return choice.worker if choice is not None else None

    def choose(
        self,
        workers: Iterable[Worker] | LiveWorkers,
        prompt_token_ids: Sequence[int],
        exclude: Collection[str] = (),
    ) -> PrefillChoice | None:
        """The worker for this prompt (None if no candidate), with what it already holds."""
        if self.routing == "least_loaded":  # the index's order, without a look at every worker
            best = as_live(workers, prefill_order).least(
                math.inf, (lambda w: w.worker_id not in exclude) if exclude else None
            )
            return PrefillChoice(best, 0, []) if best is not None else None
        candidates = sorted(
            (w for w in workers if w.worker_id not in exclude), key=lambda w: w.worker_id
        )
        if not candidates:
            return None
        turn = next(self._turn)
        if self.routing == "round_robin":
            return PrefillChoice(candidates[turn % len(candidates)], 0, [])
        return self._by_prefix(candidates, prompt_token_ids, turn)

    def _by_prefix(
        self, candidates: list[Worker], prompt: Sequence[int], turn: int
    ) -> PrefillChoice:
        p = self.params
        loads = {w.worker_id: w.prefill_load for w in candidates}
        low, high = min(loads.values()), max(loads.values())
        if high - low > p.balance_abs_tokens and high > p.balance_rel * low:
            midpoint = (low + high) / 2
            candidates = [w for w in candidates if loads[w.worker_id] <= midpoint]
        keys_by_salt: dict[bytes, list[bytes]] = {}
        scored = []
        n = len(candidates)
        for i, w in enumerate(candidates):
            salt = w.info.kv_salt  # empty: a worker that reports no KV events
            keys = keys_by_salt.get(salt)
            if keys is None:
                keys = block_keys(prompt, w.info.block_size, salt) if salt else []
                keys_by_salt[salt] = keys
            matched = self.index.match(w.worker_id, keys) * w.info.block_size
            score = matched - p.load_weight * loads[w.worker_id]
            # Highest score, then lowest load, then in turn (rotating with each request).
            scored.append(((-score, loads[w.worker_id], (i - turn) % n), w, matched, keys))
        _, worker, matched, keys = min(scored, key=lambda t: t[0])
        return PrefillChoice(worker, matched, keys)
