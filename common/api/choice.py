"""One choice of a request as its tokens arrive: the one accumulator of generated output.

Owns `Choice`: the token ids, logprobs and text of one choice, detokenized incrementally with the
request's stop strings applied (the output is cut at the first stop string and the choice is done,
finish_reason "stop"; tokens after the one that completed it are dropped), and its finish reason.
`Choice.add` takes one batch of new tokens and returns the `Delta` it made safe to show;
`Choice.result` gives the `ChoiceResult` that the body builders in `common.api.responses` take.
A chat request with tools has its output read by a tool-call parser (`common.api.tool_parsers`):
deltas and results then carry the content outside the calls and the `ToolCall`s.

With `echo` (completions) the choice shows its prompt first: the prompt text comes with the first
delta (`Delta.echo`), and results carry the prompt's token ids and logprobs for the body builders;
with `echo_only` (max_tokens 0) the prompt is all it shows, and the one token the engine computed
is dropped (finish_reason "length", as vLLM). Prompt logprobs arrive with the first tokens.

Used by both sides that generate text: the router (`router.streaming`, fed by the decode workers'
`TokenOutput`s) and `pdserve run-batch` (`common.runtime.run_batch`, fed by the engine's
`RequestOutput`s). Each caller aborts the engine request itself when a stop string cut it short.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from common.api.detokenizer import Detokenizer
from common.api.requests import GenerationRequest
from common.api.tokenizer import Tokenizer
from common.api.tool_parsers import ToolCall, output_parser
from common.sampling_params import SamplingParams

TopLogprobs = list[tuple[int, float]]  # (token id, logprob) of the best alternatives
# Per prompt token after the first: (logprob, rank, best alternatives) (engine.prompt_logprobs)
PromptLogprobs = list[tuple[float, int, TopLogprobs]]


@dataclass
class ChoiceResult:
    """What the engine and detokenizer produced for one choice (or a part of it)."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[float | None] | None = None  # per output token, when asked for
    top_logprobs: list[TopLogprobs | None] | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)  # chat with tools: the calls made
    echo_token_ids: list[int] = field(default_factory=list)  # the prompt shown before `token_ids`
    prompt_token_ids: list[int] = field(default_factory=list)
    prompt_logprobs: PromptLogprobs | None = None  # when computed (prompt_logprobs or echo)


@dataclass(slots=True)
class Delta:
    """What one `Choice.add` added to a choice (one a streamed token: slots, nothing to build)."""

    text: str  # the text it made safe to show (often '' while a character or stop is pending)
    first_token: int  # index in `Choice.token_ids` of the first token it added
    finish_reason: str | None  # set on the delta that finished the choice
    tool_calls: Sequence[ToolCall] = ()  # calls it completed
    first_tool_call: int = 0  # index among the choice's calls of the first of them
    echo: bool = False  # `text` starts with the echoed prompt (the choice's first delta)


