"""common/api/responses.py: whole response bodies and the SSE chunks of a stream."""

from __future__ import annotations

import json

import pytest

from common.api.choice import Choice, ChoiceResult
from common.api.requests import RequestError, parse_chat_request, parse_completion_request
from common.api.responses import (
    DONE,
    chat_body,
    completion_body,
    delta_chunk,
    error_event,
    role_chunk,
    sse,
    usage_chunk,
)
from common.api.tokenizer import Tokenizer
from common.model.model_files import resolve_model
from common.sampling_params import SamplingParams

SERVED = ["default", "smol"]
CHAT = {"model": "default", "messages": [{"role": "user", "content": "Hi"}]}
COMPLETION = {"model": "default", "prompt": "Hello"}
IM_END = 2  # <|im_end|>


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_source(resolve_model("default"))


def test_completion_response_body(tok: Tokenizer) -> None:
    req = parse_completion_request({**COMPLETION, "logprobs": 1}, SERVED)
    hello, world = tok.encode(" Hello world", add_special_tokens=False)
    choice = ChoiceResult(
        index=0,
        text=" Hello world",
        token_ids=[hello, world],
        finish_reason="length",
        logprobs=[-0.5, -1.25],
        top_logprobs=[[(hello, -0.5)], [(7, -0.75)]],
    )
    body = completion_body(req, [choice], tok, prompt_tokens=3, request_id="cmpl-1", created=9)
    assert body == {
        "id": "cmpl-1",
        "object": "text_completion",
        "created": 9,
        "model": "default",
        "choices": [
            {
                "index": 0,
                "text": " Hello world",
                "logprobs": {
                    "tokens": [" Hello", " world"],
                    "token_logprobs": [-0.5, -1.25],
                    "top_logprobs": [
                        {" Hello": -0.5},
                        {" world": -1.25, tok.decode([7], skip_special_tokens=False): -0.75},
                    ],
                    "text_offset": [0, 6],
                },
                "finish_reason": "length",
            }
        ],
        "usage": {"prompt_tokens": 3, "completion_tokens": 2, "total_tokens": 5},
    }
    plain = parse_completion_request(COMPLETION, SERVED)
    body = completion_body(plain, [choice, choice], tok, prompt_tokens=3)
    assert body["choices"][0]["logprobs"] is None and body["id"].startswith("cmpl-")
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 4, "total_tokens": 7}


def test_chat_response_body(tok: Tokenizer) -> None:
    req = parse_chat_request(
        {**CHAT, "logprobs": True, "top_logprobs": 1, "return_tokens_as_token_ids": True}, SERVED
    )
    (cafe,) = tok.encode("é", add_special_tokens=False)[:1] or [0]
    choice = ChoiceResult(
        index=0,
        text="ok",
        token_ids=[cafe, 2],
        finish_reason="stop",
        logprobs=[-0.1, float("-inf")],
        top_logprobs=[[(cafe, -0.1)], [(2, -3.0)]],
    )
    body = chat_body(req, [choice], tok, prompt_tokens=10, request_id="chatcmpl-1", created=1)
    assert body["object"] == "chat.completion" and body["model"] == "default"
    (c,) = body["choices"]
    assert c["message"] == {"role": "assistant", "content": "ok"} and c["finish_reason"] == "stop"
    first, second = c["logprobs"]["content"]
    assert first["token"] == f"token_id:{cafe}" and first["logprob"] == -0.1
    assert bytes(first["bytes"]) == "é".encode()
    assert first["top_logprobs"] == [
        {"token": f"token_id:{cafe}", "logprob": -0.1, "bytes": first["bytes"]}
    ]
    assert second["logprob"] == -9999.0  # JSON has no -inf
    assert bytes(second["bytes"]) == b"<|im_end|>"
    assert body["usage"] == {"prompt_tokens": 10, "completion_tokens": 2, "total_tokens": 12}
    no_logprobs = chat_body(parse_chat_request(CHAT, SERVED), [choice], tok, prompt_tokens=10)
    assert no_logprobs["choices"][0]["logprobs"] is None
    assert no_logprobs["id"].startswith("chatcmpl-")


