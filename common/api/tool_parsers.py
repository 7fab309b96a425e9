"""Tool calling, output side: a choice's generated text in, content and `ToolCall`s out.

Owns `ToolCall` (one call with its `call_...` id, in the API's message and streaming shapes) and
the two readers of output, both incremental so that streams and whole bodies agree exactly:

- `HermesParser` (`--tool-call-parser hermes`, for tool_choice "auto"): calls are
  `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, as Hermes, Qwen2 and Qwen3 chat
  templates ask for. Text outside the calls is content, streamed as it comes (a possible start of
  `<tool_call>` is held back until it is known); a block whose JSON is not a call stays content,
  as written; an unclosed block at the end is a call when its JSON is one (vLLM reads those too).
  Once a call was made, whitespace at the start or the end of the content is not content (the
  newlines around a `<tool_call>` block); content is otherwise the text with the calls cut out.
  The generic format (`common.api.generic_tools`, every tool_choice) writes the same blocks,
  its grammar keeping text and calls apart; there a block cut short by max_tokens is the call so
  far (`partial=True`): its name, and its arguments text as far as it came, as OpenAI returns one.
- `ForcedCallParser` (hermes format, tool_choice "required" or a named function): the grammar
  made the whole output JSON (`ToolRequest.forced_schema`); it is read once complete. Cut short
  (max_tokens, a stop string), the calls so far are returned, the last one's arguments text
  truncated; output without even one call's name is returned as content.

`output_parser` picks one for a request. Called by `common.api.choice`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from common.api.generic_tools import partial_call
from common.api.tools import ToolRequest

HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"


def _call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolCall:
    """One function call the model made; `arguments` is JSON text, as the API carries it."""

    name: str
    arguments: str
    id: str = field(default_factory=_call_id)

    def body(self) -> dict[str, Any]:
        """The call in a message's `tool_calls`."""
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }

    def delta_body(self, index: int) -> dict[str, Any]:
        """The call as one streamed delta: `index` (its place among the choice's calls) first."""
        return {"index": index, **self.body()}


@dataclass
class Parsed:
    """What one piece of output added: content text and completed calls."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)

    def __add__(self, other: Parsed) -> Parsed:
        return Parsed(self.content + other.content, self.calls + other.calls)


def _arguments_text(args: Any) -> str | None:
    """A call's arguments as JSON text of an object; None when they are not an object."""
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return json.dumps(args, ensure_ascii=False)


class HermesParser:
    """`<tool_call>` JSON blocks among text; see the module docstring. Feed text, then finish."""

    def __init__(self, max_calls: int | None = None, partial: bool = False) -> None:
        self.max_calls = max_calls  # 1 when parallel_tool_calls is false: later calls are dropped
        self.partial = partial  # an unclosed block at the end is the call so far (generic format)
        self.num_calls = 0
        self._buf = ""  # text not yet classified
        self._in_call = False  # inside <tool_call>, waiting for </tool_call>
        self._pending_ws = ""  # whitespace after the last content, shown once content follows
        self._shown_any = False  # some content was shown

    def feed(self, text: str) -> Parsed:
        self._buf += text
        out = Parsed()
        while True:
            if self._in_call:
                end = self._buf.find(HERMES_END)
                if end < 0:
                    return out
                raw, self._buf = self._buf[:end], self._buf[end + len(HERMES_END) :]
                self._in_call = False
                out += self._block(raw, HERMES_START + raw + HERMES_END)
                continue
            start = self._buf.find(HERMES_START)
            if start >= 0:
                out.content += self._content(self._buf[:start])
                self._buf = self._buf[start + len(HERMES_START) :]
                self._in_call = True
                continue
            keep = _partial_suffix(self._buf, HERMES_START)
            cut = len(self._buf) - keep
            out.content += self._content(self._buf[:cut])
            self._buf = self._buf[cut:]
            return out

    def finish(self) -> Parsed:
        """The end of the output: an unclosed block or a held-back prefix is settled."""
        out = Parsed()
        if self._in_call and self.partial:
            cut = partial_call(self._buf)
            if cut is not None:
                out += self._call(ToolCall(*cut))
        elif self._in_call:
            out += self._block(self._buf, HERMES_START + self._buf)
        else:
            out.content += self._content(self._buf)
        self._buf, self._in_call = "", False
        if not self.num_calls:
            out.content += self._pending_ws
        self._pending_ws = ""
        return out

    def _block(self, raw: str, as_written: str) -> Parsed:
        call = _hermes_call(raw)
        if call is None:
            return Parsed(self._content(as_written))
        return self._call(call)

    def _call(self, call: ToolCall) -> Parsed:
        self.num_calls += 1
        if self.max_calls is not None and self.num_calls > self.max_calls:
            return Parsed()
        return Parsed(calls=[call])

    def _content(self, text: str) -> str:
        """Content to show now: trailing whitespace waits for what follows it."""
        text = self._pending_ws + text
        shown = text.rstrip()
        self._pending_ws = text[len(shown) :]
        if not self._shown_any and self.num_calls:
            shown = shown.lstrip()
        self._shown_any = self._shown_any or bool(shown)
        return shown


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that could be the start of `tag`."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _hermes_call(raw: str) -> ToolCall | None:
    try:
        obj = json.loads(raw)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    arguments = _arguments_text(obj.get("arguments", obj.get("parameters", {})))
    return None if arguments is None else ToolCall(obj["name"], arguments)


