"""Speculative decoding (common/engine/spec/: proposers, verify, governor; and its engine path).

Greedy output equals plain decoding, the rejection sampler keeps the target distribution, and the
KV of rejected drafts is rolled back.
"""

from __future__ import annotations

import math
import random
import time

import pytest
import torch

from common.cli import build_parser
from common.config import EngineConfig, config_from_args
from common.engine.engine import Engine
from common.engine.scheduler import ScheduledSeq
from common.engine.spec import governor as governor_mod
from common.engine.spec.governor import ShadowDrafts, SpeculationGovernor, mean_accepted_length
from common.engine.spec.proposers import ngram_propose
from common.engine.spec.verify import greedy_accept, rejection_sample
from common.sampling_params import SamplingParams
from tests.common.engine.test_engine import make_engine as make_plain_engine

GREEDY = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
SPEC_MODES = {
    "ngram": dict(speculative="ngram"),
    "draft-layers": dict(speculative="draft", draft_layers=1),
    "draft-model": dict(speculative="draft"),  # draft_model: the same tiny model's directory
}
# chi-square critical values at significance 0.001, by degrees of freedom
CHI2_CRITICAL = {1: 10.83, 2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52, 6: 22.46, 7: 24.32, 8: 26.12}


def make_engine(tiny_llama, mode: str | None = None, **overrides) -> Engine:
    """test_engine's tiny engine, with speculation `mode` drafting at every batch size."""
    hf_model, path = tiny_llama
    cfg: dict = {}
    if mode is not None:
        # draft at every batch size and every step, however the timings come out
        cfg.update(
            SPEC_MODES[mode], speculative_disable_by_batch_size=0, speculative_adaptive=False
        )
        if mode == "draft-model":
            cfg["draft_model"] = str(path)
    cfg.update(overrides)
    return make_plain_engine(hf_model, **cfg)


def prompts(n: int, seed: int = 0, lengths=(3, 7, 8, 9, 17, 31, 40)) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(2, 250, (lengths[i % len(lengths)],), generator=g).tolist() for i in range(n)
    ]


def repetitive(seed: int) -> list[int]:
    """A prompt whose tail recurs earlier, so prompt lookup finds drafts at once."""
    body = prompts(1, seed=seed, lengths=(6,))[0]
    return body * 3 + body[:3]


def assert_block_pool_full(engine: Engine) -> None:
    assert engine.pool.num_free == engine.pool.num_blocks
    assert all(b.ref_count == 0 for b in engine.pool.blocks)


def outputs(engine: Engine, ps: list[list[int]], params) -> list[list[int]]:
    return [s.output_token_ids for s in engine.generate(ps, params)]


class OracleProposer:
    """Drafts the known greedy continuation, with every `wrong_every`-th draft token corrupted:
    exercises long accepted runs, partial rejections and rollback in one run."""

    def __init__(self, expected: dict[tuple[int, ...], list[int]], wrong_every: int) -> None:
        self.expected = expected
        self.wrong_every = wrong_every
        self.calls = 0

    def propose(self, items: list[ScheduledSeq]) -> None:
        for item in items:
            seq = item.seq
            truth = self.expected[tuple(seq.prompt_token_ids)]
            done = seq.num_output_tokens
            draft = truth[done : done + item.num_lookahead_tokens]
            self.calls += 1
            if draft and self.calls % self.wrong_every == 0:
                j = self.calls % len(draft)
                draft[j] = (draft[j] + 1) % 256
            item.draft_token_ids = draft


# --- proposers and acceptance rules, no model ----------------------------------------------------


