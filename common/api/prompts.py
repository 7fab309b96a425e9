"""From a validated request to what the engine takes: token ids and fully resolved parameters.

Owns tokenizing each prompt (chat messages through the model's chat template), the checks only token
ids allow (empty prompt, ids outside the vocabulary in the prompt or logit_bias, the context-length
check that names both numbers as OpenAI does), resolving `max_tokens` per prompt against the
context, and the distinct seeds of a prompt's n choices. Called by `router.app` and
`common.runtime.run_batch` after `common.api.requests` has validated the body. A chat request's
tools are rendered by the chat template in the hermes format, and as plain messages in the generic
one (`common.api.generic_tools`); `tool_call_format` says which a server uses.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from common.api.generic_tools import generic_messages
from common.api.requests import GenerationRequest, RequestError
from common.api.tokenizer import Tokenizer
from common.sampling_params import MAX_PROMPT_LOGPROB_TOKENS, SamplingParams


@dataclass
class EngineInput:
    """One prompt of a request as the engine takes it: ids and fully resolved parameters."""

    prompt_token_ids: list[int]
    params: SamplingParams


def engine_inputs(
    request: GenerationRequest, tokenizer: Tokenizer, max_model_len: int
) -> list[EngineInput]:
    """Tokenize each prompt (chat: through the chat template) and resolve max_tokens per prompt."""
    if request.endpoint == "chat":
        prompts = [chat_prompt_ids(request, tokenizer)]
    else:
        prompts = [
            p if isinstance(p, list) else tokenizer.encode(p, add_special_tokens=True)
            for p in request.prompts
        ]
    vocab_size = tokenizer.vocab_size
    bias = request.params.logit_bias
    if bias and max(bias) >= vocab_size:
        raise RequestError(
            f"logit_bias keys must be token ids in [0, {vocab_size}), got {max(bias)}", "logit_bias"
        )
    inputs = []
    for ids in prompts:
        if not ids:
            raise RequestError("the prompt is empty", "prompt")
        if min(ids) < 0 or max(ids) >= vocab_size:
            raise RequestError(f"prompt token ids must be in [0, {vocab_size})", "prompt")
        if request.params.prompt_logprobs is not None and len(ids) > MAX_PROMPT_LOGPROB_TOKENS:
            raise RequestError(
                f"prompt logprobs (prompt_logprobs, or echo with logprobs) are returned for "
                f"prompts of at most {MAX_PROMPT_LOGPROB_TOKENS} tokens; this one has {len(ids)}",
                "prompt_logprobs",
            )
        inputs.append(EngineInput(ids, _resolve_max_tokens(request, len(ids), max_model_len)))
    return inputs


def chat_prompt_ids(request: GenerationRequest, tokenizer: Tokenizer) -> list[int]:
    """A chat request's messages (and tools) through the chat template; RequestError when the
    template fails."""
    messages, tools = request.messages, request.tools
    if tools is not None:
        tools.check_schemas()
    # Generic: the tools and the tool traffic as plain messages; so too the traffic of a request
    # without tools, where the template cannot render it.
    generic = tools.generic if tools is not None else not tokenizer.renders_tools()
    if generic:
        messages = generic_messages(messages, tools)
    try:
        return tokenizer.apply_chat_template(
            messages,
            add_generation_prompt=request.add_generation_prompt,
            tools=None if generic or tools is None else tools.tools,
        )
    except Exception as e:  # template errors (e.g. roles must alternate) are the caller's
        raise RequestError(f"could not apply the chat template: {e}", "messages") from None


def tool_call_format(tool_call_parser: str, tokenizer: Tokenizer) -> str:
    """The tool format a server uses: "hermes" when `--tool-call-parser hermes` and the chat
    template renders tools; "generic" otherwise (`common.api.generic_tools`), for any model."""
    if tool_call_parser == "hermes" and tokenizer.renders_tools():
        return "hermes"
    return "generic"


def _resolve_max_tokens(
    request: GenerationRequest, num_prompt_tokens: int, max_model_len: int
) -> SamplingParams:
    where = "messages" if request.endpoint == "chat" else "prompt"
    max_tokens = request.max_tokens
    if max_tokens is None:
        max_tokens = max_model_len - num_prompt_tokens
    if num_prompt_tokens >= max_model_len or num_prompt_tokens + max_tokens > max_model_len:
        raise RequestError(
            f"This model's maximum context length is {max_model_len} tokens. However, you "
            f"requested {num_prompt_tokens + max(max_tokens, 1)} tokens ({num_prompt_tokens} in "
            f"the {where}, {max(max_tokens, 1)} in the completion). Please reduce the length of "
            f"the {where} or completion.",
            where if num_prompt_tokens >= max_model_len else "max_tokens",
        )
    if request.params.min_tokens > max_tokens:
        raise RequestError(
            f"min_tokens ({request.params.min_tokens}) must not exceed max_tokens ({max_tokens})",
            "min_tokens",
        )
    params = replace(request.params, max_tokens=max_tokens)
    params.stop_token_ids = list(params.stop_token_ids)  # each engine request owns its lists
    return params


def choice_params(params: SamplingParams, n: int) -> list[SamplingParams]:
    """Parameters for the n choices of one prompt: distinct seeds derived from a given seed."""
    if params.seed is None:
        return [params] * n
    return [replace(params, seed=(params.seed + k) % 2**64) for k in range(n)]
