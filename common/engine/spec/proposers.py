"""Draft proposers: cheap guesses of a sequence's next tokens, for the target to verify.

After the scheduler has reserved slots for up to k draft tokens per decoding sequence, the engine
calls a proposer's `propose`, which fills each scheduled sequence's `draft_token_ids` (possibly
with fewer, or none) and, for drafts drawn at random, `draft_probs`. The engine then scores every
draft in the step's one target forward and verifies them (`common.engine.spec.verify`).

- `NgramProposer` (prompt lookup): the tokens that followed the most recent earlier occurrence of
  the sequence's last n tokens (prompt and output), n from `prompt_lookup_max` down to
  `prompt_lookup_min`.
- `DraftProposer`: k autoregressive steps of a draft model, given the model and a row builder
  (`common.kernels.attention.build_batch` bound to the block size and device), never the runner.
  Early exit (`--draft-layers N`) runs the target's first N layers, its final norm and its head,
  and shares the target's KV cache: layer i's KV at a position is the same whether the draft or
  the target computes it, so every token the target has computed (prefix-cache hits and received
  KV included) serves the draft, and the slots the draft writes past them are overwritten by the
  verifying forward. A separate draft model (`--draft-model`) has its own KV cache, addressed with
  the target's block tables; each sequence tracks how many of its tokens the draft has computed
  and the draft catches up on the rest (after a prefix hit, received KV or a preemption). Writing a
  shared block's slots is harmless: the draft writes there the values any sequence with that
  prefix would.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable

import numpy as np
import torch

from common.config import EngineConfig
from common.engine.sampler import Sampler
from common.engine.scheduler import ScheduledSeq
from common.engine.spec.verify import draw
from common.kernels.attention import AttentionMetadata, Row
from common.model.llama import CausalLM

RowBuilder = Callable[[list[Row]], tuple[torch.Tensor, torch.Tensor, AttentionMetadata]]


def ngram_propose(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the last n tokens.

    The tokens as 8-byte integers, searched from the end with `bytes.rfind` (C's substring
    search): a hit at an offset that is not a whole token is skipped. About 10 us at 400 tokens,
    where windows compared in numpy took 0.4 ms a sequence and step."""
    num = len(token_ids)
    if k <= 0 or num <= min_n:
        return []
    data = array("q", token_ids).tobytes()
    width = 8
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        # occurrences that start at 0 .. num-1-n: each is followed by at least one token, none is
        # the suffix itself
        needle = data[(num - n) * width :]
        end = (num - 1) * width
        while True:
            hit = data.rfind(needle, 0, end)
            if hit < 0:
                break
            if hit % width == 0:
                start = hit // width + n
                return token_ids[start : start + k]
            end = hit + len(needle) - 1  # the next candidate starts before this one
    return []


class NgramProposer:
    """Prompt lookup over each sequence's own tokens; no model, no state."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, items: list[ScheduledSeq]) -> None:
        for item in items:
            item.draft_token_ids = self.draft(item.seq.token_ids, item.num_lookahead_tokens)

    def draft(self, token_ids: list[int], k: int) -> list[int]:
        """Up to k tokens to follow `token_ids` (ngram_propose with this proposer's n range)."""
        return ngram_propose(token_ids, k, self.min_n, self.max_n)


class DraftProposer:
    """k batched steps of a draft model (a separate one, or the target cut to `num_layers`)."""

    def __init__(
        self,
        model: CausalLM,
        build_rows: RowBuilder,
        *,
        separate: bool,
        num_layers: int | None = None,
        eos_token_ids: frozenset[int] = frozenset(),
    ) -> None:
        self.model = model
        self.build_rows = build_rows
        self.separate = separate  # its own KV cache: track what it has computed per sequence
        self.num_layers = num_layers
        self.eos_token_ids = eos_token_ids
        self.sampler = Sampler()

    @torch.inference_mode()
    def propose(self, items: list[ScheduledSeq]) -> None:
        rows = []
        for item in items:
            seq = item.seq
            start = seq.num_draft_computed_tokens if self.separate else seq.num_computed_tokens
            rows.append((seq.token_ids[start:], start, seq.block_table))
        probs: dict[int, list[torch.Tensor]] = {id(item): [] for item in items}
        active = list(items)
        while active:
            ids, pos, meta = self.build_rows(rows)
            hidden = self.model(ids, pos, meta, self.num_layers)
            last = np.cumsum(meta.query_lens_cpu) - 1
            logits = self.model.compute_logits(hidden[torch.from_numpy(last).to(hidden.device)])
            tokens = self._choose(logits, active, probs)
            next_active, rows = [], []
            for item, token in zip(active, tokens):
                item.draft_token_ids.append(token)
                if len(item.draft_token_ids) < item.num_lookahead_tokens:
                    position = item.seq.num_tokens - 1 + len(item.draft_token_ids)
                    next_active.append(item)
                    rows.append(([token], position, item.seq.block_table))
            active = next_active
        for item in items:
            if probs[id(item)]:
                item.draft_probs = torch.stack(probs[id(item)])
            if self.separate:  # slots written: up to the input of the last draft step
                item.seq.num_draft_computed_tokens = (
                    item.seq.num_tokens - 1 + len(item.draft_token_ids)
                )

    def _choose(
        self,
        logits: torch.Tensor,
        items: list[ScheduledSeq],
        probs: dict[int, list[torch.Tensor]],
    ) -> list[int]:
        """The draft's next token per row, chosen as the target's sampler would from the draft's
        logits: argmax for greedy rows, a draw (its distribution kept) for random rows."""
        tokens = logits.max(dim=-1).indices.tolist()
        states = {
            i: item.seq.sampling_state(self.eos_token_ids, item.draft_token_ids)
            for i, item in enumerate(items)
            if not item.seq.params.greedy
            or item.seq.params.has_penalties
            or item.seq.params.min_tokens > item.seq.num_output_tokens
        }
        if not states:
            return tokens
        rows = list(states)
        scores = self.sampler.process_logits(logits[torch.tensor(rows)], list(states.values()))
        for j, i in enumerate(rows):
            if items[i].seq.params.greedy:
                tokens[i] = int(scores[j].argmax())
            else:
                dist = torch.softmax(scores[j], dim=-1)
                tokens[i] = draw(dist, items[i].seq.generator)
                probs[id(items[i])].append(dist)
        return tokens


def make_proposer(
    config: EngineConfig,
    model: CausalLM,
    draft_model: CausalLM | None,
    build_rows: RowBuilder,
    eos_token_ids: frozenset[int] = frozenset(),
) -> NgramProposer | DraftProposer | None:
    """The proposer `config.speculative` asks for (None: no speculation). `model` is the target,
    `draft_model` the separate draft (`--draft-model`) when there is one."""
    if config.speculative == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.speculative == "draft":
        if draft_model is not None:
            return DraftProposer(
                draft_model, build_rows, separate=True, eos_token_ids=eos_token_ids
            )
        return DraftProposer(
            model,
            build_rows,
            separate=False,
            num_layers=config.draft_layers,
            eos_token_ids=eos_token_ids,
        )
    return None
