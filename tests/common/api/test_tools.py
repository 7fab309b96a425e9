"""common/api/tools.py and its callers: tool request validation, the forced-call schema, tools and
tool messages through a chat template, and tool calls in choices, bodies and stream chunks."""

from __future__ import annotations

import json

import jsonschema
import pytest
from transformers import AutoTokenizer

from common.api.choice import Choice
from common.api.generic_tools import closed_schema
from common.api.prompts import engine_inputs, tool_call_format
from common.api.requests import RequestError, parse_chat_request
from common.api.responses import chat_body, delta_chunk
from common.api.tokenizer import Tokenizer
from common.api.tools import MAX_TOOLS
from common.engine.grammar import check_structured_output, compiler_for
from common.model.model_files import resolve_model
from common.sampling_params import SamplingParams, StructuredOutput
from tests.common.api.tool_template import tool_tokenizer_dir

SERVED = ["default"]
WEATHER_PARAMS = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 9},
    },
    "required": ["city", "days"],
    "additionalProperties": False,
}
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Forecast",
            "parameters": WEATHER_PARAMS,
        },
    },
    {"type": "function", "function": {"name": "get_time"}},  # no parameters: an empty object
]
USER = [{"role": "user", "content": "Weather in Paris?"}]
ROUND_TRIP = USER + [
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
]


def chat(parser: str = "hermes", **body):
    return parse_chat_request({"messages": USER, "tools": TOOLS, **body}, SERVED, parser)


def refused(body: dict, parser: str = "hermes") -> RequestError:
    with pytest.raises(RequestError) as e:
        parse_chat_request({"messages": USER, **body}, SERVED, parser)
    assert e.value.code == 400
    return e.value


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer.from_source(resolve_model("default"))


@pytest.fixture(scope="module")
def tool_tok(tmp_path_factory) -> Tokenizer:
    hf = AutoTokenizer.from_pretrained(tool_tokenizer_dir(tmp_path_factory.mktemp("tool-tok")))
    return Tokenizer(hf, {2})