def test_ngram_propose_finds_latest_longest_match():
    tokens = [1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # suffix [2, 3] last occurred at index 5 (followed by 7, 8, 5, 2); [5, 2, 3] never before
    assert ngram_propose(tokens, 3, 2, 3) == [7, 8, 5]
    assert ngram_propose(tokens, 10, 2, 3) == [7, 8, 5, 2, 3]
    # the longer suffix wins over a later match of a shorter one
    tokens = [4, 5, 6, 10, 11, 9, 5, 6, 12, 4, 5, 6]
    assert ngram_propose(tokens, 2, 2, 3) == [10, 11]
    assert ngram_propose(tokens, 2, 2, 2) == [12, 4]
    assert ngram_propose([1, 2, 3, 4], 4, 1, 3) == []
    assert ngram_propose([7, 7], 3, 1, 1) == [7]
    assert ngram_propose([1, 2, 1, 2], 0, 1, 2) == []


def _ngram_reference(tokens: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """The definition, token by token: the latest earlier occurrence of the longest suffix."""
    num = len(tokens)
    if k <= 0 or num <= min_n:
        return []
    for n in range(min(max_n, num - 1), min_n - 1, -1):
        for start in range(num - 1 - n, -1, -1):
            if tokens[start : start + n] == tokens[num - n :]:
                return tokens[start + n : start + n + k]
    return []


def test_ngram_propose_equals_the_definition_on_random_and_byte_aligned_traps():
    rng = random.Random(0)
    cases = []
    for _ in range(400):
        vocab = rng.choice([3, 5, 50, 1 << 20])
        cases.append([rng.randrange(vocab) for _ in range(rng.randrange(1, 60))])
    # tokens whose 8-byte forms overlap: a byte-level match across token boundaries must not count
    cases.append([1 << 8, 1, 0, 1 << 8, 1, 1 << 8, 1])
    cases.append([0, 1 << 56, 0, 1, 1 << 56, 1])
    cases.append([2**40 + 7, 7, 2**40 + 7, 7])
    for tokens in cases:
        for k, lo, hi in ((4, 2, 4), (3, 1, 3), (1, 1, 1), (8, 2, 2)):
            assert ngram_propose(tokens, k, lo, hi) == _ngram_reference(tokens, k, lo, hi), tokens


def test_greedy_accept_longest_matching_prefix_plus_one():
    assert greedy_accept([5, 6, 7], [5, 6, 7, 8]) == [5, 6, 7, 8]
    assert greedy_accept([5, 6, 7], [5, 9, 7, 8]) == [5, 9]
    assert greedy_accept([5, 6, 7], [1, 6, 7, 8]) == [1]
    assert greedy_accept([], [4]) == [4]


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson statistic over the cells with expected count >= 5, and its degrees of freedom."""
    expected = probs * counts.sum()
    cells = expected >= 5
    assert counts[~cells].sum() <= 0.01 * counts.sum()  # nothing lands where p is ~0
    stat = float(((counts[cells] - expected[cells]) ** 2 / expected[cells]).sum())
    return stat, int(cells.sum()) - 1


def _dist(*values: float) -> torch.Tensor:
    p = torch.tensor(values, dtype=torch.float64)
    return p / p.sum()


P0 = _dist(0.30, 0.25, 0.20, 0.15, 0.10, 0.0)  # the last token truncated away (top-k style)
P1 = _dist(0.05, 0.05, 0.10, 0.20, 0.25, 0.35)
DRAFTS = {
    "good-dense": torch.stack([_dist(28, 27, 20, 14, 11, 0), _dist(6, 4, 10, 20, 25, 35)]).float(),
    "bad-dense": torch.stack([_dist(2, 2, 6, 10, 30, 50), _dist(60, 20, 10, 5, 3, 2)]).float(),
    "good-fixed": [0, 5],  # one-hot drafts, as n-gram ones: likely tokens
    "bad-fixed": [5, 0],  # a token the target never emits, then an unlikely one
}


@pytest.mark.parametrize("draft", list(DRAFTS))
def test_rejection_sampler_keeps_target_distribution(draft):
    target = torch.stack([P0, P1, _dist(1, 1, 1, 1, 1, 1)]).float()
    gen = torch.Generator().manual_seed(1234)
    draft_gen = torch.Generator().manual_seed(99)
    n = 20000
    first = torch.zeros(6)
    second = torch.zeros(6)  # the token after an accepted first draft
    accepted = 0
    for _ in range(n):
        spec = DRAFTS[draft]
        if isinstance(spec, list):  # fixed tokens
            ids, q_probs = spec, None
        else:  # drafts drawn from q, as a draft model's
            q_probs = spec
            ids = [int(torch.multinomial(row, 1, generator=draft_gen)) for row in q_probs]
        tokens = rejection_sample(target, ids, q_probs, gen)
        assert 1 <= len(tokens) <= 3 and tokens[: len(tokens) - 1] == ids[: len(tokens) - 1]
        accepted += len(tokens) - 1
        first[tokens[0]] += 1
        if len(tokens) >= 2:
            second[tokens[1]] += 1
    stat, dof = chi_square(first, P0)
    assert stat < CHI2_CRITICAL[dof], (draft, first.tolist())
    if second.sum() > 0:
        stat, dof = chi_square(second, P1)
        assert stat < CHI2_CRITICAL[dof], (draft, second.tolist())
    # acceptance rate: sum(min(p, q)) per position (p(draft) for fixed drafts)
    if isinstance(spec, list):
        rate = [float(P0[spec[0]]), float(P1[spec[1]])]
    else:
        rate = [float(torch.minimum(p.float(), q).sum()) for p, q in zip((P0, P1), spec)]
    assert accepted == pytest.approx(n * rate[0] * (1 + rate[1]), rel=0.05, abs=10)


def test_rejection_sampler_accepts_a_draft_equal_to_the_target():
    p = torch.stack([P0, P1, P0]).float()
    gen = torch.Generator().manual_seed(0)
    for _ in range(500):
        ids = [int(torch.multinomial(row, 1, generator=gen)) for row in p[:2]]
        assert rejection_sample(p, ids, p[:2], gen)[:2] == ids


# --- the engine ----------------------------------------------------------------------------------


@pytest.mark.parametrize("mode", list(SPEC_MODES))
def test_greedy_equals_plain_decoding_mixed_batch(tiny_llama, mode):
    ps = prompts(6, seed=1) + [repetitive(2), repetitive(3)]
    params = [GREEDY] * len(ps)
    params[1] = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True, min_tokens=3)
    params[2] = SamplingParams(max_tokens=33, temperature=0.0, disable_speculation=True)
    params[3] = SamplingParams(max_tokens=40, temperature=0.0, repetition_penalty=1.3)
    params[6] = SamplingParams(max_tokens=21, temperature=0.0, ignore_eos=True)
    expected = outputs(make_engine(tiny_llama), ps, params)
    # a small token budget: prefill chunks, plain decode rows and verify rows share steps
    engine = make_engine(tiny_llama, mode, max_num_batched_tokens=24)
    assert outputs(engine, ps, params) == expected
    stats = engine.stats()
    assert stats["spec_decode_num_drafts_total"] > 0
    assert stats["spec_decode_num_draft_tokens_total"] >= stats["spec_decode_num_drafts_total"]
    if mode == "draft-model":  # the draft is the target itself
        drafted = stats["spec_decode_num_draft_tokens_total"]
        assert stats["spec_decode_num_accepted_tokens_total"] == drafted
        assert mean_accepted_length(stats) > 3.0
    assert_block_pool_full(engine)


def test_greedy_equals_transformers(tiny_llama):
    from tests.common.engine.test_engine import hf_greedy

    hf_model, _ = tiny_llama
    ps = prompts(3, seed=5, lengths=(5, 16, 23))
    engine = make_engine(tiny_llama, "draft-layers", num_speculative_tokens=3)
    for prompt, out in zip(ps, outputs(engine, ps, GREEDY)):
        assert out == hf_greedy(hf_model, prompt, GREEDY.max_tokens)
    assert_block_pool_full(engine)


@pytest.mark.parametrize("mode", list(SPEC_MODES))
def test_greedy_equals_plain_decoding_under_preemption(tiny_llama, mode):
    ps = prompts(6, seed=2, lengths=(30, 25, 40, 12, 33, 20))
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    expected = outputs(make_engine(tiny_llama), ps, params)
    # 4 KiB a block (2 layers * K,V * 8 tokens * 2 heads * 16 dims * 4 bytes), with the draft
    # model's cache 8 KiB: 20 blocks = 160 tokens for six sequences of up to 80
    per_block = 8192 if mode == "draft-model" else 4096
    engine = make_engine(tiny_llama, mode, kv_cache_memory=str(20 * per_block), max_model_len=128)
    assert engine.pool.num_blocks == 20
    assert outputs(engine, ps, params) == expected
    assert engine.scheduler.num_preemptions > 0
    assert_block_pool_full(engine)


def test_oracle_drafts_accepted_and_rejected_runs(tiny_llama):
    """Long accepted runs and rejections at every offset: output and KV stay exact."""
    ps = prompts(5, seed=7, lengths=(4, 15, 16, 23, 9))
    expected = outputs(make_engine(tiny_llama), ps, GREEDY)
    engine = make_engine(tiny_llama, "ngram", num_speculative_tokens=5)
    engine.proposer = OracleProposer({tuple(p): e for p, e in zip(ps, expected)}, wrong_every=3)
    assert outputs(engine, ps, GREEDY) == expected
    stats = engine.stats()
    accepted = stats["spec_decode_num_accepted_tokens_total"]
    assert 0 < accepted < stats["spec_decode_num_draft_tokens_total"]
    assert_block_pool_full(engine)


def test_blocks_cached_during_speculation_hold_the_right_kv(tiny_llama):
    """A prompt reusing blocks filled by verify steps (drafts rejected in them) continues as a
    fresh engine would: only accepted tokens' blocks were registered, with their true KV."""
    ps = prompts(3, seed=8, lengths=(5, 12, 19))
    plain = make_engine(tiny_llama)
    expected = outputs(plain, ps, GREEDY)
    engine = make_engine(tiny_llama, "draft-layers")
    assert outputs(engine, ps, GREEDY) == expected
    assert (
        engine.stats()["spec_decode_num_accepted_tokens_total"]
        < (engine.stats()["spec_decode_num_draft_tokens_total"])
    )
    longer = [p + e for p, e in zip(ps, expected)]
    seqs = engine.generate(longer, GREEDY)
    assert all(s.num_cached_tokens >= 32 for s in seqs)
    assert [s.output_token_ids for s in seqs] == outputs(make_engine(tiny_llama), longer, GREEDY)
    assert_block_pool_full(engine)


@pytest.mark.parametrize("mode", ["draft-model", "draft-layers"])
def test_stops_inside_an_accepted_run(tiny_llama, mode):
    p = prompts(1, seed=4, lengths=(10,))[0]
    free_run = outputs(make_engine(tiny_llama), [p], GREEDY)[0]
    stop_at = free_run[6]
    first = free_run.index(stop_at)
    engine = make_engine(tiny_llama, mode)
    seq = engine.generate(
        [p], SamplingParams(max_tokens=40, temperature=0.0, stop_token_ids=[stop_at])
    )[0]
    assert seq.finish_reason == "stop"
    assert seq.output_token_ids == free_run[: first + 1]
    # max_tokens that is not a multiple of k + 1
    seq = engine.generate([p], SamplingParams(max_tokens=7, temperature=0.0, ignore_eos=True))[0]
    assert seq.output_token_ids == free_run[:7] and seq.finish_reason == "length"
    # eos, held back by min_tokens
    engine.eos_token_ids = engine.verifier.eos_token_ids = frozenset([stop_at])
    engine.proposer.eos_token_ids = engine.eos_token_ids
    seq = engine.generate([p], SamplingParams(max_tokens=40, temperature=0.0))[0]
    assert seq.output_token_ids == free_run[: first + 1]
    seq = engine.generate(
        [p], SamplingParams(max_tokens=40, temperature=0.0, min_tokens=first + 3)
    )[0]
    assert stop_at not in seq.output_token_ids[: first + 2]
    assert len(seq.output_token_ids) >= first + 3
    # the context length ends a run too
    short = make_engine(tiny_llama, mode, max_model_len=len(p) + 9)
    seq = short.generate([p], SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True))[0]
    assert seq.output_token_ids == free_run[:9] and seq.finish_reason == "length"
    assert_block_pool_full(engine)
    assert_block_pool_full(short)


def test_logprobs_match_plain_decoding(tiny_llama):
    ps = prompts(2, seed=9, lengths=(6, 13))
    params = SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True, logprobs=3)
    plain = make_engine(tiny_llama).generate(ps, params)
    spec = make_engine(tiny_llama, "draft-model").generate(ps, params)
    for a, b in zip(plain, spec):
        assert a.output_token_ids == b.output_token_ids
        assert a.output_logprobs == pytest.approx(b.output_logprobs, abs=1e-4)
        for top_a, top_b in zip(a.output_top_logprobs, b.output_top_logprobs):
            assert [t for t, _ in top_a] == [t for t, _ in top_b]
            assert [v for _, v in top_a] == pytest.approx([v for _, v in top_b], abs=1e-4)


