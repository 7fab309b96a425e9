"""common/api/body.py: raw bytes to a trusted JSON object, and the character-length check."""

from __future__ import annotations

import pytest

from common.api.body import (
    MAX_CHARS_PER_TOKEN,
    MAX_JSON_DEPTH,
    check_prompt_chars,
    parse_json_object,
)
from common.api.requests import RequestError, parse_request

BAD = {
    "not JSON": b"{nope",
    "not UTF-8": b'{"prompt": "\xff"}',
    "not an object": b"[1]",
    "5000 digits": b'{"n": ' + b"7" * 5000 + b"}",
    "100k deep": b"[" * 100_000 + b"]" * 100_000,
    "33 deep": b'{"a": ' + b"[" * MAX_JSON_DEPTH + b"]" * MAX_JSON_DEPTH + b"}",
    "surrogate value": b'{"prompt": "\\ud800"}',
    "surrogate key": b'{"\\udc00": 1}',
    "surrogate deep": b'{"messages": [{"content": [{"text": "a\\ud83d"}]}]}',
}


@pytest.mark.parametrize("name", list(BAD))
def test_bad_bodies_are_request_errors(name: str) -> None:
    with pytest.raises(RequestError) as e:
        parse_json_object(BAD[name])
    assert e.value.code == 400


def test_good_bodies_pass() -> None:
    assert parse_json_object(b'{"prompt": "\\ud83d\\ude00", "n": 2}') == {"prompt": "😀", "n": 2}
    deep = b'{"a": ' + b"[" * (MAX_JSON_DEPTH - 1) + b"]" * (MAX_JSON_DEPTH - 1) + b"}"
    assert parse_json_object(deep)


def test_prompt_chars() -> None:
    check_prompt_chars(["x" * (MAX_CHARS_PER_TOKEN * 100)], 100, "prompt")
    with pytest.raises(RequestError) as e:
        check_prompt_chars(["x" * 1000, "y" * (MAX_CHARS_PER_TOKEN * 100 - 999)], 100, "prompt")
    assert e.value.param == "prompt" and "maximum context length is 100" in e.value.message


@pytest.mark.parametrize(
    "field, value",
    [
        ("top_k", 2**70),
        ("max_tokens", 2**31),
        ("min_tokens", 2**40),
        ("stop_token_ids", [2**70]),
        ("top_p", 5e-324),
        ("repetition_penalty", 5e-324),
        ("temperature", 1e-300),
        ("min_p", 10**400),
        ("seed", 2**64),
    ],
)
def test_out_of_range_fields(field: str, value: object) -> None:
    with pytest.raises(RequestError) as e:
        parse_request("/v1/completions", {"prompt": "x", field: value}, ["m"])
    assert e.value.param == field and len(e.value.message) < 200


def test_in_range_extremes_pass() -> None:
    body = {"prompt": "x", "top_k": 2**31 - 1, "top_p": 1e-30, "temperature": 0, "seed": -(2**63)}
    req = parse_request("/v1/completions", body, ["m"])
    assert req.params.top_k == 2**31 - 1 and req.params.top_p == 1e-30
