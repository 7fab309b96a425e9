"""Speculative decoding: drafting tokens cheaply, and verifying them so the target's output is kept.

Owns the proposers and the acceptance rule. After the scheduler has reserved slots for up to k
draft tokens per decoding sequence, the engine calls a proposer's `propose`, which fills each
scheduled sequence's `draft_token_ids` (possibly with fewer, or none). The model runner's
`execute_speculative` then scores every draft in the step's one batched target forward and calls
`Verifier.verify`, and the engine appends the accepted tokens and rolls the rest back.

- `NgramProposer` (prompt lookup): the tokens that followed the most recent earlier occurrence of
  the sequence's last n tokens (prompt and output), n from `prompt_lookup_max` down to
  `prompt_lookup_min`.
- `DraftProposer`: k autoregressive steps of a draft model. Early exit (`--draft-layers N`) runs the
  target's first N layers, its final norm and its head, and shares the target's KV cache: layer i's
  KV at a position is the same whether the draft or the target computes it, so every token the
  target has computed (prefix-cache hits and received KV included) serves the draft, and the slots
  the draft writes past them are overwritten by the verifying forward. A separate draft model
  (`--draft-model`) has its own KV cache, addressed with the target's block tables; each sequence
  tracks how many of its tokens the draft has computed and the draft catches up on the rest (after
  a prefix hit, received KV or a preemption). Writing a shared block's slots is harmless: the draft
  writes there the values any sequence with that prefix would.
- `SpeculationGovernor`: turns drafting off at a batch size while verified steps cost more per
  token than plain ones (`--speculative-adaptive`), and tries again later.
- `Verifier`: greedy rows keep the longest prefix of drafts equal to the target's argmax, plus the
  target's next token. Random rows use rejection sampling (draft x accepted with probability
  min(1, p(x) / q(x)); on rejection a token is drawn from max(0, p - q) normalized; all accepted: a
  bonus token drawn from p), which leaves the output distributed exactly as the target's `p`:
  the processed distribution of the ordinary sampler (penalties, min_tokens, temperature, top-k/p,
  min-p). N-gram drafts are fixed tokens (q one-hot).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from numpy.lib.stride_tricks import sliding_window_view

from common.config import EngineConfig
from common.engine.sampler import Sampler, SampleResult, SamplingState
from common.engine.scheduler import ScheduledSeq

if TYPE_CHECKING:
    from common.model.model_runner import ModelRunner


def ngram_propose(token_ids: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the last n tokens."""
    num = len(token_ids)
    if k <= 0 or num <= min_n:
        return []
    arr = np.asarray(token_ids, dtype=np.int64)
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        # windows start at 0 .. num-1-n: each is followed by at least one token, none is the suffix
        windows = sliding_window_view(arr[: num - 1], n)
        hits = np.flatnonzero((windows == arr[num - n :]).all(axis=1))
        if len(hits):
            start = int(hits[-1]) + n
            return token_ids[start : start + k]
    return []


class NgramProposer:
    """Prompt lookup over each sequence's own tokens; no model, no state."""

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, items: list[ScheduledSeq]) -> None:
        for item in items:
            item.draft_token_ids = ngram_propose(
                item.seq.token_ids, item.num_lookahead_tokens, self.min_n, self.max_n
            )


class DraftProposer:
    """k batched steps of a draft model (the runner's separate draft, or the target cut short)."""

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.separate = runner.draft_model is not None
        self.model = runner.draft_model if runner.draft_model is not None else runner.model
        self.num_layers = None if self.separate else runner.config.draft_layers
        self.eos_token_ids = runner.eos_token_ids
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
            ids, pos, meta = self.runner.prepare_rows(rows)
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
            i: _state(item, len(item.draft_token_ids), self.eos_token_ids)
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


def _state(item: ScheduledSeq, num_drafts: int, eos_token_ids: frozenset[int]) -> SamplingState:
    """The sampling state at the position after the sequence's first `num_drafts` drafts."""
    seq = item.seq
    output = seq.output_token_ids
    if num_drafts:
        output = output + item.draft_token_ids[:num_drafts]
    return SamplingState(seq.params, seq.prompt_token_ids, output, seq.generator, eos_token_ids)


