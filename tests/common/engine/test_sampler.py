"""Tests for common/engine/sampler.py: greedy, logprobs, seeds, truncation, temperature,
penalties."""

from __future__ import annotations

import math

import pytest
import torch

from common.engine import penalties
from common.engine import sampler as sampler_module
from common.engine.sampler import Sampler, SampleResult, SamplingState, make_generator
from common.engine.sequence import SequenceState
from common.sampling_params import SamplingParams

# Chi-square critical value for 7 degrees of freedom at p = 1e-4 (V = 8 tokens): a correct sampler
# fails a fixed-seed test with probability 1e-4; a wrong one (checked below) exceeds it by far.
CHI2_DF7_P1E4 = 29.88


def state(params: SamplingParams, prompt=(0,), output=(), eos=()) -> SamplingState:
    gen = make_generator(params)
    return SamplingState.from_tokens(params, list(prompt), list(output), gen, frozenset(eos))


def tokens(results: list[SampleResult]) -> list[int]:
    return [r.token_id for r in results]


def counts_of(token_ids: list[int], vocab: int) -> torch.Tensor:
    return torch.bincount(torch.tensor(token_ids), minlength=vocab).double()


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.fixture
def logits() -> torch.Tensor:
    return torch.randn(6, 50, generator=torch.Generator().manual_seed(0)) * 3


# ---- greedy and logprobs -------------------------------------------------------------------------


def test_greedy_equals_argmax(logits):
    states = [state(SamplingParams(temperature=0.0)) for _ in range(len(logits))]
    assert tokens(Sampler()(logits, states)) == logits.argmax(-1).tolist()
    bf16 = logits.bfloat16()
    assert tokens(Sampler()(bf16, states)) == bf16.float().argmax(-1).tolist()


def test_greedy_rows_in_a_mixed_batch_are_argmax(logits):
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.7, seed=3),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=1.0, top_p=0.5),
    ]
    got = tokens(Sampler()(logits, [state(p) for p in params]))
    for i, p in enumerate(params):
        if p.greedy:
            assert got[i] == int(logits[i].argmax())


def test_logprobs_are_raw_log_softmax(logits):
    params = [
        SamplingParams(temperature=0.0, logprobs=0),
        SamplingParams(temperature=0.8, logprobs=5, repetition_penalty=1.5),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0, logprobs=3, presence_penalty=2.0),
        SamplingParams(temperature=1.3, logprobs=20, top_k=4, seed=1),
        SamplingParams(temperature=0.5, logprobs=1, min_p=0.1, min_tokens=2),
    ]
    states = [state(p, prompt=[1, 2, 3], output=[4, 4], eos=[7]) for p in params]
    results = Sampler()(logits.bfloat16(), states)
    raw = torch.log_softmax(logits.bfloat16().float(), dim=-1)
    for i, (p, r) in enumerate(zip(params, results)):
        if p.logprobs is None:
            assert r.logprob is None and r.top_logprobs is None
            continue
        assert r.logprob == pytest.approx(float(raw[i, r.token_id]), abs=1e-5)
        assert len(r.top_logprobs) == p.logprobs
        best = raw[i].topk(p.logprobs)
        assert [t for t, _ in r.top_logprobs] == best.indices.tolist()
        assert [v for _, v in r.top_logprobs] == pytest.approx(best.values.tolist(), abs=1e-5)
        values = [v for _, v in r.top_logprobs]
        assert values == sorted(values, reverse=True)
    assert results[0].top_logprobs == []


def test_input_logits_are_not_modified(logits):
    before = logits.clone()
    params = SamplingParams(
        temperature=0.9, top_k=5, top_p=0.8, min_p=0.05, repetition_penalty=1.3,
        frequency_penalty=0.5, presence_penalty=0.5, min_tokens=4, logprobs=2,
    )  # fmt: skip
    Sampler()(logits, [state(params, prompt=[1, 2], output=[3], eos=[0])] * len(logits))
    assert torch.equal(logits, before)


# ---- seeds ---------------------------------------------------------------------------------------


def run_steps(sampler: Sampler, step_logits: list[torch.Tensor], st: SamplingState, row: int,
              others: list[SamplingState]) -> list[int]:  # fmt: skip
    """Decode len(step_logits) steps for `st` placed at `row` among `others`."""
    out = []
    for lg in step_logits:
        batch = others[:row] + [st] + others[row:]
        out.append(sampler(lg[: len(batch)], batch)[row].token_id)
        st.num_output_tokens += 1
        if st.history is not None:
            st.history.extend(out[-1:])
    return out