class Choice:
    """One choice (index `index` of its request) as its tokens arrive."""

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
        self.top_logprobs: list[TopLogprobs | None] = []
        self.finish_reason: str | None = None
        # With tools, the output is read by a tool-call parser: `text` is then the content, the
        # text outside the calls, and a choice that made calls finishes with "tool_calls".
        self.tool_parser = output_parser(request.tools)
        self.tool_calls: list[ToolCall] = []
        self._content = ""
        self.echo = request.echo
        self.echo_only = request.echo_only
        self.echo_pending = request.echo  # the prompt is not shown yet
        self.prompt_text = _prompt_text(request, index, prompt_token_ids, tokenizer)
        self.prompt_logprobs: PromptLogprobs | None = None
        # No logprobs, echo or tools: each add is text only (`_add_text`).
        self._plain = not (
            self.want_logprobs or self.echo or self.echo_only or self.tool_parser is not None
        )
        # Chars of the token strings already streamed: where the next streamed completions chunk's
        # logprobs text_offset starts (kept by common.api.responses.delta_chunk).
        self.streamed_token_chars = 0

    @property
    def done(self) -> bool:
        return self.finish_reason is not None

    @property
    def text(self) -> str:
        """The output text so far (cut at the stop string once one matched), after the prompt
        when echoed; with a tool parser, the content shown so far."""
        return self.prompt_text + (self.detok.text if self.tool_parser is None else self._content)

    def add(
        self,
        token_ids: Sequence[int],
        logprobs: Sequence[float | None] = (),
        top_logprobs: Sequence[TopLogprobs | None] = (),
        finished: bool = False,
        finish_reason: str | None = None,
        prompt_logprobs: PromptLogprobs | None = None,
    ) -> Delta:
        """Append new tokens (with their logprobs when asked for); `finished`: no more will come.

        A stop string completed by one of the tokens finishes the choice with "stop" there, even
        when the generation was not finished. Adding to a done choice is an error.
        """
        if self.finish_reason is not None:
            raise RuntimeError(f"choice {self.index} is done; no more tokens")
        if self._plain and prompt_logprobs is None:  # nearly every streamed token: text only
            return self._add_text(token_ids, finished, finish_reason)
        if prompt_logprobs is not None:
            self.prompt_logprobs = list(prompt_logprobs)
        echo, self.echo_pending = self.echo_pending, False
        if self.echo_only:
            self.finish_reason = "length"
            return Delta(self.prompt_text, 0, self.finish_reason, echo=True)
        first = len(self.token_ids)
        text = []
        for j, token_id in enumerate(token_ids):
            self.token_ids.append(token_id)
            if self.want_logprobs:
                # Missing entries (a sender that had none for a token) read as unknown.
                self.logprobs.append(logprobs[j] if j < len(logprobs) else None)
                self.top_logprobs.append(top_logprobs[j] if j < len(top_logprobs) else None)
            text.append(self.detok.add_token(token_id))
            if self.detok.stopped:
                break
        if self.detok.stopped:
            self.finish_reason = "stop"
        elif finished:
            text.append(self.detok.finish())
            self.finish_reason = finish_reason or "stop"
        if self.tool_parser is not None:  # chat only: never with echo (completions only)
            return self._read_tool_calls("".join(text), first)
        if echo:
            text.insert(0, self.prompt_text)
        return Delta("".join(text), first, self.finish_reason, echo=echo)

    def _add_text(
        self, token_ids: Sequence[int], finished: bool, finish_reason: str | None
    ) -> Delta:
        """`add` for a choice without logprobs, echo or tools: what `add` does, fewer steps."""
        ids, detok = self.token_ids, self.detok
        first = len(ids)
        if len(token_ids) == 1:
            ids.append(token_ids[0])
            text = detok.add_token(token_ids[0])
        else:
            texts = []
            for token_id in token_ids:
                ids.append(token_id)
                texts.append(detok.add_token(token_id))
                if detok.stop_reason is not None:
                    break
            text = "".join(texts)
        if detok.stop_reason is not None:
            self.finish_reason = "stop"
        elif finished:
            text += detok.finish()
            self.finish_reason = finish_reason or "stop"
        return Delta(text, first, self.finish_reason)

    def _read_tool_calls(self, text: str, first: int) -> Delta:
        """The delta of new output `text` as the tool parser reads it: content and calls."""
        assert self.tool_parser is not None
        parsed = self.tool_parser.feed(text)
        if self.done:
            parsed += self.tool_parser.finish()
        first_call = len(self.tool_calls)
        self.tool_calls.extend(parsed.calls)
        self._content += parsed.content
        if self.done and self.tool_calls and self.finish_reason == "stop":
            self.finish_reason = "tool_calls"
        return Delta(
            parsed.content, first, self.finish_reason, tool_calls=parsed.calls,
            first_tool_call=first_call,
        )  # fmt: skip

    def result(
        self, first_token: int = 0, text: str | None = None, with_prompt: bool | None = None
    ) -> ChoiceResult:
        """The choice (or its tokens from `first_token` on, with `text`) for the body builders.

        The whole choice shows the echoed prompt; a part of it when `with_prompt` (its first).
        """
        shows_prompt = self.echo and (text is None if with_prompt is None else with_prompt)
        return ChoiceResult(
            index=self.index,
            text=self.text if text is None else text,
            token_ids=self.token_ids[first_token:],
            finish_reason=self.finish_reason,
            logprobs=self.logprobs[first_token:] if self.want_logprobs else None,
            top_logprobs=self.top_logprobs[first_token:] if self.want_logprobs else None,
            tool_calls=list(self.tool_calls),
            echo_token_ids=self.prompt_token_ids if shows_prompt else [],
            prompt_token_ids=self.prompt_token_ids,
            prompt_logprobs=self.prompt_logprobs,
        )


def _prompt_text(
    request: GenerationRequest, index: int, prompt_token_ids: list[int], tokenizer: Tokenizer
) -> str:
    """The text echo shows: the prompt as sent (choice `index` is choice index % n of prompt
    index // n, as the router and run-batch number them), token-id prompts decoded."""
    if not request.echo:
        return ""
    prompt = request.prompts[index // request.n]
    if isinstance(prompt, str):
        return prompt
    return tokenizer.decode(prompt_token_ids, skip_special_tokens=False)
