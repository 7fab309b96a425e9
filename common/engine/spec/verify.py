"""Verification: keeping the drafts the target agrees with, so the output is the target's own.

Called by the engine after the step's one target forward (`Verifier.pick_tokens`: rows without
drafts go to the ordinary sampler, rows with drafts to `verify`, with their k+1 logits at the last
token and at each draft). Greedy rows keep the longest prefix of drafts equal to the
target's argmax, plus the target's next token. Random rows use rejection sampling (draft x
accepted with probability min(1, p(x) / q(x)); on rejection a token is drawn from max(0, p - q)
normalized; all accepted: a bonus token drawn from p), which leaves the output distributed exactly
as the target's `p`: the processed distribution of the ordinary sampler (penalties, min_tokens,
temperature, top-k/p, min-p). N-gram drafts are fixed tokens (q one-hot).
"""

from __future__ import annotations

import torch

from common.engine.sampler import Sampler, SampleResult
from common.engine.scheduler import ScheduledSeq


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

    def pick_tokens(
        self,
        sampler: Sampler,
        batch: list[ScheduledSeq],
        logits: torch.Tensor | None,
        num_logits: list[int],
    ) -> list[list[SampleResult]]:
        """Each row's new tokens: one from `sampler`, or its accepted drafts plus one; none for a
        prefill chunk. `logits` holds num_logits[i] rows for batch row i, in batch order."""
        results: list[list[SampleResult]] = [[] for _ in batch]
        if logits is None:
            return results
        plain: list[int] = []  # batch rows sampling one token, and their logits rows
        plain_at: list[int] = []
        verify: list[int] = []
        verify_at: list[int] = []
        offset = 0
        for i, (item, n) in enumerate(zip(batch, num_logits)):
            if item.draft_token_ids:
                verify.append(i)
                verify_at.extend(range(offset, offset + n))
            elif n:
                plain.append(i)
                plain_at.append(offset)
            offset += n
        if plain:
            states = [batch[i].seq.sampling_state(self.eos_token_ids) for i in plain]
            for i, state in zip(plain, states):
                if batch[i].seq.grammar is not None:
                    state.token_bitmask = batch[i].seq.grammar.bitmask()
            for i, result in zip(plain, sampler(_rows(logits, plain_at), states)):
                results[i] = [result]
        if verify:
            items = [batch[i] for i in verify]
            for i, samples in zip(verify, self.verify(_rows(logits, verify_at), items)):
                results[i] = samples
        return results

    def verify(self, logits: torch.Tensor, items: list[ScheduledSeq]) -> list[list[SampleResult]]:
        """logits: for each item in order, its k+1 rows (at the last token and each draft)."""
        states = [
            item.seq.sampling_state(self.eos_token_ids, item.draft_token_ids[:j])
            for item in items
            for j in range(len(item.draft_token_ids) + 1)
        ]
        start = 0
        for item in items:
            if item.seq.grammar is not None:
                # the grammar's mask at each draft: a draft it refuses has probability 0 there,
                # so it is rejected (and the matcher is left as it was before the drafts)
                masks = item.seq.grammar.draft_bitmasks(item.draft_token_ids)
                for state, mask in zip(states[start:], masks):
                    state.token_bitmask = mask
            start += len(item.draft_token_ids) + 1
        # all greedy and nothing to apply (the common case): the raw logits' argmax, no copy
        argmax = self.sampler.greedy_picks(logits, states)
        if argmax is None:
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


def _rows(x: torch.Tensor, index: list[int]) -> torch.Tensor:
    """x[index] for increasing `index`: x itself (no copy) when it takes every row."""
    if len(index) == x.shape[0]:
        return x
    return x[torch.tensor(index, device=x.device)]