class ForcedCallParser:
    """The JSON a grammar forced (named: the arguments; required: [{name, parameters}, ...])."""

    def __init__(self, function_name: str | None) -> None:
        self.function_name = function_name  # None: "required"
        self._buf = ""

    def feed(self, text: str) -> Parsed:
        self._buf += text
        return Parsed()  # nothing is shown before the JSON is complete

    def finish(self) -> Parsed:
        text, self._buf = self._buf, ""
        calls = self._calls(text)
        return Parsed(calls=calls) if calls else Parsed(text)

    def _calls(self, text: str) -> list[ToolCall]:
        try:
            obj = json.loads(text)
        except ValueError:
            return self._cut_calls(text)
        if self.function_name is not None:
            arguments = _arguments_text(obj)
            return [] if arguments is None else [ToolCall(self.function_name, arguments)]
        if not isinstance(obj, list):
            return []
        calls = []
        for item in obj:
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return []
            arguments = _arguments_text(item.get("parameters"))
            if arguments is None:
                return []
            calls.append(ToolCall(item["name"], arguments))
        return calls

    def _cut_calls(self, text: str) -> list[ToolCall]:
        """The calls of JSON cut short (the grammar's spelling, JSON_OPTIONS): whole calls, then
        the last one's name and arguments text so far; [] when not even a name is complete."""
        if self.function_name is not None:
            return [ToolCall(self.function_name, text)] if text.startswith("{") else []
        calls, decoder, at = [], json.JSONDecoder(), 1
        if not text.startswith("["):
            return []
        while at < len(text):
            try:
                item, end = decoder.raw_decode(text, at)
            except ValueError:
                head = _FORCED_HEAD.match(text, at)
                if head is not None:
                    calls.append(ToolCall(head.group(1), text[head.end() :]))
                return calls
            if not isinstance(item, dict) or not isinstance(item.get("name"), str):
                return calls
            arguments = _arguments_text(item.get("parameters"))
            if arguments is None:
                return calls
            calls.append(ToolCall(item["name"], arguments))
            at = end + len(", ") if text.startswith(", ", end) else len(text)
        return calls


_FORCED_HEAD = re.compile(r'\{"name": "([A-Za-z0-9_.\-]+)", "parameters": ')
OutputParser = HermesParser | ForcedCallParser


def output_parser(tools: ToolRequest | None) -> OutputParser | None:
    """The reader of a choice's output for this request's tools; None: the output is all content."""
    if tools is None or tools.choice == "none":
        return None
    if tools.generic:
        return HermesParser(max_calls=None if tools.parallel else 1, partial=True)
    if tools.forced:
        return ForcedCallParser(tools.function_name)
    if tools.parser == "hermes":
        return HermesParser(max_calls=None if tools.parallel else 1)
    raise ValueError(f"unknown tool call parser {tools.parser!r}")
