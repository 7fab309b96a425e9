"""Prompt logprobs (common/engine/prompt_logprobs.py) against transformers on the same weights.

Every prompt token's logprob must equal log_softmax of HF's float32 logits at the position before
it, with whole prompts, chunked prefill, a prefix-cache hit, preemption and the prefill -> decode
handoff. Tolerance: 1e-4 absolute. Both sides run float32 but sum in different orders (fused
QKV and gate/up projections, paged attention over chunks vs one dense forward); the tiny model's
logprobs lie in [-11, -2], where float32 rounding alone is ~1e-6 per operation, and the largest
difference measured was 1.1e-5. 1e-4 leaves a 10x margin, while a wrong position (an off-by-one,
a stale chunk) is off by far more (> 0.1).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from common.engine.prompt_logprobs import SCORE_SLICE_TOKENS, chunk_targets
from common.sampling_params import SamplingParams
from tests.common.engine.test_engine import assert_block_pool_full, make_engine, prompts

ATOL = 1e-4
NUM_TOP = 3
SCORED = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=NUM_TOP)


def hf_prompt_logprobs(hf_model, prompt: list[int]) -> torch.Tensor:
    """[len(prompt) - 1, vocab] float32 logprobs of the positions that predict tokens 1.."""
    with torch.no_grad():
        logits = hf_model(torch.tensor([prompt])).logits[0, :-1]
    return logits.float().log_softmax(dim=-1)


def assert_matches_hf(hf_model, prompt: list[int], got, num_top: int = NUM_TOP) -> None:
    expected = hf_prompt_logprobs(hf_model, prompt)
    assert len(got) == len(prompt) - 1
    targets = torch.tensor(prompt[1:])
    want = expected.gather(1, targets[:, None]).squeeze(1)
    lps = torch.tensor([lp for lp, _, _ in got])
    torch.testing.assert_close(lps, want, rtol=0, atol=ATOL)
    ranks = (expected >= want[:, None]).sum(dim=-1).tolist()
    assert [rank for _, rank, _ in got] == ranks
    best = expected.topk(num_top, dim=-1)
    for j, (_, _, top) in enumerate(got):
        assert len(top) == num_top
        torch.testing.assert_close(
            torch.tensor([v for _, v in top]), best.values[j], rtol=0, atol=ATOL
        )
        # alternatives' ids agree unless two of them tie within the tolerance
        gaps = best.values[j, :-1] - best.values[j, 1:]
        if bool((gaps > 2 * ATOL).all()):
            assert [t for t, _ in top] == best.indices[j].tolist()


def test_chunk_targets_skip_the_sampled_position():
    tokens = [10, 11, 12, 13, 14, 99]  # a 5-token prompt and one output token
    assert chunk_targets(tokens, 5, 0, 2) == [11, 12]
    assert chunk_targets(tokens, 5, 2, 3) == [13, 14]  # position 4 predicts the output token
    assert chunk_targets(tokens, 5, 4, 1) == []
    assert chunk_targets([7], 1, 0, 1) == []


def test_prompt_logprobs_match_transformers_batched(tiny_llama):
    hf_model, _ = tiny_llama
    engine = make_engine(hf_model)
    ps = prompts(4, seed=11, lengths=(2, 9, 17, 40))
    plain = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    # a request without prompt logprobs in the same batch is untouched
    seqs = engine.generate([*ps, ps[-1]], [SCORED] * len(ps) + [plain])
    for p, seq in zip(ps, seqs):
        assert_matches_hf(hf_model, p, seq.prompt_logprobs)
    assert seqs[-1].prompt_logprobs == []
    assert seqs[-1].output_token_ids == seqs[-2].output_token_ids
    assert_block_pool_full(engine)


def test_first_output_carries_them_once(tiny_llama):
    hf_model, _ = tiny_llama
    engine = make_engine(hf_model)
    (p,) = prompts(1, seed=3, lengths=(12,))
    engine.add_request("r", p, dataclasses.replace(SCORED, max_tokens=3, prompt_logprobs=0))
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    assert [o.prompt_logprobs is not None for o in outs] == [True, False, False]
    assert_matches_hf(hf_model, p, outs[0].prompt_logprobs, num_top=0)


@pytest.mark.parametrize("chunk", [5, 16])
def test_chunked_prefill(tiny_llama, chunk):
    hf_model, _ = tiny_llama
    engine = make_engine(hf_model, max_num_batched_tokens=chunk)
    ps = prompts(2, seed=12, lengths=(23, 40))
    for p, seq in zip(ps, engine.generate(ps, SCORED)):
        assert_matches_hf(hf_model, p, seq.prompt_logprobs)


def test_long_prompt_scores_in_slices(tiny_llama):
    hf_model, _ = tiny_llama
    engine = make_engine(hf_model, max_num_batched_tokens=512)
    (p,) = prompts(1, seed=13, lengths=(SCORE_SLICE_TOKENS + 40,))
    assert_matches_hf(hf_model, p, engine.generate([p], SCORED)[0].prompt_logprobs)


def test_prefix_cache_hit_does_not_skip_them(tiny_llama):
    # The prompt is cached by a first request; one asking for prompt logprobs computes it all
    # again (it does not read the cache), and a later plain request still hits the cache.
    hf_model, _ = tiny_llama
    engine = make_engine(hf_model)
    (p,) = prompts(1, seed=14, lengths=(33,))
    plain = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)
    first = engine.generate([p], plain)[0]
    assert first.num_cached_tokens == 0
    scored = engine.generate([p], SCORED)[0]
    assert scored.num_cached_tokens == 0
    assert_matches_hf(hf_model, p, scored.prompt_logprobs)
    assert scored.output_token_ids == first.output_token_ids
    assert engine.generate([p], plain)[0].num_cached_tokens == 32
    assert_block_pool_full(engine)


def test_preemption_rescores_from_the_start(tiny_llama):
    hf_model, _ = tiny_llama
    ps = prompts(6, seed=2, lengths=(30, 25, 40, 12, 33, 20))
    params = dataclasses.replace(SCORED, max_tokens=12)
    # 12 blocks of 8 tokens (4 KiB each, see test_engine's preemption test), chunks of 16 tokens
    engine = make_engine(
        hf_model, kv_cache_memory=str(12 * 4096), max_model_len=96, max_num_batched_tokens=16
    )
    mid_prompt = []  # per preemption: did it hit a sequence still scoring its prompt
    preempt = engine.scheduler._preempt

    def record(seq):
        mid_prompt.append(seq.scores_prompt and bool(seq.prompt_logprobs))
        preempt(seq)

    engine.scheduler._preempt = record
    seqs = engine.generate(ps, params)
    assert any(mid_prompt)
    for p, seq in zip(ps, seqs):
        assert_matches_hf(hf_model, p, seq.prompt_logprobs)
    assert_block_pool_full(engine)


def test_handoff_carries_them_to_the_decode_engine(tiny_llama):
    hf_model, _ = tiny_llama
    prefill, decode = make_engine(hf_model), make_engine(hf_model)
    (p,) = prompts(1, seed=15, lengths=(26,))
    assert decode.reserve("h", p, SCORED) == 0
    prefill.add_request("h", p, dataclasses.replace(SCORED, max_tokens=1), hold_blocks=True)
    while "h" not in prefill.held:
        prefill.step()
    held = prefill.held["h"]
    dst = decode.reserved_block_ids("h")
    decode.runner.kv_cache[:, :, dst[: len(held.block_table)]] = prefill.runner.kv_cache[
        :, :, held.block_table
    ]
    with pytest.raises(ValueError, match="prompt logprobs"):
        decode.admit_prefilled("h", held.output_token_ids[0], prompt_logprobs=[])
    assert "h" in decode.reserved  # refused before anything changed
    out = decode.admit_prefilled(
        "h", held.output_token_ids[0], prompt_logprobs=held.prompt_logprobs
    )
    assert prefill.release("h")
    assert_matches_hf(hf_model, p, out.prompt_logprobs)
    while decode.has_unfinished():
        assert all(o.prompt_logprobs is None for o in decode.step())
    assert_block_pool_full(prefill)
    assert_block_pool_full(decode)
