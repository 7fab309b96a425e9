"""Tool calling end to end: a real router and decode worker, a tiny random model, the `openai` SDK.

tool_choice "required" and a named function are enforced by the grammar engine, so even random
weights return valid calls: every call's arguments validate against its tool's schema, streamed
and not, and a round trip (call, tool result message, answer) goes through the model's chat
template (a Qwen-style one that renders tools, written into the model directory).
"""

from __future__ import annotations

import json
import shutil

import jsonschema
import openai
import pytest

from tests.common.api.tool_template import write_tool_template
from tests.e2e.cluster import Cluster

# Closed schemas (enums, bounded integers, no extra keys): random weights cannot wander off.
WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "metric": {"type": "boolean"},
    },
    "required": ["city", "days", "metric"],
    "additionalProperties": False,
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def client(chat_model_dir, tmp_path_factory):
    # The session's tiny chat model, copied: only its chat template changes.
    model = tmp_path_factory.mktemp("tool-model")
    shutil.copytree(chat_model_dir, model, dirs_exist_ok=True)
    write_tool_template(model)
    tmp = tmp_path_factory.mktemp("tool-cluster")
    with Cluster(str(model), tmp, prefill=0, decode=1) as cluster:
        c = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
        c.model = c.models.list().data[0].id  # the served name, for the tests' requests
        yield c


def check_calls(message, names=tuple(SCHEMAS)) -> None:
    assert message.tool_calls, message
    for call in message.tool_calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in names
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def test_named_call_round_trip(client: openai.OpenAI) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = client.chat.completions.create(
        model=client.model, messages=MESSAGES, tools=TOOLS, tool_choice=named, max_tokens=60, seed=1
    )
    (choice,) = first.choices
    assert choice.finish_reason == "tool_calls"
    check_calls(choice.message, names=("get_weather",))
    (call,) = choice.message.tool_calls
    history = MESSAGES + [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 21 C"},
    ]
    answer = client.chat.completions.create(
        model=client.model, messages=history, tools=TOOLS, tool_choice="none", max_tokens=8, seed=1
    )
    assert answer.choices[0].message.tool_calls is None
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens  # the call and result rendered


@pytest.mark.parametrize("seed", [0, 1])
def test_required_streamed_and_not(client: openai.OpenAI, seed: int) -> None:
    kwargs = dict(
        model=client.model, messages=MESSAGES, tools=TOOLS, tool_choice="required", max_tokens=200
    )
    whole = client.chat.completions.create(**kwargs, seed=seed)
    assert whole.choices[0].finish_reason == "tool_calls"
    check_calls(whole.choices[0].message)
    with client.chat.completions.stream(**kwargs, seed=seed) as stream:
        final = stream.get_final_completion()
    (choice,) = final.choices
    assert choice.finish_reason == "tool_calls"
    check_calls(choice.message)
    # Same seed, same output: the stream assembles to the whole response's calls.
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        (c.function.name, c.function.arguments) for c in whole.choices[0].message.tool_calls
    ]


def test_required_single_call(client: openai.OpenAI) -> None:
    out = client.chat.completions.create(
        model=client.model,
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=100,
        seed=3,
    )
    check_calls(out.choices[0].message)
    assert len(out.choices[0].message.tool_calls) == 1
