"""JSON Schemas of the request bodies, for the router's OpenAPI document (`/openapi.json`, `/docs`).

Owns describing what `common.api.requests` accepts (types and bounds, from its own constants) so
that clients and API fuzzers (schemathesis, in tests/router/test_schema_fuzz.py) have something to
work with. The schemas only document: validation stays in `common.api.requests` and
`common.api.body`, which is why the router reads raw bodies and attaches these through
`openapi_body`. Unknown fields are allowed, as the validators ignore them. Called by `router.app`.
"""

from __future__ import annotations

from typing import Any

from common.api.requests import MAX_INT32, MAX_N, MAX_STOP, MAX_STOP_TOKEN_IDS
from common.api.tools import MAX_TOOLS
from common.sampling_params import MAX_LOGIT_BIAS, MAX_LOGIT_BIAS_VALUE, MAX_TOP_LOGPROBS

_TOKEN_IDS = {"type": "array", "items": {"type": "integer", "minimum": 0}, "minItems": 1}
_STOP = {
    "oneOf": [
        {"type": "string", "minLength": 1},
        {"type": "array", "items": {"type": "string", "minLength": 1}, "maxItems": MAX_STOP},
        {"type": "null"},
    ]
}


def _number(lo: float, hi: float, default: float, lo_open: bool = False) -> dict[str, Any]:
    bound = {"exclusiveMinimum": lo} if lo_open else {"minimum": lo}
    return {"type": "number", **bound, "maximum": hi, "default": default}


def _integer(lo: int, hi: int = MAX_INT32) -> dict[str, Any]:
    return {"type": "integer", "minimum": lo, "maximum": hi}


_SAMPLING: dict[str, Any] = {
    "model": {"type": "string", "description": "a served model name (default: the first)"},
    "n": {**_integer(1, MAX_N), "default": 1},
    "temperature": _number(0.0, 2.0, 1.0),
    "top_p": _number(0.0, 1.0, 1.0, lo_open=True),
    "top_k": {**_integer(-1), "default": 0},
    "min_p": _number(0.0, 1.0, 0.0),
    "presence_penalty": _number(-2.0, 2.0, 0.0),
    "frequency_penalty": _number(-2.0, 2.0, 0.0),
    "repetition_penalty": _number(0.0, 2.0, 1.0, lo_open=True),
    "seed": {"type": "integer", "minimum": -(2**63), "maximum": 2**64 - 1},
    "stop": _STOP,
    "stop_token_ids": {
        "type": "array",
        "items": _integer(0),
        "maxItems": MAX_STOP_TOKEN_IDS,
    },
    "ignore_eos": {"type": "boolean", "default": False},
    "min_tokens": {**_integer(0), "default": 0},
    "max_tokens": _integer(1),
    "stream": {"type": "boolean", "default": False},
    "stream_options": {
        "type": "object",
        "properties": {"include_usage": {"type": "boolean"}},
    },
    "include_stop_str_in_output": {"type": "boolean", "default": False},
    "skip_special_tokens": {"type": "boolean", "default": True},
    "return_tokens_as_token_ids": {"type": "boolean", "default": False},
    "disable_speculation": {"type": "boolean", "default": False},
    "prompt_logprobs": _integer(0, MAX_TOP_LOGPROBS),
    "logit_bias": {
        "type": "object",
        "description": "token id (as a string) -> bias added to its logit",
        "propertyNames": {"pattern": "^[0-9]{1,10}$"},
        "additionalProperties": {
            "type": "number",
            "minimum": -MAX_LOGIT_BIAS_VALUE,
            "maximum": MAX_LOGIT_BIAS_VALUE,
        },
        "maxProperties": MAX_LOGIT_BIAS,
    },
    "user": {"type": "string"},
}

_MESSAGE = {
    "type": "object",
    "required": ["role", "content"],
    "properties": {
        "role": {"type": "string", "enum": ["system", "developer", "user", "assistant", "tool"]},
        "tool_call_id": {"type": "string", "description": "tool messages: the call answered"},
        "tool_calls": {"type": "array", "items": {"type": "object"}},
        "content": {
            "oneOf": [
                {"type": "null"},  # an assistant message with tool_calls
                {"type": "string"},
                {
                    "type": "array",
                    "items": {
                        "type": "object",
                        "required": ["type", "text"],
                        "properties": {
                            "type": {"type": "string", "enum": ["text"]},
                            "text": {"type": "string"},
                        },
                    },
                },
            ]
        },
    },
}
_MESSAGES = {"type": "array", "items": _MESSAGE, "minItems": 1}
_TOOL = {
    "type": "object",
    "required": ["type", "function"],
    "properties": {
        "type": {"type": "string", "enum": ["function"]},
        "function": {
            "type": "object",
            "required": ["name"],
            "properties": {
                "name": {"type": "string", "pattern": "^[A-Za-z0-9_.-]{1,64}$"},
                "description": {"type": "string"},
                "parameters": {"type": "object", "description": "a JSON schema of an object"},
            },
        },
    },
}
_TOOLS: dict[str, Any] = {
    "tools": {"type": "array", "items": _TOOL, "maxItems": MAX_TOOLS},
    "tool_choice": {
        "oneOf": [
            {"type": "string", "enum": ["none", "auto", "required"]},
            {
                "type": "object",
                "required": ["type", "function"],
                "properties": {
                    "type": {"type": "string", "enum": ["function"]},
                    "function": {
                        "type": "object",
                        "required": ["name"],
                        "properties": {"name": {"type": "string"}},
                    },
                },
            },
        ]
    },
    "parallel_tool_calls": {"type": "boolean", "default": True},
}

COMPLETION_REQUEST: dict[str, Any] = {
    "type": "object",
    "required": ["prompt"],
    "properties": {
        "prompt": {
            "oneOf": [
                {"type": "string"},
                {"type": "array", "items": {"type": "string"}, "minItems": 1},
                _TOKEN_IDS,
                {"type": "array", "items": _TOKEN_IDS, "minItems": 1},
            ]
        },
        "logprobs": _integer(0, MAX_TOP_LOGPROBS),
        "echo": {"type": "boolean", "default": False},
        **_SAMPLING,
    },
}

CHAT_REQUEST: dict[str, Any] = {
    "type": "object",
    "required": ["messages"],
    "properties": {
        "messages": _MESSAGES,
        "logprobs": {"type": "boolean", "default": False},
        "top_logprobs": _integer(0, MAX_TOP_LOGPROBS),
        "max_completion_tokens": _integer(1),
        "add_generation_prompt": {"type": "boolean", "default": True},
        **_TOOLS,
        **_SAMPLING,
    },
}

TOKENIZE_REQUEST: dict[str, Any] = {
    "type": "object",
    "properties": {
        "model": _SAMPLING["model"],
        "prompt": {"type": "string"},
        "add_special_tokens": {"type": "boolean", "default": True},
        "messages": _MESSAGES,
    },
}

DETOKENIZE_REQUEST: dict[str, Any] = {
    "type": "object",
    "required": ["tokens"],
    "properties": {"model": _SAMPLING["model"], "tokens": {"type": "array", "items": _integer(0)}},
}


def openapi_body(schema: dict[str, Any]) -> dict[str, Any]:
    """`openapi_extra` for a route that reads its JSON body itself: the body's schema."""
    return {
        "requestBody": {
            "required": True,
            "content": {"application/json": {"schema": schema}},
        }
    }