def test_seeded_sampling_is_reproducible(tiny_llama):
    ps = prompts(4, seed=10)
    params = [
        SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=i, ignore_eos=True)
        for i in range(4)
    ]
    params[0] = SamplingParams(
        max_tokens=30, temperature=1.0, top_k=5, frequency_penalty=0.5, seed=7, ignore_eos=True
    )
    first = outputs(make_engine(tiny_llama, "draft-layers"), ps, params)
    again = outputs(make_engine(tiny_llama, "draft-layers"), ps, params)
    assert first == again
    assert all(len(o) == 30 for o in first)


def test_engine_sampling_distribution_equals_target(tiny_llama):
    """Tokens 1-2 of many seeded requests (token 2 from a verify step, drafted by the early-exit
    draft) against the exact joint distribution computed with transformers."""
    hf_model, _ = tiny_llama
    prompt = prompts(1, seed=11, lengths=(5,))[0]
    top_k = 3

    def top_k_probs(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            logits = hf_model(torch.tensor([ids])).logits[0, -1].double()
        cut = logits.topk(top_k).values[-1]
        return torch.softmax(logits.masked_fill(logits < cut, -math.inf), dim=-1)

    p1 = top_k_probs(prompt)
    firsts = p1.nonzero().squeeze(1).tolist()
    joint = {}
    for t1 in firsts:
        p2 = top_k_probs(prompt + [t1])
        for t2 in p2.nonzero().squeeze(1).tolist():
            joint[(t1, t2)] = float(p1[t1] * p2[t2])
    cells = list(joint)
    n = 1200
    engine = make_engine(
        tiny_llama,
        "draft-layers",
        num_speculative_tokens=1,
        max_num_seqs=n,
        kv_cache_memory="16MiB",
    )
    params = [
        SamplingParams(max_tokens=3, temperature=1.0, top_k=top_k, seed=i, ignore_eos=True)
        for i in range(n)
    ]
    counts = torch.zeros(len(cells), dtype=torch.float64)
    for out in outputs(engine, [prompt] * n, params):
        counts[cells.index((out[0], out[1]))] += 1
    stats = engine.stats()
    # every request verified a draft for token 2 (a few, prefilled in two chunks, also for token 1)
    assert n <= stats["spec_decode_num_drafts_total"] < 1.1 * n
    stat, dof = chi_square(counts, torch.tensor([joint[c] for c in cells], dtype=torch.float64))
    assert stat < CHI2_CRITICAL[dof], counts.tolist()
    assert_block_pool_full(engine)


# --- configuration -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "fields, message",
    [
        (dict(speculative="medusa"), "--speculative"),
        (dict(speculative="draft"), "exactly one"),
        (dict(speculative="draft", draft_layers=1, draft_model="x"), "exactly one"),
        (dict(speculative="ngram", num_speculative_tokens=0), "--num-speculative-tokens"),
        (dict(speculative="ngram", prompt_lookup_min=3, prompt_lookup_max=2), "prompt-lookup"),
        (dict(speculative="ngram", prompt_lookup_min=0), "prompt-lookup"),
        (dict(draft_layers=-1), "--draft-layers"),
    ],
)
def test_config_validation(fields, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(**fields).validate()


def test_draft_layers_must_leave_a_layer(tiny_llama):
    with pytest.raises(ValueError, match="less than the target's 2 layers"):
        make_engine(tiny_llama, "draft-layers", draft_layers=2)


def test_flags_and_environment(monkeypatch):
    monkeypatch.setenv("PDSERVE_SPECULATIVE", "draft")
    monkeypatch.setenv("PDSERVE_DRAFT_LAYERS", "3")
    for command in (["run-batch", "-i", "a", "-o", "b"], ["decode"], ["prefill"]):
        args = build_parser().parse_args([*command, "--num-speculative-tokens", "6"])
        config = config_from_args(args)
        assert (config.speculative, config.draft_layers) == ("draft", 3)
        assert config.num_speculative_tokens == 6 and config.draft_model is None
    args = build_parser().parse_args(
        ["decode", "--speculative", "ngram", "--prompt-lookup-min", "1", "--enforce-eager"]
    )
    config = config_from_args(args)
    assert (config.speculative, config.prompt_lookup_min, config.enforce_eager) == (
        "ngram",
        1,
        True,
    )


def test_no_drafts_while_more_sequences_run_than_the_limit(tiny_llama) -> None:
    limited = make_engine(tiny_llama, "ngram", speculative_disable_by_batch_size=2)
    assert limited.scheduler.speculative_max_batch == 2
    prompts = [[5, 6, 7, 5, 6, 7, 5, 6, 7, 5, 6] for _ in range(3)]  # the output repeats itself
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    three = [s.output_token_ids for s in limited.generate(prompts, params)]
    assert limited.stats()["spec_decode_num_drafts_total"] == 0  # 3 running > 2
    two = limited.generate(prompts[:2], params)
    assert limited.stats()["spec_decode_num_drafts_total"] > 0
    assert [s.output_token_ids for s in two] == three[:2]
    assert limited.pool.num_free == limited.pool.num_blocks
    # The CPU default is 2; a GPU's is no limit.
    assert make_engine(tiny_llama, "ngram").scheduler.speculative_max_batch == 0  # set to 0 above
    hf_model, _ = tiny_llama
    auto = Engine(
        EngineConfig(model="tiny", dtype="float32", kv_cache_memory="8MiB", speculative="ngram"),
        hf_model.config,
        hf_model.state_dict().items(),
    )
    assert auto.scheduler.speculative_max_batch == 2


def test_governor_pauses_drafting_that_loses_and_keeps_drafting_that_wins() -> None:
    gov = SpeculationGovernor(pause_steps=10, probe_steps=2, min_steps=3, alpha=1.0, margin=1.1)
    # No plain measurement yet: after min_steps drafting steps, a short probe without drafts.
    for _ in range(3):
        assert gov.allow(1)
        gov.record(1, True, 0.030, 3)  # 10 ms a token
    assert [gov.allow(1) for _ in range(3)] == [False, False, True]
    gov.record(1, False, 0.025, 1)  # plain: 25 ms a token, so drafting wins
    for _ in range(5):
        gov.record(1, True, 0.030, 3)
        assert gov.allow(1)
    assert gov.num_pauses == 0
    # At batch size 2 drafting is slower: it pauses, and longer after each loss in a row.
    gov.record(2, False, 0.040, 2)  # 20 ms a token
    for _ in range(3):
        gov.record(2, True, 0.050, 2)  # 25 ms a token
    assert gov.num_pauses == 1
    assert sum(not gov.allow(2) for _ in range(30)) == 10
    for _ in range(3):
        gov.record(2, True, 0.050, 2)
    assert sum(not gov.allow(2) for _ in range(30)) == 20
    assert gov.allow(1)  # batch size 1 is unaffected
    # Within the margin (5% slower): noise, not a loss.
    gov.record(3, False, 0.060, 3)
    for _ in range(6):
        gov.record(3, True, 0.063, 3)
        assert gov.allow(3)


def test_shadow_drafts_score_what_drafting_would_have_gained() -> None:
    drafts = iter([[5, 6, 7], [8, 9], [1]])
    shadow = ShadowDrafts(lambda token_ids: next(drafts, []))
    assert shadow.observe("a", [4], [3, 4], False) == []  # no draft yet: one is made from here
    assert shadow.observe("a", [5], [3, 4, 5], False) == []
    assert shadow.observe("a", [6], [3, 4, 5, 6], False) == []
    assert shadow.observe("a", [0], [3, 4, 5, 6, 0], False) == [3]  # 2 came true, then a miss
    assert shadow.observe("a", [8], [3, 4, 5, 6, 0, 8], False) == []
    assert shadow.observe("a", [9], [3, 4, 5, 6, 0, 8, 9], False) == [3]  # all of it came true
    assert shadow.observe("a", [2], [3, 4, 5, 6, 0, 8, 9, 2], True) == [1]  # missed at once
    assert shadow.pending == {}  # finished: no fresh draft


def test_governor_resumes_a_pause_when_shadow_drafts_would_pay() -> None:
    gov = SpeculationGovernor(pause_steps=100, min_steps=3, alpha=1.0, margin=1.1, min_shadows=3)
    gov.record(1, False, 0.010, 1)  # plain: 10 ms a token
    for _ in range(3):
        gov.record(1, True, 0.015, 1)  # drafts rejected: 15 ms a token
    assert gov.num_pauses == 1 and gov.paused(1)
    gov.shadow(1, 1)  # nothing would have come true: stays paused
    gov.shadow(1, 1)
    gov.shadow(1, 1)
    assert gov.paused(1) and gov.num_resumes == 0
    for _ in range(4):  # now the model copies: 4 tokens a 15 ms verify step, 3.75 ms a token
        gov.shadow(1, 4)
    assert not gov.paused(1) and gov.num_resumes == 1 and gov.allow(1)
    gov.shadow(2, 5)  # a batch size never paused: nothing to resume
    assert gov.num_resumes == 1


def test_adaptive_ngram_drafting_comes_back_when_the_model_starts_copying(tiny_llama) -> None:
    """A pause taken while drafts missed ends within a few steps once n-gram drafts would come
    true (shadow drafts), not after the pause's 64 steps; the output is plain decoding's. The
    model is made to repeat itself (logit_bias +100 on one token: greedy picks it every step)."""
    engine = make_engine(tiny_llama, "ngram", speculative_adaptive=True)
    prompt = repetitive(5)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True, logit_bias={42: 100})
    gov = engine.governor
    gov.record(1, False, 1e-3, 1)  # as if drafting had just lost at batch 1: paused 64 steps
    gov._pace[1].paused, gov._pace[1].step = 64, 1e-3
    (seq,) = engine.generate([prompt], params)
    assert seq.output_token_ids == [42] * 48
    assert gov.num_resumes >= 1 and engine.num_accepted_tokens > 0
    assert engine.num_steps < 48  # plain decoding takes 49 (the prompt, then 48 tokens)
    assert_block_pool_full(engine)


