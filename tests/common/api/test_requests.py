"""common/api/requests.py: request validation and the OpenAI error body."""

from __future__ import annotations

import pytest

from common.api.requests import (
    CHAT_URL,
    COMPLETIONS_URL,
    RequestError,
    parse_chat_request,
    parse_completion_request,
    parse_request,
)
from common.sampling_params import SamplingParams

SERVED = ["default", "smol"]
CHAT = {"model": "default", "messages": [{"role": "user", "content": "Hi"}]}
COMPLETION = {"model": "default", "prompt": "Hello"}


def test_completion_body_to_sampling_params() -> None:
    body = {
        "model": "smol",
        "prompt": "Once upon a time",
        "max_tokens": 40,
        "temperature": 0.7,
        "top_p": 0.9,
        "top_k": 50,
        "min_p": 0.05,
        "presence_penalty": 0.5,
        "frequency_penalty": -0.5,
        "repetition_penalty": 1.1,
        "seed": 1234,
        "n": 3,
        "stop": "\n\n",
        "stop_token_ids": [7, 9],
        "ignore_eos": True,
        "min_tokens": 4,
        "disable_speculation": True,
        "logprobs": 5,
        "user": "someone",
        "some_future_field": {"ignored": True},
    }
    req = parse_completion_request(body, SERVED)
    assert req.endpoint == "completions" and req.model == "smol"
    assert req.prompts == ["Once upon a time"]
    assert req.n == 3 and req.stop == ["\n\n"] and req.max_tokens == 40
    assert req.params == SamplingParams(
        max_tokens=40,
        temperature=0.7,
        top_p=0.9,
        top_k=50,
        min_p=0.05,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.1,
        seed=1234,
        logprobs=5,
        stop_token_ids=[7, 9],
        ignore_eos=True,
        min_tokens=4,
        disable_speculation=True,
    )


def test_completion_defaults() -> None:
    req = parse_completion_request({"prompt": "x"}, SERVED)
    assert req.model == "default"  # no model: the first served name, as vLLM
    assert req.max_tokens == 16 and req.n == 1 and req.stop == [] and not req.stream
    assert req.params == SamplingParams(max_tokens=16)
    assert req.num_top_logprobs is None and req.skip_special_tokens


@pytest.mark.parametrize(
    "prompt, expected",
    [
        ("abc", ["abc"]),
        (["a", "b"], ["a", "b"]),
        ([5, 6, 7], [[5, 6, 7]]),
        ([[5, 6], [7]], [[5, 6], [7]]),
    ],
)
def test_completion_prompt_forms(prompt, expected) -> None:
    assert parse_completion_request({**COMPLETION, "prompt": prompt}, SERVED).prompts == expected


def test_chat_body_to_request() -> None:
    body = {
        "model": "default",
        "messages": [
            {"role": "developer", "content": "Be brief."},
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            },
            {"role": "assistant", "content": None, "name": "bot"},
            {"role": "user", "content": "again"},
        ],
        "max_tokens": 10,
        "max_completion_tokens": 20,
        "logprobs": True,
        "top_logprobs": 3,
        "stop": ["x", "y"],
        "stream": True,
        "stream_options": {"include_usage": True},
        "temperature": 0,
    }
    req = parse_chat_request(body, SERVED)
    assert req.endpoint == "chat"
    assert req.messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": ""},
        {"role": "user", "content": "again"},
    ]
    assert req.max_tokens == 20  # max_completion_tokens wins over the deprecated max_tokens
    assert req.params.logprobs == 3 and req.params.greedy
    assert req.stop == ["x", "y"] and req.stream and req.include_usage
    assert parse_chat_request({**CHAT, "logprobs": True}, SERVED).params.logprobs == 0
    assert parse_chat_request({**CHAT, "logprobs": False}, SERVED).params.logprobs is None
    assert parse_chat_request(CHAT, SERVED).max_tokens is None


def test_parse_request_dispatches_on_url() -> None:
    assert parse_request(CHAT_URL, CHAT, SERVED).endpoint == "chat"
    assert parse_request(COMPLETIONS_URL, COMPLETION, SERVED).endpoint == "completions"
    with pytest.raises(RequestError) as e:
        parse_request("/v1/embeddings", COMPLETION, SERVED)
    assert e.value.code == 404 and e.value.param == "url"


