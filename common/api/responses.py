"""Engine results in, OpenAI response bodies out: whole bodies and the SSE chunks of a stream.

Owns the non-streamed `text_completion` and `chat.completion` bodies with usage and logprobs (in
each endpoint's own format; with echo, a completion's logprobs cover its prompt first, null for
the first prompt token, as vLLM) and vLLM's `prompt_logprobs` (on each completions choice, on the
chat response), and the streamed ones: the SSE framing, the `text_completion` chunk
and the `chat.completion.chunk` of one choice's delta, the chat stream's opening role chunk, the
usage chunk (`stream_options.include_usage`), the error event and `[DONE]`. Takes `ChoiceResult`s
and `Choice`s from `common.api.choice`. No HTTP: the router (`router.app`, `router.streaming`) and
`pdserve run-batch` call it.

Tool calls (chat with tools): `message.tool_calls` with content null when there is none; streamed,
a call is one delta carrying its index, id, type, name and whole arguments.
"""

from __future__ import annotations

import itertools
import json
import time
import uuid
from typing import Any

from common.api.choice import Choice, ChoiceResult, Delta, TopLogprobs
from common.api.detokenizer import token_bytes, token_text
from common.api.requests import GenerationRequest, RequestError
from common.api.tokenizer import Tokenizer

MIN_LOGPROB = -9999.0  # what vLLM reports for -inf (JSON has no infinity)
DONE = b"data: [DONE]\n\n"  # the last event of every stream


# ---- whole bodies -------------------------------------------------------------------------------


def usage_body(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def completion_body(
    request: GenerationRequest,
    choices: list[ChoiceResult],
    tokenizer: Tokenizer,
    prompt_tokens: int,
    request_id: str | None = None,
    created: int | None = None,
) -> dict[str, Any]:
    """A non-streamed `text_completion` body; `prompt_tokens` counts every prompt once."""
    with_prompt_logprobs = request.prompt_logprobs is not None
    return {
        "id": request_id or f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()) if created is None else created,
        "model": request.model,
        "choices": [
            {
                "index": c.index,
                "text": c.text,
                "logprobs": completion_logprobs(request, c, tokenizer),
                "finish_reason": c.finish_reason,
                **(
                    {"prompt_logprobs": prompt_logprobs_body(request, c, tokenizer)}
                    if with_prompt_logprobs
                    else {}
                ),
            }
            for c in choices
        ],
        "usage": usage_body(prompt_tokens, sum(len(c.token_ids) for c in choices)),
    }


def chat_body(
    request: GenerationRequest,
    choices: list[ChoiceResult],
    tokenizer: Tokenizer,
    prompt_tokens: int,
    request_id: str | None = None,
    created: int | None = None,
) -> dict[str, Any]:
    """A non-streamed `chat.completion` body."""
    extra = {}
    if request.prompt_logprobs is not None and choices:  # the choices share one prompt
        extra["prompt_logprobs"] = prompt_logprobs_body(request, choices[0], tokenizer)
    return {
        "id": request_id or f"chatcmpl-{uuid.uuid4().hex}",
        "object": "chat.completion",
        "created": int(time.time()) if created is None else created,
        "model": request.model,
        "choices": [
            {
                "index": c.index,
                "message": chat_message(c),
                "logprobs": chat_logprobs(request, c, tokenizer),
                "finish_reason": c.finish_reason,
            }
            for c in choices
        ],
        "usage": usage_body(prompt_tokens, sum(len(c.token_ids) for c in choices)),
        **extra,
    }


def chat_message(c: ChoiceResult) -> dict[str, Any]:
    """A chat choice's message: with tool calls, content is null when there is none."""
    if not c.tool_calls:
        return {"role": "assistant", "content": c.text}
    return {
        "role": "assistant",
        "content": c.text or None,
        "tool_calls": [call.body() for call in c.tool_calls],
    }


def _logprob(v: float | None) -> float:
    return MIN_LOGPROB if v is None or v < MIN_LOGPROB else v


def _token_str(request: GenerationRequest, tokenizer: Tokenizer, token_id: int) -> str:
    if request.return_tokens_as_token_ids:
        return f"token_id:{token_id}"
    return token_text(tokenizer, token_id)


def completion_logprobs(
    request: GenerationRequest, c: ChoiceResult, tokenizer: Tokenizer
) -> dict[str, list] | None:
    """A choice's `logprobs` in the /v1/completions format, or None when not asked for: its
    echoed prompt's tokens first (when it has one), then its output tokens."""
    if request.num_top_logprobs is None or c.logprobs is None:
        return None
    tokens: list[str] = []
    token_logprobs: list[float | None] = []
    top_logprobs: list[dict[str, float] | None] = []

    def add(token_id: int, lp: float | None, alts: TopLogprobs | None) -> None:
        text = _token_str(request, tokenizer, token_id)
        tokens.append(text)
        token_logprobs.append(_logprob(lp))
        # As vLLM: the token itself first, then the best alternatives.
        top = {text: _logprob(lp)}
        for alt_id, alt_lp in alts or []:
            top.setdefault(_token_str(request, tokenizer, alt_id), _logprob(alt_lp))
        top_logprobs.append(top)

    scores = c.prompt_logprobs or []
    for j, token_id in enumerate(c.echo_token_ids):
        if 0 < j <= len(scores):
            lp, _, alts = scores[j - 1]
            add(token_id, lp, alts[: request.num_top_logprobs])
        else:  # the first prompt token has no context: null, as vLLM
            tokens.append(_token_str(request, tokenizer, token_id))
            token_logprobs.append(None)
            top_logprobs.append(None)
    for i, token_id in enumerate(c.token_ids):
        add(token_id, c.logprobs[i], c.top_logprobs[i] if c.top_logprobs else None)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": list(itertools.accumulate((len(t) for t in tokens[:-1]), initial=0))
        if tokens
        else [],
    }