def draw(probs: torch.Tensor, generator: torch.Generator | None) -> int:
    """One token from the distribution `probs` [V], from `generator` when given."""
    if generator is None:
        u = torch.rand(probs.shape[0], device=probs.device)
    else:
        u = torch.rand(probs.shape[0], generator=generator, device=generator.device)
        u = u.to(probs.device)
    # exponential race: argmax p_i / E_i with E_i = -log U_i ~ Exp(1) picks i with probability p_i
    return int((probs / u.log_().neg_()).argmax())


def greedy_accept(draft_ids: list[int], target_ids: list[int]) -> list[int]:
    """Drafts up to the first that differs from the target's argmax, then the target's token."""
    for j, token in enumerate(draft_ids):
        if token != target_ids[j]:
            return draft_ids[:j] + [target_ids[j]]
    return draft_ids + [target_ids[len(draft_ids)]]


def rejection_sample(
    target_probs: torch.Tensor,
    draft_ids: list[int],
    draft_probs: torch.Tensor | None,
    generator: torch.Generator | None,
) -> list[int]:
    """Accepted drafts plus one token, distributed as the target's; `draft_probs` None: one-hot.

    target_probs [k+1, V]: the target's distribution at each draft's position and after the last.
    """
    k = len(draft_ids)
    dev = target_probs.device
    accepted = k
    if k:
        rows = torch.arange(k, device=dev)
        ids = torch.tensor(draft_ids, device=dev)
        p = target_probs[rows, ids]
        q = torch.ones_like(p) if draft_probs is None else draft_probs[rows, ids]
        if generator is None:
            u = torch.rand(k, device=dev)
        else:
            u = torch.rand(k, generator=generator, device=generator.device).to(dev)
        rejected = (u * q >= p).nonzero()  # accept with probability min(1, p / q)
        if len(rejected):
            accepted = int(rejected[0])
    if accepted == k:
        return draft_ids + [draw(target_probs[k], generator)]
    if draft_probs is None:
        residual = target_probs[accepted].clone()
        residual[draft_ids[accepted]] = 0.0
    else:
        residual = (target_probs[accepted] - draft_probs[accepted]).clamp_(min=0.0)
    if not residual.sum() > 0:  # p <= q everywhere only when p == q, where no draft is rejected
        residual = target_probs[accepted]
    return draft_ids[:accepted] + [draw(residual, generator)]


class Verifier:
    """Accepts drafts against the target's logits; see the module docstring."""

    def __init__(self, eos_token_ids: frozenset[int] = frozenset()) -> None:
        self.eos_token_ids = eos_token_ids
        self.sampler = Sampler()

    def verify(self, logits: torch.Tensor, items: list[ScheduledSeq]) -> list[list[SampleResult]]:
        """logits: for each item in order, its k+1 rows (at the last token and each draft)."""
        states = [
            _state(item, j, self.eos_token_ids)
            for item in items
            for j in range(len(item.draft_token_ids) + 1)
        ]
        scores = self.sampler.process_logits(logits, states)
        argmax = scores.max(dim=-1).indices.tolist()
        results = []
        start = 0
        for item in items:
            drafts = item.draft_token_ids
            end = start + len(drafts) + 1
            if item.seq.params.greedy:
                tokens = greedy_accept(drafts, argmax[start:end])
            else:
                probs = torch.softmax(scores[start:end], dim=-1)
                tokens = rejection_sample(probs, drafts, item.draft_probs, item.seq.generator)
            results.append(_with_logprobs(logits[start:end], tokens, item.seq.params.logprobs))
            start = end
        return results


