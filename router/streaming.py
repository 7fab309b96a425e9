"""Turning the workers' token ids into OpenAI response text, streamed or whole.

Owns `ChoiceStream` (one choice's tokens, logprobs and text, detokenized incrementally with stop
strings applied), `choice_deltas` (the loop that applies a job's events to its choices, cuts a
choice at its stop string and aborts it on the worker, and turns failures into RequestErrors),
the SSE chunk bodies of both endpoints (`text_completion` chunks, `chat.completion.chunk`s with
the role first, the usage chunk, the error event, `[DONE]`) and `sse_events`, the stream a
`StreamingResponse` sends. Called by `router.app`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any

from common.api.detokenizer import Detokenizer
from common.api.openai_protocol import (
    ChoiceResult,
    GenerationRequest,
    RequestError,
    chat_logprobs,
    completion_logprobs,
    usage_body,
)
from common.api.tokenizer import Tokenizer
from common.protocol import TokenOutput
from common.sampling_params import SamplingParams
from router.dispatch import FlightFailed, Job
from router.metrics import RequestTimer

DONE = b"data: [DONE]\n\n"


@dataclass
class Delta:
    """What one TokenOutput added to a choice."""

    text: str
    first_token: int  # index in `token_ids` of the first new token
    finish_reason: str | None


class ChoiceStream:
    """One choice as its tokens arrive."""

    def __init__(
        self,
        index: int,
        prompt_token_ids: list[int],
        params: SamplingParams,
        request: GenerationRequest,
        tokenizer: Tokenizer,
    ) -> None:
        self.index = index
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.want_logprobs = params.logprobs is not None
        self.detok = Detokenizer(
            tokenizer,
            prompt_token_ids,
            skip_special_tokens=request.skip_special_tokens,
            stop=request.stop,
            include_stop_str_in_output=request.include_stop_str_in_output,
            min_tokens=params.min_tokens,
        )
        self.token_ids: list[int] = []
        self.logprobs: list[float | None] = []
        self.top_logprobs: list[list[tuple[int, float]] | None] = []
        self.finish_reason: str | None = None
        self.token_text_len = 0  # chars of the token strings streamed (completions text_offset)

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    def add(self, out: TokenOutput) -> Delta:
        first = len(self.token_ids)
        text = []
        for j, token_id in enumerate(out.token_ids):
            self.token_ids.append(token_id)
            if self.want_logprobs:
                self.logprobs.append(out.logprobs[j] if j < len(out.logprobs) else None)
                self.top_logprobs.append(out.top_logprobs[j] if j < len(out.top_logprobs) else None)
            text.append(self.detok.add_token(token_id))
            if self.detok.stopped:
                break
        if self.detok.stopped:
            self.finish_reason = "stop"
        elif out.finished:
            text.append(self.detok.finish())
            self.finish_reason = out.finish_reason or "stop"
        return Delta("".join(text), first, self.finish_reason)

    def result(self, first_token: int = 0, text: str | None = None) -> ChoiceResult:
        """The choice (or its tokens from `first_token` on) as the body builders take it."""
        return ChoiceResult(
            index=self.index,
            text=self.detok.text if text is None else text,
            token_ids=self.token_ids[first_token:],
            finish_reason=self.finish_reason,
            logprobs=self.logprobs[first_token:] if self.want_logprobs else None,
            top_logprobs=self.top_logprobs[first_token:] if self.want_logprobs else None,
        )


async def choice_deltas(
    job: Job, choices: Sequence[ChoiceStream], timeout_s: float, timer: RequestTimer
) -> AsyncIterator[tuple[ChoiceStream, Delta]]:
    """Apply the job's events until every choice is done; RequestError on failure or timeout."""
    clock = timer.metrics.clock
    deadline = clock() + timeout_s
    remaining = sum(not c.done for c in choices)
    while remaining:
        index, event = await job.next_event(deadline - clock())
        if isinstance(event, FlightFailed):
            raise RequestError(event.reason, code=event.code, type="service_unavailable")
        choice = choices[index]
        if choice.done:
            continue
        timer.tokens(index, len(event.token_ids))
        delta = choice.add(event)
        if choice.done:
            remaining -= 1
            job.finish(index)  # aborts it on the worker when a stop string cut it short
        yield choice, delta


# ---- chunks -------------------------------------------------------------------------------------


def sse(obj: Any) -> bytes:
    return b"data: " + json.dumps(obj, ensure_ascii=False).encode() + b"\n\n"


def _chunk_head(request: GenerationRequest, response_id: str, created: int) -> dict[str, Any]:
    kind = "chat.completion.chunk" if request.endpoint == "chat" else "text_completion"
    return {"id": response_id, "object": kind, "created": created, "model": request.model}


def delta_chunk(
    request: GenerationRequest,
    response_id: str,
    created: int,
    choice: ChoiceStream,
    delta: Delta,
    tokenizer: Tokenizer,
) -> dict[str, Any]:
    """The chunk carrying one delta of one choice."""
    part = choice.result(delta.first_token, delta.text)
    if request.endpoint == "chat":
        body = {
            "index": choice.index,
            "delta": {"content": delta.text} if delta.text or not delta.finish_reason else {},
            "logprobs": chat_logprobs(request, part, tokenizer),
            "finish_reason": delta.finish_reason,
        }
    else:
        logprobs = completion_logprobs(request, part, tokenizer)
        if logprobs is not None:
            logprobs["text_offset"] = [o + choice.token_text_len for o in logprobs["text_offset"]]
            choice.token_text_len += sum(len(t) for t in logprobs["tokens"])
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
    return {
        **_chunk_head(request, response_id, created),
        "choices": [],
        "usage": usage_body(prompt_tokens, completion_tokens),
    }


async def sse_events(
    request: GenerationRequest,
    response_id: str,
    created: int,
    job: Job,
    choices: Sequence[ChoiceStream],
    tokenizer: Tokenizer,
    prompt_tokens: int,
    timeout_s: float,
    timer: RequestTimer,
) -> AsyncIterator[bytes]:
    """The SSE body of a streamed response; the job is closed (aborting what runs) at the end.

    A failure mid-stream becomes an error event; the stream then ends with [DONE] as usual.
    """
    try:
        if request.endpoint == "chat":
            for choice in choices:
                yield sse(role_chunk(request, response_id, created, choice.index))
        async for choice, delta in choice_deltas(job, choices, timeout_s, timer):
            new_tokens = len(choice.token_ids) > delta.first_token
            if delta.text or delta.finish_reason or (choice.want_logprobs and new_tokens):
                yield sse(delta_chunk(request, response_id, created, choice, delta, tokenizer))
        completion_tokens = sum(len(c.token_ids) for c in choices)
        timer.finished(prompt_tokens, completion_tokens, [c.finish_reason or "" for c in choices])
        if request.include_usage:
            yield sse(usage_chunk(request, response_id, created, prompt_tokens, completion_tokens))
    except RequestError as e:
        timer.failed(e.code)
        yield sse(e.body())
    finally:
        job.close()  # also when the client went away: abort on the workers
    yield DONE
