"""common/engine/step_budget.py and the scheduler's prompt-token budget.

The fit recovers known step costs; the chunk follows from them (fixed share <= SLACK); the
scheduler never computes more prompt tokens per step than the budget while decode rows are
never held back by it; under a burst, prompts then finish one after another in arrival order,
and greedy output through an engine is the same with any chunk.
"""

from __future__ import annotations

import math
import random

import pytest

from common.engine.step_budget import (
    MAX_STEP_S,
    MIN_CHUNK,
    MIN_STEPS,
    SLACK,
    PrefillBudget,
    StepCosts,
)
from tests.common.engine.test_engine import GREEDY, hf_greedy, make_engine, prompts
from tests.common.engine.test_scheduler import books, compute, make, seq

ROWS = 8  # decode rows riding along in each prompt step (the running batch, slow to change)


def synthetic_costs(fixed: float, per_token: float, per_row: float, steps: int = 80) -> StepCosts:
    """Prompt steps of varied sizes and decode-only steps, timed exactly by the linear model."""
    costs = StepCosts()
    rng = random.Random(0)
    for i in range(steps):
        prompt = 0 if i % 2 else rng.randint(1, 512)
        rows = rng.randint(1, 32) if prompt == 0 else ROWS
        costs.record(prompt, rows, fixed + per_token * prompt + per_row * rows)
    return costs


def test_the_fit_recovers_a_prompt_steps_costs():
    fixed, per_token = synthetic_costs(0.010, 0.0018, 0.0003).fit()
    assert fixed == pytest.approx(0.010 + 0.0003 * ROWS, rel=1e-6)  # its decode rows included
    assert per_token == pytest.approx(0.0018, rel=1e-6)


def test_no_fit_until_prompt_steps_of_varied_sizes_were_seen():
    costs = StepCosts()
    for _ in range(50):
        costs.record(100, 0, 0.2)  # prompt steps of one size only: fixed and per-token mixed up
    for _ in range(MIN_STEPS):
        costs.record(0, 4, 0.011)  # decode-only steps say nothing about prompt tokens
    assert costs.fit() is None and costs.prefill_token_s() is None
    for p in range(1, MIN_STEPS + 1):
        costs.record(20 * p, 0, 0.1 + 0.001 * 20 * p)
    assert costs.fit() is not None


def test_a_prefill_only_worker_fits_from_its_varied_chunks():
    costs = StepCosts()
    rng = random.Random(1)
    for _ in range(60):  # chunks of 256 and prompt tails of any length; never a decode row
        p = rng.choice([256, 256, rng.randint(1, 255)])
        costs.record(p, 0, 0.012 + 0.0015 * p)
    fixed, per_token = costs.fit()
    assert fixed == pytest.approx(0.012, rel=1e-6) and per_token == pytest.approx(0.0015, rel=1e-6)
    assert PrefillBudget(2048, None, costs).tokens() in (80, 81)  # 0.012 / 0.00015, rounded up


def test_the_chunk_is_where_the_fixed_cost_is_a_slack_share():
    budget = PrefillBudget(2048, None, synthetic_costs(0.010, 0.0018, 0.0003))
    chunk = budget.tokens()
    fixed = 0.010 + 0.0003 * ROWS
    assert chunk == math.ceil(fixed / (SLACK * 0.0018))  # 69 tokens
    per_token = (fixed + 0.0018 * chunk) / chunk
    assert per_token <= (1 + SLACK) * 0.0018 * (1 + 1e-6)
    assert f"prefill chunk {chunk} tokens (measured)" in budget.describe()


def test_a_step_holds_at_most_max_step_s_of_prompt_work():
    """Steps the linear fit reads as a large fixed part (a few tokens after a long cached
    prefix, ~100 ms of attention on one core, beside whole 1,500-token prompts; measured on
    benchmarks/kv_cluster.py's workload): the slack rule alone would take most of a prompt in one
    step; the chunk is held to MAX_STEP_S at the measured seconds per prompt token."""
    costs = StepCosts()
    for i in range(40):
        p = 1524 if i % 3 == 0 else 36
        costs.record(p, 1, 0.105 + 0.00076 * p + (0.25 if p > 1000 else 0.0))
    fixed, per_token = costs.fit()
    assert fixed / (SLACK * per_token) > 1000  # the slack rule alone: most of a prompt a step
    per_token_s = costs.seconds_per_prompt_token()
    assert 0.0008 < per_token_s < 0.0013
    budget = PrefillBudget(2048, None, costs)
    assert budget.tokens() == int(MAX_STEP_S / per_token_s) < 400
    assert "at most 250 ms of them a step" in budget.describe()
    # nothing timed yet: no limit; a process's first prompt steps (one-time costs) do not count
    fresh = StepCosts()
    assert fresh.seconds_per_prompt_token() is None
    for seconds in (2.0, 2.0, 0.2, 0.2):
        fresh.record(200, 0, seconds)
    assert fresh.seconds_per_prompt_token() == pytest.approx(0.001)
    # ... nor steps of a few prompt tokens, mostly fixed cost (they would cut short prompts)
    for _ in range(10):
        fresh.record(40, 0, 0.05)
    assert fresh.seconds_per_prompt_token() == pytest.approx(0.001)


