"""OpenAI request bodies in, validated requests out.

Owns the strict validation of `/v1/completions` and `/v1/chat/completions` bodies (types, ranges,
served model names) and the `GenerationRequest` they become; `RequestError` and the typed field
readers live in `common.api.fields` (shared with `structured` and `tools`). No HTTP and no
tokenizer here: the router (`router.app`) and `pdserve run-batch` (`common.runtime.run_batch`)
both call it; `common.api.prompts` then turns a request into engine inputs. Unknown body fields
are ignored (OpenAI clients send extras); known fields we cannot honour (suffix, best_of,
functions, ...) are rejected rather than silently dropped. Every integer and float field is
bounded here, before anything reaches a worker (see `common.api.fields` for the bounds' reasons).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from common.api.fields import MAX_INT32, RequestError
from common.api.fields import bool_field as _bool
from common.api.fields import float_field as _float
from common.api.fields import int_field as _int
from common.api.fields import is_int as _is_int
from common.api.fields import json_object as _object
from common.api.structured import parse_structured_output
from common.api.tools import ToolRequest, assistant_tool_calls, parse_tools, tool_message
from common.sampling_params import (
    MAX_LOGIT_BIAS,
    MAX_LOGIT_BIAS_VALUE,
    MAX_TOP_LOGPROBS,
    SamplingParams,
)

COMPLETIONS_URL = "/v1/completions"
CHAT_URL = "/v1/chat/completions"
MAX_N = 16  # choices per prompt
MAX_STOP = 16  # stop strings per request (OpenAI allows 4, vLLM any number)
MAX_STOP_TOKEN_IDS = 256
DEFAULT_COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions
# developer is OpenAI's newer name for system; tool carries a tool call's result (common.api.tools)
_CHAT_ROLES = {
    "system": "system", "developer": "system", "user": "user", "assistant": "assistant",
    "tool": "tool",
}  # fmt: skip


@dataclass
class GenerationRequest:
    """A validated completions or chat request, before tokenization.

    `params.max_tokens` is a placeholder until `prompts.engine_inputs` resolves it against the
    context (`max_tokens` None means: whatever room the context leaves, the chat default).
    """

    endpoint: Literal["completions", "chat"]
    model: str
    params: SamplingParams
    max_tokens: int | None
    prompts: list[str | list[int]] = field(default_factory=list)  # completions only
    messages: list[dict[str, Any]] = field(default_factory=list)  # chat: {role, content, ...}
    add_generation_prompt: bool = True
    n: int = 1
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    return_tokens_as_token_ids: bool = False
    echo: bool = False  # completions: the prompt (and its logprobs) before each choice's output
    echo_only: bool = False  # echo with max_tokens 0: the prompt alone (a token computed, dropped)
    prompt_logprobs: int | None = None  # alternatives in the response's prompt_logprobs (vLLM)
    stream: bool = False
    include_usage: bool = False
    user: str | None = None
    tools: ToolRequest | None = None  # chat only: common.api.tools

    @property
    def num_top_logprobs(self) -> int | None:
        """Alternatives per token to report; None when logprobs were not asked for."""
        return self.params.logprobs


def parse_request(
    url: str, body: Any, served_model_names: list[str], tool_call_parser: str = ""
) -> GenerationRequest:
    """Validate a body for `url` (COMPLETIONS_URL or CHAT_URL); RequestError when it is bad.
    `tool_call_parser`: the tool-call format, hermes or generic ("" is generic), as
    `common.api.prompts.tool_call_format` resolves `--tool-call-parser` for the chat template."""
    if url == COMPLETIONS_URL:
        return parse_completion_request(body, served_model_names)
    if url == CHAT_URL:
        return parse_chat_request(body, served_model_names, tool_call_parser)
    raise RequestError(f"unknown url {url!r}; supported: {COMPLETIONS_URL}, {CHAT_URL}", "url", 404)


def parse_completion_request(body: Any, served_model_names: list[str]) -> GenerationRequest:
    """Validate a `/v1/completions` body."""
    body = _object(body)
    model = _model(body, served_model_names)
    prompts = _prompts(body.get("prompt"))
    echo = _bool(body, "echo", False)
    if body.get("suffix") is not None:
        raise RequestError("suffix is not supported", "suffix")
    best_of = _int(body, "best_of", None, lo=1, hi=MAX_INT32)
    if best_of is not None and best_of > 1:
        raise RequestError("best_of is not supported; use n", "best_of")
    logprobs = _int(body, "logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
    max_tokens = _int(
        body, "max_tokens", DEFAULT_COMPLETION_MAX_TOKENS, lo=0 if echo else 1, hi=MAX_INT32
    )
    request = _common(
        body, "completions", model, max_tokens or 1, logprobs, prompts=prompts, echo=echo,
        echo_only=max_tokens == 0,
    )  # fmt: skip
    return _with_prompt_logprobs(request, body, logprobs if echo else None)


def parse_chat_request(
    body: Any, served_model_names: list[str], tool_call_parser: str = ""
) -> GenerationRequest:
    """Validate a `/v1/chat/completions` body."""
    body = _object(body)
    model = _model(body, served_model_names)
    messages = _messages(body.get("messages"))
    tools = parse_tools(body, tool_call_parser)
    want_logprobs = _bool(body, "logprobs", False)
    top = _int(body, "top_logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
    if top and not want_logprobs:
        raise RequestError("top_logprobs requires logprobs to be true", "top_logprobs")
    logprobs = (top or 0) if want_logprobs else None
    max_tokens = _int(body, "max_completion_tokens", None, lo=1, hi=MAX_INT32)
    if max_tokens is None:
        max_tokens = _int(body, "max_tokens", None, lo=1, hi=MAX_INT32)
    request = _common(
        body,
        "chat",
        model,
        max_tokens,
        logprobs,
        messages=messages,
        add_generation_prompt=_bool(body, "add_generation_prompt", True),
        tools=tools,
    )
    if tools is not None:
        tools.constrain(request.params)
    return _with_prompt_logprobs(request, body, None)


def _with_prompt_logprobs(
    request: GenerationRequest, body: dict, echo_logprobs: int | None
) -> GenerationRequest:
    """vLLM's `prompt_logprobs` (alternatives per prompt token; as vLLM, refused above 0 in a
    stream, whose chunks have no field for them) and what echo's logprobs need
    (`echo_logprobs`): the engine computes enough alternatives for both."""
    asked = _int(body, "prompt_logprobs", None, lo=0, hi=MAX_TOP_LOGPROBS)
    if asked and request.stream:
        raise RequestError("prompt_logprobs are not available with stream", "prompt_logprobs")
    if not request.stream:  # as vLLM: echo with logprobs reports them too
        request.prompt_logprobs = asked if asked is not None else echo_logprobs
    wanted = [n for n in (request.prompt_logprobs, echo_logprobs) if n is not None]
    request.params.prompt_logprobs = max(wanted) if wanted else None
    return request


def _common(
    body: dict,
    endpoint: Literal["completions", "chat"],
    model: str,
    max_tokens: int | None,
    logprobs: int | None,
    **fields: Any,
) -> GenerationRequest:
    """The sampling and output fields both endpoints share."""
    stream = _bool(body, "stream", False)
    stream_options = body.get("stream_options")
    include_usage = False
    if stream_options is not None:
        if not stream:
            raise RequestError(
                "stream_options is only allowed when stream is true", "stream_options"
            )
        if not isinstance(stream_options, dict):
            raise RequestError("stream_options must be an object", "stream_options")
        include_usage = _bool(
            stream_options, "include_usage", False, "stream_options.include_usage"
        )
    user = body.get("user")
    if user is not None and not isinstance(user, str):
        raise RequestError("user must be a string", "user")
    min_tokens = _int(body, "min_tokens", 0, lo=0, hi=MAX_INT32)
    params = SamplingParams(
        # A placeholder when max_tokens is left to the context: engine_inputs resolves it.
        max_tokens=max_tokens or max(1, min_tokens),
        temperature=_float(body, "temperature", 1.0, lo=0.0, hi=2.0),
        top_p=_float(body, "top_p", 1.0, lo=0.0, hi=1.0, lo_open=True),
        top_k=_int(body, "top_k", 0, lo=-1, hi=MAX_INT32),
        min_p=_float(body, "min_p", 0.0, lo=0.0, hi=1.0),
        presence_penalty=_float(body, "presence_penalty", 0.0, lo=-2.0, hi=2.0),
        frequency_penalty=_float(body, "frequency_penalty", 0.0, lo=-2.0, hi=2.0),
        repetition_penalty=_float(body, "repetition_penalty", 1.0, lo=0.0, hi=2.0, lo_open=True),
        seed=_int(body, "seed", None, lo=-(2**63), hi=2**64 - 1),
        logprobs=logprobs,
        stop_token_ids=_stop_token_ids(body.get("stop_token_ids")),
        ignore_eos=_bool(body, "ignore_eos", False),
        min_tokens=min_tokens,
        # pdserve extension: decode this request without speculation (one token a step).
        disable_speculation=_bool(body, "disable_speculation", False),
        # response_format, structured_outputs or guided_*: common.api.structured
        structured_output=parse_structured_output(body),
        logit_bias=_logit_bias(body.get("logit_bias")),
    )
    if max_tokens is not None and params.min_tokens > max_tokens:
        raise RequestError(
            f"min_tokens ({params.min_tokens}) must not exceed max_tokens ({max_tokens})",
            "min_tokens",
        )
    try:
        params.validate()
    except ValueError as e:
        raise RequestError(str(e)) from None
    return GenerationRequest(
        endpoint=endpoint,
        model=model,
        params=params,
        max_tokens=max_tokens,
        n=_int(body, "n", 1, lo=1, hi=MAX_N),
        stop=_stop(body.get("stop")),
        include_stop_str_in_output=_bool(body, "include_stop_str_in_output", False),
        skip_special_tokens=_bool(body, "skip_special_tokens", True),
        return_tokens_as_token_ids=_bool(body, "return_tokens_as_token_ids", False),
        stream=stream,
        include_usage=include_usage,
        user=user,
        **fields,
    )


def _model(body: dict, served_model_names: list[str]) -> str:
    model = body.get("model")
    if model is None:
        return served_model_names[0]  # as vLLM: no model means the (first) served one
    if not isinstance(model, str):
        raise RequestError("model must be a string", "model")
    if model not in served_model_names:
        raise RequestError(
            f"The model `{model}` does not exist. Served models: {', '.join(served_model_names)}",
            "model",
            404,
            "model_not_found",
        )
    return model


def _is_token_ids(v: Any) -> bool:
    return isinstance(v, list) and bool(v) and all(_is_int(t) for t in v)


def _prompts(prompt: Any) -> list[str | list[int]]:
    if prompt is None:
        raise RequestError("prompt is required", "prompt")
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt:
        if _is_token_ids(prompt):
            return [list(prompt)]
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)
        if all(_is_token_ids(p) for p in prompt):
            return [list(p) for p in prompt]
    raise RequestError(
        "prompt must be a string, a list of strings, a non-empty list of token ids, "
        "or a list of non-empty lists of token ids",
        "prompt",
    )


def _messages(messages: Any) -> list[dict[str, Any]]:
    if messages is None:
        raise RequestError("messages is required", "messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(messages):
        param = f"messages[{i}]"
        if not isinstance(m, dict):
            raise RequestError(f"{param} must be an object", param)
        role = m.get("role")
        if not isinstance(role, str):
            raise RequestError(f"{param}.role must be a string", f"{param}.role")
        if role not in _CHAT_ROLES:
            raise RequestError(
                f"{param}.role {role!r} is not supported "
                "(system, developer, user, assistant, tool)",
                f"{param}.role",
            )
        content = m.get("content")
        if content is None and role == "assistant":
            content = ""
        message = {"role": _CHAT_ROLES[role], "content": _content(content, f"{param}.content")}
        if role == "tool":
            message = tool_message(m, message["content"], param)
        elif role == "assistant" and m.get("tool_calls") is not None:
            message["tool_calls"] = assistant_tool_calls(m["tool_calls"], f"{param}.tool_calls")
        out.append(message)
    return out


def _content(content: Any, param: str) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text":
                raise RequestError(f"{param}[{j}]: only text content parts are supported", param)
            if not isinstance(part.get("text"), str):
                raise RequestError(f"{param}[{j}].text must be a string", param)
            texts.append(part["text"])
        return "\n".join(texts)
    raise RequestError(f"{param} must be a string or a list of text parts", param)


def _stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops):
        raise RequestError("stop must be a non-empty string or a list of them", "stop")
    if len(stops) > MAX_STOP:
        raise RequestError(f"at most {MAX_STOP} stop strings are allowed", "stop")
    return list(stops)


def _logit_bias(bias: Any) -> dict[int, float] | None:
    """OpenAI's logit_bias: {"token id": bias}, at most MAX_LOGIT_BIAS entries, biases in
    [-100, 100]. Ids beyond the vocabulary are refused once it is known (common.api.prompts)."""
    if bias is None or bias == {}:
        return None
    if not isinstance(bias, dict):
        raise RequestError('logit_bias must be an object like {"50256": -100}', "logit_bias")
    if len(bias) > MAX_LOGIT_BIAS:
        raise RequestError(
            f"logit_bias may have at most {MAX_LOGIT_BIAS} entries, got {len(bias)}", "logit_bias"
        )
    out = {}
    for key, value in bias.items():
        if not (isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= 10):
            raise RequestError(
                f"logit_bias keys must be token ids (decimal integers), got {key!r}", "logit_bias"
            )
        name = f"logit_bias[{key}]"
        if value is None:
            raise RequestError(f"{name} must be a number", name)
        hi = MAX_LOGIT_BIAS_VALUE
        out[int(key)] = _float({name: value}, name, 0.0, lo=-hi, hi=hi)
    return out


def _stop_token_ids(ids: Any) -> list[int]:
    if ids is None:
        return []
    if not isinstance(ids, list) or not all(_is_int(t) and 0 <= t <= MAX_INT32 for t in ids):
        raise RequestError(
            f"stop_token_ids must be a list of integers in [0, {MAX_INT32}]", "stop_token_ids"
        )
    if len(ids) > MAX_STOP_TOKEN_IDS:
        raise RequestError(f"at most {MAX_STOP_TOKEN_IDS} stop_token_ids", "stop_token_ids")
    return list(ids)