def test_governor_drafts_as_many_tokens_as_pay_by_measurement() -> None:
    """draft_limit: k until a draft's added cost and each position's acceptance are measured,
    then the count with the most expected tokens per unit of step time, and k again every
    FULL_EVERY-th call (deeper positions keep being measured)."""
    k = 4
    gov = SpeculationGovernor(alpha=1.0)
    assert gov.draft_limit(1, k) == k  # nothing measured
    gov.record(1, False, 0.010, 1)  # plain step: 10 ms
    gov.record(1, True, 0.030, 3, drafts=4.0)  # 4 drafts cost 20 ms more: 0.5 a draft
    assert gov.draft_limit(1, k) == k  # acceptance not measured yet
    # the first draft always comes true, the second half the time, the third never
    for i in range(40):
        gov.verified(4, 2 if i % 2 else 1)
    assert 0.99 < gov._accepted[0] / gov._offered[0] and gov._accepted[2] == 0.0
    # gains per step time: d=1: 2 / 1.5 = 1.33; d=2: 2.5 / 2 = 1.25; d=3: 2.5 / 2.5 = 1.0
    choices = [gov.draft_limit(1, k) for _ in range(governor_mod.FULL_EVERY)]
    assert choices == [1] * (governor_mod.FULL_EVERY - 1) + [k]
    # cheaper drafts (0.1 a plain step each): two pay, a third (never accepted) does not
    gov.record(1, True, 0.014, 3, drafts=4.0)
    assert gov.draft_limit(1, k) == 2
    assert gov.draft_limit(2, k) == k  # batch size 2: its draft cost is not measured
    gov.verified(0, 0)  # nothing verified: nothing counted
    assert len(gov._offered) == 4


