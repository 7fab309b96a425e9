"""The decode side of a prefill -> decode handoff: blocks held for KV on its way, then admitted.

`reserve` holds blocks for a prompt another worker prefills (counting what every admitted
sequence will still need, so reservations cannot starve a preempted one), `admit_prefilled`
starts it decoding once its KV has been written into them (with the prefill side's first token
and RNG state), `prefill_reserved` computes it here after all when its KV arrived damaged.
A mixin of `common.engine.engine.Engine`, whose state (block manager, scheduler, sequences) it
uses; split out to keep the engine's step loop on its own.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

from common.engine import prompt_logprobs as scoring
from common.engine.sampler import SampleResult, restore_generator
from common.engine.sequence import SequenceState
from common.sampling_params import SamplingParams

if TYPE_CHECKING:
    from common.engine.engine import RequestOutput

# A reservation leaves room for each admitted sequence to grow by this many more output tokens
# (or what it may still produce, if less): a typical reply runs without preemption, while a
# request with a huge max_tokens does not hold back everyone else (SGLang clips its estimate too).
OUTPUT_RESERVE_TOKENS = 256
MAX_RETRIED_IDS = 4096  # refused reservations remembered, so a retry is not a second query


class KVHandoff:
    """Reservations for KV that another worker sends (see the module docstring)."""

    reserved: dict[str, SequenceState]  # blocks held for KV that is on its way
    reserve_refused: OrderedDict[str, None]  # the latest refused reservations' request ids

    def reserve(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams
    ) -> int | None:
        """Hold blocks for a prompt whose KV another worker will send; None if there is no room.

        Returns how many leading prompt tokens this engine already holds (prefix-cache hit, a
        multiple of the block size): the sender need not send those blocks.
        """
        seq = self._new_sequence(request_id, prompt_token_ids, params)
        manager = self.block_manager
        # a request the router retries here (no room yet) counts as one prefix-cache query
        queried = self.reserve_refused
        seq.prefix_queried = request_id in queried
        cached = manager.match_prefix(seq)
        # The blocks every admitted sequence (running, waiting, reserved, and this one) still
        # needs to grow by its next token and up to OUTPUT_RESERVE_TOKENS more: a preempted one
        # all of its tokens again, so new reservations cannot starve it. Growth past that is
        # covered by preemption.
        sched = self.scheduler
        admitted = [*sched.running, *sched.waiting, *self.reserved.values(), seq]
        if sum(self._blocks_to_grow(s) for s in admitted) > self.pool.num_free:
            manager.free(seq)
            queried[request_id] = None
            if len(queried) > MAX_RETRIED_IDS:  # ids of retries that went elsewhere age out
                queried.popitem(last=False)
            return None
        queried.pop(request_id, None)
        manager.ensure_slots(seq, seq.num_tokens + 1)
        seq.num_cached_tokens = cached
        self.reserved[request_id] = seq
        return cached

    def _blocks_to_grow(self, seq: SequenceState) -> int:
        """Blocks `seq` must still take to hold its next token and the output it may still
        produce, up to OUTPUT_RESERVE_TOKENS."""
        room = min(
            seq.params.max_tokens - seq.num_output_tokens, self.max_model_len - seq.num_tokens
        )
        grown = seq.num_tokens + max(1, min(room, OUTPUT_RESERVE_TOKENS))
        return self.block_manager.num_new_blocks(seq, grown)

    def reserved_block_ids(self, request_id: str) -> list[int] | None:
        seq = self.reserved.get(request_id)
        return None if seq is None else list(seq.block_table)

    def admit_prefilled(
        self,
        request_id: str,
        token_id: int,
        logprob: float | None = None,
        top_logprobs: list[tuple[int, float]] | None = None,
        generator_state: bytes = b"",
        prompt_logprobs: list[scoring.PromptLogprob] | None = None,
    ) -> RequestOutput:
        """The reserved prompt's KV has arrived: add the first token and start decoding it.

        `generator_state` is the prefill side's sampler RNG state after it sampled the first token
        (seeded requests): restoring it makes the decode side continue the same random stream.
        `prompt_logprobs`: the prefill side's scores of the prompt (when the request wants them).
        """
        seq = self.reserved[request_id]
        scoring.adopt_prompt_logprobs(seq, prompt_logprobs)  # raises before anything changes
        if seq.generator is not None and generator_state:
            restore_generator(seq.generator, generator_state)  # raises before anything changes
        del self.reserved[request_id]
        seq.num_computed_tokens = seq.num_prompt_tokens
        self.block_manager.commit(seq)
        self.seqs[request_id] = seq
        self.scheduler.add(seq)
        return self._append_tokens(seq, [SampleResult(token_id, logprob, top_logprobs)])

    def prefill_reserved(self, request_id: str) -> None:
        """Compute a reserved prompt here after all (its KV arrived damaged and was never
        written): it prefills in its reserved blocks, from its prefix-cache hit on, and samples
        its first token with its own generator, the same as the prefill side would have."""
        seq = self.reserved.pop(request_id)
        seq.num_computed_tokens = seq.num_cached_tokens
        self.seqs[request_id] = seq
        self.scheduler.add(seq)
