"""common/engine/scheduler.py on its own: a real block pool and manager, sequences, no model.

Admission under the token budget and max_num_seqs, chunked prefill, preemption of the newest
running sequence, and draft slots: granted only from blocks and budget nobody running needs.
"""

from __future__ import annotations

from common.engine.block_manager import BlockManager
from common.engine.block_pool import BlockPool
from common.engine.scheduler import Scheduler
from common.engine.sequence import SequenceState, SequenceStatus
from common.sampling_params import SamplingParams

BS = 4
PARAMS = SamplingParams(max_tokens=100, temperature=0.0)


def make(num_blocks: int, budget: int = 64, max_seqs: int = 8, lookahead: int = 0, **kw):
    manager = BlockManager(BlockPool(num_blocks, BS), b"salt")
    return Scheduler(manager, max_seqs, budget, num_lookahead_tokens=lookahead, **kw)


def seq(rid: str, num_tokens: int, params: SamplingParams = PARAMS) -> SequenceState:
    return SequenceState(rid, list(range(10, 10 + num_tokens)), num_tokens, params)


def compute(sched: Scheduler, batch) -> None:
    """What the engine does after a plain step: KV computed, one token sampled at a prompt's end."""
    for item in batch:
        s = item.seq
        s.num_computed_tokens += item.num_new_tokens
        sched.block_manager.commit(s)
        if s.num_computed_tokens == s.num_tokens:
            s.token_ids.append(7)


def books(sched: Scheduler):
    return sched.block_manager.check_books({"running": [*sched.running, *sched.waiting]})


def test_admits_in_order_within_the_token_budget_and_chunks_the_rest():
    sched = make(num_blocks=32, budget=10)
    a, b, c = seq("a", 6), seq("b", 7), seq("c", 3)
    for s in (a, b, c):
        sched.add(s)
    batch = sched.schedule()
    assert [(i.seq.request_id, i.num_new_tokens) for i in batch] == [("a", 6), ("b", 4)]
    assert list(sched.waiting) == [c] and sched.running == [a, b]
    assert len(a.block_table) == 2 and len(b.block_table) == 1  # slots for what is computed
    compute(sched, batch)
    # running first (a decodes one token, b finishes its prompt), then c within what is left
    batch = sched.schedule()
    assert [(i.seq.request_id, i.num_new_tokens) for i in batch] == [("a", 1), ("b", 3), ("c", 3)]
    assert books(sched).ok


def test_max_num_seqs_caps_the_running_set():
    sched = make(num_blocks=32, max_seqs=2)
    for i in range(3):
        sched.add(seq(f"s{i}", 2))
    assert [i.seq.request_id for i in sched.schedule()] == ["s0", "s1"]
    assert [s.request_id for s in sched.waiting] == ["s2"]


def test_out_of_blocks_preempts_the_newest_running_sequence():
    sched = make(num_blocks=4)
    old, new = seq("old", 8), seq("new", 8)  # two blocks each: the pool is full
    sched.add(old)
    sched.add(new)
    batch = sched.schedule()
    assert len(batch) == 2 and sched.block_manager.pool.num_free == 0
    compute(sched, batch)
    # old's next token needs a third block: new is preempted, its blocks freed, first in line
    batch = sched.schedule()
    assert [(i.seq.request_id, i.num_new_tokens) for i in batch] == [("old", 1)]
    assert sched.num_preemptions == 1 and new.status is SequenceStatus.WAITING
    assert list(sched.waiting) == [new] and new.block_table == [] and new.num_computed_tokens == 0
    assert len(old.block_table) == 3
    assert books(sched).ok


def test_a_waiting_prompt_that_does_not_fit_waits_holding_nothing():
    sched = make(num_blocks=3)
    sched.add(seq("fits", 8))
    sched.add(seq("big", 8))
    assert [i.seq.request_id for i in sched.schedule()] == ["fits"]
    big = sched.waiting[0]
    assert big.block_table == [] and sched.block_manager.pool.num_free == 1
    assert books(sched).ok


def decoding(sched: Scheduler, *lengths: int) -> list[SequenceState]:
    """Sequences admitted and past their prompts, each with one sampled token to compute."""
    seqs = [seq(f"d{i}", n) for i, n in enumerate(lengths)]
    for s in seqs:
        sched.add(s)
    compute(sched, sched.schedule())
    assert all(s.num_tokens - s.num_computed_tokens == 1 for s in seqs)
    return seqs


def test_drafts_get_slots_and_budget_when_free():
    sched = make(num_blocks=16, lookahead=3)
    a, b = decoding(sched, 5, 6)
    batch = sched.schedule()
    assert [(i.num_new_tokens, i.num_lookahead_tokens) for i in batch] == [(1, 3), (1, 3)]
    # each holds slots for its new token and three drafts: 6 + 3 and 7 + 3 tokens
    assert len(a.block_table) == 3 and len(b.block_table) == 3


