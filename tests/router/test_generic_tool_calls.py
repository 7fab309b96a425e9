"""The generic tool-call format through a real router on the default model's tokenizer (SmolLM2's
chat template renders no tools; no --tool-call-parser), with the real clients: the `openai` SDK,
LangChain's `bind_tools` and the OpenAI Agents SDK's tool loop.

A scripted decode worker answers each request with what the grammar the router sent allows (it
checks): a call while a tool is to be called, text once a tool result is in the prompt. So these
tests pin the request shapes the clients send, the prompt and grammar the router makes of them,
and the responses the clients read; tests/e2e/test_tool_calls.py runs the same on a real model.
"""

from __future__ import annotations

import asyncio
import json
import re

import openai
import pytest

from common.engine.grammar import compiler_for
from common.protocol import Generate
from common.sampling_params import SamplingParams
from tests.router.fake_worker import FakeWorker, RouterThread, default_tokenizer

IM_END = 2
WEATHER = {
    "type": "object",
    "properties": {"city": {"type": "string"}},
    "required": ["city"],
}  # as OpenAI and LangChain write schemas: nothing about additionalProperties
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}}]
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
CALL = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
ANSWER = "It is sunny in Paris."


class ScriptedWorker(FakeWorker):
    """Answers `ANSWER` once a tool result is in the prompt, else `CALL` (of the first tool the
    grammar names) when a grammar is sent, else `ANSWER`; each answer checked against the
    request's grammar first."""

    def _start_stream(self, request_id, prompt, params: SamplingParams, num_sent=0) -> None:
        tok = default_tokenizer()
        text = tok.decode(prompt, skip_special_tokens=False)
        answered = "<tool_response>" in text.rsplit("<|im_start|>user", 1)[-1]
        so = params.structured_output
        answer = ANSWER if answered or so is None else CALL
        if answer == CALL:  # a call of the grammar's first tool
            name = re.search(r'call_0: "<tool_call>\{\\"name\\": \\"([^\\]+)', so.spec)[1]
            answer = CALL.replace("get_weather", name)
        ids = tok.encode(answer, add_special_tokens=False)
        if so is not None:
            matcher = compiler_for(tok).matcher(so).matcher
            assert matcher.validate_tokens(ids) == len(ids), (answer, so.spec)
        self.output_token_ids = ids + [IM_END]
        super()._start_stream(request_id, prompt, params, num_sent)


@pytest.fixture(scope="module")
def router():
    assert not default_tokenizer().renders_tools()
    with RouterThread(colocated=True) as r:
        w = ScriptedWorker(r.control, "decode", "decode-0", eos_token_id=IM_END, token_delay_s=0)
        r.workers.append(w)
        assert w.wait_registered().accepted
        r.decode = w
        yield r


def client(router: RouterThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)


def sent(router: RouterThread, back: int = 1) -> tuple[str, SamplingParams]:
    """The prompt text and the params of the request `back` requests ago."""
    msg = router.decode.messages(Generate)[-back]
    return default_tokenizer().decode(msg.prompt_token_ids, skip_special_tokens=False), msg.params


def test_auto_on_the_default_template_whole_and_streamed(router: RouterThread) -> None:
    c = client(router)
    whole = c.chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS)
    (choice,) = whole.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Paris"}')
    prompt, params = sent(router)
    assert "# Tools" in prompt and '"name": "get_weather"' in prompt
    assert params.structured_output.kind == "grammar"
    assert params.structured_output.spec.startswith("start: TEXT | calls")
    chunks = list(
        c.chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS, stream=True)
    )
    deltas = [tc for ch in chunks for tc in ch.choices[0].delta.tool_calls or ()]
    (delta,) = deltas  # OpenAI's streaming shape: index, id, type, name and arguments
    assert (delta.index, delta.type, delta.id.startswith("call_")) == (0, "function", True)
    assert (delta.function.name, delta.function.arguments) == ("get_weather", '{"city": "Paris"}')
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert not any(ch.choices[0].delta.content for ch in chunks)


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_cut_by_max_tokens_is_a_partial_call(
    router: RouterThread, stream: bool
) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    kwargs = dict(model="default", messages=MESSAGES, tools=TOOLS, tool_choice=named)
    cut = default_tokenizer().decode(
        default_tokenizer().encode(CALL, add_special_tokens=False)[:18]
    )
    assert cut.startswith('<tool_call>{"name": "get_weather", "arguments": {"city')  # mid-args
    arguments = cut.split('"arguments": ', 1)[1]
    c = client(router)
    if stream:
        chunks = list(c.chat.completions.create(**kwargs, max_tokens=18, stream=True))
        (call,) = [tc for ch in chunks for tc in ch.choices[0].delta.tool_calls or ()]
        assert not any(ch.choices[0].delta.content for ch in chunks)
        reason = chunks[-1].choices[0].finish_reason
    else:
        (choice,) = c.chat.completions.create(**kwargs, max_tokens=18).choices
        (call,) = choice.message.tool_calls
        assert choice.message.content is None
        reason = choice.finish_reason
    assert reason == "length"
    assert (call.function.name, call.function.arguments) == ("get_weather", arguments)


def test_langchain_bind_tools_default(router: RouterThread) -> None:
    langchain_openai = pytest.importorskip("langchain_openai")
    from langchain_core.tools import tool

    @tool
    def get_weather(city: str) -> str:
        """The forecast for a city."""
        return "sunny"

    llm = langchain_openai.ChatOpenAI(
        model="default", base_url=router.url + "/v1", api_key="unused", max_retries=0
    )
    message = llm.bind_tools([get_weather]).invoke("Weather in Paris?")
    assert [(c["name"], c["args"]) for c in message.tool_calls] == [
        ("get_weather", {"city": "Paris"})
    ]
    _, params = sent(router)  # bind_tools sends no tool_choice: "auto"
    assert params.structured_output.spec.startswith("start: TEXT | calls")
    # with_structured_output(method="function_calling") forces the tool: a parsed object.
    schema = {"title": "Weather", "description": "A city.", **WEATHER}
    structured = llm.with_structured_output(schema, method="function_calling")
    assert structured.invoke("Paris?") == {"city": "Paris"}


def test_agents_sdk_function_tool_loop(router: RouterThread) -> None:
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    calls = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The forecast for a city."""
        calls.append(city)
        return "sunny, 21 C"

    model = agents.OpenAIChatCompletionsModel(
        model="default",
        openai_client=openai.AsyncOpenAI(base_url=router.url + "/v1", api_key="unused"),
    )
    agent = agents.Agent(
        name="weather",
        instructions="Answer with the weather.",
        model=model,
        tools=[get_weather],
        model_settings=agents.ModelSettings(tool_choice="get_weather"),
    )
    result = asyncio.run(agents.Runner.run(agent, "Weather in Paris?", max_turns=3))
    assert result.final_output == ANSWER and calls == ["Paris"]
    # Turn 1 forced the named tool; turn 2 (tool_choice reset to auto) carried the call and its
    # result, rendered in the generic format.
    _, first = sent(router, back=2)
    prompt, second = sent(router)
    assert first.structured_output.spec.startswith("start: calls")
    assert second.structured_output.spec.startswith("start: TEXT | calls")
    assert f"<|im_start|>assistant\n{CALL}<|im_end|>" in prompt
    result_line = json.dumps({"name": "get_weather", "content": "sunny, 21 C"})
    assert f"<tool_response>{result_line}</tool_response>" in prompt