def events(data: bytes) -> list[dict]:
    """The JSON objects of SSE bytes (every event a `data:` line and a blank line)."""
    chunks = data.decode().split("\n\n")
    assert chunks[-1] == "" and all(c.startswith("data: ") for c in chunks[:-1])
    return [json.loads(c.removeprefix("data: ")) for c in chunks[:-1]]


def test_sse_framing_keeps_non_ascii_text() -> None:
    data = sse({"text": "日本語 ☕"})
    assert data == 'data: {"text": "日本語 ☕"}\n\n'.encode()
    assert events(data) == [{"text": "日本語 ☕"}]
    assert DONE == b"data: [DONE]\n\n"


def test_completion_delta_chunks_carry_text_and_running_text_offsets(tok: Tokenizer) -> None:
    req = parse_completion_request({**COMPLETION, "logprobs": 0}, SERVED)
    out = tok.encode(" Hello world again", add_special_tokens=False)
    choice = Choice(1, tok.encode("Hello"), SamplingParams(logprobs=0), req, tok)
    chunks = []
    for i, (t, last) in enumerate(zip(out, [False] * (len(out) - 1) + [True])):
        delta = choice.add([t], [-0.5 * (i + 1)], [[]], finished=last, finish_reason="length")
        chunks.append(delta_chunk(req, "cmpl-9", 42, choice, delta, tok))
    for chunk in chunks:
        assert {k: chunk[k] for k in ("id", "object", "created", "model")} == {
            "id": "cmpl-9",
            "object": "text_completion",
            "created": 42,
            "model": "default",
        }
    bodies = [c["choices"][0] for c in chunks]
    assert all(b["index"] == 1 for b in bodies)
    assert "".join(b["text"] for b in bodies) == " Hello world again"
    assert [b["finish_reason"] for b in bodies] == [None] * (len(out) - 1) + ["length"]
    tokens = [t for b in bodies for t in b["logprobs"]["tokens"]]
    offsets = [o for b in bodies for o in b["logprobs"]["text_offset"]]
    # Offsets count from the start of the choice, across chunks, as in the whole body.
    assert offsets == [sum(len(t) for t in tokens[:i]) for i in range(len(tokens))]
    assert [lp for b in bodies for lp in b["logprobs"]["token_logprobs"]] == [
        -0.5 * (i + 1) for i in range(len(out))
    ]
    whole = completion_body(req, [choice.result()], tok, prompt_tokens=1)
    assert whole["choices"][0]["logprobs"]["text_offset"] == offsets


def test_chat_delta_role_and_usage_chunks(tok: Tokenizer) -> None:
    req = parse_chat_request(
        {**CHAT, "stream": True, "stream_options": {"include_usage": True}}, SERVED
    )
    assert role_chunk(req, "chatcmpl-1", 7, 2) == {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 7,
        "model": "default",
        "choices": [
            {
                "index": 2,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": None,
                "finish_reason": None,
            }
        ],
    }
    choice = Choice(0, [1, 2], SamplingParams(), req, tok)
    delta = choice.add(tok.encode("Hi there", add_special_tokens=False))
    (body,) = delta_chunk(req, "chatcmpl-1", 7, choice, delta, tok)["choices"]
    assert body == {"index": 0, "delta": {"content": "Hi there"}, "logprobs": None,
                    "finish_reason": None}  # fmt: skip
    # The last delta often has no text: its chunk says only why the choice finished.
    delta = choice.add([IM_END], finished=True, finish_reason="stop")
    (body,) = delta_chunk(req, "chatcmpl-1", 7, choice, delta, tok)["choices"]
    assert body["delta"] == {} and body["finish_reason"] == "stop"
    usage = usage_chunk(req, "chatcmpl-1", 7, prompt_tokens=5, completion_tokens=3)
    assert usage["choices"] == [] and usage["object"] == "chat.completion.chunk"
    assert usage["usage"] == {"prompt_tokens": 5, "completion_tokens": 3, "total_tokens": 8}


def test_error_event_is_the_openai_error_body() -> None:
    error = RequestError("the request timed out", code=504, type="timeout")
    assert events(error_event(error)) == [
        {"error": {"message": "the request timed out", "type": "timeout", "param": None,
                   "code": 504}}
    ]  # fmt: skip
