"""common/api/tool_parsers.py: hermes `<tool_call>` parsing (whole, streamed) and forced calls."""

from __future__ import annotations

import json

import pytest

from common.api.tool_parsers import (
    ForcedCallParser,
    HermesParser,
    Parsed,
    ToolCall,
    output_parser,
)
from common.api.tools import ToolRequest

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
TIME = '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": \\"UTC\\"}"}</tool_call>'


def parse(
    text: str, parser: HermesParser | ForcedCallParser | None = None, step: int = 0
) -> Parsed:
    """All of `text` through a parser: at once (step 0) or `step` characters at a time."""
    parser = parser or HermesParser()
    out = Parsed()
    pieces = [text] if step == 0 else [text[i : i + step] for i in range(0, len(text), step)]
    for piece in pieces:
        out += parser.feed(piece)
    return out + parser.finish()


def calls(parsed: Parsed, raw: bool = False) -> list[tuple[str, dict | str]]:
    """(name, arguments) of each call: as an object, or `raw`, the JSON text as it came."""
    return [(c.name, c.arguments if raw else json.loads(c.arguments)) for c in parsed.calls]


WEATHER_GENERIC = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'


@pytest.mark.parametrize("step", [0, 1, 3])
def test_hermes_one_call(step: int) -> None:
    out = parse(WEATHER, step=step)
    assert calls(out) == [("get_weather", {"city": "Paris"})]
    assert out.content == ""
    assert out.calls[0].id.startswith("call_") and len(out.calls[0].id) > 10


@pytest.mark.parametrize("step", [0, 1, 7])
def test_hermes_two_calls_with_text_around(step: int) -> None:
    text = f"Let me check.\n{WEATHER}\n{TIME}\nDone"
    out = parse(text, step=step)
    # Arguments given as a JSON string are read as the object they hold.
    assert calls(out) == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC"})]
    assert out.content == "Let me check.\n\n\nDone"  # the text with the calls cut out
    assert out.calls[0].id != out.calls[1].id


@pytest.mark.parametrize("step", [0, 1])
def test_hermes_malformed_json_stays_content(step: int) -> None:
    bad = '<tool_call>{"name": "get_weather", "arguments": {"city": </tool_call>'
    not_a_call = '<tool_call>["get_weather"]</tool_call>'
    bad_args = '<tool_call>{"name": "f", "arguments": [1]}</tool_call>'
    for text in (bad, not_a_call, bad_args, "a < b <tool", "<tool_call>{half"):
        out = parse(text, step=step)
        assert out.calls == [] and out.content == text, text


def test_hermes_without_calls_is_the_text_exactly() -> None:
    for text in ("Hello  \n", "  spaced <toolbox> and <tool_ca", "\n\n"):
        assert parse(text, step=1) == Parsed(text)
        assert parse(text) == Parsed(text)


def test_hermes_whitespace_around_calls_is_not_content() -> None:
    for step in (0, 1):
        out = parse(f"\n{WEATHER}\n", step=step)
        assert out.content == "" and len(out.calls) == 1
        out = parse(f"  {WEATHER}\n Then this. \n", step=step)
        assert out.content == "Then this."


def test_hermes_unclosed_call_at_the_end_is_a_call() -> None:
    out = parse('Sure <tool_call>{"name": "f", "arguments": {"x": 1}}')
    assert calls(out) == [("f", {"x": 1})] and out.content == "Sure"


def test_hermes_streams_content_before_the_call_and_holds_a_partial_tag() -> None:
    parser = HermesParser()
    assert parser.feed("Hi there <tool").content == "Hi there"  # the space waits, then is dropped
    assert parser.feed("_call>{").content == ""
    out = parser.feed('"name": "f", "arguments": {}}</tool_call>')
    assert calls(out) == [("f", {})]
    assert parser.finish() == Parsed()


def test_hermes_parallel_false_keeps_the_first_call() -> None:
    out = parse(f"{WEATHER}{TIME}", HermesParser(max_calls=1))
    assert calls(out) == [("get_weather", {"city": "Paris"})] and out.content == ""


def test_forced_named_and_required() -> None:
    named = parse('{"city": "Paris", "days": 3}', ForcedCallParser("get_weather"), step=2)
    assert calls(named) == [("get_weather", {"city": "Paris", "days": 3})]
    required = parse(
        '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]',
        ForcedCallParser(None),
    )
    assert calls(required) == [("a", {"x": 1}), ("b", {})]
    # Cut short (max_tokens) after a name: the calls so far, the last one's arguments cut.
    assert calls(parse('{"city": "Pa', ForcedCallParser("f")), raw=True) == [("f", '{"city": "Pa')]
    cut = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {"y": [1, '
    assert calls(parse(cut, ForcedCallParser(None)), raw=True) == [
        ("a", '{"x": 1}'),
        ("b", '{"y": [1, '),
    ]
    # Not of the forced shape, or cut before a name: content, no calls.
    for parser, text in [
        (ForcedCallParser("f"), "[1]"),
        (ForcedCallParser(None), '[{"name": "a'),
        (ForcedCallParser(None), '[{"name": "a"}]'),
        (ForcedCallParser(None), '{"name": "a", "parameters": {}}'),
    ]:
        assert parse(text, parser) == Parsed(text)


def test_output_parser_per_choice() -> None:
    def req(choice, parser="", name=None, parallel=True):
        return ToolRequest([], choice, name, parallel, parser)

    assert output_parser(None) is None
    assert output_parser(req("none", "hermes")) is None
    assert isinstance(output_parser(req("auto", "hermes")), HermesParser)
    assert output_parser(req("auto", "hermes", parallel=False)).max_calls == 1
    assert output_parser(req("function", "hermes", name="f")).function_name == "f"
    assert output_parser(req("required", "hermes")).function_name is None
    # generic: every choice reads <tool_call> blocks, a cut one as the call so far
    for choice in ("auto", "required", "function"):
        parser = output_parser(req(choice, "generic", parallel=False))
        assert isinstance(parser, HermesParser) and parser.partial and parser.max_calls == 1


@pytest.mark.parametrize("step", [0, 1, 4])
def test_generic_calls_whole_streamed_and_cut_short(step: int) -> None:
    two = f'{WEATHER_GENERIC}\n<tool_call>{{"name": "get_time", "arguments": {{}}}}</tool_call>'
    out = parse(two, HermesParser(partial=True), step=step)
    assert calls(out) == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert out.content == ""
    # Cut by max_tokens: inside the arguments, inside the end tag, before the name is whole.
    for text, expected in [
        ('<tool_call>{"name": "get_weather", "arguments": {"city": "Pa', '{"city": "Pa'),
        (WEATHER_GENERIC[:-3], '{"city": "Paris"}'),
        ('<tool_call>{"name": "get_weather", "arguments": ', ""),
    ]:
        out = parse(text, HermesParser(partial=True), step=step)
        assert calls(out, raw=True) == [("get_weather", expected)] and out.content == ""
    assert parse('<tool_call>{"name": "get_w', HermesParser(partial=True), step=step) == Parsed()
    # Plain text (the grammar keeps the tag out of it) is the content exactly.
    assert parse("Hi <tool", HermesParser(partial=True), step=step) == Parsed("Hi <tool")


def test_tool_call_shapes() -> None:
    call = ToolCall("f", '{"x": 1}', id="call_abc")
    assert call.body() == {
        "id": "call_abc",
        "type": "function",
        "function": {"name": "f", "arguments": '{"x": 1}'},
    }
    assert call.delta_body(2) == {"index": 2, **call.body()}
