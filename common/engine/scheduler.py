"""Continuous batching: which sequences run this step and how many tokens each computes.

One step mixes decode tokens of running sequences with (chunked) prefill of new ones under a token
budget, as vLLM v1 does, and the prompt tokens of a step under their own budget
(`prefill_budget`, set by the engine from measured step costs: common.engine.step_budget).
Running sequences go first, oldest first; when blocks run out the newest running sequence is
preempted (its blocks freed, its tokens recomputed later). One exception, for the time to first
token: while a running prompt is being prefilled in chunks, a waiting request whose prefill is
short once its cached prefix is counted (at most a quarter of the prompt budget: a returning
conversation, a shared system prompt) starts first, and that step's running chunks shrink to a
quarter of the budget, so it does not wait behind the long prompt's remaining chunks
(`_admit_short`; only where the blocks it takes leave every running sequence what this step
needs, so it never causes a preemption). With speculative decoding a decoding
sequence also gets slots (and budget) for up to `num_lookahead_tokens` draft tokens, when they
fit without preempting anyone: the free blocks left after them must still cover what every
running sequence behind it needs for this step's own tokens, and the token budget too.
Called by the engine.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from common.engine.block_manager import BlockManager
from common.engine.sequence import SequenceState, SequenceStatus

if TYPE_CHECKING:
    import torch

MIN_SHARED_CHUNK = 16  # a running prompt's chunk in a step shared with short ones: a block
SHORT_LOOKS = 2  # waiting requests matched against the prefix cache per step by _admit_short


@dataclass
class ScheduledSeq:
    seq: SequenceState
    num_new_tokens: int  # tokens whose KV this step computes, starting at seq.num_computed_tokens
    num_lookahead_tokens: int = 0  # slots reserved past them for draft tokens to verify
    draft_token_ids: list[int] = field(default_factory=list)  # set by the proposer, then verified
    draft_probs: torch.Tensor | None = None  # [k, vocab] the drafts were sampled from; None: fixed


class Scheduler:
    """Waiting queue, running set and the per-step admission decision."""

    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        num_lookahead_tokens: int = 0,
        max_model_len: int | None = None,
        speculative_max_batch: int = 0,
        row_granule: int = 1,
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        # prompt tokens (prefill chunks) one step computes at most; the engine sets it per step
        self.prefill_budget = max_num_batched_tokens
        self.num_lookahead_tokens = num_lookahead_tokens
        self.speculative_max_batch = speculative_max_batch  # no drafts above this many; 0: any
        self.drafting = True  # the engine's governor may switch drafting off for a step
        self.draft_limit: int | None = None  # ... or draft fewer than num_lookahead_tokens
        self.max_model_len = max_model_len
        self.waiting: deque[SequenceState] = deque()
        self.running: list[SequenceState] = []
        self.num_preemptions = 0
        self.row_granule = row_granule  # a cut chunk makes the step's rows a multiple (_round_cut)

    def add(self, seq: SequenceState) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def remove(self, seq: SequenceState) -> None:
        """Take a finished or aborted sequence out and free its blocks."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self.block_manager.free(seq)

    def _victim(self) -> SequenceState | None:
        """The newest sequence holding blocks: a waiting one (prefilled elsewhere, not started)
        before the newest running one."""
        for seq in reversed(self.waiting):
            if seq.block_table:
                return seq
        return self.running[-1] if self.running else None

    def _preempt(self, seq: SequenceState) -> None:
        """Free `seq`'s blocks; it waits (first in line if it was running) to recompute them."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
            seq.status = SequenceStatus.WAITING
            self.waiting.appendleft(seq)
        self.block_manager.free(seq)
        self.num_preemptions += 1

    def _lookahead(self, seq: SequenceState, n: int, budget: int) -> int:
        """How many draft tokens a decoding sequence may verify this step (0: plain decode)."""
        if (
            self.num_lookahead_tokens == 0
            or not self.drafting
            or (0 < self.speculative_max_batch < len(self.running))
            or n != 1
            or seq.num_tokens - seq.num_computed_tokens != 1
            or seq.params.disable_speculation
            or seq.hold_blocks
        ):
            return 0
        # every accepted draft is an output token: stay within max_tokens and the context
        room = seq.params.max_tokens - seq.num_output_tokens - 1
        if self.max_model_len is not None:
            room = min(room, self.max_model_len - seq.num_tokens - 1)
        most = self.num_lookahead_tokens if self.draft_limit is None else self.draft_limit
        return max(0, min(self.num_lookahead_tokens, most, budget - 1, room))

    def _blocks_needed_behind(self, running: list[SequenceState]) -> list[int]:
        """For each running sequence, the blocks the ones after it need for this step's tokens
        (at most the whole token budget each: an upper bound)."""
        needs = [
            self.block_manager.num_new_blocks(
                s,
                s.num_computed_tokens
                + min(s.num_tokens - s.num_computed_tokens, self.max_num_batched_tokens),
            )
            for s in running
        ]
        behind = [0] * len(running)
        for i in range(len(running) - 2, -1, -1):
            behind[i] = behind[i + 1] + needs[i + 1]
        return behind

    def schedule(self) -> list[ScheduledSeq]:
        """Pick this step's work; every returned sequence has blocks for its new tokens."""
        budget = self.max_num_batched_tokens
        prompt_budget = max(1, self.prefill_budget)
        scheduled: list[ScheduledSeq] = []
        preempted = False
        running = list(self.running)
        manager = self.block_manager
        if self.waiting and any(s.num_tokens - s.num_computed_tokens > 1 for s in running):
            budget, prompt_budget, started = self._admit_short(scheduled, budget, prompt_budget)
            if started:  # this step stays short: the long prompts' chunks give way
                prompt_budget = min(prompt_budget, max(MIN_SHARED_CHUNK, self.prefill_budget // 4))
        behind = self._blocks_needed_behind(running) if self.num_lookahead_tokens else []
        for index, seq in enumerate(running):
            if budget == 0:
                break
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            if n > 1 or seq.num_tokens - seq.num_computed_tokens > 1:  # a prefill chunk
                n = min(n, prompt_budget)
                if n == 0:
                    continue  # its next chunk waits for a step with room
                prompt_budget -= n
            # drafts only from budget the running sequences behind this one do not need
            lookahead = self._lookahead(seq, n, budget - (len(running) - index - 1))
            # ... and only from blocks they do not need either: drafts never cause a preemption
            if lookahead and (
                manager.num_new_blocks(seq, seq.num_computed_tokens + n + lookahead) + behind[index]
                <= manager.pool.num_free
            ):
                manager.ensure_slots(seq, seq.num_computed_tokens + n + lookahead)
                scheduled.append(ScheduledSeq(seq, n, lookahead))
                budget -= n + lookahead
                continue
            while not self.block_manager.ensure_slots(seq, seq.num_computed_tokens + n):
                victim = self._victim() or seq  # never None: seq is running
                self._preempt(victim)
                preempted = True
                if victim is seq:
                    break
            if seq.status is SequenceStatus.RUNNING:
                scheduled.append(ScheduledSeq(seq, n))
                budget -= n
        if preempted:
            return scheduled
        budget = self._admit(scheduled, budget, prompt_budget)
        # Nothing can run: the waiting sequences that hold blocks keep them from the others (all
        # at once cannot fit). Free the newest until something fits; blocks held for KV still on
        # its way come back when it arrives or its reservation expires.
        while not scheduled and not self.running and self.waiting:
            victim = self._victim()
            if victim is None:
                break
            self._preempt(victim)
            budget = self._admit(scheduled, budget, prompt_budget)
        self._round_cut(scheduled)
        return scheduled

    def _round_cut(self, scheduled: list[ScheduledSeq]) -> None:
        """Shorten the last chunk that ends before its prompt does (the one a budget cut) by
        the step's rows (tokens and draft slots) modulo `row_granule`, where it keeps a token:
        those tokens come first in a later step, which the cut prompt takes anyway. A step whose
        prompts all finish is left as it is (shortening it would add a step)."""
        granule = self.row_granule
        if granule <= 1:
            return
        for item in reversed(scheduled):
            seq = item.seq
            if seq.num_computed_tokens + item.num_new_tokens < seq.num_tokens:
                rows = sum(i.num_new_tokens + i.num_lookahead_tokens for i in scheduled)
                if rows % granule < item.num_new_tokens:
                    item.num_new_tokens -= rows % granule
                return

    def _admit_short(
        self, scheduled: list[ScheduledSeq], budget: int, prompt_budget: int
    ) -> tuple[int, int, int]:
        """Start the waiting sequences (holding no blocks yet, in order) whose prefill after
        their prefix-cache hit is at most a quarter of the prompt budget, up to half of it in
        all, where their blocks leave the running ones all they need this step; the others
        drop the hit they were matched with and are not looked at again (a request is matched
        here at most once; SHORT_LOOKS a step). Returns (token budget, prompt budget, started)."""
        manager = self.block_manager
        limit = max(1, prompt_budget // 4)
        share = prompt_budget // 2
        running_need = sum(
            manager.num_new_blocks(
                s, s.num_computed_tokens + min(s.num_tokens - s.num_computed_tokens, budget)
            )
            for s in self.running
        )
        started = looks = 0
        for seq in list(self.waiting):
            if len(self.running) >= self.max_num_seqs or share <= 0 or looks >= SHORT_LOOKS:
                break
            if seq.block_table or seq.long_prefill or not seq.reads_prefix_cache:
                continue
            looks += 1
            hit = manager.match_prefix(seq)
            n = seq.num_tokens - seq.num_computed_tokens
            seq.long_prefill = n > limit  # looked at once: matching hashes its whole prompt
            if (
                n > min(limit, share, budget)
                or manager.num_new_blocks(seq, seq.num_tokens) + running_need
                > manager.pool.num_free
                or not manager.ensure_slots(seq, seq.num_tokens)
            ):
                manager.free(seq)  # drops the hit: _admit matches it again in its turn
                continue
            if seq.num_output_tokens == 0:
                seq.num_cached_tokens = hit
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            prompt_budget -= n
            share -= n
            started += 1
        return budget, prompt_budget, started

    def _admit(self, scheduled: list[ScheduledSeq], budget: int, prompt_budget: int) -> int:
        """Start waiting sequences, in order, within the budgets and the free blocks; returns the
        token budget left. After one without blocks finds none free, later ones without blocks wait
        (first come, first served), while those already holding theirs still start."""
        manager = self.block_manager
        blocked = False
        for seq in list(self.waiting):
            if budget <= 0 or len(self.running) >= self.max_num_seqs:
                break
            holds_blocks = bool(seq.block_table)
            if not holds_blocks:
                if blocked:
                    continue
                # prompt logprobs need every prompt position computed (engine.prompt_logprobs)
                hit = manager.match_prefix(seq) if seq.reads_prefix_cache else 0
                if seq.num_output_tokens == 0:  # a preempted sequence keeps its first count
                    seq.num_cached_tokens = hit
            n = min(seq.num_tokens - seq.num_computed_tokens, budget)
            prefill = seq.num_tokens - seq.num_computed_tokens > 1
            if prefill:
                n = min(n, prompt_budget)
                if n == 0:
                    if not holds_blocks:
                        manager.free(seq)  # drops the prefix hit it just took
                        blocked = True  # first come, first served
                    continue
            if not manager.ensure_slots(seq, seq.num_computed_tokens + n):
                if not holds_blocks:
                    manager.free(seq)
                    blocked = True
                continue
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            self.running.append(seq)
            scheduled.append(ScheduledSeq(seq, n))
            budget -= n
            prompt_budget -= n if prefill else 0
        return budget
