"""What a worker tells its routers about the KV it holds: `KVEvents` messages, per tier.

Owns the building of those messages from the engine's books: the device cache's changes (the
block pool's stored / evicted keys) and, with a KV tier (common.engine.kv_tier), the keys each
tier gained or dropped ("cpu": host RAM, "disk"), one message per tier; or a full snapshot (a
`reset` message for every tier the worker has, even an empty one, so that the router forgets
what it held before). Messages are cut so that each names at most `chunk_keys` keys per list (the
router bounds a KV events frame by the worker's block count; a tier may hold many more blocks than
the cache): the first part of a snapshot resets, the rest add. Numbering (`seq`) and sending are
the worker's (`common.runtime.worker.WorkerBase.publish_kv_events`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from common.protocol import KVEvents

if TYPE_CHECKING:
    from common.engine.engine import Engine

MIN_CHUNK_KEYS = 1024  # keys per list in one message, at least (a router takes 64 KiB from anyone)

# tier name -> (keys stored, keys dropped)
TierChanges = dict[str, tuple[list[bytes], list[bytes]]]


def chunk_keys(engine: Engine) -> int:
    """Keys per list in one message: the router allows twice the worker's blocks per message."""
    return max(MIN_CHUNK_KEYS, engine.pool.num_blocks)


def drain_changes(engine: Engine) -> TierChanges:
    """Every tier's changes since the last call, the device cache first (`reset` False)."""
    changes: TierChanges = {"device": engine.pool.drain_events()}
    if engine.tier is not None:
        changes.update(engine.tier.drain_events())
    return changes


def snapshot(engine: Engine) -> dict[str, list[bytes]]:
    """Every key each tier holds, the device cache first."""
    keys = {"device": engine.pool.cached_keys()}
    if engine.tier is not None:
        keys.update(engine.tier.keys())
    return keys


def change_messages(worker_id: str, changes: TierChanges, chunk: int) -> list[KVEvents]:
    """The messages (seq unset: -1) that report `changes`; none for a tier without any."""
    messages = []
    for tier, (stored, evicted) in changes.items():
        for start in range(0, max(len(stored), len(evicted)), chunk):
            part = slice(start, start + chunk)
            messages.append(KVEvents(worker_id, -1, stored[part], evicted[part], False, tier))
    return messages


def snapshot_messages(worker_id: str, keys: dict[str, list[bytes]], chunk: int) -> list[KVEvents]:
    """The messages (seq unset: -1) of a full snapshot: per tier, one reset, then the rest."""
    messages = []
    for tier, held in keys.items():
        for start in range(0, max(len(held), 1), chunk):
            part = held[start : start + chunk]
            messages.append(KVEvents(worker_id, -1, part, [], start == 0, tier))
    return messages