def prompt_logprobs_body(
    request: GenerationRequest, c: ChoiceResult, tokenizer: Tokenizer
) -> list[dict[int, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs`: null for the first prompt token, then per token a map from
    token id to {logprob, rank, decoded_token} holding the token itself and its best
    `request.prompt_logprobs` alternatives (ranks 1..n). None when they were not computed."""
    if c.prompt_logprobs is None:
        return None

    def ranked(token_id: int, lp: float, rank: int) -> dict[str, Any]:
        text = _token_str(request, tokenizer, token_id)
        return {"logprob": _logprob(lp), "rank": rank, "decoded_token": text}

    body: list[dict[int, dict[str, Any]] | None] = [None]
    num_top = request.prompt_logprobs or 0
    for token_id, (lp, rank, alts) in zip(c.prompt_token_ids[1:], c.prompt_logprobs):
        entry = {token_id: ranked(token_id, lp, rank)}
        for alt_rank, (alt_id, alt_lp) in enumerate(alts[:num_top], 1):
            entry.setdefault(alt_id, ranked(alt_id, alt_lp, alt_rank))
        body.append(entry)
    return body


def chat_logprobs(
    request: GenerationRequest, c: ChoiceResult, tokenizer: Tokenizer
) -> dict[str, list] | None:
    """A choice's `logprobs` in the /v1/chat/completions format, or None when not asked for."""
    if request.num_top_logprobs is None or c.logprobs is None:
        return None

    def entry(token_id: int, lp: float | None) -> dict[str, Any]:
        return {
            "token": _token_str(request, tokenizer, token_id),
            "logprob": _logprob(lp),
            "bytes": token_bytes(tokenizer, token_id),
        }

    content = []
    for i, token_id in enumerate(c.token_ids):
        alts = (c.top_logprobs[i] if c.top_logprobs else None) or []
        content.append(
            {**entry(token_id, c.logprobs[i]), "top_logprobs": [entry(t, lp) for t, lp in alts]}
        )
    return {"content": content}


# ---- SSE chunks ---------------------------------------------------------------------------------


_SSE_JSON = json.JSONEncoder(ensure_ascii=False)  # json.dumps would build one per call


def sse(obj: Any) -> bytes:
    """One server-sent event carrying `obj` as JSON."""
    return b"data: " + _SSE_JSON.encode(obj).encode() + b"\n\n"


def _chunk_head(request: GenerationRequest, response_id: str, created: int) -> dict[str, Any]:
    kind = "chat.completion.chunk" if request.endpoint == "chat" else "text_completion"
    return {"id": response_id, "object": kind, "created": created, "model": request.model}


def delta_chunk(
    request: GenerationRequest,
    response_id: str,
    created: int,
    choice: Choice,
    delta: Delta,
    tokenizer: Tokenizer,
) -> dict[str, Any]:
    """The chunk carrying one delta of one choice.

    Completions logprobs' `text_offset` counts from the start of the choice, so this advances
    `choice.streamed_token_chars`: call it once per delta, in order.
    """
    part = choice.result(delta.first_token, delta.text, with_prompt=delta.echo)
    if request.endpoint == "chat":
        message: dict[str, Any] = {}
        if delta.text or not (delta.finish_reason or delta.tool_calls):
            message["content"] = delta.text
        if delta.tool_calls:
            first = delta.first_tool_call
            message["tool_calls"] = [
                call.delta_body(first + k) for k, call in enumerate(delta.tool_calls)
            ]
        body = {
            "index": choice.index,
            "delta": message,
            "logprobs": chat_logprobs(request, part, tokenizer),
            "finish_reason": delta.finish_reason,
        }
    else:
        logprobs = completion_logprobs(request, part, tokenizer)
        if logprobs is not None:
            start = choice.streamed_token_chars
            logprobs["text_offset"] = [o + start for o in logprobs["text_offset"]]
            choice.streamed_token_chars += sum(len(t) for t in logprobs["tokens"])
        body = {
            "index": choice.index,
            "text": delta.text,
            "logprobs": logprobs,
            "finish_reason": delta.finish_reason,
        }
    return {**_chunk_head(request, response_id, created), "choices": [body]}


def role_chunk(
    request: GenerationRequest, response_id: str, created: int, index: int
) -> dict[str, Any]:
    """Chat streams open each choice with the assistant role."""
    body = {
        "index": index,
        "delta": {"role": "assistant", "content": ""},
        "logprobs": None,
        "finish_reason": None,
    }
    return {**_chunk_head(request, response_id, created), "choices": [body]}


def usage_chunk(
    request: GenerationRequest,
    response_id: str,
    created: int,
    prompt_tokens: int,
    completion_tokens: int,
) -> dict[str, Any]:
    """The last chunk before [DONE] when the client asked for stream_options.include_usage."""
    return {
        **_chunk_head(request, response_id, created),
        "choices": [],
        "usage": usage_body(prompt_tokens, completion_tokens),
    }


def error_event(error: RequestError) -> bytes:
    """A failure after the stream began: its OpenAI error body as an event (then [DONE])."""
    return sse(error.body())