def test_draft_slots_never_take_a_block_a_running_sequence_needs():
    # a (5 tokens computed + 1 new) can draft into a third block; b (8 + 1) needs its third block
    # for its own next token. One block is free: it must go to b, not to a's drafts (b's own
    # drafts then fit in it).
    sched = make(num_blocks=5, lookahead=3)
    a, b = decoding(sched, 5, 8)
    assert sched.block_manager.pool.num_free == 1
    batch = sched.schedule()
    assert [(i.seq.request_id, i.num_lookahead_tokens) for i in batch] == [("d0", 0), ("d1", 3)]
    assert sched.num_preemptions == 0 and sched.running == [a, b]
    assert len(a.block_table) == 2 and len(b.block_table) == 3
    assert books(sched).ok


def test_drafts_take_a_block_nobody_behind_needs():
    sched = make(num_blocks=5, lookahead=3)
    a, b = decoding(sched, 5, 6)  # b's next token fits its second block
    batch = sched.schedule()
    assert [i.num_lookahead_tokens for i in batch] == [3, 0]  # a took the last free block
    assert sched.num_preemptions == 0 and len(a.block_table) == 3


def test_drafts_leave_budget_for_the_sequences_behind():
    sched = make(num_blocks=32, budget=4, lookahead=3)
    decoding_seqs = decoding(sched, 2, 2)
    assert len(decoding_seqs) == 2
    batch = sched.schedule()
    # 4 tokens: the second sequence keeps 1, so the first drafts at most 2
    assert [(i.num_new_tokens, i.num_lookahead_tokens) for i in batch] == [(1, 2), (1, 0)]


def test_lookahead_stays_within_max_tokens_and_the_context():
    sched = make(num_blocks=32, lookahead=5, max_model_len=9)
    near_max = seq("m", 3, SamplingParams(max_tokens=3, temperature=0.0))
    near_ctx = seq("c", 5)
    for s in (near_max, near_ctx):
        sched.add(s)
    compute(sched, sched.schedule())
    batch = sched.schedule()
    # m has 1 output and 2 to go: 1 draft; c has 6 of 9 tokens: 2 drafts
    assert [i.num_lookahead_tokens for i in batch] == [1, 2]


def test_no_drafts_when_switched_off_or_above_the_batch_limit():
    sched = make(num_blocks=32, lookahead=3, speculative_max_batch=1)
    decoding(sched, 3, 3)
    assert [i.num_lookahead_tokens for i in sched.schedule()] == [0, 0]  # 2 running > 1
    sched = make(num_blocks=32, lookahead=3)
    decoding(sched, 3)
    sched.drafting = False
    assert [i.num_lookahead_tokens for i in sched.schedule()] == [0]


def test_prefix_hit_at_admission_counts_cached_tokens():
    sched = make(num_blocks=16)
    first = seq("first", 9)
    sched.add(first)
    compute(sched, sched.schedule())  # 9 prompt tokens computed: two full blocks registered
    sched.remove(first)
    again = seq("again", 9)
    sched.add(again)
    [item] = sched.schedule()
    assert again.num_cached_tokens == 8 and item.num_new_tokens == 1
    assert books(sched).ok


def prefilled(sched: Scheduler, rid: str, num_prompt: int) -> SequenceState:
    """A sequence whose prompt KV arrived from a prefill worker (engine.admit_prefilled): it holds
    its blocks, with room for the first token, and waits to start."""
    s = seq(rid, num_prompt)
    assert sched.block_manager.ensure_slots(s, num_prompt + 1)
    s.num_computed_tokens = num_prompt
    s.token_ids.append(7)  # the first token, sampled by the prefill worker
    sched.add(s)
    return s


def test_sequences_holding_their_blocks_never_wait_behind_one_that_cannot_get_any():
    # The PD deadlock: a preempted sequence first in line needs more blocks than are free, the
    # prefilled ones behind it hold the rest. They must start (needing no new blocks), and the
    # oldest running one must always advance.
    sched = make(num_blocks=8)
    old = seq("old", 12)  # 3 blocks
    sched.add(old)
    compute(sched, sched.schedule())
    prefilled(sched, "a", 7)  # 2 blocks each (7 tokens + the first output)
    prefilled(sched, "b", 7)
    stuck = SequenceState("stuck", list(range(100, 116)), 16, PARAMS)  # shares no prefix
    sched.waiting.appendleft(stuck)  # as a preemption leaves it: first in line, no blocks
    assert sched.block_manager.pool.num_free == 1
    batch = sched.schedule()
    assert [i.seq.request_id for i in batch] == ["old", "a", "b"]
    assert list(sched.waiting) == [stuck] and stuck.block_table == []
    assert books(sched).ok
    # everything finishes: run to the end as the engine would
    for _ in range(200):
        if not sched.has_unfinished():
            break
        batch = sched.schedule()
        compute(sched, batch)
        for item in batch:
            if item.seq.num_output_tokens >= 6:
                sched.remove(item.seq)
                item.seq.status = SequenceStatus.FINISHED
    assert not sched.has_unfinished()
    assert sched.block_manager.pool.num_free == 8