def test_same_seed_same_tokens_across_calls():
    g = torch.Generator().manual_seed(1)
    step_logits = [torch.randn(1, 1000, generator=g) for _ in range(12)]
    params = SamplingParams(temperature=1.0, seed=1234, top_p=0.95)
    first = run_steps(Sampler(), step_logits, state(params), 0, [])
    again = run_steps(Sampler(), step_logits, state(params), 0, [])
    other_seed = run_steps(Sampler(), step_logits, state(SamplingParams(seed=99)), 0, [])
    assert first == again
    assert first != other_seed


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.8, seed=7, top_p=0.9, min_p=0.01),
        SamplingParams(temperature=1.2, seed=8, top_k=200, top_p=0.8, presence_penalty=0.5),
    ],
)
def test_seeded_tokens_do_not_depend_on_the_batch(params):
    g = torch.Generator().manual_seed(2)
    step_logits = [torch.randn(5, 1000, generator=g) for _ in range(10)]
    alone = run_steps(Sampler(), [lg[2:3] for lg in step_logits], state(params), 0, [])
    others = [
        state(SamplingParams(temperature=1.0)),
        state(SamplingParams(temperature=0.0)),
        state(SamplingParams(temperature=1.5, seed=8, top_p=0.9)),
        state(SamplingParams(temperature=0.7, repetition_penalty=1.2, logprobs=3)),
    ]
    torch.manual_seed(0)  # the unseeded rows' draws must not leak into the seeded row
    in_batch = run_steps(Sampler(), step_logits, state(params), 2, others)
    assert alone == in_batch


# ---- truncation: top-k, top-p, min-p -------------------------------------------------------------

# Token probabilities 0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02 (sum 1).
CRAFTED = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.02]).log()


def draw(params: SamplingParams, n: int = 4000, logits: torch.Tensor = CRAFTED) -> set[int]:
    torch.manual_seed(0)
    batch = logits.expand(n, -1)
    return set(tokens(Sampler()(batch, [state(params)] * n)))


@pytest.mark.parametrize(
    "params, allowed",
    [
        (SamplingParams(top_k=1), {0}),
        (SamplingParams(top_k=3), {0, 1, 2}),
        (SamplingParams(top_p=0.6), {0, 1}),  # 0.4 < 0.6 <= 0.65
        (SamplingParams(top_p=0.7), {0, 1, 2}),  # 0.65 < 0.7 <= 0.8
        (SamplingParams(top_p=0.01), {0}),  # the best token always stays
        (SamplingParams(min_p=0.3), {0, 1, 2}),  # 0.15 >= 0.12 > 0.1
        (SamplingParams(min_p=0.7), {0}),
        # Top-4 mass is 0.9, renormalized: 0.65 / 0.9 < 0.85 <= 0.8 / 0.9.
        (SamplingParams(top_k=4, top_p=0.85), {0, 1, 2}),
        (SamplingParams(top_p=0.92, min_p=0.3), {0, 1, 2}),
        (SamplingParams(temperature=5.0, top_k=5, top_p=0.99), {0, 1, 2, 3, 4}),
    ],
)
def test_truncation_never_emits_excluded_tokens(params, allowed):
    assert draw(params) == allowed  # nothing outside, and (4000 draws) everything inside appears


def test_truncation_also_holds_for_seeded_rows():
    n = 300
    states = [state(SamplingParams(top_p=0.7, seed=s)) for s in range(n)]
    got = set(tokens(Sampler()(CRAFTED.expand(n, -1), states)))
    assert got == {0, 1, 2}


