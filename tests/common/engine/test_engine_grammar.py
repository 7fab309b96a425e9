"""Structured outputs in the engine: a random model whose free output is garbage always produces
text that matches the grammar, greedy and sampled, with n-gram speculation, across a prefix-cache
hit, a forced preemption and the prefill/decode handoff (common/engine/grammar.py, sampler.py,
spec/verify.py and the engine's hooks).

The model is tests/tiny_models.py's tiny Llama over SmolLM2's tokenizer, with its vocabulary
padded by 64 ids the tokenizer does not have (as many checkpoints pad theirs), so every test also
checks that the padding is never produced.
"""

from __future__ import annotations

import json
import re
import shutil

import jsonschema
import pytest
from transformers import AutoTokenizer

from common.config import EngineConfig
from common.engine.engine import Engine
from common.engine.grammar import GrammarCompiler
from common.sampling_params import SamplingParams, StructuredOutput
from tests.common.engine.test_engine_handoff import handoff
from tests.tiny_models import CHAT_TOKENS, random_model, tiny_config

PAD = 64
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "ok": {"type": "boolean"},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 2},
    },
    "required": ["name", "age", "ok", "tags"],
    "additionalProperties": False,
}
JSON = StructuredOutput("json", json.dumps(SCHEMA))
EXAMPLE = '{"name": "Bo", "age": 7, "ok": true, "tags": ["a"]}'


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(HF model, its directory, HF tokenizer, a shared GrammarCompiler)."""
    from common.model.model_files import resolve_model

    hf_dir = resolve_model("default").hf_dir
    tokenizer = AutoTokenizer.from_pretrained(hf_dir)
    path = tmp_path_factory.mktemp("tiny-padded-chat")
    config = tiny_config("llama", vocab_size=len(tokenizer) + PAD, **CHAT_TOKENS)
    hf_model = random_model(config, seed=3)
    hf_model.save_pretrained(path)
    for f in hf_dir.iterdir():
        if f.name != "config.json":
            shutil.copy(f, path)
    compiler = GrammarCompiler(tokenizer, vocab_size=config.vocab_size)
    return hf_model, path, tokenizer, compiler


def make_engine(model, **overrides) -> Engine:
    hf_model, path, _, compiler = model
    cfg = dict(
        model=str(path),
        dtype="float32",
        kv_cache_memory="8MiB",
        block_size=8,
        max_num_batched_tokens=256,
    )
    cfg.update(overrides)
    engine = Engine(EngineConfig(**cfg), hf_model.config, hf_model.state_dict().items())
    engine.grammars = compiler  # share one tokenizer's compiled grammars across the tests
    engine.check_books_when_idle = True
    return engine


def prompt(model, text: str = "Give me a JSON object about a person:") -> list[int]:
    return model[2].encode(text)


def texts(model, seqs) -> list[str]:
    tokenizer = model[2]
    for s in seqs:
        assert max(s.output_token_ids, default=0) < len(tokenizer)  # never the padding
    return [tokenizer.decode(s.output_token_ids, skip_special_tokens=True) for s in seqs]


def assert_valid(model, seqs) -> None:
    for s, text in zip(seqs, texts(model, seqs)):
        assert s.finish_reason == "stop", (s.finish_reason, text)
        jsonschema.validate(json.loads(text), SCHEMA)


def test_unconstrained_is_garbage_constrained_always_validates(model) -> None:
    engine = make_engine(model)
    p = prompt(model)
    free = engine.generate([p] * 2, [SamplingParams(max_tokens=16, seed=s) for s in range(2)])
    for text in texts(model, free):
        with pytest.raises(ValueError):
            json.loads(text)
    sampled = [SamplingParams(max_tokens=80, seed=s, structured_output=JSON) for s in range(3)]
    greedy = SamplingParams(max_tokens=80, temperature=0.0, structured_output=JSON)
    top = SamplingParams(max_tokens=80, seed=9, top_k=5, top_p=0.9, structured_output=JSON)
    seqs = engine.generate([p] * 5, [*sampled, greedy, top])
    assert_valid(model, seqs)
    assert len({tuple(s.output_token_ids) for s in seqs}) > 2  # sampling still samples


@pytest.mark.parametrize(
    "so, check",
    [
        (StructuredOutput("regex", r"[a-z]{2,5}-\d{2}"), re.compile(r"[a-z]{2,5}-\d{2}").fullmatch),
        (
            StructuredOutput("choice", '["red", "green", "blue"]'),
            {"red", "green", "blue"}.__contains__,
        ),
        (
            StructuredOutput("grammar", 'root ::= "(" [xy]{1,4} ")"'),
            re.compile(r"\([xy]{1,4}\)").fullmatch,
        ),
        (StructuredOutput("json_object"), lambda t: isinstance(json.loads(t), dict)),
    ],
    ids=["regex", "choice", "grammar", "json_object"],
)
def test_each_kind_holds_sampled_and_greedy(model, so, check) -> None:
    engine = make_engine(model)
    params = [SamplingParams(max_tokens=40, seed=s, structured_output=so) for s in range(2)]
    params.append(SamplingParams(max_tokens=40, temperature=0.0, structured_output=so))
    seqs = engine.generate([prompt(model)] * 3, params)
    for s, text in zip(seqs, texts(model, seqs)):
        if so.kind != "json_object":  # a free-form object may run to max_tokens
            assert s.finish_reason == "stop"
            assert check(text), text
        elif s.finish_reason == "stop":
            assert check(text), text
    # the grammar ends the sequence itself: no eos token is generated after it
    assert all(2 not in s.output_token_ids for s in seqs if s.finish_reason == "stop")


def test_ngram_speculation_is_checked_against_the_grammar(model) -> None:
    # The prompt repeats the format, so prompt lookup drafts its continuations; drafts the
    # grammar forces are accepted, drafts it refuses (other values) are rejected and rolled back.
    p = prompt(model, " ".join([EXAMPLE] * 3))
    greedy = SamplingParams(max_tokens=80, temperature=0.0, structured_output=JSON)
    expected = [s.output_token_ids for s in make_engine(model).generate([p], greedy)]
    spec = dict(
        speculative="ngram",
        num_speculative_tokens=4,
        speculative_disable_by_batch_size=0,
        speculative_adaptive=False,
    )
    engine = make_engine(model, **spec)
    seqs = engine.generate([p], greedy)
    assert [s.output_token_ids for s in seqs] == expected  # exactly the plain grammar output
    sampled = [SamplingParams(max_tokens=80, seed=s, structured_output=JSON) for s in range(2)]
    seqs += engine.generate([p] * 2, sampled)
    assert_valid(model, seqs)
    assert engine.num_accepted_tokens > 0
    assert engine.num_accepted_tokens < engine.num_draft_tokens  # some drafts were refused


def test_prefix_cache_hit_and_preemption_keep_the_matcher_right(model) -> None:
    ps = [prompt(model, f"Person number {i} as JSON, please:" * 3) for i in range(4)]
    greedy = SamplingParams(max_tokens=80, temperature=0.0, structured_output=JSON)
    expected = [s.output_token_ids for s in make_engine(model).generate(ps, greedy)]
    # 20 blocks of 8 tokens for four sequences of ~60 tokens: one is preempted and recomputed
    engine = make_engine(model, kv_cache_memory=str(20 * 4096), max_model_len=128)
    seqs = engine.generate(ps, greedy)
    assert engine.scheduler.num_preemptions > 0
    assert [s.output_token_ids for s in seqs] == expected
    again = engine.generate(ps[:1], greedy)  # served from the prefix cache
    assert again[0].num_cached_tokens > 0
    assert again[0].output_token_ids == expected[0]
    assert_valid(model, seqs + again)


def test_first_token_from_the_prefill_engine_obeys_and_decode_continues(model) -> None:
    params = SamplingParams(max_tokens=80, seed=5, structured_output=JSON)
    p = prompt(model)
    expected = make_engine(model).generate([p], params)[0].output_token_ids
    prefill, decode = make_engine(model), make_engine(model)
    _, first = handoff(prefill, decode, "r", p, params)
    assert first.new_token_ids == expected[:1]
    tokens = list(first.new_token_ids)
    while decode.has_unfinished():
        tokens += [t for o in decode.step() for t in o.new_token_ids]
    assert tokens == expected
    json.loads(model[2].decode(tokens))


def test_bad_structured_output_is_refused_at_admission(model) -> None:
    engine = make_engine(model)
    bad = SamplingParams(structured_output=StructuredOutput("json", '{"type": "object", "if": {}}'))
    with pytest.raises(ValueError, match="if"):
        engine.add_request("bad", prompt(model), bad)
    assert not engine.has_unfinished()
