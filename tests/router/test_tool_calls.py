"""Tool calls through a real router (`--tool-call-parser hermes`) with the real `openai` SDK.

A fake decode worker emits crafted output (Hermes `<tool_call>` text, or the JSON a grammar would
force) so that parsing, shaping and streaming are tested without depending on random weights; the
router holds the default model's tokenizer with a tool-rendering (Qwen-style) chat template.
"""

from __future__ import annotations

import json

import openai
import pytest
from transformers import AutoTokenizer

from common.api.tokenizer import Tokenizer
from common.engine.grammar import compiler_for
from common.protocol import Generate
from router.server import RouterConfig, RouterServer
from tests.common.api.tool_template import tool_tokenizer_dir
from tests.router import fake_worker
from tests.router.fake_worker import FakeWorker, RouterThread

IM_END = 2
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The forecast for a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    },
    {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
]
MESSAGES = [{"role": "user", "content": "Weather in Paris, and the time?"}]
HERMES = (
    "Let me look.\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
)


@pytest.fixture(scope="module")
def tok(tmp_path_factory) -> Tokenizer:
    hf = AutoTokenizer.from_pretrained(tool_tokenizer_dir(tmp_path_factory.mktemp("tool-tok")))
    return Tokenizer(hf, {IM_END})


@pytest.fixture(scope="module")
def router(tok: Tokenizer):
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fake_worker, "default_tokenizer", lambda: tok)
        r = RouterThread(colocated=True, tool_call_parser="hermes")
    with r:
        r.worker("decode", "decode-0", eos_token_id=IM_END, token_delay_s=0.001)
        yield r


def emit(router: RouterThread, tok: Tokenizer, text: str) -> FakeWorker:
    """Make the decode worker answer the next requests with `text`, then <|im_end|>."""
    (worker,) = router.workers
    worker.output_token_ids = tok.encode(text, add_special_tokens=False) + [IM_END]
    return worker


def client(router: RouterThread) -> openai.OpenAI:
    return openai.OpenAI(base_url=router.url + "/v1", api_key="unused", max_retries=0)


def test_auto_parses_hermes_calls_whole_and_streamed(router: RouterThread, tok: Tokenizer) -> None:
    emit(router, tok, HERMES)
    c = client(router)
    whole = c.chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS)
    (choice,) = whole.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me look."
    got = [(t.function.name, json.loads(t.function.arguments)) for t in choice.message.tool_calls]
    assert got == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert all(t.id.startswith("call_") and t.type == "function" for t in choice.message.tool_calls)

    # The SDK's stream helper assembles the same message from the deltas.
    with c.chat.completions.stream(model="default", messages=MESSAGES, tools=TOOLS) as stream:
        chunks = [e.chunk for e in stream if e.type == "chunk"]
        final = stream.get_final_completion()
    (streamed,) = final.choices
    assert streamed.finish_reason == "tool_calls" and streamed.message.content == "Let me look."
    assert [(t.function.name, t.function.arguments) for t in streamed.message.tool_calls] == [
        (t.function.name, t.function.arguments) for t in choice.message.tool_calls
    ]
    deltas = [d for ch in chunks for d in ch.choices[0].delta.tool_calls or []]
    assert [d.index for d in deltas] == [0, 1]
    assert all(d.id and d.type == "function" and d.function.name for d in deltas)
    # Content streamed before the calls; no chunk showed any of the <tool_call> text.
    shown = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    assert shown == "Let me look."


def test_auto_text_without_calls_is_plain_content(router: RouterThread, tok: Tokenizer) -> None:
    emit(router, tok, "It is sunny <b>today</b>.")
    out = client(router).chat.completions.create(model="default", messages=MESSAGES, tools=TOOLS)
    (choice,) = out.choices
    assert choice.finish_reason == "stop" and choice.message.content == "It is sunny <b>today</b>."
    assert not choice.message.tool_calls


@pytest.mark.parametrize("stream", [False, True])
def test_forced_calls_carry_the_schema_and_become_tool_calls(
    router: RouterThread, tok: Tokenizer, stream: bool
) -> None:
    worker = emit(router, tok, '[{"name": "get_weather", "parameters": {"city": "Paris"}}]')
    c = client(router)
    kwargs = dict(model="default", messages=MESSAGES, tools=TOOLS, tool_choice="required")
    if stream:
        with c.chat.completions.stream(**kwargs) as s:
            final = s.get_final_completion()
    else:
        final = c.chat.completions.create(**kwargs)
    (choice,) = final.choices
    assert choice.finish_reason == "tool_calls" and not choice.message.content
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": "Paris"},
    )
    # The worker was asked to enforce the required-call schema.
    sent = worker.messages(Generate)[-1].params.structured_output
    assert sent.kind == "json" and json.loads(sent.spec)["minItems"] == 1
    # The router checked the schema without building llguidance's tokenizer, which holds the GIL
    # long enough (0.3-1 s) to stall its event loop and have --max-loop-lag-s refuse requests.
    assert not compiler_for(router.server.state.tokenizer).tokenizer_built


def test_round_trip_messages_and_named_choice(router: RouterThread, tok: Tokenizer) -> None:
    worker = emit(router, tok, '{"city": "Tokyo"}')
    c = client(router)
    named = {"type": "function", "function": {"name": "get_weather"}}
    first = c.chat.completions.create(
        model="default", messages=MESSAGES, tools=TOOLS, tool_choice=named
    )
    (call,) = first.choices[0].message.tool_calls
    assert (call.function.name, call.function.arguments) == ("get_weather", '{"city": "Tokyo"}')
    sent = worker.messages(Generate)[-1].params.structured_output
    # The tool's schema, closed against keys it does not list.
    assert json.loads(sent.spec) == {
        **TOOLS[0]["function"]["parameters"],
        "additionalProperties": False,
    }
    # The call and its result go back; the template renders both into the next prompt.
    emit(router, tok, "Sunny in Tokyo.")
    history = MESSAGES + [
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]
    answer = c.chat.completions.create(model="default", messages=history, tools=TOOLS)
    assert answer.choices[0].message.content == "Sunny in Tokyo."
    prompt = tok.decode(worker.messages(Generate)[-1].prompt_token_ids, skip_special_tokens=False)
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}' in prompt
    assert "<tool_response>\nsunny\n</tool_response>" in prompt


def test_bad_tool_requests_are_400s(router: RouterThread) -> None:
    c = client(router)
    with pytest.raises(openai.BadRequestError, match="not in tools"):
        c.chat.completions.create(
            model="default",
            messages=MESSAGES,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "nope"}},
        )
    with pytest.raises(openai.BadRequestError, match="name must be"):
        c.chat.completions.create(
            model="default",
            messages=MESSAGES,
            tools=[{"type": "function", "function": {"name": "has space"}}],
        )


def test_unknown_parser_is_refused_at_startup(tok: Tokenizer) -> None:
    with pytest.raises(ValueError, match="--tool-call-parser must be one of hermes"):
        RouterServer(RouterConfig(tool_call_parser="mistral"), tok, 2048)