def test_the_engine_drafts_no_more_than_the_governor_allows(tiny_llama) -> None:
    """With the governor's limit at 1 every drafting step reserves room for, and verifies, at
    most one draft a sequence instead of k = 4 (logit_bias makes greedy repeat one token, which
    n-gram lookup drafts); the output is plain decoding's."""
    prompt = repetitive(5)
    params = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True, logit_bias={42: 100})
    (plain,) = make_engine(tiny_llama).generate([prompt], params)
    engine = make_engine(
        tiny_llama, "ngram", speculative_adaptive=True, num_speculative_tokens=4
    )
    engine.governor.min_steps = 1000  # never paused here: the limit alone is under test
    engine.governor.draft_limit = lambda batch_size, k: 1
    seen: list[int] = []
    propose = engine.proposer.propose

    def spy(items: list[ScheduledSeq]) -> None:
        assert all(item.num_lookahead_tokens == 1 for item in items)
        propose(items)
        seen.extend(len(item.draft_token_ids) for item in items)

    engine.proposer.propose = spy
    (seq,) = engine.generate([prompt], params)
    assert seq.output_token_ids == plain.output_token_ids == [42] * 32
    assert seen and max(seen) == 1 and engine.num_accepted_tokens > 0
    # what the choice is made from was measured in the engine: a draft's added cost (plain
    # and drafting steps both ran) and the first position's acceptance
    assert engine.governor._pace[1].row_cost is not None
    assert engine.governor._accepted[0] > 0 and len(engine.governor._offered) == 1
    assert engine.pool.num_free == engine.pool.num_blocks


