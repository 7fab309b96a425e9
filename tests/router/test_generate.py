"""router/generate.py's `WholeBody`: the bytes and headers `JSONResponse` would send for the same
content (non-ASCII text, floats, nulls), and the same refusal of a value JSON cannot hold."""

from __future__ import annotations

import math

import pytest
from starlette.responses import JSONResponse

from router.generate import WholeBody

CONTENT = {
    "id": "cmpl-0",
    "choices": [{"index": 0, "text": "café ☕ \u2028 \"q\" \x00", "logprobs": None,
                 "token_logprobs": [-1e-05, -0.1, -9999.0, -1.6791544770398125e-06]}],
    "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5},
}  # fmt: skip


def test_whole_body_is_what_json_response_sends() -> None:
    ours, theirs = WholeBody(CONTENT), JSONResponse(CONTENT)
    assert ours.body == theirs.body
    assert ours.status_code == theirs.status_code == 200
    assert sorted(ours.raw_headers) == sorted(theirs.raw_headers)


def test_whole_body_refuses_what_json_cannot_hold() -> None:
    for bad in (math.nan, math.inf):
        with pytest.raises(ValueError):
            JSONResponse({"x": bad})
        with pytest.raises(ValueError):
            WholeBody({"x": bad})