def test_tool_choice_modes() -> None:
    auto = chat()
    assert (auto.tools.choice, auto.tools.parser, auto.params.structured_output) == (
        "auto",
        "hermes",
        None,
    )
    assert [t["function"]["name"] for t in auto.tools.tools] == ["get_weather", "get_time"]
    # Closed against extra keys for the grammar (the schema did not say otherwise).
    assert auto.tools.parameters["get_time"] == {
        "type": "object",
        "properties": {},
        "additionalProperties": False,
    }
    assert chat(tool_choice="none").tools.choice == "none"
    # No tools (or an empty list): no tool request, whatever the parser.
    assert parse_chat_request({"messages": USER, "tools": []}, SERVED).tools is None
    named = chat(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert named.tools.choice == "function" and named.tools.function_name == "get_weather"
    assert named.params.structured_output == StructuredOutput("json", json.dumps(WEATHER_PARAMS))


def test_required_schema_accepts_calls_of_the_tools_only() -> None:
    req = chat(tool_choice="required")
    schema = json.loads(req.params.structured_output.spec)
    good = [{"name": "get_weather", "parameters": {"city": "Tokyo", "days": 3}}]
    jsonschema.validate(good, schema)
    jsonschema.validate(good + [{"name": "get_time", "parameters": {}}], schema)
    for bad in (
        [],
        [{"name": "get_weather", "parameters": {"city": "Rome", "days": 3}}],
        [{"name": "nope", "parameters": {}}],
        [{"name": "get_time"}],
    ):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    single = json.loads(
        chat(tool_choice="required", parallel_tool_calls=False).params.structured_output.spec
    )
    assert single["maxItems"] == 1


def test_forced_schemas_compile_in_the_grammar_engine(tok: Tokenizer) -> None:
    for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
        for parser in ("hermes", "generic"):
            check_structured_output(chat(parser, tool_choice=choice).params.structured_output, tok)


def test_required_schema_keeps_references_to_definitions(tok: Tokenizer) -> None:
    # As pydantic writes them: "#/$defs/..." references, which point at the root once moved.
    unit = {"type": "string", "enum": ["C", "F"]}
    with_defs = {
        "type": "object",
        "properties": {"unit": {"$ref": "#/$defs/Unit"}},
        "required": ["unit"],
        "$defs": {"Unit": unit},
    }
    tools = TOOLS + [{"type": "function", "function": {"name": "temp", "parameters": with_defs}}]
    req = parse_chat_request(
        {"messages": USER, "tools": tools, "tool_choice": "required"}, SERVED, "hermes"
    )
    so = req.params.structured_output
    schema = json.loads(so.spec)
    assert schema["$defs"] == {"Unit": unit}
    jsonschema.validate([{"name": "temp", "parameters": {"unit": "C"}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "temp", "parameters": {"unit": "K"}}], schema)
    check_structured_output(so, tok)
    clash = {**with_defs, "$defs": {"Unit": {"type": "integer"}}}
    tools.append({"type": "function", "function": {"name": "temp2", "parameters": clash}})
    e = refused({"tools": tools, "tool_choice": "required"})
    assert "define $defs/Unit differently" in e.message
    bad = {"type": "function", "function": {"name": "f", "parameters": {"$defs": []}}}
    assert "$defs must be an object" in refused({"tools": [bad]}).message


def test_bad_tools_are_400s() -> None:
    fn = {"name": "f", "parameters": {"type": "object"}}
    cases = {
        "must be a list": {"tools": {"type": "function"}},
        f"at most {MAX_TOOLS} tools": {
            "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]
        },
        '"type": "function"': {"tools": [{"type": "retrieval", "function": fn}]},
        "function must be an object": {"tools": [{"type": "function"}]},
        "name must be 1 to 64": {"tools": [{"type": "function", "function": {"name": "a b"}}]},
        "two tools are named": {"tools": [{"type": "function", "function": fn}] * 2},
        "describe an object": {
            "tools": [{"type": "function", "function": {**fn, "parameters": {"type": "string"}}}]
        },
        "$schema must be a string": {
            "tools": [{"type": "function", "function": {**fn, "parameters": {"$schema": 5}}}]
        },
        "characters": {
            "tools": [{"type": "function", "function": {**fn, "description": "x" * 600_000}}]
        },
        "deprecated": {"functions": [fn]},
        "parallel_tool_calls must be a boolean": {"tools": TOOLS, "parallel_tool_calls": "yes"},
        "tool_choice must be": {"tools": TOOLS, "tool_choice": "always"},
        "which is not in tools": {
            "tools": TOOLS,
            "tool_choice": {"type": "function", "function": {"name": "get_news"}},
        },
        "named tool_choice": {"tools": TOOLS, "tool_choice": {"function": {"name": 3}}},
        '"required" needs tools': {"tool_choice": "required"},
    }
    for message, body in cases.items():
        assert message in refused(body).message, message
    # "auto" (also by default) without a parser is the generic format, never a 400.
    for body in ({"tools": TOOLS}, {"tools": TOOLS, "tool_choice": "auto"}):
        req = chat("", **body)
        assert (req.tools.choice, req.tools.parser) == ("auto", "generic")
        assert req.params.structured_output.kind == "grammar"


def test_invalid_parameter_schemas_are_400s_before_tokenizing(tool_tok: Tokenizer) -> None:
    bad = {"type": "object", "properties": {"x": {"type": "nah"}}}
    tools = [TOOLS[1], {"type": "function", "function": {"name": "f", "parameters": bad}}]
    req = parse_chat_request({"messages": USER, "tools": tools}, SERVED, "hermes")
    with pytest.raises(RequestError) as e:
        engine_inputs(req, tool_tok, max_model_len=2048)
    assert e.value.param == "tools[1].function.parameters"
    assert "not a valid JSON schema at properties/x/type" in e.value.message


def test_a_forced_call_does_not_combine_with_another_structured_output() -> None:
    e = refused(
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}
    )
    assert "cannot be combined" in e.message and e.param == "tool_choice"
    # "auto" and "none" leave the output free, so response_format applies as asked.
    req = chat(tool_choice="none", response_format={"type": "json_object"})
    assert req.params.structured_output.kind == "json_object"


def test_tool_messages_are_accepted_and_normalized() -> None:
    req = parse_chat_request({"messages": ROUND_TRIP, "tools": TOOLS}, SERVED, "hermes")
    assistant, tool = req.messages[1], req.messages[2]
    assert assistant["content"] == ""
    # Arguments sent as JSON text become the object the templates render with tojson.
    assert assistant["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": {"city": "Paris", "days": 2},
    }
    assert tool == {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}
    for messages, message in [
        (USER + [{"role": "tool", "content": "x"}], "tool_call_id must be a string"),
        (USER + [{"role": "assistant", "tool_calls": {}}], "must be a list"),
        (USER + [{"role": "assistant", "tool_calls": [{"function": {}}]}], "with a name"),
    ]:
        assert message in refused({"messages": messages}).message


