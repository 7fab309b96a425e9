"""The refusal every request parser raises, and the typed readers of a JSON body's fields.

Owns `RequestError` (an HTTP status and its OpenAI error body) and the checks each field goes
through before anything reaches a worker: integers are real integers (not booleans) inside their
bounds, which fit the wire's int64 (msgpack) and the engine's int32 token arithmetic; floats are
finite, inside their range, and a nonzero float is never so small (`MIN_NONZERO_FLOAT`) that
dividing logits by it overflows float32 or that float32 flushes it to zero; error messages show
what the client sent, shortened. Used by `common.api.requests`, `common.api.structured`,
`common.api.tools` and the router.
"""

from __future__ import annotations

import math
from typing import Any

MAX_INT32 = 2**31 - 1  # token counts, token ids and top_k: the engine keeps them in int32
# Temperature and repetition_penalty divide logits: below this a logit of 100 overflows float32
# (max 3.4e38). Subnormal values (5e-324) would also flush to zero in float32.
MIN_NONZERO_FLOAT = 1e-30


class RequestError(Exception):
    """A request the API refuses; `code` is the HTTP status, `body()` the OpenAI error body."""

    def __init__(
        self,
        message: str,
        param: str | None = None,
        code: int = 400,
        type: str = "invalid_request_error",
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code
        self.type = type
        self.headers = headers  # extra HTTP headers of the response (Retry-After on a 429)

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


def json_object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object")
    return body


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def int_field(
    body: dict, name: str, default: int | None, lo: int | None = None, hi: int | None = None
) -> int | None:
    v = body.get(name)
    if v is None:
        return default
    if not is_int(v):
        raise RequestError(f"{name} must be an integer, got {show(v)}", name)
    if (lo is not None and v < lo) or (hi is not None and v > hi):
        if hi is None or hi == MAX_INT32:  # a technical bound: name only the one broken
            bounds = f">= {lo}" if lo is not None and v < lo else f"<= {hi}"
        else:
            bounds = f"in [{lo}, {hi}]"
        raise RequestError(f"{name} must be {bounds}, got {show(v)}", name)
    return v


def float_field(
    body: dict, name: str, default: float, lo: float, hi: float, lo_open: bool = False
) -> float:
    v = body.get(name)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise RequestError(f"{name} must be a number, got {show(v)}", name)
    try:
        v = float(v)  # an integer of 400 digits does not fit a float: OverflowError
    except OverflowError:
        v = math.inf
    if not math.isfinite(v):
        raise RequestError(f"{name} must be a finite number in [{lo}, {hi}]", name)
    if v < lo or v > hi or (lo_open and v == lo):
        bounds = f"{'(' if lo_open else '['}{lo}, {hi}]"
        raise RequestError(f"{name} must be in {bounds}, got {show(v)}", name)
    if v != 0 and abs(v) < MIN_NONZERO_FLOAT:
        raise RequestError(
            f"{name} must be 0 or at least {MIN_NONZERO_FLOAT}, got {show(v)}", name
        )
    return v


def bool_field(body: dict, name: str, default: bool, param: str | None = None) -> bool:
    v = body.get(name)
    if v is None:
        return default
    if not isinstance(v, bool):
        raise RequestError(f"{param or name} must be a boolean, got {show(v)}", param or name)
    return v


def show(v: Any) -> str:
    """A value for an error message: short, whatever the client sent."""
    if isinstance(v, int) and abs(v) >= 10**30:
        return f"an integer of {len(str(abs(v)))} digits"
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."