def test_adaptive_engine_stops_a_slow_proposer_and_keeps_the_output(tiny_llama) -> None:
    class SlowProposer:
        """Drafts nothing useful, slowly: drafting can only lose."""

        def __init__(self) -> None:
            self.calls = 0

        def propose(self, items: list[ScheduledSeq]) -> None:
            self.calls += 1
            time.sleep(0.02)
            for item in items:
                item.draft_token_ids = [0] * item.num_lookahead_tokens

    prompts = [[5, 9, 13, 2, 7], [3, 3, 8]]
    params = SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True)
    plain = [s.output_token_ids for s in make_engine(tiny_llama).generate(prompts, params)]
    engine = make_engine(tiny_llama, "ngram", speculative_adaptive=True)
    engine.governor.min_steps = 4
    engine.proposer = proposer = SlowProposer()
    out = [s.output_token_ids for s in engine.generate(prompts, params)]
    assert out == plain
    assert engine.governor.num_pauses >= 1
    assert proposer.calls < 40  # most of the ~60 steps ran without drafting
    assert engine.pool.num_free == engine.pool.num_blocks


@pytest.mark.parametrize("mode", [None, "ngram"])
def test_logit_bias_matches_transformers(tiny_llama, mode) -> None:
    """logit_bias against HF generate's sequence_bias (the same addition to the logits), with and
    without speculation; +100 makes greedy pick one token every step."""
    hf_model, _ = tiny_llama
    engine = make_engine(tiny_llama, mode)
    prompt = repetitive(5)
    bias = {17: 4.0, 90: -3.0, 91: 2.5}
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True, logit_bias=bias)
    (seq,) = engine.generate([prompt], params)
    ids = torch.tensor([prompt])
    reference = hf_model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=24, do_sample=False,
        eos_token_id=None, pad_token_id=0, sequence_bias={(t,): b for t, b in bias.items()},
    )[0, len(prompt) :].tolist()  # fmt: skip
    assert seq.output_token_ids == reference
    unbiased = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    assert engine.generate([prompt], unbiased)[0].output_token_ids != reference  # it mattered
    forced = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, logit_bias={42: 100})
    assert engine.generate([prompt], forced)[0].output_token_ids == [42] * 8
    outside = SamplingParams(max_tokens=4, logit_bias={engine.vocab_size: 1.0})
    with pytest.raises(ValueError, match="logit_bias token ids must be in"):
        engine.add_request("outside", prompt, outside)  # a worker refuses what no router sends