def test_top_p_sort_fallback_matches_candidate_path(monkeypatch):
    """Rows whose nucleus is wider than TOP_P_CANDIDATES take the full-sort path: same cutoff."""
    logits = torch.randn(8, 300, generator=torch.Generator().manual_seed(3))
    params = [SamplingParams(top_p=p) for p in (0.1, 0.3, 0.5, 0.7, 0.9, 0.95, 0.99, 0.999)]
    wide = sampler_module._truncation_cutoffs(logits, params, torch.empty_like(logits))
    monkeypatch.setattr(sampler_module, "TOP_P_CANDIDATES", 8)
    narrow = sampler_module._truncation_cutoffs(logits, params, torch.empty_like(logits))
    assert torch.equal(wide, narrow)
    # And the cutoff is the smallest set reaching top_p, by a plain sort.
    probs = logits.softmax(-1).sort(-1, descending=True).values.double()
    for i, p in enumerate(params):
        kept = int((logits[i] >= wide[i]).sum())
        assert probs[i, :kept].sum() >= p.top_p - 1e-6
        assert probs[i, : kept - 1].sum() < p.top_p + 1e-6


# ---- temperature: the sampled distribution is softmax(logits / T) --------------------------------

TEMP_LOGITS = torch.tensor([1.0, 0.8, 0.5, 0.3, 0.0, -0.2, -0.5, -0.8])


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_sampling_matches_softmax(temperature):
    n = 20000
    torch.manual_seed(1234)
    params = SamplingParams(temperature=temperature)
    results = Sampler()(TEMP_LOGITS.expand(n, -1), [state(params)] * n)
    counts = counts_of(tokens(results), 8)
    assert chi_square(counts, (TEMP_LOGITS / temperature).softmax(-1)) < CHI2_DF7_P1E4
    # The test has power: the untempered distribution is rejected (T = 1 has nothing to compare).
    if temperature != 1.0:
        assert chi_square(counts, TEMP_LOGITS.softmax(-1)) > 10 * CHI2_DF7_P1E4


def test_seeded_sampling_matches_softmax():
    n = 20000
    states = [state(SamplingParams(temperature=0.7, seed=s)) for s in range(n)]
    counts = counts_of(tokens(Sampler()(TEMP_LOGITS.expand(n, -1), states)), 8)
    assert chi_square(counts, (TEMP_LOGITS / 0.7).softmax(-1)) < CHI2_DF7_P1E4


# ---- penalties and min_tokens --------------------------------------------------------------------


def test_penalties_match_hand_computation():
    logits = torch.tensor(
        [
            [2.0, -1.0, 0.5, 3.0, -2.0, 1.0],
            [2.0, -1.0, 0.5, 3.0, -2.0, 1.0],
            [2.0, -1.0, 0.5, 3.0, -2.0, 1.0],
        ]
    )
    states = [
        # Prompt {0, 1}, output 3, 3, 4: repetition over {0, 1, 3, 4}; counts 3 -> 2, 4 -> 1.
        state(
            SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
            prompt=[0, 1, 0],
            output=[3, 3, 4],
        ),
        state(SamplingParams(), prompt=[0, 1], output=[3, 3, 4]),  # no penalties: untouched
        state(SamplingParams(frequency_penalty=-1.0), prompt=[2], output=[5, 5, 5]),
    ]
    x = logits.clone()
    penalties.apply_penalties(x, states)
    expected = torch.tensor(
        [
            # 2/2, -1*2, untouched, 3/2 - 2*0.5 - 0.25, -2*2 - 0.5 - 0.25, untouched
            [1.0, -2.0, 0.5, 0.25, -4.75, 1.0],
            [2.0, -1.0, 0.5, 3.0, -2.0, 1.0],
            [2.0, -1.0, 0.5, 3.0, -2.0, 4.0],  # 1 + 3 * 1.0
        ]
    )
    assert torch.allclose(x, expected)


def test_penalties_steer_greedy_choice():
    logits = torch.tensor([[1.0, 3.0, 2.5, 0.0]])
    plain = Sampler()(logits, [state(SamplingParams(temperature=0.0), output=[1])])
    assert plain[0].token_id == 1
    for params in (
        SamplingParams(temperature=0.0, repetition_penalty=1.5),  # 3 / 1.5 = 2 < 2.5
        SamplingParams(temperature=0.0, frequency_penalty=1.0),  # 3 - 1 = 2 < 2.5
        SamplingParams(temperature=0.0, presence_penalty=1.0),
    ):
        assert Sampler()(logits, [state(params, output=[1])])[0].token_id == 2


