"""Tool calling end to end: a real router and decode worker, a tiny random model, the `openai` SDK.

tool_choice "required" and a named function are enforced by the grammar engine, so even random
weights return valid calls: every call's arguments validate against its tool's schema, streamed
and not, and a round trip (call, tool result message, answer) goes through the model's chat
template (a Qwen-style one that renders tools, written into the model directory). On the default
model's own template, which renders no tools, the generic format serves tool_choice "auto" too:
every answer is text or well-formed calls, streamed and not, and the clients' tool loops run, on
random weights and on the default model itself.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from typing import Literal

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


# ---- the default model's own chat template (renders no tools): the generic format -------------

# As OpenAI and LangChain write schemas: nothing about additionalProperties, so the server closes
# them (generic_tools.closed_schema); "days" is optional, so a model could pad the object.
OPEN_WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "enum": ["Paris", "Tokyo", "Lima"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city"],
}
OPEN_TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": OPEN_WEATHER}}]


def _serve(model: str, tmp, engine_flags: tuple[str, ...] = ()):
    with Cluster(model, tmp, prefill=0, decode=1, engine_flags=engine_flags) as cluster:
        c = openai.OpenAI(base_url=cluster.url + "/v1", api_key="unused", max_retries=0)
        c.model = c.models.list().data[0].id
        c.url = cluster.url
        yield c


@pytest.fixture(scope="module")
def template_client(chat_model_dir, tmp_path_factory):
    """Tiny random weights under the default model's chat template (which renders no tools)."""
    yield from _serve(str(chat_model_dir), tmp_path_factory.mktemp("generic-tool-cluster"))


@pytest.fixture(scope="module", params=["template", "default-model"])
def default_client(request, tmp_path_factory):
    """The same template with tiny random weights (template_client's cluster: the same flags),
    then the default model itself (its GGUF)."""
    if request.param == "template":
        yield request.getfixturevalue("template_client")
    else:
        # its 8,192-token context needs more KV than the test clusters' default holds; no prefix
        # cache, so that a repeated prompt is computed as the first was (a cached prefix rounds
        # differently, and a real model's sampling notices: same seed, same answer holds then)
        flags = ("--max-model-len", "1024", "--no-enable-prefix-caching")
        yield from _serve("default", tmp_path_factory.mktemp("generic-tool-default-model"), flags)


def check_answer(message, finish_reason: str) -> None:
    """Text, or well-formed calls of the given tool with arguments under its schema and no
    other keys: nothing else."""
    if not message.tool_calls:
        assert "<tool_call>" not in (message.content or "")
        return
    assert not message.content and finish_reason in ("tool_calls", "length")
    for call in message.tool_calls:
        assert call.function.name == "get_weather" and call.id.startswith("call_")
        if finish_reason == "tool_calls":
            closed = {**OPEN_WEATHER, "additionalProperties": False}
            jsonschema.validate(json.loads(call.function.arguments), closed)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_auto_on_the_default_template_streamed_and_not(default_client, seed: int) -> None:
    kwargs = dict(
        model=default_client.model, messages=MESSAGES, tools=OPEN_TOOLS, max_tokens=48, seed=seed
    )
    whole = default_client.chat.completions.create(**kwargs)
    (choice,) = whole.choices
    check_answer(choice.message, choice.finish_reason)
    chunks = list(default_client.chat.completions.create(**kwargs, stream=True))
    content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
    calls = [tc for ch in chunks if ch.choices for tc in ch.choices[0].delta.tool_calls or ()]
    assert content == (choice.message.content or "")  # same seed, same answer
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (c.function.name, c.function.arguments) for c in choice.message.tool_calls or ()
    ]


def test_named_call_whole_and_cut_short_on_the_default_template(template_client) -> None:
    default_client = template_client  # a real model may close the call within the cut below
    named = {"type": "function", "function": {"name": "get_weather"}}
    kwargs = dict(
        model=default_client.model, messages=MESSAGES, tools=OPEN_TOOLS, tool_choice=named
    )
    for seed in (0, 1):
        out = default_client.chat.completions.create(**kwargs, max_tokens=60, seed=seed)
        assert out.choices[0].finish_reason == "tool_calls"
        check_answer(out.choices[0].message, "tool_calls")
    cut = default_client.chat.completions.create(**kwargs, max_tokens=20, seed=0)  # mid-arguments
    (choice,) = cut.choices
    assert choice.finish_reason == "length" and choice.message.content is None
    (call,) = choice.message.tool_calls  # the call so far, as OpenAI returns it
    assert call.function.name == "get_weather" and call.function.arguments.startswith("{")
    with pytest.raises(ValueError):
        json.loads(call.function.arguments)  # truncated


def test_agents_sdk_loop_on_the_default_template(default_client) -> None:
    """Turn 1 forces the tool; the SDK then resets tool_choice and sends the call and its result
    back: every turn is served (no 400), whatever the random weights answer."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    cities = []

    @agents.function_tool
    def get_weather(city: Literal["Paris", "Lima"]) -> str:  # an enum: random weights stay short
        """The forecast for a city."""
        cities.append(city)
        return "sunny, 21 C"

    model = agents.OpenAIChatCompletionsModel(
        model=default_client.model,
        openai_client=openai.AsyncOpenAI(base_url=default_client.url + "/v1", api_key="unused"),
    )
    settings = agents.ModelSettings(
        tool_choice="get_weather", max_tokens=60, extra_args={"seed": 0}
    )
    agent = agents.Agent(name="w", model=model, tools=[get_weather], model_settings=settings)
    try:
        result = asyncio.run(agents.Runner.run(agent, "Weather in Paris?", max_turns=3))
        assert isinstance(result.final_output, str)
    except agents.MaxTurnsExceeded:
        pass  # the random model kept calling: each of those turns was served and parsed
    assert len(cities) >= 1 and set(cities) <= {"Paris", "Lima"}


def test_langchain_bind_tools_on_the_default_template(default_client) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(
        model=default_client.model, base_url=default_client.url + "/v1", api_key="unused",
        max_retries=0, max_tokens=48, seed=1,
    )  # fmt: skip
    message = llm.bind_tools(OPEN_TOOLS).invoke("Weather in Paris?")
    for call in message.tool_calls:
        assert call["name"] == "get_weather"
        jsonschema.validate(call["args"], {**OPEN_WEATHER, "additionalProperties": False})
    assert message.tool_calls or isinstance(message.content, str)