def test_tools_and_tool_messages_through_a_tool_template(tool_tok: Tokenizer) -> None:
    req = parse_chat_request({"messages": ROUND_TRIP, "tools": TOOLS}, SERVED, "hermes")
    (inp,) = engine_inputs(req, tool_tok, max_model_len=2048)
    text = tool_tok.decode(inp.prompt_token_ids, skip_special_tokens=False)
    assert json.dumps(TOOLS[0]) in text  # the tools, as the template writes them
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}' in text
    assert "<tool_response>\nsunny, 21 C\n</tool_response>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_a_template_without_tools_gets_the_generic_format(tok: Tokenizer) -> None:
    assert not tok.renders_tools()
    assert tool_call_format("hermes", tok) == tool_call_format("", tok) == "generic"
    req = chat(tool_call_format("hermes", tok))
    (inp,) = engine_inputs(req, tok, max_model_len=2048)
    text = tok.decode(inp.prompt_token_ids, skip_special_tokens=False)
    assert (
        text.startswith("<|im_start|>system\n# Tools\n")
        and json.dumps(TOOLS[0]["function"]) in text
    )
    assert "answer in plain text" in text and text.endswith("<|im_start|>assistant\n")


def feed(choice: Choice, tok: Tokenizer, text: str, finish_reason: str = "stop") -> list:
    token_ids = tok.encode(text, add_special_tokens=False)
    deltas = [choice.add([t]) for t in token_ids]
    deltas.append(choice.add([2], finished=True, finish_reason=finish_reason))
    return deltas


def test_choice_reads_hermes_calls_streamed_like_whole(tool_tok: Tokenizer) -> None:
    req = chat()
    call = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
    text = f"Checking.\n<tool_call>\n{call}\n</tool_call>"
    choice = Choice(0, [1], SamplingParams(max_tokens=100), req, tool_tok)
    deltas = feed(choice, tool_tok, text)
    assert "".join(d.text for d in deltas) == choice.text == "Checking."
    assert [c.name for d in deltas for c in d.tool_calls] == ["get_weather"]
    assert deltas[-1].finish_reason == choice.finish_reason == "tool_calls"
    body = chat_body(req, [choice.result()], tool_tok, prompt_tokens=1)
    (out,) = body["choices"]
    assert out["finish_reason"] == "tool_calls"
    (call,) = out["message"]["tool_calls"]
    assert out["message"]["content"] == "Checking."
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    # The delta that completed the call streams it whole, with its index.
    (k,) = [i for i, d in enumerate(deltas) if d.tool_calls]
    chunk = delta_chunk(req, "chatcmpl-1", 0, choice, deltas[k], tool_tok)
    assert chunk["choices"][0]["delta"] == {"tool_calls": [{"index": 0, **call}]}