def test_verify_steps_are_not_prompt_steps_of_the_prefill_chunk_fit(tiny_llama):
    """A verify step's drafts ride along like decode rows: only the prompt's own steps reach the
    prefill-chunk fit (counted as prompt tokens, a run of verify steps of k + 1 tokens fitted a
    16-token chunk that then cut the next prompt into pieces)."""
    engine = make_engine(tiny_llama, "ngram")
    engine.generate([repetitive(seed) for seed in range(3)], GREEDY)
    costs = engine.prefill_budget.costs
    assert engine.proposer is not None and engine.num_steps > 3
    # the three prompts in one step (a process's first prompt steps count as its warm-up, not
    # fitted); every later step verified
    assert costs.warmup_steps + costs.prefill_steps == 1
    assert costs.decode_steps == engine.num_steps - 1


def test_greedy_verify_takes_the_raw_argmax_and_keeps_the_output(tiny_llama, monkeypatch):
    """All-greedy verify steps with nothing to apply pick the raw logits' argmax (no float32
    copy through process_logits), with plain decoding's output; a logit bias takes the full
    path again."""
    from common.engine.sampler import Sampler

    calls = {"process": 0, "fast": 0}
    process, fast = Sampler.process_logits, Sampler.greedy_picks

    def counted_process(self, logits, states):
        calls["process"] += 1
        return process(self, logits, states)

    def counted_fast(self, logits, states):
        picks = fast(self, logits, states)
        calls["fast"] += picks is not None
        return picks

    monkeypatch.setattr(Sampler, "process_logits", counted_process)
    monkeypatch.setattr(Sampler, "greedy_picks", counted_fast)
    ps = [repetitive(seed) for seed in range(3)]
    plain = outputs(make_plain_engine(tiny_llama[0]), ps, GREEDY)
    engine = make_engine(tiny_llama, "ngram")
    assert outputs(engine, ps, GREEDY) == plain
    assert calls["fast"] > 0 and calls["process"] == 0
    # +100 on one token: the output repeats it, so prompt lookup drafts it from the output
    forced = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logit_bias={42: 100})
    assert outputs(engine, ps[:1], forced) == [[42] * 12]
    assert calls["process"] > 0


def test_warm_up_builds_a_draft_models_padded_matmuls(tiny_llama, monkeypatch):
    """A separate draft model prefills the prompts too, so its oneDNN matmuls are built at the
    same padded row counts as the target's before a request meets them."""
    from common.model.llama import PAD_ROWS

    engine = make_engine(tiny_llama, "draft-model", max_num_batched_tokens=600)
    seen: list[int] = []
    qkv = engine.runner.draft_model.layers[0].self_attn.qkv_proj
    forward = qkv.forward
    monkeypatch.setattr(qkv, "forward", lambda x: seen.append(x.shape[0]) or forward(x))
    engine.warm_up()
    want = list(range(288, 608 + 1, PAD_ROWS))
    assert [n for n in seen if n > 256][-len(want) :] == want
