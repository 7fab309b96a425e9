"""Tests of common/engine/grammar.py: compiling each kind of structured output, the cache, the
router's check (errors that name the feature), and a matcher following a sequence's tokens."""

from __future__ import annotations

import json

import pytest
import torch

from common.engine.grammar import (
    GrammarCompiler,
    check_structured_output,
    grammar_text,
    refused_tokens,
)
from common.sampling_params import StructuredOutput


@pytest.fixture(scope="module")
def hf_tokenizer():
    from transformers import AutoTokenizer

    from common.model.model_files import resolve_model

    return AutoTokenizer.from_pretrained(resolve_model("default").hf_dir)


@pytest.fixture(scope="module")
def compiler(hf_tokenizer) -> GrammarCompiler:
    return GrammarCompiler(hf_tokenizer)


SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


def _accepts(compiler: GrammarCompiler, hf_tokenizer, so: StructuredOutput, text: str) -> bool:
    """Whether `text` (tokenized as the tokenizer would) is a complete match of `so`."""
    m = compiler.matcher(so)
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    return m.matcher.validate_tokens(ids) == len(ids) and (
        m.sync(ids, 0) or m.matcher.is_accepting()
    )


@pytest.mark.parametrize(
    "so, good, bad",
    [
        (StructuredOutput("json", json.dumps(SCHEMA)), '{"name": "Bo", "age": 3}', '{"name": 3}'),
        (StructuredOutput("json_object"), '{"x": [1, 2]}', "[1, 2]"),
        (StructuredOutput("regex", r"\d{3}-[a-z]+"), "123-abc", "12-abc"),
        (StructuredOutput("choice", '["yes", "no"]'), "no", "maybe"),
        (StructuredOutput("grammar", 'start: "a" b+\nb: "b"\n'), "abbb", "ba"),
        (StructuredOutput("grammar", 'root ::= "x" [0-9]+'), "x42", "x"),  # GBNF
    ],
    ids=["json", "json_object", "regex", "choice", "lark", "gbnf"],
)
def test_each_kind_accepts_its_language_only(compiler, hf_tokenizer, so, good, bad) -> None:
    assert _accepts(compiler, hf_tokenizer, so, good)
    assert not _accepts(compiler, hf_tokenizer, so, bad)


@pytest.mark.parametrize(
    "so, named",
    [
        (StructuredOutput("json", '{"type": "object", "if": {}}'), "if"),
        (StructuredOutput("json", '{"type": "string", "format": "weird"}'), "weird"),
        (StructuredOutput("json", '{"type": '), "not valid JSON"),
        (StructuredOutput("json", "[1]"), "must be an object"),
        (StructuredOutput("regex", "[a-z"), "unclosed character class"),
        (StructuredOutput("choice", '["a", 1]'), "list of strings"),
        (StructuredOutput("choice", "[]"), "list of strings"),
        (StructuredOutput("grammar", "start: nope\n"), "nope"),
        (StructuredOutput("xml", ""), "kind must be one of"),
    ],
)
def test_bad_specs_raise_naming_the_problem(hf_tokenizer, so, named) -> None:
    with pytest.raises(ValueError, match=named):
        check_structured_output(so, hf_tokenizer)


def test_checks_build_the_tokenizer_only_for_grammars_naming_tokens(hf_tokenizer) -> None:
    # Building llguidance's tokenizer holds the GIL for 0.3-1 s: the router's event loop would
    # stall on it, so schemas, regexes and choices are checked without it.
    compiler = GrammarCompiler(hf_tokenizer)
    for so in (
        StructuredOutput("json", json.dumps(SCHEMA)),
        StructuredOutput("json_object"),
        StructuredOutput("regex", r"\d+"),
        StructuredOutput("choice", '["a", "b"]'),
        StructuredOutput("grammar", 'start: "x" /[0-9]+/\n'),
    ):
        compiler.check(so)
    for so, named in (
        (StructuredOutput("json", '{"type": "string", "format": "weird"}'), "weird"),
        (StructuredOutput("grammar", "start: nope\n"), "nope"),
    ):
        with pytest.raises(ValueError, match=named):
            compiler.check(so)
    assert not compiler.tokenizer_built and compiler.num_compiled == 0
    # Token references can only be judged against the vocabulary.
    compiler.check(StructuredOutput("grammar", 'start: "a" <|endoftext|>\n'))
    assert compiler.tokenizer_built
    for spec, named in (("start: <|nosuch|>\n", "nosuch"), ("start: <[99999999]>\n", "too large")):
        for _ in range(2):  # the second answer comes from the cache
            with pytest.raises(ValueError, match=named):
                compiler.check(StructuredOutput("grammar", spec))
    assert compiler.num_compiled == 3


