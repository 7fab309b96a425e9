"""The request fields that ask for structured output, parsed into one `StructuredOutput`.

Both endpoints accept OpenAI's `response_format` (`{"type": "json_object"}`, `{"type":
"json_schema", "json_schema": {"name", "schema", "strict"}}`, `{"type": "text"}` = none), vLLM's
`structured_outputs` object (exactly one of `json`, `json_object`, `regex`, `choice`, `grammar`)
and the older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar` fields that
existing clients still send. More than one of them in a request is refused. `common.api.requests`
calls `parse_structured_output` while validating a body; the router calls `check_structured_output`
before dispatch, with the tokenizer (the grammar engine judges the spec: a 400 names what it does
not support).
"""

from __future__ import annotations

import json
from typing import Any

from common.api.fields import RequestError
from common.sampling_params import StructuredOutput

# vLLM's structured_outputs options that tune a backend: accepted and ignored (the grammar engine
# here always uses its own settings), so that clients written for vLLM keep working.
_IGNORED_OPTIONS = {
    "disable_fallback",
    "disable_any_whitespace",
    "disable_additional_properties",
    "whitespace_pattern",
    "backend",
    "_backend",
    "_backend_was_auto",
}
_KINDS = ("json", "json_object", "regex", "choice", "grammar")
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice"}
_GUIDED["guided_grammar"] = "grammar"


def parse_structured_output(body: dict) -> StructuredOutput | None:
    """The body's structured-output request, or None; RequestError when it is malformed."""
    found: list[tuple[str, StructuredOutput]] = []
    fmt = body.get("response_format")
    if fmt is not None:
        so = _response_format(fmt)
        if so is not None:
            found.append(("response_format", so))
    so_body = body.get("structured_outputs")
    if so_body is not None:
        found.append(("structured_outputs", _structured_outputs(so_body)))
    for name, kind in _GUIDED.items():
        value = body.get(name)
        if value is not None:
            found.append((name, _spec(kind, value, name)))
    if body.get("guided_json_object"):  # rarely sent, but vLLM read it
        found.append(("guided_json_object", StructuredOutput("json_object")))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise RequestError(f"only one structured output may be given; got {names}", found[1][0])
    return found[0][1] if found else None


def check_structured_output(so: StructuredOutput, tokenizer: Any) -> None:
    """RequestError (400) naming what the grammar engine cannot do with `so`. Compiles (cached):
    call it off the event loop."""
    from common.engine.grammar import check_structured_output as check

    try:
        check(so, tokenizer)
    except ValueError as e:
        raise RequestError(str(e)) from None


def _response_format(fmt: Any) -> StructuredOutput | None:
    if not isinstance(fmt, dict) or not isinstance(fmt.get("type"), str):
        raise RequestError("response_format must be an object with a type", "response_format")
    kind = fmt["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "json_schema":
        inner = fmt.get("json_schema")
        if not isinstance(inner, dict):
            raise RequestError(
                "response_format json_schema needs a json_schema object", "response_format"
            )
        name = inner.get("name")
        if name is not None and not isinstance(name, str):
            raise RequestError(
                "response_format.json_schema.name must be a string", "response_format"
            )
        schema = inner.get("schema", {})  # OpenAI: no schema means any JSON value
        return _spec("json", schema, "response_format.json_schema.schema")
    raise RequestError(
        f"response_format type {kind!r} is not supported; use text, json_object or json_schema",
        "response_format",
    )


def _structured_outputs(value: Any) -> StructuredOutput:
    param = "structured_outputs"
    if not isinstance(value, dict):
        raise RequestError("structured_outputs must be an object", param)
    given = [k for k in _KINDS if value.get(k) not in (None, False)]
    unknown = set(value) - set(_KINDS) - _IGNORED_OPTIONS
    if unknown:
        raise RequestError(
            f"structured_outputs.{sorted(unknown)[0]} is not supported; "
            f"use one of {', '.join(_KINDS)}",
            param,
        )
    if len(given) != 1:
        raise RequestError(f"structured_outputs needs exactly one of {', '.join(_KINDS)}", param)
    kind = given[0]
    if kind == "json_object":
        if value[kind] is not True:
            raise RequestError("structured_outputs.json_object must be true", param)
        return StructuredOutput("json_object")
    return _spec(kind, value[kind], f"{param}.{kind}")


def _spec(kind: str, value: Any, param: str) -> StructuredOutput:
    """A StructuredOutput of `kind` from a field's value (a JSON schema may come as an object or
    as its text)."""
    if kind == "json":
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except ValueError as e:
                raise RequestError(f"{param} is not valid JSON: {e}", param) from None
        if not isinstance(value, dict | bool):
            raise RequestError(f"{param} must be a JSON schema object", param)
        return StructuredOutput("json", json.dumps(value))
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) for c in value):
            raise RequestError(f"{param} must be a non-empty list of strings", param)
        return StructuredOutput("choice", json.dumps(value))
    if not isinstance(value, str) or not value:
        raise RequestError(f"{param} must be a non-empty string", param)
    return StructuredOutput(kind, value)
