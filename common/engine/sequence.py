"""A request's running state inside an engine: its tokens, blocks and progress (`SequenceState`).

Owned by the scheduler (status, block table, computed-token count) and the engine (tokens appended,
finish reason, the sampling state of each step). Proposers read it; the model runner never sees it
(it gets rows of tokens and block tables).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

import torch

from common.engine.grammar import GrammarMatcher
from common.engine.penalties import TokenHistory
from common.engine.prompt_logprobs import PromptLogprob
from common.engine.sampler import SamplingState
from common.sampling_params import SamplingParams


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class SequenceState:
    """Prompt + generated tokens of one request, and how far its KV has been computed."""

    request_id: str
    token_ids: list[int]  # prompt then output tokens
    num_prompt_tokens: int
    params: SamplingParams
    generator: torch.Generator | None = None
    status: SequenceStatus = SequenceStatus.WAITING
    block_table: list[int] = field(default_factory=list)
    block_keys: list[bytes] = field(default_factory=list)  # keys of the leading full blocks
    num_computed_tokens: int = 0  # tokens whose KV is in the cache
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at admission
    prefix_queried: bool = False  # counted in the prefix cache's query metrics (once per request)
    long_prefill: bool = False  # the scheduler found its prefill long: not started ahead of turn
    num_draft_computed_tokens: int = 0  # tokens whose KV a separate draft model holds
    finish_reason: str | None = None
    hold_blocks: bool = False  # prefill worker: keep the blocks after finishing, until released
    arrival_time: float = field(default_factory=time.monotonic)
    output_logprobs: list[float | None] = field(default_factory=list)
    output_top_logprobs: list[list[tuple[int, float]] | None] = field(default_factory=list)
    history: TokenHistory | None = None  # for penalties; created by the first sampling_state
    grammar: GrammarMatcher | None = None  # structured output: follows the output tokens
    # params.prompt_logprobs: prompt tokens 1.. scored so far (common.engine.prompt_logprobs)
    prompt_logprobs: list[PromptLogprob] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def scores_prompt(self) -> bool:
        """Its prompt tokens' logprobs are wanted and not yet all handed out."""
        return self.params.prompt_logprobs is not None and self.num_output_tokens == 0

    @property
    def reads_prefix_cache(self) -> bool:
        """A cache hit would skip prompt positions whose logprobs are wanted: such a sequence
        computes its whole prompt (and still registers its blocks for others)."""
        return not self.scores_prompt

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    def sampling_state(
        self, eos_token_ids: frozenset[int], drafts: list[int] | None = None
    ) -> SamplingState:
        """The sampler's view of the next token (after `drafts`, when verifying them).

        O(1) without penalties; with them the token history takes in only the new tokens.
        """
        params = self.params
        if params.has_penalties:
            if self.history is None:
                self.history = TokenHistory(self.token_ids[: self.num_prompt_tokens])
            self.history.sync(self.token_ids)
        return SamplingState(
            params,
            self.num_output_tokens + (len(drafts) if drafts else 0),
            self.generator,
            eos_token_ids,
            self.history,
            drafts or (),
        )