def test_choice_forced_call_and_a_cut_short_one(tool_tok: Tokenizer) -> None:
    req = chat(tool_choice="required")
    choice = Choice(0, [1], SamplingParams(max_tokens=100), req, tool_tok)
    deltas = feed(choice, tool_tok, '[{"name": "get_time", "parameters": {}}]')
    assert all(d.text == "" for d in deltas) and choice.finish_reason == "tool_calls"
    message = chat_body(req, [choice.result()], tool_tok, 1)["choices"][0]["message"]
    assert message["content"] is None
    assert message["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}
    # max_tokens cut the JSON before a name: no call, the text is the content, "length".
    choice = Choice(0, [1], SamplingParams(max_tokens=100), req, tool_tok)
    feed(choice, tool_tok, '[{"name": "get_ti', finish_reason="length")
    body = chat_body(req, [choice.result()], tool_tok, 1)["choices"][0]
    assert body["finish_reason"] == "length"
    assert body["message"] == {"role": "assistant", "content": '[{"name": "get_ti'}
    # After the name: the call so far, its arguments text cut where the output was (as OpenAI).
    choice = Choice(0, [1], SamplingParams(max_tokens=100), req, tool_tok)
    feed(choice, tool_tok, '[{"name": "get_weather", "parameters": {"city": "Pa', "length")
    body = chat_body(req, [choice.result()], tool_tok, 1)["choices"][0]
    assert body["finish_reason"] == "length" and body["message"]["content"] is None
    (call,) = body["message"]["tool_calls"]
    assert call["function"] == {"name": "get_weather", "arguments": '{"city": "Pa'}


def accepts(tok: Tokenizer, so: StructuredOutput, text: str) -> bool:
    """Whether the grammar of `so` takes all of `text` (a prefix of an answer)."""
    matcher = compiler_for(tok).matcher(so).matcher
    ids = tok.encode(text, add_special_tokens=False)
    return matcher.validate_tokens(ids) == len(ids)


def test_generic_grammar_is_text_or_well_formed_calls(tok: Tokenizer) -> None:
    open_params = {"type": "object", "properties": {"city": {"type": "string"}}}  # no extra keys
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": open_params}}]
    tools.append(TOOLS[1])

    def so(**body) -> StructuredOutput:
        req = parse_chat_request({"messages": USER, "tools": tools, **body}, SERVED, "generic")
        return req.params.structured_output

    call = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    time = '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
    auto = so()
    assert accepts(tok, auto, "It is sunny in Paris.") and accepts(tok, auto, call)
    assert accepts(tok, auto, f"{call}\n{time}")
    assert not accepts(tok, auto, "Let me see. <tool_call>")  # text or calls, never both
    assert not accepts(tok, auto, call.replace('"Paris"', '"Paris", "api_key": "x"'))
    assert not accepts(tok, auto, call.replace("get_weather", "get_news"))
    assert not accepts(tok, auto, '<tool_call>{"name":"get_weather"')  # one spelling only
    single = so(parallel_tool_calls=False)
    assert accepts(tok, single, call) and not accepts(tok, single, f"{call}\n")
    required = so(tool_choice="required")
    assert accepts(tok, required, call) and not accepts(tok, required, "Sunny.")
    named = so(tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert accepts(tok, named, time) and not accepts(tok, named, call)
    # With a JSON response_format, "auto" answers that JSON or calls.
    fmt = {"type": "json_schema", "json_schema": {"name": "a", "schema": open_params}}
    answer = so(response_format=fmt)
    assert accepts(tok, answer, '{"city": "Lima"}') and accepts(tok, answer, call)
    assert not accepts(tok, answer, "Lima")
    e = refused(
        {"tools": tools, "response_format": {"type": "json_object"}, "tool_choice": "required"}
    )
    assert "cannot be combined" in e.message


def test_closed_schema_rule() -> None:
    item = {"type": "object", "properties": {"a": {"type": "integer"}}}
    schema = {
        "type": "object",
        "properties": {
            "items": {"type": "array", "items": item},
            "free": {"type": "object", "additionalProperties": True},
            "typed": {"type": "object", "additionalProperties": {"type": "string"}},
            "union": {"anyOf": [item, {"type": "null"}]},
            "both": {"allOf": [item, {"properties": {"b": {"type": "string"}}}]},
        },
        "$defs": {"Item": item},
    }
    closed = closed_schema(schema)
    props = closed["properties"]
    assert (
        closed["additionalProperties"] is False
        and closed["$defs"]["Item"]["additionalProperties"] is False
    )
    assert props["items"]["items"]["additionalProperties"] is False
    assert props["free"]["additionalProperties"] is True  # said explicitly: kept
    assert props["typed"]["additionalProperties"] == {"type": "string"}
    assert props["union"]["anyOf"][0]["additionalProperties"] is False
    assert props["union"]["anyOf"][1] == {"type": "null"}
    assert "additionalProperties" not in props["both"]["allOf"][0]  # parts of one object: open
    assert schema["properties"]["items"]["items"] == item  # the caller's schema is not changed
    assert "additionalProperties" not in item


def test_generic_messages_render_a_tool_loop(tok: Tokenizer) -> None:
    # Turn 2 of a loop: the call and its result as text, the tools in the caller's system prompt.
    messages = [{"role": "system", "content": "Be brief."}, *ROUND_TRIP]
    messages.append({"role": "tool", "tool_call_id": "call_1", "content": "windy"})
    req = parse_chat_request({"messages": messages, "tools": TOOLS}, SERVED, "generic")
    (inp,) = engine_inputs(req, tok, max_model_len=2048)
    text = tok.decode(inp.prompt_token_ids, skip_special_tokens=False)
    assert text.startswith("<|im_start|>system\nBe brief.\n\n# Tools\n")
    call = (
        '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}</tool_call>'
    )
    assert f"<|im_start|>assistant\n{call}<|im_end|>" in text
    results = [f'{{"name": "get_weather", "content": "{c}"}}' for c in ("sunny, 21 C", "windy")]
    results = "\n".join(f"<tool_response>{r}</tool_response>" for r in results)
    assert f"<|im_start|>user\n{results}<|im_end|>\n<|im_start|>assistant\n" in text
    # "none": the traffic and the tools render, the model is told not to call, nothing forced.
    req = parse_chat_request(
        {"messages": ROUND_TRIP, "tools": TOOLS, "tool_choice": "none"}, SERVED, "generic"
    )
    text = tok.decode(engine_inputs(req, tok, 2048)[0].prompt_token_ids, skip_special_tokens=False)
    assert "# Tools" in text and "Do not call a function now" in text and call in text
    assert req.params.structured_output is None
