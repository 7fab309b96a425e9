"""The pool of physical KV blocks: ref counts, prefix-cache map and LRU reuse.

Owns which physical block is free, shared or cached. The block manager (per-sequence block tables)
and the KV transfer code call it; nothing else touches block ids' lifetimes.

A block whose ref count drops to zero keeps its prefix key and goes to the tail of the free list; a
later prefix hit takes it back (ref count up, out of the free list). Allocation takes from the head,
so the least recently freed cached block is evicted first; with a KV tier (common.engine.kv_tier)
`on_evict` sees each evicted cached block first, while its KV is still intact.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass


@dataclass
class Block:
    """One physical block of `block_size` token slots in every layer's cache."""

    block_id: int
    ref_count: int = 0
    key: bytes | None = None  # prefix key once the block is full and registered
    tokens: tuple[int, ...] | None = None  # the block's tokens, to guard against key collisions


class BlockPool:
    """Fixed set of blocks with ref counts and a prefix-key index."""

    def __init__(self, num_blocks: int, block_size: int, track_events: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.block_size = block_size
        self.blocks = [Block(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self.query_tokens = 0  # prefix-cache queries, counted in tokens (as vLLM)
        self.hit_tokens = 0
        self.track_events = track_events  # record `events` (a worker reports them to the router)
        self._events: dict[bytes, bool] = {}  # key -> stored (True) or evicted, net since drained
        # (block id, key, tokens) of a cached block about to be reused: the KV tier keeps it
        self.on_evict: Callable[[int, bytes, tuple[int, ...]], None] | None = None

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def usage(self) -> float:
        """Fraction of blocks held by running sequences (cached-but-free blocks count as free)."""
        return 1.0 - self.num_free / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        """Take `n` free blocks (LRU first), evicting their cached keys; ValueError if too few."""
        if n > len(self._free):
            raise ValueError(f"asked for {n} blocks, {len(self._free)} free")
        ids = []
        for _ in range(n):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.key is not None:
                if self._cached.get(block.key) == block_id:
                    if self.on_evict is not None:
                        self.on_evict(block_id, block.key, block.tokens)
                    del self._cached[block.key]
                    if self.track_events:
                        self._record(block.key, stored=False)
                block.key = None
                block.tokens = None
            block.ref_count = 1
            ids.append(block_id)
        return ids

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block; blocks reaching zero become reusable.

        Pass a sequence's blocks in order: they are released tail first, so the end of a prefix is
        evicted before its start (the start is the part other prompts are likely to share).
        """
        for block_id in reversed(block_ids):
            block = self.blocks[block_id]
            if block.ref_count <= 0:
                raise RuntimeError(f"block {block_id} freed more often than taken")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free[block_id] = None

    def lookup(self, keys: Sequence[bytes], token_blocks: Sequence[Sequence[int]]) -> list[int]:
        """Longest run of leading blocks cached under `keys` with equal tokens (not yet taken)."""
        hits = []
        for key, tokens in zip(keys, token_blocks):
            block_id = self._cached.get(key)
            if block_id is None or self.blocks[block_id].tokens != tuple(tokens):
                break
            hits.append(block_id)
        return hits

    def is_cached(self, key: bytes) -> bool:
        """A block holding prefix `key` is in the cache (free or in use)."""
        return key in self._cached

    def take(self, block_ids: Sequence[int]) -> None:
        """Add a reference to each block (prefix-cache hits), taking free ones off the free list."""
        for block_id in block_ids:
            block = self.blocks[block_id]
            if block.ref_count == 0:
                del self._free[block_id]
            block.ref_count += 1

    def register(self, block_id: int, key: bytes, tokens: Sequence[int]) -> None:
        """Record that a full, computed block holds prefix `key` so later prompts can share it."""
        block = self.blocks[block_id]
        if block.key is not None:
            return
        block.key = key
        block.tokens = tuple(tokens)
        # An equal prefix computed twice keeps the first block as the cached one.
        if self._cached.setdefault(key, block_id) == block_id and self.track_events:
            self._record(key, stored=True)

    def _record(self, key: bytes, stored: bool) -> None:
        # Only the net change matters: stored then evicted (or the reverse) since the last drain
        # is the same as the last of the two.
        self._events.pop(key, None)
        self._events[key] = stored

    def drain_events(self) -> tuple[list[bytes], list[bytes]]:
        """Keys stored and keys evicted since the last drain (disjoint); clears the record."""
        events, self._events = self._events, {}
        stored = [k for k, s in events.items() if s]
        evicted = [k for k, s in events.items() if not s]
        return stored, evicted

    def free_and_cached(self) -> tuple[set[int], set[int]]:
        """(blocks on the free list, those of them a prefix-cache hit can take back)."""
        free = set(self._free)
        return free, {b for b in self._cached.values() if b in free}

    def check_index(self) -> list[str]:
        """Errors in the prefix-cache index: a key pointing at a block that holds another."""
        return [
            f"prefix key {key.hex()[:12]} points at block {b}, which holds another key"
            for key, b in self._cached.items()
            if self.blocks[b].key != key
        ]

    def cached_keys(self) -> list[bytes]:
        """Every key currently reusable (for a full resync of the router's index)."""
        return list(self._cached)

    def record_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.query_tokens += num_query_tokens
        self.hit_tokens += num_hit_tokens
