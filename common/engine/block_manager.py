"""Per-sequence block tables on top of the block pool, with prefix-cache matching.

Called by the scheduler: match a new sequence's prefix against cached blocks, grow its block table
before each step, register blocks as they fill, and give everything back when it ends or is
preempted. The engine also trims the slots of rejected draft tokens after a speculative step, and
audits the books (`check_books`: every block free, cached or held by exactly the sequences whose
tables list it). With a KV tier (common.engine.kv_tier) a prefix the device cache misses is looked
up there too and, when reloading it measures cheaper than computing it, read back into new blocks.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common.engine.block_pool import BlockPool
from common.engine.sequence import SequenceState
from common.prefix_hash import block_key, block_keys

if TYPE_CHECKING:
    from common.engine.kv_tier import KVTier


@dataclass
class BlockBooks:
    """Where every KV block is; `free + cached + running + reserved + held == total` when the books
    balance, and `errors` names each block or sequence that is out of place."""

    total: int
    free: int = 0  # on the free list, holding nothing reusable
    cached: int = 0  # on the free list, a prefix a later prompt can take back
    running: int = 0  # in the block table of a running (or waiting) sequence
    reserved: int = 0  # held for KV on its way (decode worker), by no running sequence
    held: int = 0  # kept by a finished sequence until its KV is sent (prefill worker)
    errors: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.errors


class BlockManager:
    """Keeps each sequence's block table in step with the tokens it will have computed."""

    def __init__(self, pool: BlockPool, salt: bytes, enable_prefix_caching: bool = True) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.salt = salt
        self.enable_prefix_caching = enable_prefix_caching
        self.tier: KVTier | None = None  # set by kv_tier.attach

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, seq: SequenceState) -> int:
        """Attach cached blocks holding `seq`'s leading tokens; returns the number of tokens hit.

        At least one token is always left to compute, since the step that computes it samples the
        next token.
        """
        assert not seq.block_table, "prefix matching is for sequences holding no blocks"
        if not self.enable_prefix_caching:
            return 0
        bs = self.block_size
        max_blocks = (seq.num_tokens - 1) // bs
        tokens = seq.token_ids
        keys = block_keys(tokens[: max_blocks * bs], bs, self.salt)
        token_blocks = [tokens[b * bs : (b + 1) * bs] for b in range(len(keys))]
        table: list[int] = []
        device_hits = 0
        while len(table) < len(keys):  # device hits, then tier reloads, then device hits ...
            hits = self.pool.lookup(keys[len(table) :], token_blocks[len(table) :])
            self.pool.take(hits)
            table += hits
            device_hits += len(hits)
            if self.tier is None or len(table) == len(keys):
                break
            reloaded = self.tier.reload(self.pool, keys[len(table) :], token_blocks[len(table) :])
            if not reloaded:
                break
            table += reloaded
        seq.block_table = table
        seq.block_keys = keys[: len(table)]
        seq.num_computed_tokens = len(table) * bs
        if not seq.prefix_queried:  # once per request, not per retry of a waiting one
            seq.prefix_queried = True
            self.pool.record_query(seq.num_tokens, device_hits * bs)
            if self.tier is not None:
                self.tier.query_tokens += seq.num_tokens
                self.tier.hit_tokens += (len(table) - device_hits) * bs
        return seq.num_computed_tokens

    def num_new_blocks(self, seq: SequenceState, num_tokens: int) -> int:
        """Blocks `seq` must still take to hold `num_tokens` tokens."""
        return max(0, self.blocks_needed(num_tokens) - len(seq.block_table))

    def ensure_slots(self, seq: SequenceState, num_tokens: int) -> bool:
        """Grow `seq`'s block table to hold `num_tokens` tokens; False (taking nothing) if short."""
        needed = self.blocks_needed(num_tokens) - len(seq.block_table)
        if needed <= 0:
            return True
        if needed > self.pool.num_free:
            return False
        seq.block_table.extend(self.pool.allocate(needed))
        return True

    def commit(self, seq: SequenceState) -> None:
        """Register blocks that became full and computed, so later prompts can reuse them."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        num_full = seq.num_computed_tokens // bs
        start = len(seq.block_keys)
        if num_full <= start:
            return
        parent = seq.block_keys[-1] if seq.block_keys else None
        for b in range(start, num_full):
            tokens = seq.token_ids[b * bs : (b + 1) * bs]
            parent = block_key(parent, tokens, self.salt)
            seq.block_keys.append(parent)
            self.pool.register(seq.block_table[b], parent, tokens)

    def trim(self, seq: SequenceState) -> None:
        """Free the blocks past those holding `seq`'s computed tokens (slots of rejected drafts).

        Trailing blocks are never registered: `commit` only registers blocks of computed tokens.
        """
        keep = self.blocks_needed(seq.num_computed_tokens)
        if len(seq.block_table) > keep:
            self.pool.free(seq.block_table[keep:])
            del seq.block_table[keep:]

    def free(self, seq: SequenceState) -> None:
        """Release all of `seq`'s blocks (they stay in the prefix cache until evicted)."""
        self.pool.free(seq.block_table)
        seq.block_table = []
        seq.block_keys = []
        seq.num_computed_tokens = 0
        seq.num_draft_computed_tokens = 0

    def check_books(self, owners: dict[str, Iterable[SequenceState]]) -> BlockBooks:
        """Audit every block against the sequences holding blocks, by category ("running",
        "reserved", "held"; a block shared across categories counts in the first).

        Each block must be either on the free list with no references, or referenced exactly as
        often as block tables list it; no sequence may be in two categories or list a block twice.
        """
        pool = self.pool
        books = BlockBooks(total=pool.num_blocks)
        errors = books.errors
        refs = [0] * pool.num_blocks
        owner: list[str | None] = [None] * pool.num_blocks
        where: dict[str, str] = {}
        for name, seqs in owners.items():
            for seq in seqs:
                rid = seq.request_id
                if rid in where:
                    errors.append(f"request {rid!r} is both {where[rid]} and {name}")
                where[rid] = name
                if len(set(seq.block_table)) != len(seq.block_table):
                    errors.append(f"request {rid!r} lists a block twice: {seq.block_table}")
                for block_id in seq.block_table:
                    if not 0 <= block_id < pool.num_blocks:
                        errors.append(f"request {rid!r} lists block {block_id}, not in the pool")
                        continue
                    refs[block_id] += 1
                    owner[block_id] = owner[block_id] or name
        free, cached = pool.free_and_cached()
        counts = {"free": 0, "cached": 0, **dict.fromkeys(owners, 0)}
        for block in pool.blocks:
            b = block.block_id
            if block.ref_count and not refs[b]:
                errors.append(f"block {b} is in use (ref count {block.ref_count}) by no sequence")
            elif block.ref_count != refs[b]:
                errors.append(f"block {b}: ref count {block.ref_count}, listed {refs[b]} times")
            if b in free and block.ref_count:
                errors.append(f"block {b} is on the free list and in use")
            elif b not in free and not block.ref_count:
                errors.append(f"block {b} is neither free nor in use")
            if owner[b] is not None:
                counts[owner[b]] += 1
            elif b in free:
                counts["cached" if b in cached else "free"] += 1
        errors.extend(pool.check_index())
        if self.tier is not None:
            errors.extend(self.tier.check())
        for name, count in counts.items():
            setattr(books, name, count)
        if sum(counts.values()) != pool.num_blocks:
            errors.append(f"{sum(counts.values())} blocks accounted for, {pool.num_blocks} exist")
        return books