def test_min_tokens_blocks_eos_and_stop_ids():
    logits = torch.tensor([[0.0, 1.0, 0.0, 0.0, 4.0, 5.0]])  # eos 5 best, stop id 4 second
    eos = [5]

    def pick(params: SamplingParams, n_out: int) -> int:
        st = state(params, output=[2] * n_out, eos=eos)
        return Sampler()(logits, [st])[0].token_id

    greedy = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[4])
    assert pick(greedy, 2) == 1
    assert pick(greedy, 3) == 5
    # With ignore_eos, eos is no stop, so (as in vLLM) only the stop ids are held back.
    ignoring = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[4], ignore_eos=True)
    assert pick(ignoring, 2) == 5
    sampled = SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[4], seed=0)
    n = 2000
    torch.manual_seed(0)
    below = Sampler()(logits.expand(n, -1), [state(sampled, output=[2, 2], eos=eos)] * n)
    assert not {4, 5} & set(tokens(below))
    reached = Sampler()(logits.expand(n, -1), [state(sampled, output=[2] * 3, eos=eos)] * n)
    assert {4, 5} <= set(tokens(reached))


def test_empty_output_and_large_vocab_smoke():
    """A realistic shape: 16 rows over a 32k vocab, every knob, results well-formed."""
    logits = torch.randn(16, 32000, generator=torch.Generator().manual_seed(5)) * 4
    params = SamplingParams(
        temperature=0.7, top_k=40, top_p=0.9, min_p=0.02, repetition_penalty=1.1, logprobs=2,
        frequency_penalty=0.2, presence_penalty=0.1, seed=11,
    )  # fmt: skip
    results = Sampler()(logits, [state(params, prompt=[1, 2, 3]) for _ in range(16)])
    assert all(0 <= r.token_id < 32000 and math.isfinite(r.logprob) for r in results)
    assert all(len(r.top_logprobs) == 2 for r in results)


# ---- per-step cost: sampling states independent of the context, penalty history incremental ----


class CountingList(list):
    """A token list that counts the elements any slice or iteration copies out of it."""

    copied = 0

    def __getitem__(self, index):
        item = super().__getitem__(index)
        if isinstance(index, slice):
            CountingList.copied += len(item)
        return item

    def __iter__(self):
        CountingList.copied += len(self)
        return super().__iter__()


def reference_penalties(x: torch.Tensor, rows: list[tuple[SamplingParams, list, list]]) -> None:
    """The penalty pass as it was before token histories: every token, every step."""
    for i, (p, prompt, output) in enumerate(rows):
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(prompt + output)), dtype=torch.long)
            vals = x[i, seen]
            x[i, seen] = torch.where(
                vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
            )
        if output:
            ids = torch.tensor(output, dtype=torch.long)
            distinct = torch.tensor(sorted(set(output)), dtype=torch.long)
            x[i, distinct] -= p.presence_penalty
            x[i].index_add_(0, ids, torch.full((len(output),), -p.frequency_penalty))


PENALTY_PARAMS = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, repetition_penalty=1.3),
    SamplingParams(temperature=0.0, frequency_penalty=0.7, presence_penalty=-0.4),
    SamplingParams(temperature=0.9, seed=5, repetition_penalty=0.8, frequency_penalty=-0.3),
    SamplingParams(temperature=1.1, seed=6, presence_penalty=1.5, min_tokens=3),
]


def test_incremental_history_samples_what_a_full_recount_does():
    """Engine-style states (one SequenceState each, history synced step by step, drafts on top)
    give the tokens and processed logits of states rebuilt from every token at every step."""
    vocab, steps = 64, 40
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (5, 9, 1, 17, 30)]
    seqs = [
        SequenceState(f"s{i}", list(p), len(p), params, make_generator(params))
        for i, (p, params) in enumerate(zip(prompts, PENALTY_PARAMS))
    ]
    fresh_gens = [make_generator(p) for p in PENALTY_PARAMS]
    eos = frozenset([0])
    incremental, recount = Sampler(), Sampler()
    for step in range(steps):
        logits = torch.randn(len(seqs), vocab, generator=g) * 2
        drafts = [] if step % 3 else [7, 7, 8]  # every third step, states after three drafts
        new = [s.sampling_state(eos, drafts) for s in seqs]
        old = [
            SamplingState.from_tokens(
                s.params, s.prompt_token_ids, s.output_token_ids + drafts, s.generator, eos
            )
            for s in seqs
        ]
        torch.testing.assert_close(
            incremental.process_logits(logits, new), recount.process_logits(logits, old)
        )
        ref = logits.clone()
        reference_penalties(
            ref, [(s.params, s.prompt_token_ids, s.output_token_ids + drafts) for s in seqs]
        )
        got = logits.clone()
        penalties.apply_penalties(got, new)
        torch.testing.assert_close(got, ref)
        # sample with the new states, and with recounted states on twin generators
        twins = [
            SamplingState.from_tokens(s.params, s.prompt_token_ids, s.output_token_ids, gen, eos)
            for s, gen in zip(seqs, fresh_gens)
        ]
        picked = tokens(incremental(logits, [s.sampling_state(eos) for s in seqs]))
        assert picked == tokens(recount(logits, twins))
        for s, t in zip(seqs, picked):
            s.token_ids.append(t)


