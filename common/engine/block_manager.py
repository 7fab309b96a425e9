"""Per-sequence block tables on top of the block pool, with prefix-cache matching.

Called by the scheduler: match a new sequence's prefix against cached blocks, grow its block table
before each step, register blocks as they fill, and give everything back when it ends or is
preempted. The engine also trims the slots of rejected draft tokens after a speculative step.
"""

from __future__ import annotations

from common.engine.block_pool import BlockPool
from common.engine.sequence import Sequence
from common.prefix_hash import block_key, block_keys


class BlockManager:
    """Keeps each sequence's block table in step with the tokens it will have computed."""

    def __init__(self, pool: BlockPool, salt: bytes, enable_prefix_caching: bool = True) -> None:
        self.pool = pool
        self.block_size = pool.block_size
        self.salt = salt
        self.enable_prefix_caching = enable_prefix_caching

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def match_prefix(self, seq: Sequence) -> int:
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
        hits = self.pool.lookup(keys, [tokens[b * bs : (b + 1) * bs] for b in range(len(keys))])
        self.pool.take(hits)
        seq.block_table = list(hits)
        seq.block_keys = keys[: len(hits)]
        seq.num_computed_tokens = len(hits) * bs
        self.pool.record_query(seq.num_tokens, seq.num_computed_tokens)
        return seq.num_computed_tokens

    def ensure_slots(self, seq: Sequence, num_tokens: int) -> bool:
        """Grow `seq`'s block table to hold `num_tokens` tokens; False (taking nothing) if short."""
        needed = self.blocks_needed(num_tokens) - len(seq.block_table)
        if needed <= 0:
            return True
        if needed > self.pool.num_free:
            return False
        seq.block_table.extend(self.pool.allocate(needed))
        return True

    def commit(self, seq: Sequence) -> None:
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

    def trim(self, seq: Sequence) -> None:
        """Free the blocks past those holding `seq`'s computed tokens (slots of rejected drafts).

        Trailing blocks are never registered: `commit` only registers blocks of computed tokens.
        """
        keep = self.blocks_needed(seq.num_computed_tokens)
        if len(seq.block_table) > keep:
            self.pool.free(seq.block_table[keep:])
            del seq.block_table[keep:]

    def free(self, seq: Sequence) -> None:
        """Release all of `seq`'s blocks (they stay in the prefix cache until evicted)."""
        self.pool.free(seq.block_table)
        seq.block_table = []
        seq.block_keys = []
        seq.num_computed_tokens = 0
        seq.num_draft_computed_tokens = 0