BAD_BODIES = [
    # (url, body, status, param, message fragment)
    (CHAT_URL, {"model": "default"}, 400, "messages", "messages is required"),
    (CHAT_URL, {**CHAT, "messages": []}, 400, "messages", "non-empty"),
    (CHAT_URL, {**CHAT, "messages": "hi"}, 400, "messages", "non-empty list"),
    (CHAT_URL, {**CHAT, "messages": ["hi"]}, 400, "messages[0]", "object"),
    (CHAT_URL, {**CHAT, "messages": [{"role": "user"}]}, 400, "messages[0].content", "string"),
    (CHAT_URL, {**CHAT, "messages": [{"role": "tool", "content": "x"}]}, 400, None, "tool"),
    (CHAT_URL, {**CHAT, "messages": [{"role": 3, "content": "x"}]}, 400, None, "role"),
    (
        CHAT_URL,
        {**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url"}]}]},
        400,
        "messages[0].content",
        "only text",
    ),
    (CHAT_URL, {**CHAT, "max_tokens": -1}, 400, "max_tokens", ">= 1"),
    (CHAT_URL, {**CHAT, "max_completion_tokens": 0}, 400, "max_completion_tokens", ">= 1"),
    (CHAT_URL, {**CHAT, "max_tokens": "10"}, 400, "max_tokens", "integer"),
    (CHAT_URL, {**CHAT, "max_tokens": 1.5}, 400, "max_tokens", "integer"),
    (CHAT_URL, {**CHAT, "logprobs": 1}, 400, "logprobs", "boolean"),
    (CHAT_URL, {**CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs", "[0, 20]"),
    (CHAT_URL, {**CHAT, "top_logprobs": 2}, 400, "top_logprobs", "requires logprobs"),
    (CHAT_URL, {**CHAT, "tools": [{"type": "function"}]}, 400, "tools[0].function", "object"),
    (CHAT_URL, {**CHAT, "response_format": {"type": "xml"}}, 400, "response_format", "xml"),
    (CHAT_URL, {**CHAT, "model": "gpt-4o"}, 404, "model", "does not exist"),
    (COMPLETIONS_URL, {**COMPLETION, "model": "gpt-4o"}, 404, "model", "gpt-4o"),
    (COMPLETIONS_URL, {**COMPLETION, "model": 5}, 400, "model", "string"),
    (COMPLETIONS_URL, [COMPLETION], 400, None, "JSON object"),
    (COMPLETIONS_URL, {"model": "default"}, 400, "prompt", "prompt is required"),
    (COMPLETIONS_URL, {**COMPLETION, "prompt": []}, 400, "prompt", ""),
    (COMPLETIONS_URL, {**COMPLETION, "prompt": ["a", 1]}, 400, "prompt", ""),
    (COMPLETIONS_URL, {**COMPLETION, "prompt": [[1], []]}, 400, "prompt", ""),
    (COMPLETIONS_URL, {**COMPLETION, "prompt": [True, 2]}, 400, "prompt", ""),
    (COMPLETIONS_URL, {**COMPLETION, "logprobs": 21}, 400, "logprobs", "[0, 20]"),
    (COMPLETIONS_URL, {**COMPLETION, "logprobs": -1}, 400, "logprobs", "[0, 20]"),
    (COMPLETIONS_URL, {**COMPLETION, "logprobs": True}, 400, "logprobs", "integer"),
    (COMPLETIONS_URL, {**COMPLETION, "max_tokens": -5}, 400, "max_tokens", ">= 1"),
    (COMPLETIONS_URL, {**COMPLETION, "echo": 1}, 400, "echo", "boolean"),
    (COMPLETIONS_URL, {**COMPLETION, "max_tokens": 0}, 400, "max_tokens", ">= 1"),
    (COMPLETIONS_URL, {**COMPLETION, "prompt_logprobs": 21}, 400, "prompt_logprobs", "[0, 20]"),
    (COMPLETIONS_URL, {**COMPLETION, "prompt_logprobs": -1}, 400, "prompt_logprobs", "[0, 20]"),
    (COMPLETIONS_URL, {**COMPLETION, "suffix": "x"}, 400, "suffix", "not supported"),
    (COMPLETIONS_URL, {**COMPLETION, "best_of": 3}, 400, "best_of", "not supported"),
    (COMPLETIONS_URL, {**COMPLETION, "logit_bias": [5]}, 400, "logit_bias", "object"),
    (CHAT_URL, {**CHAT, "logit_bias": {"x": 1}}, 400, "logit_bias", "token ids"),
    (CHAT_URL, {**CHAT, "logit_bias": {"-5": 1}}, 400, "logit_bias", "token ids"),
    (CHAT_URL, {**CHAT, "logit_bias": {"5": 101}}, 400, "logit_bias[5]", "[-100.0, 100.0]"),
    (CHAT_URL, {**CHAT, "logit_bias": {"5": "1"}}, 400, "logit_bias[5]", "number"),
    (CHAT_URL, {**CHAT, "logit_bias": {"5": None}}, 400, "logit_bias[5]", "number"),
    (CHAT_URL, {**CHAT, "logit_bias": {str(i): 1 for i in range(301)}}, 400, "logit_bias", "300"),
    (COMPLETIONS_URL, {**COMPLETION, "temperature": "hot"}, 400, "temperature", "number"),
    (COMPLETIONS_URL, {**COMPLETION, "temperature": 2.5}, 400, "temperature", "[0.0, 2.0]"),
    (COMPLETIONS_URL, {**COMPLETION, "top_p": 0}, 400, "top_p", "(0.0, 1.0]"),
    (COMPLETIONS_URL, {**COMPLETION, "top_k": -2}, 400, "top_k", ""),
    (COMPLETIONS_URL, {**COMPLETION, "repetition_penalty": 0}, 400, "repetition_penalty", ""),
    (COMPLETIONS_URL, {**COMPLETION, "presence_penalty": 3}, 400, "presence_penalty", ""),
    (COMPLETIONS_URL, {**COMPLETION, "n": 0}, 400, "n", "[1, 16]"),
    (COMPLETIONS_URL, {**COMPLETION, "n": 17}, 400, "n", "[1, 16]"),
    (COMPLETIONS_URL, {**COMPLETION, "seed": "7"}, 400, "seed", "integer"),
    (COMPLETIONS_URL, {**COMPLETION, "stop": ""}, 400, "stop", "non-empty"),
    (COMPLETIONS_URL, {**COMPLETION, "stop": [1]}, 400, "stop", ""),
    (COMPLETIONS_URL, {**COMPLETION, "stop": ["s"] * 17}, 400, "stop", "at most 16"),
    (COMPLETIONS_URL, {**COMPLETION, "stop_token_ids": [-1]}, 400, "stop_token_ids", ""),
    (COMPLETIONS_URL, {**COMPLETION, "min_tokens": 20}, 400, "min_tokens", "max_tokens"),
    (COMPLETIONS_URL, {**COMPLETION, "ignore_eos": "yes"}, 400, "ignore_eos", "boolean"),
    (COMPLETIONS_URL, {**COMPLETION, "disable_speculation": 1}, 400, "disable_speculation", ""),
    (COMPLETIONS_URL, {**COMPLETION, "stream": 1}, 400, "stream", "boolean"),
    (
        COMPLETIONS_URL,
        {**COMPLETION, "stream_options": {"include_usage": True}},
        400,
        "stream_options",
        "only allowed when stream is true",
    ),
    (COMPLETIONS_URL, {**COMPLETION, "user": 5}, 400, "user", "string"),
]


@pytest.mark.parametrize("url, body, status, param, fragment", BAD_BODIES)
def test_bad_bodies_give_openai_errors(url, body, status, param, fragment) -> None:
    with pytest.raises(RequestError) as e:
        parse_request(url, body, SERVED)
    err = e.value.body()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["code"] == e.value.code == status
    assert err["type"] == ("model_not_found" if status == 404 else "invalid_request_error")
    if param is not None:
        assert err["param"] == param
    assert fragment in err["message"]


def test_logit_bias_reaches_the_params() -> None:
    body = {**CHAT, "logit_bias": {"5": -100, "17": 2.5, "0": 100.0}}
    assert parse_chat_request(body, SERVED).params.logit_bias == {5: -100.0, 17: 2.5, 0: 100.0}
    assert parse_chat_request({**CHAT, "logit_bias": {}}, SERVED).params.logit_bias is None
    body = {**COMPLETION, "logit_bias": {str(i): 1 for i in range(300)}}  # OpenAI's limit
    assert len(parse_completion_request(body, SERVED).params.logit_bias) == 300
