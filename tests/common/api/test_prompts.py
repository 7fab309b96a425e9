"""common/api/prompts.py: engine inputs (tokenization, the context check, per-choice seeds)."""

from __future__ import annotations

import pytest

from common.api.prompts import choice_params, engine_inputs
from common.api.requests import RequestError, parse_chat_request, parse_completion_request
from common.api.tokenizer import Tokenizer
from common.model.model_files import resolve_model
from common.sampling_params import SamplingParams

SERVED = ["default", "smol"]
CHAT = {"model": "default", "messages": [{"role": "user", "content": "Hi"}]}
COMPLETION = {"model": "default", "prompt": "Hello"}


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_source(resolve_model("default"))


def test_engine_inputs_for_chat_fill_the_context(tok: Tokenizer) -> None:
    req = parse_chat_request(CHAT, SERVED)
    (inp,) = engine_inputs(req, tok, max_model_len=100)
    assert inp.prompt_token_ids == tok.apply_chat_template(CHAT["messages"])
    # No max_tokens for chat: whatever room the context leaves.
    assert inp.params.max_tokens == 100 - len(inp.prompt_token_ids)
    req = parse_chat_request({**CHAT, "max_tokens": 7}, SERVED)
    assert engine_inputs(req, tok, max_model_len=100)[0].params.max_tokens == 7


def test_engine_inputs_for_completion_prompts(tok: Tokenizer) -> None:
    req = parse_completion_request({**COMPLETION, "prompt": ["Hello world", "Bye"]}, SERVED)
    inputs = engine_inputs(req, tok, max_model_len=2048)
    assert [i.prompt_token_ids for i in inputs] == [tok.encode("Hello world"), tok.encode("Bye")]
    assert all(i.params.max_tokens == 16 for i in inputs)
    req = parse_completion_request({**COMPLETION, "prompt": [[1, 2, 3]], "seed": 5}, SERVED)
    (inp,) = engine_inputs(req, tok, max_model_len=2048)
    assert inp.prompt_token_ids == [1, 2, 3]
    assert [p.seed for p in choice_params(inp.params, 3)] == [5, 6, 7]
    assert choice_params(SamplingParams(), 2) == [SamplingParams()] * 2


def test_too_long_prompt_is_a_400_naming_both_numbers(tok: Tokenizer) -> None:
    prompt = [5] * 90
    req = parse_completion_request({**COMPLETION, "prompt": prompt, "max_tokens": 20}, SERVED)
    with pytest.raises(RequestError) as e:
        engine_inputs(req, tok, max_model_len=100)
    assert e.value.code == 400 and e.value.param == "max_tokens"
    assert "maximum context length is 100 tokens" in e.value.message
    assert "110 tokens (90 in the prompt, 20 in the completion)" in e.value.message
    # A chat prompt that alone fills the context has no room even for a default max_tokens.
    long_chat = {**CHAT, "messages": [{"role": "user", "content": "word " * 200}]}
    with pytest.raises(RequestError) as e:
        engine_inputs(parse_chat_request(long_chat, SERVED), tok, max_model_len=100)
    assert e.value.code == 400 and e.value.param == "messages"
    assert "maximum context length is 100 tokens" in e.value.message


def test_bad_token_ids_and_empty_prompt(tok: Tokenizer) -> None:
    for prompt, fragment in [([1, tok.vocab_size], "token ids must be in"), ("", "empty")]:
        req = parse_completion_request({**COMPLETION, "prompt": prompt}, SERVED)
        with pytest.raises(RequestError, match=fragment):
            engine_inputs(req, tok, max_model_len=2048)


def test_logit_bias_ids_outside_the_vocabulary_are_refused(tok: Tokenizer) -> None:
    req = parse_chat_request({**CHAT, "logit_bias": {str(tok.vocab_size): 1}}, SERVED)
    with pytest.raises(RequestError, match="logit_bias keys must be token ids in") as e:
        engine_inputs(req, tok, max_model_len=2048)
    assert e.value.param == "logit_bias"
    req = parse_chat_request({**CHAT, "logit_bias": {str(tok.vocab_size - 1): 1}}, SERVED)
    assert engine_inputs(req, tok, max_model_len=2048)[0].params.logit_bias


def test_min_tokens_above_the_filled_context_is_refused(tok: Tokenizer) -> None:
    req = parse_chat_request({**CHAT, "min_tokens": 90}, SERVED)
    with pytest.raises(RequestError, match="min_tokens"):
        engine_inputs(req, tok, max_model_len=100)
