"""`--seed`: a worker's unseeded sampling is reproducible for one seed and differs across seeds."""

from __future__ import annotations

import pytest

from common.cli import build_parser
from common.runtime import worker_cli
from common.sampling_params import SamplingParams
from tests.common.engine.test_engine import make_engine, prompts

# Temperature 1 and no per-request seed: the sampler's shared generators decide every token.
RANDOM = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True)


def sample_with_flags(monkeypatch, hf_model, *flags: str) -> list[list[int]]:
    """Build a decode worker's engine from its command line (the model loader swapped for the
    tiny model) and sample three prompts."""
    monkeypatch.setattr(worker_cli, "load_engine", lambda config: make_engine(hf_model))
    args = build_parser().parse_args(["decode", "--model", "tiny", *flags])
    engine = worker_cli.build_engine(args)
    return [s.output_token_ids for s in engine.generate(prompts(3), RANDOM)]


@pytest.mark.parametrize("tiny_model", ["llama"], indirect=True)
def test_seed_flag_makes_sampling_reproducible(tiny_model, monkeypatch) -> None:
    _, hf_model, _ = tiny_model
    first = sample_with_flags(monkeypatch, hf_model, "--seed", "5")
    again = sample_with_flags(monkeypatch, hf_model, "--seed", "5")
    other = sample_with_flags(monkeypatch, hf_model, "--seed", "6")
    assert first == again
    assert first != other


@pytest.mark.parametrize("tiny_model", ["llama"], indirect=True)
def test_request_seed_is_not_the_engine_seed(tiny_model) -> None:
    _, hf_model, _ = tiny_model
    engine = make_engine(hf_model)
    seeded = SamplingParams(max_tokens=12, temperature=1.0, ignore_eos=True, seed=123)
    outputs = []
    for engine_seed in (5, 6):
        worker_cli.seed_generators(engine_seed)
        outputs.append(engine.generate(prompts(1), seeded)[0].output_token_ids)
    assert outputs[0] == outputs[1]
