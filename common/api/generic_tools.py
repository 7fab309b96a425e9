"""The generic tool-call format: tools for any model, whatever its chat template.

Used when the chat template cannot render tools, or the router runs with `--tool-call-parser
generic` (or with none). Owns the format's three parts, all plain text the chat template renders
as ordinary messages:
- the prompt: a section appended to the system message (or a system message of its own) listing
  each tool as `{"name", "description", "parameters"}` JSON, with how to call them
  (`tools_section`); past calls in assistant messages as the call text the model writes, and tool
  results as one user message of `<tool_response>{"name": ..., "content": ...}</tool_response>`
  lines (`generic_messages`), so a tool loop renders on every turn;
- the answer, enforced by a grammar (`generic_grammar`, llguidance Lark): either plain text that
  never contains `<tool_call>` (tool_choice "auto" only; a JSON `response_format` takes its place
  when given), or one call, or with `parallel_tool_calls` several, one per line, each
  `<tool_call>{"name": "<a tool>", "arguments": <its arguments>}</tool_call>` with the arguments
  valid under the tool's schema (`closed_schema`: no extra keys unless the schema allows them);
- reading a call cut short by max_tokens (`partial_call`): its name and the arguments text so far.

`common.api.tools` builds the grammar, `common.api.prompts` the messages, `common.api.tool_parsers`
reads the answer (as Hermes-style `<tool_call>` blocks, which this format is).
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from common.api.tools import ToolRequest

CALL_START, CALL_END = "<tool_call>", "</tool_call>"
RESULT_START, RESULT_END = "<tool_response>", "</tool_response>"
# The call's JSON as the grammar spells it (JSON_OPTIONS' separators): what partial_call reads.
_CALL_HEAD = re.compile(r'\{"name": "([A-Za-z0-9_.\-]+)", "arguments": ', re.DOTALL)
# Subschemas whose objects are closed like the root: each is a whole value of its own. allOf
# branches are partial descriptions of one object, so they are walked but never closed.
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_SCHEMA_LISTS = ("anyOf", "oneOf", "prefixItems")
_SCHEMA_ONE = ("items", "additionalProperties")


def closed_schema(schema: Any, close: bool = True) -> Any:
    """`schema` with `"additionalProperties": false` on every object schema that does not say.

    The rule for tool arguments: an object takes the keys its schema lists (plain OpenAI and
    LangChain schemas never say `additionalProperties`, and a model would otherwise invent keys
    that reach the user's function); `additionalProperties` (true or a schema) or
    `unevaluatedProperties` given explicitly are kept. Objects combined with `allOf` or `$ref`
    are left open (closing one part would refuse the other's keys).
    """
    if not isinstance(schema, dict):
        return schema
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: closed_schema(s) for name, s in value.items()}
        elif key in _SCHEMA_LISTS and isinstance(value, list):
            out[key] = [closed_schema(s) for s in value]
        elif key == "allOf" and isinstance(value, list):
            out[key] = [closed_schema(s, close=False) for s in value]
        elif key in _SCHEMA_ONE:
            out[key] = (
                [closed_schema(s) for s in value]
                if isinstance(value, list)
                else (closed_schema(value))
            )
        else:
            out[key] = value
    kind = schema.get("type")
    is_object = kind == "object" or (isinstance(kind, list) and "object" in kind)
    is_object = is_object or "properties" in schema
    open_by_choice = {"additionalProperties", "unevaluatedProperties", "allOf", "$ref"} & set(
        schema
    )
    if close and is_object and not open_by_choice:
        out["additionalProperties"] = False
    return out


def call_text(name: str, arguments: Any) -> str:
    """One call as the model writes it in this format (arguments: an object, or JSON text)."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass  # not JSON: shown as the string it is
    return f'{CALL_START}{{"name": {json.dumps(name)}, "arguments": {_json(arguments)}}}{CALL_END}'


def tools_section(tools: ToolRequest) -> str:
    """The system prompt's description of the tools and of how to call them."""
    listed = "\n".join(_json(t["function"]) for t in tools.tools)
    several = tools.parallel and tools.choice != "function"
    how = (
        "To call a function, answer with the call and nothing else, written as\n"
        f'{CALL_START}{{"name": "<function name>", "arguments": <the arguments as a JSON object>}}'
        f"{CALL_END}\n" + ("(one call per line to call several).\n" if several else "")
    )
    if tools.choice == "function":
        rule = f"You must call the function {tools.function_name}."
    elif tools.choice == "required":
        rule = "You must call at least one function."
    elif tools.choice == "none":
        rule = "Do not call a function now: answer in plain text."
    else:
        rule = "If no function is needed, answer in plain text instead."
    return (
        "# Tools\n\nYou can call the functions below. Each is a JSON object with its name, its "
        "description and the JSON schema of its arguments (parameters):\n"
        f"{listed}\n\n{how}{rule}\nResults of calls come back as {RESULT_START}...{RESULT_END}."
    )


def generic_messages(
    messages: list[dict[str, Any]], tools: ToolRequest | None
) -> list[dict[str, Any]]:
    """The chat messages in this format: tool traffic as text, the tools in the system prompt
    (with tool_choice "none" too, told not to call them, as the model still sees its tools)."""
    out: list[dict[str, Any]] = []
    names: dict[str, str] = {}  # call id -> function name, to name the results
    results_at = -1  # index in out of the user message collecting consecutive tool results
    for m in messages:
        if m["role"] == "tool":
            name = m.get("name") or names.get(m["tool_call_id"], "")
            line = f"{RESULT_START}{_json({'name': name, 'content': m['content']})}{RESULT_END}"
            if results_at == len(out) - 1 and results_at >= 0:
                out[results_at]["content"] += "\n" + line
            else:
                out.append({"role": "user", "content": line})
                results_at = len(out) - 1
            continue
        if m["role"] == "assistant" and m.get("tool_calls"):
            calls = [
                call_text(c["function"]["name"], c["function"]["arguments"])
                for c in m["tool_calls"]
            ]
            names.update((c["id"], c["function"]["name"]) for c in m["tool_calls"])
            m = {"role": "assistant", "content": "\n".join([m["content"], *calls]).lstrip("\n")}
        out.append(m)
    if tools is not None:
        section = tools_section(tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{section}".lstrip("\n")}
        else:
            out.insert(0, {"role": "system", "content": section})
    return out


def generic_grammar(tools: ToolRequest, text_schema: dict | None = None) -> str:
    """The Lark grammar of an answer (see the module docstring); `text_schema`: a JSON schema the
    non-call answer must follow instead of being free text (response_format with "auto")."""
    names = [tools.function_name] if tools.choice == "function" else list(tools.parameters)
    rules = []
    for i, name in enumerate(names):
        head = f'{CALL_START}{{"name": {json.dumps(name)}, "arguments": '
        rules.append(f"call_{i}: {json.dumps(head)} args_{i} {json.dumps('}' + CALL_END)}")
        rules.append(f"args_{i}: %json {_json(_with_options(tools.parameters[name]))}")
    rules.append("call: " + " | ".join(f"call_{i}" for i in range(len(names))))
    several = tools.parallel and tools.choice != "function"
    rules.append('calls: call ("\\n" call)*' if several else "calls: call")
    if tools.choice != "auto":
        start = "start: calls"
    elif text_schema is None:
        start = "start: TEXT | calls"
        # Any text that never contains the call tag: a call is all or nothing.
        rules.append(f"TEXT: /(?s:.*)/ & ~/(?s:.*{re.escape(CALL_START)}.*)/")
    else:
        start = "start: answer | calls"
        rules.append(f"answer: %json {_json(_with_options(text_schema))}")
    return "\n".join([start, *rules]) + "\n"


def partial_call(text: str) -> tuple[str, str] | None:
    """(name, arguments text so far) of a call cut short: `text` follows `<tool_call>`; None when
    it stops before the name is complete."""
    for n in range(min(len(text), len(CALL_END) - 1), 0, -1):  # cut inside the end tag
        if CALL_END.startswith(text[-n:]):
            text = text[:-n]
            break
    head = _CALL_HEAD.match(text)
    if head is None:
        return None
    arguments = text[head.end() :]
    if arguments.endswith("}}"):  # the call's JSON is whole: its arguments without its brace
        try:
            call = json.loads(text)
        except ValueError:
            call = None
        if isinstance(call, dict):
            arguments = _json(call.get("arguments"))
    return head.group(1), arguments


def _with_options(schema: Any) -> Any:
    """A schema for llguidance's `%json`, with the separators every JSON answer here uses."""
    from common.engine.grammar import JSON_OPTIONS  # the engine's (torch): not at import

    if not isinstance(schema, dict):  # true / false
        return schema
    return {**schema, "x-guidance": JSON_OPTIONS}


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)
