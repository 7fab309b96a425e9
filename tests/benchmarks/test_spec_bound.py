"""benchmarks/spec_decode.py's n-gram bound: the replay of prompt lookup over given outputs."""

from __future__ import annotations

from tests.benchmarks.scripts import load_script


def test_bound_counts_steps_of_a_replayed_copy() -> None:
    bound = load_script("spec_decode").ngram_bound
    prompt = [10, 11, 12, 13, 14, 15, 16, 17]
    # steps: 12 (no earlier [16, 17]: nothing drafted), 13 (nor [17, 12]), then [12, 13] is found
    # in the prompt: its 4 drafts 14..17 all equal the output, which ends there: 6 tokens, 3 steps
    assert bound([prompt], [[12, 13, 14, 15, 16, 17]], 4, 2, 4) == 2.0
    # a draft that is wrong at once still gains the step's own token; k caps what one step keeps
    assert bound([prompt], [[12, 13, 99, 98]], 4, 2, 4) == 1.0
    assert bound([prompt], [[12, 13, 14, 15, 16, 17]], 2, 2, 4) == 6 / 4
    assert bound([prompt], [[]], 4, 2, 4) == 0.0
