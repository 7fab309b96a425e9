"""Tests of common/api/structured.py: every request field that asks for structured output, on both
endpoints, becomes one StructuredOutput; malformed or doubled ones are 400s naming the field."""

from __future__ import annotations

import json

import pytest

from common.api.requests import CHAT_URL, COMPLETIONS_URL, RequestError, parse_request
from common.sampling_params import StructuredOutput

CHAT = {"model": "default", "messages": [{"role": "user", "content": "Hi"}]}
COMPLETION = {"model": "default", "prompt": "Hello"}
SCHEMA = {"type": "object", "properties": {"b": {"type": "integer"}, "a": {"type": "string"}}}


def parsed(url: str, extra: dict) -> StructuredOutput | None:
    body = {**(CHAT if url == CHAT_URL else COMPLETION), **extra}
    return parse_request(url, body, ["default"]).params.structured_output


@pytest.mark.parametrize("url", [CHAT_URL, COMPLETIONS_URL], ids=["chat", "completions"])
@pytest.mark.parametrize(
    "extra, expected",
    [
        ({"response_format": {"type": "text"}}, None),
        ({"response_format": {"type": "json_object"}}, StructuredOutput("json_object")),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "p", "schema": SCHEMA, "strict": True},
                }
            },
            StructuredOutput("json", json.dumps(SCHEMA)),  # property order kept
        ),
        ({"structured_outputs": {"json": SCHEMA}}, StructuredOutput("json", json.dumps(SCHEMA))),
        (
            {"structured_outputs": {"json": json.dumps(SCHEMA)}},
            StructuredOutput("json", json.dumps(SCHEMA)),
        ),
        ({"structured_outputs": {"regex": "a+"}}, StructuredOutput("regex", "a+")),
        ({"structured_outputs": {"choice": ["x", "y"]}}, StructuredOutput("choice", '["x", "y"]')),
        (
            {"structured_outputs": {"grammar": 'start: "a"'}},
            StructuredOutput("grammar", 'start: "a"'),
        ),
        ({"structured_outputs": {"json_object": True}}, StructuredOutput("json_object")),
        (
            {"structured_outputs": {"regex": "a", "disable_any_whitespace": True}},
            StructuredOutput("regex", "a"),
        ),
        ({"guided_json": SCHEMA}, StructuredOutput("json", json.dumps(SCHEMA))),
        ({"guided_regex": "[0-9]+"}, StructuredOutput("regex", "[0-9]+")),
        ({"guided_choice": ["yes", "no"]}, StructuredOutput("choice", '["yes", "no"]')),
        ({"guided_grammar": 'root ::= "a"'}, StructuredOutput("grammar", 'root ::= "a"')),
        ({}, None),
    ],
)
def test_each_field_becomes_a_structured_output(url, extra, expected) -> None:
    assert parsed(url, extra) == expected


@pytest.mark.parametrize(
    "extra, param, message",
    [
        ({"response_format": "json"}, "response_format", "must be an object"),
        ({"response_format": {"type": "xml"}}, "response_format", "xml"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "json_schema object"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": [1]}}},
            "response_format.json_schema.schema",
            "JSON schema object",
        ),
        ({"guided_json": "{nope"}, "guided_json", "not valid JSON"),
        ({"guided_choice": []}, "guided_choice", "non-empty list"),
        ({"guided_choice": ["a", 2]}, "guided_choice", "list of strings"),
        ({"guided_regex": ""}, "guided_regex", "non-empty string"),
        (
            {"structured_outputs": {"regex": "a", "choice": ["a"]}},
            "structured_outputs",
            "exactly one",
        ),
        ({"structured_outputs": {}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs", "structural_tag"),
        (
            {"response_format": {"type": "json_object"}, "guided_regex": "a"},
            "guided_regex",
            "only one structured output",
        ),
        (
            {"structured_outputs": {"regex": "a"}, "guided_json": SCHEMA},
            "guided_json",
            "structured_outputs, guided_json",
        ),
        ({"guided_grammar": "x" * (2**20 + 1)}, None, "at most"),
    ],
)
def test_malformed_or_doubled_requests_are_refused(extra, param, message) -> None:
    with pytest.raises(RequestError, match=message) as info:
        parsed(CHAT_URL, extra)
    assert info.value.code == 400 and info.value.param == param
