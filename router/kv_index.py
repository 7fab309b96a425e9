"""The router's index of which worker holds which prefix blocks, fed by the workers' KV events.

Owns, per worker, the set of block keys (common.prefix_hash) its prefix cache holds, as its
`KVEvents` messages report them, plus the keys of prompts dispatched to it whose blocks are not
reported yet ("pending": a second request for a prefix that is still being computed should go to
the same worker). Pending keys expire after `pending_ttl_s` unless a stored event confirms them, so
a failed prefill leaves no phantom entries behind: expired ones are dropped as new ones come
(one queue in expiry order for all workers), so what is pending is at most the keys dispatched
within one TTL.

Sequence numbers: each worker numbers its messages from 0. A message older than the last applied
one is a duplicate and is ignored; a newer one after a gap means something was lost: the index
applies it (best effort) and asks the worker for a full snapshot (`KVResync`), at most once per
`resync_interval_s`. A snapshot (reset=True) replaces the worker's set. A heartbeat reports the
last seq sent, so a lost final message is noticed too (one heartbeat later, to let a message in
flight on the other socket arrive). A dead worker's entries are dropped (`remove`).

Besides the keys per worker, the index knows who holds each key (`holders`: reported keys, and
the first key of each pending prompt), so that a policy scores only the workers holding a
prompt's first block: any other matches nothing. One holder is stored as its id, several as a set
(most keys have one holder: a dict entry per key, no set).

Tiers: a worker with a KV tier (common.engine.kv_tier) also reports the keys its host RAM
("cpu") and disk ("disk") tiers hold, in `KVEvents` of that `tier` (numbered with its other
messages; a reset replaces that tier's keys only). A key held in any tier counts as held for
`match` and `holders` (reloading it costs far less than computing it); `tiers_of` says where each
of a prompt's leading blocks is, for a peer fetch to read it out by key.

Called by `router.control` (events, heartbeats, removal) and `router.policy` (matching).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from common.protocol import KVEvents

PENDING_TTL_S = 30.0
RESYNC_INTERVAL_S = 2.0

Holders = dict[bytes, "str | set[str]"]  # key -> the id of its one holder, or a set of them


def _hold(holders: Holders, key: bytes, worker_id: str) -> None:
    held = holders.get(key)
    if held is None:
        holders[key] = worker_id
    elif isinstance(held, set):
        held.add(worker_id)
    elif held != worker_id:
        holders[key] = {held, worker_id}


def _unhold(holders: Holders, key: bytes, worker_id: str) -> None:
    held = holders.get(key)
    if held == worker_id:
        del holders[key]
    elif isinstance(held, set):
        held.discard(worker_id)
        if len(held) == 1:
            holders[key] = held.pop()


@dataclass
class _WorkerIndex:
    keys: set[bytes] = field(default_factory=set)
    pending: dict[bytes, float] = field(default_factory=dict)  # key -> expiry (clock seconds)
    seq: int = -1  # last applied seq; -1 before the first message
    synced: bool = False  # a snapshot arrived since the last known loss (or start)
    resync_asked_s: float = -1e9
    hb_seq: int = -1  # kv_events_seq of the previous heartbeat
    roots: set[bytes] = field(default_factory=set)  # pending keys filed in `_pending_roots`
    tiers: dict[str, set[bytes]] = field(default_factory=dict)  # "cpu", "disk" -> keys

    def in_tier(self, key: bytes) -> bool:
        return any(key in held for held in self.tiers.values())


class PrefixIndex:
    """Block keys per worker. Not thread-safe: used from the router's event loop only."""

    def __init__(
        self,
        pending_ttl_s: float = PENDING_TTL_S,
        resync_interval_s: float = RESYNC_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.pending_ttl_s = pending_ttl_s
        self.resync_interval_s = resync_interval_s
        self.clock = clock
        self._workers: dict[str, _WorkerIndex] = {}
        self._holders: Holders = {}  # reported keys
        self._pending_roots: Holders = {}  # the first key of each pending prompt
        self._tier_holders: Holders = {}  # keys in a worker's KV tier
        # (expiry, worker id, key) per pending key filed, in expiry order (one TTL for all)
        self._expiries: deque[tuple[float, str, bytes]] = deque()
        self.num_resyncs_asked = 0
        self.num_events_applied = 0

    def apply(self, msg: KVEvents) -> bool:
        """Apply one message; True when the worker should be asked for a snapshot now."""
        w = self._workers.setdefault(msg.worker_id, _WorkerIndex())
        if msg.tier != "device":
            return self._apply_tier(msg, w)
        if msg.reset:
            if msg.seq < w.seq:
                return False  # an older snapshot overtaken by newer news
            for key in w.keys:
                _unhold(self._holders, key, msg.worker_id)
            w.keys = set(msg.stored)
            for key in w.keys:
                _hold(self._holders, key, msg.worker_id)
            for key in msg.stored:
                self._drop_pending(msg.worker_id, w, key)
            w.seq, w.synced = msg.seq, True
            self.num_events_applied += 1
            return False
        if msg.seq <= w.seq:
            return False  # a duplicate, or a message from before the last snapshot
        gap = msg.seq != w.seq + 1
        for key in msg.evicted:
            if key in w.keys:
                w.keys.discard(key)
                _unhold(self._holders, key, msg.worker_id)
        for key in msg.stored:
            if key not in w.keys:
                w.keys.add(key)
                _hold(self._holders, key, msg.worker_id)
        for key in msg.evicted:
            self._drop_pending(msg.worker_id, w, key)
        for key in msg.stored:
            self._drop_pending(msg.worker_id, w, key)
        self.num_events_applied += 1
        if gap:
            # Keep the old seq: until a snapshot comes, every later message is also "after a gap".
            w.synced = False
            return self._should_ask(w)
        w.seq = msg.seq
        return False

    def _apply_tier(self, msg: KVEvents, w: _WorkerIndex) -> bool:
        """`apply` for a message about one of the worker's KV tiers."""
        if msg.seq <= w.seq:
            return False  # a duplicate, or older than what was applied
        held = w.tiers.setdefault(msg.tier, set())
        gone = held - set(msg.stored) if msg.reset else set(msg.evicted) & held
        held -= gone
        held.update(msg.stored)
        for key in gone:
            if not w.in_tier(key):
                _unhold(self._tier_holders, key, msg.worker_id)
        for key in msg.stored:
            _hold(self._tier_holders, key, msg.worker_id)
        self.num_events_applied += 1
        if msg.seq == w.seq + 1:
            w.seq = msg.seq
            return False
        w.synced = False  # a gap: as for the device's messages, keep the old seq and ask
        return self._should_ask(w)

    def on_heartbeat(self, worker_id: str, kv_events_seq: int) -> bool:
        """True when the worker should be asked for a snapshot (a lost message, or never synced).

        A seq the previous heartbeat already reported but no applied message has reached means the
        message was lost (a heartbeat later is plenty for one in flight to arrive).
        """
        w = self._workers.setdefault(worker_id, _WorkerIndex())
        lost = w.hb_seq > w.seq
        w.hb_seq = kv_events_seq
        if lost or (not w.synced and kv_events_seq >= 0):
            return self._should_ask(w)
        return False

    def _should_ask(self, w: _WorkerIndex) -> bool:
        now = self.clock()
        if now - w.resync_asked_s < self.resync_interval_s:
            return False
        w.resync_asked_s = now
        self.num_resyncs_asked += 1
        return True

    def add_pending(self, worker_id: str, keys: Sequence[bytes]) -> None:
        """Keys of a prompt just dispatched to the worker: count them as held for a while."""
        now = self.clock()
        self._expire(now)
        w = self._workers.setdefault(worker_id, _WorkerIndex())
        expiry = now + self.pending_ttl_s
        for key in keys:
            if key not in w.keys:
                if key not in w.pending:  # else its entry in the queue is there already
                    self._expiries.append((expiry, worker_id, key))
                w.pending[key] = expiry
        if keys and keys[0] in w.pending and keys[0] not in w.roots:
            w.roots.add(keys[0])
            _hold(self._pending_roots, keys[0], worker_id)

    def _expire(self, now: float) -> None:
        """Drop the pending keys whose time is up. One entry per pending key: a key filed again
        since goes back in the queue at its later expiry; one confirmed or dropped meanwhile is
        skipped (so the queue holds at most the keys that became pending within one TTL)."""
        expiries = self._expiries
        while expiries and expiries[0][0] < now:
            expiry, worker_id, key = expiries.popleft()
            w = self._workers.get(worker_id)
            current = None if w is None else w.pending.get(key)
            if w is None or current is None:
                continue
            if current > expiry:
                expiries.append((current, worker_id, key))
            else:
                self._drop_pending(worker_id, w, key)

    def _drop_pending(self, worker_id: str, w: _WorkerIndex, key: bytes) -> None:
        w.pending.pop(key, None)
        if key in w.roots:
            w.roots.discard(key)
            _unhold(self._pending_roots, key, worker_id)

    def remove(self, worker_id: str) -> None:
        """Forget a worker (dead, or registering afresh: its snapshot follows)."""
        w = self._workers.pop(worker_id, None)
        if w is None:
            return
        for key in w.keys:
            _unhold(self._holders, key, worker_id)
        for key in w.roots:
            _unhold(self._pending_roots, key, worker_id)
        for key in set().union(*w.tiers.values()):
            _unhold(self._tier_holders, key, worker_id)

    def holders(self, key: bytes) -> set[str]:
        """Workers that may hold `key`: reported holders, and workers with a prompt starting
        with it pending (maybe expired by now: `match` says how much each holds)."""
        found: set[str] = set()
        for holders in (self._holders, self._pending_roots, self._tier_holders):
            held = holders.get(key)
            if isinstance(held, set):
                found |= held
            elif held is not None:
                found.add(held)
        return found

    def match(self, worker_id: str, keys: Sequence[bytes]) -> int:
        """How many leading `keys` the worker holds (reported, in its cache or its tier, or
        pending)."""
        w = self._workers.get(worker_id)
        if w is None:
            return 0
        now = self.clock()
        n = 0
        for key in keys:
            if key in w.keys or w.in_tier(key):
                n += 1
                continue
            expiry = w.pending.get(key)
            if expiry is None:
                break
            if expiry < now:
                self._drop_pending(worker_id, w, key)
                break
            n += 1
        return n

    def num_keys(self, worker_id: str) -> int:
        """Reported keys held by the worker (pending ones not counted)."""
        w = self._workers.get(worker_id)
        return len(w.keys) if w is not None else 0

    def tiers_of(self, worker_id: str, keys: Sequence[bytes]) -> list[str]:
        """Where the worker holds each of the leading `keys` it reported: "device" (its cache),
        else "cpu" (host RAM tier), else "disk"; stops at the first it does not hold."""
        w = self._workers.get(worker_id)
        found: list[str] = []
        for key in keys if w is not None else ():
            if key in w.keys:
                found.append("device")
                continue
            tier = next((t for t in ("cpu", "disk") if key in w.tiers.get(t, ())), None)
            if tier is None:
                break
            found.append(tier)
        return found

    def worker_ids(self) -> list[str]:
        return sorted(self._workers)
