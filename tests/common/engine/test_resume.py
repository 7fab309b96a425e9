"""A request resumed on another engine from the tokens it produced (request migration):
Engine.add_request(..., num_output_tokens=N) goes on exactly as the first engine would have."""

from __future__ import annotations

import pytest

from common.sampling_params import SamplingParams
from tests.common.engine.test_engine import make_engine, prompts

CASES = {
    "greedy": SamplingParams(max_tokens=20, temperature=0.0, ignore_eos=True),
    "seeded": SamplingParams(max_tokens=20, temperature=0.9, top_p=0.9, seed=7, ignore_eos=True),
    "penalties": SamplingParams(
        max_tokens=20, temperature=0.8, seed=3, frequency_penalty=0.7, presence_penalty=0.3,
        ignore_eos=True,
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_resumed_request_continues_as_if_never_moved(tiny_llama, case):
    hf_model, _ = tiny_llama
    params = CASES[case]
    prompt = prompts(1, seed=21, lengths=(19,))[0]
    whole = make_engine(hf_model).generate([prompt], params)[0].output_token_ids
    for cut in (1, 8, 19):
        engine = make_engine(hf_model)
        engine.add_request("moved", prompt + whole[:cut], params, num_output_tokens=cut)
        seq = engine.seqs["moved"]
        assert seq.num_prompt_tokens == len(prompt) and seq.num_output_tokens == cut
        while not seq.is_finished:
            engine.step()
        assert seq.output_token_ids == whole, (case, cut)
        assert seq.finish_reason == "length"


def test_a_resume_past_max_tokens_is_refused(tiny_llama):
    hf_model, _ = tiny_llama
    engine = make_engine(hf_model)
    params = SamplingParams(max_tokens=3, temperature=0.0)
    with pytest.raises(ValueError, match="max_tokens"):
        engine.add_request("done", [5, 6, 7, 8, 9, 10], params, num_output_tokens=3)
    with pytest.raises(ValueError, match="num_output_tokens"):
        engine.add_request("all", [5, 6], params, num_output_tokens=2)
    assert not engine.has_unfinished()