def test_the_chunk_stays_within_its_bounds_and_follows_the_flag():
    assert PrefillBudget(2048, None).tokens() == 2048  # nothing measured: no limit
    # a tiny model: the fixed part dwarfs the tokens, so the whole step budget
    assert PrefillBudget(256, None, synthetic_costs(0.005, 1e-7, 1e-7)).tokens() == 256
    # a fixed part of nothing: never below a block's worth
    assert PrefillBudget(256, None, synthetic_costs(0.0, 0.001, 0.0001)).tokens() == MIN_CHUNK
    assert PrefillBudget.from_flag("off", 512).tokens() == 512
    assert PrefillBudget.from_flag("64", 512).tokens() == 64
    assert PrefillBudget.from_flag("4096", 512).tokens() == 512


def test_prompt_tokens_stay_within_the_prefill_budget_and_decode_rows_do_not_wait():
    sched = make(num_blocks=64, budget=64)
    sched.prefill_budget = 8
    a, b, c = seq("a", 6), seq("b", 20), seq("c", 5)
    c.token_ids = [t + 100 for t in c.token_ids]  # no prefix shared with a or b
    for s in (a, b, c):
        sched.add(s)
    batch = sched.schedule()
    assert [(i.seq.request_id, i.num_new_tokens) for i in batch] == [("a", 6), ("b", 2)]
    compute(sched, batch)
    batch = sched.schedule()  # a decodes outside the prompt budget; b's next chunk fills it
    assert [(i.seq.request_id, i.num_new_tokens) for i in batch] == [("a", 1), ("b", 8)]
    compute(sched, batch)
    batch = sched.schedule()
    assert [(i.seq.request_id, i.num_new_tokens) for i in batch] == [("a", 1), ("b", 8)]
    compute(sched, batch)
    batch = sched.schedule()  # b's last 2 tokens, then c in what is left, in arrival order
    assert [(i.seq.request_id, i.num_new_tokens) for i in batch] == [
        ("a", 1), ("b", 2), ("c", 5)
    ]  # fmt: skip
    assert books(sched).ok


def test_a_later_prompt_waits_while_the_prompt_budget_is_spent():
    sched = make(num_blocks=64, budget=64)
    sched.prefill_budget = 4
    long, short = seq("long", 12), seq("short", 3)
    sched.add(long)
    sched.add(short)
    batch = sched.schedule()
    assert [(i.seq.request_id, i.num_new_tokens) for i in batch] == [("long", 4)]
    assert list(sched.waiting) == [short] and not short.block_table  # nothing held while it waits
    assert books(sched).ok


def test_under_a_burst_prompts_finish_in_arrival_order_with_the_same_output(tiny_llama):
    hf_model, _ = tiny_llama
    ps = prompts(4, seed=3, lengths=(40, 40, 40, 40))
    first_step = {}
    engine = make_engine(hf_model, prefill_chunk="40")
    for i, p in enumerate(ps):
        engine.add_request(str(i), p, GREEDY)
    outputs: dict[str, list[int]] = {str(i): [] for i in range(len(ps))}
    while engine.has_unfinished():
        for out in engine.step():
            first_step.setdefault(out.request_id, engine.num_steps)
            outputs[out.request_id] += out.new_token_ids
    # one prompt per step: the first answers after one step, not after all four prompts
    assert [first_step[str(i)] for i in range(4)] == [1, 2, 3, 4]
    for i, p in enumerate(ps):
        assert outputs[str(i)] == hf_greedy(hf_model, p, GREEDY.max_tokens)


def test_the_chunk_is_logged_when_measured_and_refit_as_steps_come(caplog):
    costs = synthetic_costs(0.010, 0.0018, 0.0003)
    budget = PrefillBudget(2048, None, costs)
    with caplog.at_level("INFO", logger="common.engine.step_budget"):
        assert budget.tokens() == 69
    assert (
        "prefill chunk 69 tokens (measured); a prompt step = 12.40 ms + 1.800 ms per prompt token"
        in caplog.text
    )
    for i in range(400):  # the machine got busier: a prompt step's fixed part went to 20 ms
        costs.record(0, 1 + i % 16, 0.020 + 0.0003 * (1 + i % 16))
        costs.record(64 + i % 128, 0, 0.020 + 0.0018 * (64 + i % 128))
    # the old steps have faded to a weight of 0.98 ** 400 (3e-4): 0.020 / 0.00018 = 112 tokens
    assert budget.tokens() == math.ceil(0.020 / (SLACK * 0.0018))