def _with_logprobs(
    logits: torch.Tensor, tokens: list[int], num_top: int | None
) -> list[SampleResult]:
    """SampleResults with logprobs from the raw logits (row j scored tokens[j]), as the sampler."""
    if num_top is None:
        return [SampleResult(t, None, None) for t in tokens]
    logprobs = torch.log_softmax(logits[: len(tokens)].float(), dim=-1)
    rows = torch.arange(len(tokens), device=logits.device)
    chosen = logprobs[rows, torch.tensor(tokens, device=logits.device)].tolist()
    top: list[list[tuple[int, float]]] = [[] for _ in tokens]
    if num_top > 0:
        best = logprobs.topk(min(num_top, logprobs.shape[1]), dim=-1)
        top = [list(zip(i, v)) for i, v in zip(best.indices.tolist(), best.values.tolist())]
    return [SampleResult(t, lp, alt) for t, lp, alt in zip(tokens, chosen, top)]


def make_proposer(
    config: EngineConfig, runner: ModelRunner
) -> NgramProposer | DraftProposer | None:
    """The proposer `config.speculative` asks for (None: no speculation)."""
    if config.speculative == "ngram":
        return NgramProposer(config.prompt_lookup_min, config.prompt_lookup_max)
    if config.speculative == "draft":
        return DraftProposer(runner)
    return None


def mean_accepted_length(stats: dict[str, float]) -> float:
    """Tokens a verifying sequence gains per step (accepted drafts + the target's own token)."""
    drafts = stats["spec_decode_num_drafts_total"]
    if drafts == 0:
        return 0.0
    return 1.0 + stats["spec_decode_num_accepted_tokens_total"] / drafts


@dataclass
class _Pace:
    """Seconds per output token at one running-batch size: drafting steps vs plain steps."""

    drafting: float | None = None
    plain: float | None = None
    drafting_steps: int = 0  # since drafting was last (re)started here
    paused: int = 0  # steps left with drafting off
    failures: int = 0  # drafting lost to plain decoding this many times in a row


class SpeculationGovernor:
    """Keeps drafting on only while it pays, as measured on this machine and workload.

    Per number of running sequences it keeps exponential averages of the seconds per output
    token of steps that verified drafts and of plain decode steps (steps with prefill chunks are
    not counted). After `min_steps` drafting steps it compares: more than `margin` times slower
    than plain decoding means drafting pauses at that batch size for `pause_steps` steps
    (doubling with each loss in a row, up to 4x), then is tried afresh. With no plain measurement
    yet it pauses for `probe_steps` steps to take one. Verification is exact either way, so this
    changes speed only, never output.
    """

    def __init__(
        self,
        pause_steps: int = 64,
        probe_steps: int = 4,
        min_steps: int = 16,
        alpha: float = 0.1,
        margin: float = 1.1,
    ) -> None:
        self.pause_steps = pause_steps
        self.probe_steps = probe_steps
        self.min_steps = min_steps
        self.alpha = alpha
        self.margin = margin  # drafting must be this much slower to pause: noise is not a loss
        self._pace: dict[int, _Pace] = {}
        self.num_pauses = 0

    def allow(self, batch_size: int) -> bool:
        """Whether this step may draft; call once per step."""
        pace = self._pace.setdefault(batch_size, _Pace())
        if pace.paused > 0:
            pace.paused -= 1
            return False
        return True

    def record(self, batch_size: int, drafted: bool, seconds: float, num_tokens: int) -> None:
        """A decode step of `batch_size` sequences took `seconds` for `num_tokens` new tokens."""
        if num_tokens <= 0:
            return
        pace = self._pace.setdefault(batch_size, _Pace())
        per_token = seconds / num_tokens
        if not drafted:
            pace.plain = self._average(pace.plain, per_token)
            return
        pace.drafting = self._average(pace.drafting, per_token)
        pace.drafting_steps += 1
        if pace.drafting_steps < self.min_steps:
            return
        if pace.plain is None:
            pause = self.probe_steps
        elif pace.drafting > self.margin * pace.plain:
            pause = self.pause_steps << min(pace.failures, 2)
            pace.failures += 1
            self.num_pauses += 1
        else:
            pace.failures = 0
            return
        pace.paused, pace.drafting, pace.drafting_steps = pause, None, 0

    def _average(self, old: float | None, new: float) -> float:
        return new if old is None else (1 - self.alpha) * old + self.alpha * new
