"""Raw request bytes to a JSON object the validators can trust, and cheap size checks on prompts.

Owns the limits that hold before any field is looked at: JSON that is not UTF-8, not JSON, deeper
than `MAX_JSON_DEPTH`, holding an integer literal Python refuses to convert (more than 4300
digits), or holding a lone UTF-16 surrogate (`"\\ud800"`: valid JSON, but no tokenizer or encoder
can take it) is a 400, never an exception further in. Also `check_prompt_chars`, the length check
that runs before tokenizing: a text longer than `MAX_CHARS_PER_TOKEN` characters per token of
context cannot fit, so it is refused without spending seconds in the tokenizer first.

Called by `router.app` for every JSON body (the body size limit itself is the router's, applied
while the bytes arrive).
"""

from __future__ import annotations

import json
from typing import Any

from common.api.requests import RequestError

MAX_JSON_DEPTH = 32  # an OpenAI body nests 4 deep (messages[i].content[j].text)
# No tokenizer pdserve loads packs more characters than this into one token on average over a
# prompt (English runs 3-5, whitespace runs and repeated symbols up to ~16): beyond it, the
# prompt cannot fit the context, whatever its tokens.
MAX_CHARS_PER_TOKEN = 32


def parse_json_object(raw: bytes) -> dict:
    """The body as a JSON object; RequestError (400) for anything the validators should not see."""
    try:
        body = json.loads(raw)
    except RecursionError:
        raise RequestError(f"the request body nests deeper than {MAX_JSON_DEPTH} levels") from None
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError; too many integer digits
        raise RequestError(f"the request body is not valid JSON: {e}") from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    check_json_value(body)
    return body


def check_json_value(value: Any, max_depth: int = MAX_JSON_DEPTH) -> None:
    """RequestError if `value` nests deeper than max_depth or holds a string with a lone surrogate.

    Iterative (a deep value must not exhaust the stack here either); keys are checked too.
    """
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        v, depth = stack.pop()
        if isinstance(v, str):
            _check_text(v)
        elif isinstance(v, (dict, list)):
            if depth > max_depth:
                raise RequestError(f"the request body nests deeper than {max_depth} levels")
            if isinstance(v, dict):
                for k, item in v.items():
                    _check_text(k)
                    if isinstance(item, (str, dict, list)):
                        stack.append((item, depth + 1))
            else:
                stack.extend((item, depth + 1) for item in v if isinstance(item, (str, dict, list)))


def _check_text(s: str) -> None:
    try:
        s.encode("utf-8")
    except UnicodeEncodeError as e:
        raise RequestError(
            f"the request holds a lone UTF-16 surrogate ({s[e.start]!r} at {e.start}), "
            "which is not text"
        ) from None


def check_prompt_chars(texts: list[str], context_len: int, param: str) -> None:
    """RequestError (400) when the texts cannot fit `context_len` tokens, without tokenizing."""
    chars = sum(len(t) for t in texts)
    limit = MAX_CHARS_PER_TOKEN * context_len
    if chars > limit:
        raise RequestError(
            f"This model's maximum context length is {context_len} tokens. However, the {param} "
            f"has {chars} characters, more than {limit} ({MAX_CHARS_PER_TOKEN} per token) could "
            f"ever fit. Please reduce the length of the {param}.",
            param,
        )
