"""The sampler with structured-output bitmasks (common/engine/sampler.py): only allowed tokens
come out, greedy or sampled, with or without logprobs (which stay the model's own), in batches
that mix constrained and free rows, and never a padded-vocabulary column."""

from __future__ import annotations

import pytest
import torch

from common.engine.sampler import Sampler, SamplingState
from common.sampling_params import SamplingParams

VOCAB = 100  # logits width; the bitmasks cover 64 ids (a tokenizer smaller than the model's head)


def bitmask(allowed: list[int]) -> torch.Tensor:
    words = torch.zeros(2, dtype=torch.int64)
    for t in allowed:
        words[t // 32] |= 1 << (t % 32)
    return words.to(torch.int32)  # wraps bit 31 to the sign bit, as llguidance writes it


@pytest.mark.parametrize("logprobs", [None, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_only_allowed_tokens_are_sampled(logprobs, dtype) -> None:
    torch.manual_seed(0)
    logits = torch.randn(4, VOCAB).to(dtype)
    logits[:, 70:] += 50.0  # the padding columns would win everywhere if not refused
    allowed = [3, 31, 63]
    states = [
        SamplingState(SamplingParams(temperature=0.0, logprobs=logprobs), 0, None),
        SamplingState(SamplingParams(temperature=1.0, logprobs=logprobs), 0, None),
        SamplingState(SamplingParams(temperature=0.0), 0, None),  # free: picks the padding
        SamplingState(SamplingParams(temperature=1.0, top_k=2, logprobs=logprobs), 0, None),
    ]
    for i in (0, 1, 3):
        states[i].token_bitmask = bitmask(allowed)
    sampler = Sampler()
    for _ in range(20):
        results = sampler(logits, states)
        assert all(results[i].token_id in allowed for i in (0, 1, 3))
        assert results[2].token_id >= 70
    best = max(allowed, key=lambda t: logits[0, t].item())
    assert results[0].token_id == best
    if logprobs is not None:  # the model's raw logprob of the chosen token, before the mask
        raw = torch.log_softmax(logits[0].float(), dim=-1)[best].item()
        assert results[0].logprob == pytest.approx(raw, abs=1e-4)


def test_process_logits_masks_each_row() -> None:
    logits = torch.randn(2, VOCAB)
    states = [SamplingState(SamplingParams(temperature=0.0), 0, None) for _ in range(2)]
    states[1].token_bitmask = bitmask([5, 40])
    scores = Sampler().process_logits(logits, states)
    assert torch.isfinite(scores[0]).all()
    assert torch.isfinite(scores[1]).nonzero().flatten().tolist() == [5, 40]