def test_sampling_state_cost_does_not_grow_with_the_context():
    def copied_per_step(num_tokens: int, params: SamplingParams) -> float:
        s = SequenceState("s", CountingList(range(num_tokens)), num_tokens, params)
        s.sampling_state(frozenset())  # the first call may read the prompt (once)
        CountingList.copied = 0
        for t in range(20):
            s.token_ids.append(t)
            state = s.sampling_state(frozenset(), [1, 2])
            assert state.num_output_tokens == t + 1 + 2
        return CountingList.copied / 20

    plain = SamplingParams(temperature=0.0)
    assert copied_per_step(10, plain) == copied_per_step(50_000, plain) == 0
    penalized = SamplingParams(temperature=0.0, frequency_penalty=0.5)
    assert copied_per_step(10, penalized) == copied_per_step(50_000, penalized) == 1  # the new one


# ---- logit_bias ----------------------------------------------------------------------------------


def test_logit_bias_is_added_before_greedy_and_random_choice(logits):
    low = logits.argmin(-1).tolist()
    biased = [SamplingParams(temperature=0.0, logit_bias={low[i]: 100.0}) for i in range(3)]
    plain = [SamplingParams(temperature=0.0, logprobs=0)] * 3
    results = Sampler()(logits, [state(p) for p in biased + plain])
    assert tokens(results)[:3] == low[:3]  # +100 makes greedy pick the worst token
    assert tokens(results)[3:] == logits[3:].argmax(-1).tolist()  # rows without a bias: as before
    # -100 bans the best token: greedy takes the next best, as logits + bias says.
    best = logits.argmax(-1).tolist()
    banned = [SamplingParams(temperature=0.0, logit_bias={best[i]: -100.0}) for i in range(6)]
    reference = logits.clone()
    reference[range(6), best] -= 100.0
    assert tokens(Sampler()(logits, [state(p) for p in banned])) == reference.argmax(-1).tolist()
    # Random rows never draw a banned token; logprobs stay the model's own (raw logits).
    n = 2000
    params = SamplingParams(temperature=1.0, seed=3, logprobs=0, logit_bias={0: -100.0, 1: -100.0})
    flat = torch.zeros(1, 4).expand(n, -1)
    results = Sampler()(flat, [state(params)] * n)
    assert set(tokens(results)) == {2, 3}
    assert all(math.isclose(r.logprob, math.log(0.25), rel_tol=1e-5) for r in results)


def test_logit_bias_applies_under_a_grammar_and_in_process_logits(logits):
    # A grammar's refusal wins over any bias; among allowed tokens the bias decides.
    allowed = [4, 9, 30]
    mask = torch.zeros(2, dtype=torch.int32)
    for t in allowed:
        mask[t // 32] |= 1 << (t % 32)
    for bias, expected in [({0: 100.0}, None), ({9: 100.0}, 9), ({30: 100.0, 0: 50.0}, 30)]:
        st = state(SamplingParams(temperature=0.0, logit_bias=bias))
        st.token_bitmask = mask
        token = tokens(Sampler()(logits[:1], [st]))[0]
        assert token in allowed and (expected is None or token == expected)
    # Speculative decoding verifies against process_logits: the bias is in its scores too.
    bias = {5: 7.5, 6: -2.0}
    scores = Sampler().process_logits(
        logits, [state(SamplingParams(temperature=0.0, logit_bias=bias))] * 6
    )
    reference = logits.clone()
    reference[:, 5] += 7.5
    reference[:, 6] -= 2.0
    torch.testing.assert_close(scores, reference)