def test_a_padding_tokenizer_is_served_unpadded_and_left_as_it_was(hf_tokenizer) -> None:
    import copy

    padded = copy.deepcopy(hf_tokenizer)
    padded.backend_tokenizer.enable_padding(length=64)
    padded.backend_tokenizer.enable_truncation(max_length=64)
    compiler = GrammarCompiler(padded)
    so = StructuredOutput("json", json.dumps(SCHEMA))
    text = '{"name": "Bo", "age": 3}'
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    assert compiler.ll_tokenizer.tokenize_str(text) == ids
    assert _accepts(compiler, hf_tokenizer, so, text)
    assert padded.backend_tokenizer.padding["length"] == 64
    assert padded.backend_tokenizer.truncation["max_length"] == 64


def test_compiled_grammars_are_cached_and_bounded(hf_tokenizer) -> None:
    compiler = GrammarCompiler(hf_tokenizer, max_cached=2)
    specs = [StructuredOutput("regex", f"a{{{n}}}") for n in (1, 2, 3)]
    compiler.compile(specs[0])
    compiler.compile(specs[0])
    assert compiler.num_compiled == 1
    bad = StructuredOutput("regex", "(")
    for _ in range(2):
        with pytest.raises(ValueError):
            compiler.compile(bad)
    assert compiler.num_compiled == 2  # the error is cached too
    compiler.compile(specs[1])
    compiler.compile(specs[2])  # evicts the oldest
    compiler.compile(specs[0])
    assert compiler.num_compiled == 5
    # matchers are independent copies of the cached prototype
    a, b = compiler.matcher(specs[1]), compiler.matcher(specs[1])
    a.sync(hf_tokenizer.encode("a", add_special_tokens=False), 0)
    assert a.num_consumed == 1 and b.num_consumed == 0
    assert not b.matcher.is_accepting()


def test_sync_is_idempotent_and_drafts_roll_back(compiler, hf_tokenizer) -> None:
    so = StructuredOutput("choice", '["alpha beta", "gamma"]')
    ids = hf_tokenizer.encode("alpha beta", add_special_tokens=False)
    assert len(ids) >= 2
    m = compiler.matcher(so)
    before = m.bitmask()
    wrong = hf_tokenizer.encode("gamma", add_special_tokens=False)[0]
    drafts = [ids[0], wrong, ids[1]]  # the second draft is refused by the grammar
    masks = m.draft_bitmasks(drafts)
    assert len(masks) == 4
    assert torch.equal(masks[0], before)  # rolled back: the state is the one before the drafts
    assert torch.equal(m.bitmask(), before)
    allowed = ~refused_tokens(torch.stack(masks), len(hf_tokenizer))
    assert allowed[0, ids[0]] and not allowed[1, wrong] and allowed[1, ids[1]]
    assert torch.equal(allowed[2], allowed[1])  # unreachable rows repeat the refusing row's mask
    prompt = [7, 7]
    assert not m.sync(prompt + ids[:1], len(prompt))
    assert not m.sync(prompt + ids[:1], len(prompt))  # already consumed: nothing happens
    assert m.sync(prompt + ids, len(prompt)) and not m.failed  # complete: "stop"
    assert m.num_consumed == len(ids)


def test_padded_vocabulary_refuses_the_padding(hf_tokenizer) -> None:
    vocab = len(hf_tokenizer)
    compiler = GrammarCompiler(hf_tokenizer, vocab_size=vocab + 64)
    m = compiler.matcher(StructuredOutput("json_object"))
    allowed = ~refused_tokens(m.bitmask()[None], vocab + 64)
    assert allowed.shape == (1, vocab + 64)
    assert allowed[0, :vocab].any() and not allowed[0, vocab:].any()
    narrow = refused_tokens(m.bitmask()[None], vocab - 10)  # logits narrower than the tokenizer
    assert narrow.shape == (1, vocab - 10)


def test_grammar_text_choice_escapes_literals() -> None:
    text = grammar_text(StructuredOutput("choice", json.dumps(['say "hi"', "a\\b"])))
    assert '\\"hi\\"' in text


def test_a_tokenizer_that_cannot_load_fails_the_request_only() -> None:
    def load():
        raise OSError("no tokenizer files here")

    compiler = GrammarCompiler(vocab_size=256, load_tokenizer=load)
    with pytest.raises(ValueError, match="need the model's tokenizer: no tokenizer files"):
        compiler.matcher(StructuredOutput("regex", "a"))