def test_a_running_sequence_short_of_blocks_preempts_a_waiting_prefilled_one_first():
    sched = make(num_blocks=5)
    old = seq("old", 8)  # 2 blocks, full: its next token needs a third
    sched.add(old)
    compute(sched, sched.schedule())
    sched.max_num_seqs = 1  # the prefilled sequence cannot start yet
    waiting = prefilled(sched, "w", 7)  # the other 2 blocks... and 1 left free
    assert sched.block_manager.ensure_slots(seq("x", 4), 4)  # someone takes the last free block
    batch = sched.schedule()
    # old needs a block: the newest holder (waiting, not started) gives its blocks up, not old
    assert [i.seq.request_id for i in batch] == ["old"] and old in sched.running
    assert waiting.block_table == [] and waiting.num_computed_tokens == 0
    assert list(sched.waiting) == [waiting] and sched.num_preemptions == 1


def test_when_nothing_can_run_the_newest_waiting_holder_frees_its_blocks():
    sched = make(num_blocks=4)
    a = prefilled(sched, "a", 8)  # 3 blocks: 8 tokens + room for the first output
    b = prefilled(sched, "b", 3)  # 1 block, full with the first output
    # neither can start: a needs its next block... make both need one
    a.num_computed_tokens, b.num_computed_tokens = 8, 3
    a.token_ids += [7, 7, 7, 7]  # 13 tokens: a needs a 4th block, b a 2nd, none free
    b.token_ids += [7]
    batch = sched.schedule()
    # b (the newest holder) gives its block up; a runs
    assert [i.seq.request_id for i in batch] == ["a"]
    assert b.block_table == [] and list(sched.waiting) == [b]
    assert books(sched).ok


def test_a_short_prefill_starts_ahead_of_a_long_prompts_chunks():
    # a request whose prompt is mostly cached (a returning conversation) starts while a long
    # prompt is being prefilled, in a step whose long chunk shrinks to a quarter of the budget;
    # a waiting request with a long prefill keeps its turn
    sched = make(num_blocks=128, budget=128)
    sched.prefill_budget = 64  # prompt tokens a step (the engine sets it from measured costs)
    first = seq("first", 40)
    sched.add(first)
    compute(sched, sched.schedule())
    sched.remove(first)  # finished: its 10 blocks stay in the prefix cache
    long = SequenceState("long", list(range(1000, 1200)), 200, PARAMS)
    sched.add(long)
    batch = sched.schedule()
    assert [(i.seq.request_id, i.num_new_tokens) for i in batch] == [("long", 64)]
    compute(sched, batch)
    warm = SequenceState("warm", list(range(10, 50)) + [900, 901, 902, 903], 44, PARAMS)
    sched.add(warm)
    batch = sched.schedule()
    assert [(i.seq.request_id, i.num_new_tokens) for i in batch] == [("warm", 4), ("long", 16)]
    assert warm.num_cached_tokens == 40 and books(sched).ok
    compute(sched, batch)
    cold = SequenceState("cold", list(range(2000, 2100)), 100, PARAMS)
    sched.add(cold)
    batch = sched.schedule()
    # the long prompt's chunk is whole again; the cold one waits behind it as before
    assert [(i.seq.request_id, i.num_new_tokens) for i in batch] == [("long", 64), ("warm", 1)]
    assert list(sched.waiting) == [cold] and cold.long_prefill and not cold.block_table
    assert books(sched).ok


def test_a_cut_chunk_rounds_the_steps_rows_to_the_granule():
    sched = make(num_blocks=64, budget=20, row_granule=8)
    a, b = seq("a", 5), seq("b", 40)
    for s in (a, b):
        sched.add(s)
    batch = sched.schedule()  # the budget cuts b at 15 tokens: 20 rows, cut back to 16
    assert [(i.seq.request_id, i.num_new_tokens) for i in batch] == [("a", 5), ("b", 11)]
    compute(sched, batch)
    batch = sched.schedule()  # a decodes; b goes on where its chunk ended, cut again: 16 rows
    assert [(i.seq.request_id, i.num_new_tokens) for i in batch] == [("a", 1), ("b", 15)]
    compute(sched, batch)
    batch = sched.schedule()  # b's last 14 tokens end its prompt: the step stays at 15 rows
    assert [(i.seq.request_id, i.num_new_tokens) for i in batch] == [("a", 1), ("b", 14)]
    compute(sched, batch)
    assert b.num_computed_tokens == 40 and len(b.token_ids) == 41
    # b's blocks cover what it computed and the slots it held past its cut chunks were used
    assert len(b.block_table) == -(-40 // BS) and books(sched).ok


def test_a_cut_chunk_keeps_at_least_one_token():
    sched = make(num_blocks=64, budget=3, row_granule=8)
    sched.add(seq("a", 10))
    batch = sched.schedule()  # 3 rows: rounding down would leave nothing
    assert [(i.seq.request_id, i.num_new_tokens) for i in batch] == [("a", 3)]
