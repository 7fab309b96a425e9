"""Tool calling, request side: `tools`, `tool_choice`, tool messages, the schema forcing a call.

Owns validating a chat body's `tools` (names, JSON schemas, bounded counts and sizes),
`tool_choice` ("none", "auto", "required" or a named function) and `parallel_tool_calls` into a
`ToolRequest`; the chat messages that carry tool traffic (an assistant message with `tool_calls`,
a `tool` message with its result), normalized so that chat templates render them (arguments as
objects, as Qwen's and Hermes' templates expect); and the grammar the engine enforces on the
output. Two formats: `hermes` (`--tool-call-parser hermes` with a chat template that renders
tools: the template writes the prompt, "auto" output is free and read as `<tool_call>` blocks,
"required" and a named function are forced as the JSON schema vLLM builds) and `generic` (any
other case: `common.api.generic_tools`, where the grammar makes every answer plain text or
well-formed calls). Either way tool arguments take only the keys their schema lists unless it
says otherwise (`generic_tools.closed_schema`).

Called by `common.api.requests` (parse_chat_request), `common.api.prompts` (which tools the chat
template renders) and `common.api.choice` (which parser reads a choice's output).
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass, field
from typing import Any, Literal

from common.api.fields import RequestError
from common.api.generic_tools import closed_schema, generic_grammar
from common.sampling_params import SamplingParams, StructuredOutput

MAX_TOOLS = 128  # OpenAI's limit
MAX_TOOLS_CHARS = 512 * 1024  # the tools' JSON, all together: it is rendered into every prompt
MAX_TOOL_CALLS_PER_MESSAGE = 128
TOOL_NAME = re.compile(r"[A-Za-z0-9_.\-]{1,64}")  # OpenAI's (a-z, A-Z, 0-9, _ and -) plus dots
TOOL_CALL_PARSERS = ("hermes", "generic")  # the values --tool-call-parser takes ("": generic)
EMPTY_PARAMETERS = {"type": "object", "properties": {}}
ToolChoice = Literal["none", "auto", "required", "function"]


@dataclass
class ToolRequest:
    """A chat request's validated tools and how the answer may use them.

    `choice` "function" forces `function_name`; `parser` is the format, "hermes" or "generic"
    (the router's `--tool-call-parser` as the chat template allows: `prompts.tool_call_format`).
    `parameters` are the tools' schemas closed against extra keys, for the grammar.
    """

    tools: list[dict[str, Any]]  # {"type": "function", "function": {name, description?, ...}}
    choice: ToolChoice
    function_name: str | None = None
    parallel: bool = True
    parser: str = "generic"
    parameters: dict[str, dict] = field(default_factory=dict)  # name -> parameters schema

    @property
    def generic(self) -> bool:
        return self.parser != "hermes"

    @property
    def forced(self) -> bool:
        """The output must be a call: enforced by the grammar, read as JSON."""
        return self.choice in ("required", "function")

    def forced_schema(self) -> dict[str, Any] | None:
        """The JSON schema the output must follow ("required" / named), else None.

        Named: the function's parameters (the output is its arguments). Required: as vLLM, an
        array of at least one {"name", "parameters"} object, one anyOf branch per tool; at most
        one item when `parallel_tool_calls` is false. The tools' `$defs` / `definitions` move to
        the root, where their `#/$defs/...` references point (as vLLM; a name two tools define
        differently is a 400).
        """
        if self.choice == "function":
            assert self.function_name is not None
            return self.parameters[self.function_name]
        if self.choice != "required":
            return None
        defs: dict[str, dict[str, Any]] = {"$defs": {}, "definitions": {}}
        branches = []
        for name, schema in self.parameters.items():
            schema = dict(schema)
            for key, hoisted in defs.items():
                for def_name, definition in (schema.pop(key, None) or {}).items():
                    if hoisted.setdefault(def_name, definition) != definition:
                        raise RequestError(
                            f"two tools define {key}/{def_name} differently; a required call "
                            "needs one definition per name",
                            "tools",
                        )
            branches.append(
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [name]},
                        "parameters": schema,
                    },
                    "required": ["name", "parameters"],
                    "additionalProperties": False,
                }
            )
        array: dict[str, Any] = {"type": "array", "minItems": 1, "items": {"anyOf": branches}}
        if not self.parallel:
            array["maxItems"] = 1
        return {**array, **{key: hoisted for key, hoisted in defs.items() if hoisted}}

    def check_schemas(self) -> None:
        """RequestError naming the first tool whose parameters are not a valid JSON schema.

        Milliseconds per new schema (cached after): callers run it off the event loop.
        """
        for i, tool in enumerate(self.tools):
            error = _schema_error(json.dumps(tool["function"]["parameters"], sort_keys=True))
            if error is not None:
                param = f"tools[{i}].function.parameters"
                raise RequestError(f"{param} {error}", param)

    def constrain(self, params: SamplingParams) -> None:
        """Set the grammar of the answer on `params`: generic, every choice but "none"; hermes,
        a forced call ("required" / named). A JSON response_format with generic "auto" becomes
        the grammar's non-call answer; any other combination with a structured output is a 400."""
        so = params.structured_output
        if self.choice == "none" or (not self.generic and not self.forced):
            return
        if so is not None and (self.forced or so.kind not in ("json", "json_object")):
            raise RequestError(
                'tool_choice "required" or a named function cannot be combined with another '
                "structured output (response_format, structured_outputs, guided_*); with "
                '"auto", only a JSON one',
                "tool_choice",
            )
        if not self.generic:
            schema = self.forced_schema()
            params.structured_output = StructuredOutput("json", json.dumps(schema))
            return
        text_schema = None if so is None else _text_schema(so)
        params.structured_output = StructuredOutput("grammar", generic_grammar(self, text_schema))


def parse_tools(body: dict, tool_call_parser: str = "") -> ToolRequest | None:
    """The body's `tools` / `tool_choice` / `parallel_tool_calls`; None when it has no tools.

    RequestError (400) for a malformed tool, an unknown function name in tool_choice and a
    choice that needs tools without them. `tool_call_parser`: the format, "hermes" or "generic"
    ("" is generic).
    """
    for legacy in ("functions", "function_call"):
        if body.get(legacy) is not None:
            raise RequestError(f"{legacy} is deprecated and not supported; use tools", legacy)
    tools = _tools(body.get("tools"))
    parallel = body.get("parallel_tool_calls", True)
    if parallel is None:
        parallel = True
    if not isinstance(parallel, bool):
        raise RequestError("parallel_tool_calls must be a boolean", "parallel_tool_calls")
    choice, name = _tool_choice(body.get("tool_choice"), tools)
    if not tools:
        return None
    params = {t["function"]["name"]: closed_schema(t["function"]["parameters"]) for t in tools}
    parser = tool_call_parser or "generic"
    return ToolRequest(tools, choice, name, parallel, parser, params)


def _tools(tools: Any) -> list[dict[str, Any]]:
    if tools is None:
        return []
    if not isinstance(tools, list):
        raise RequestError("tools must be a list", "tools")
    if len(tools) > MAX_TOOLS:
        raise RequestError(f"at most {MAX_TOOLS} tools are allowed, got {len(tools)}", "tools")
    if len(json.dumps(tools)) > MAX_TOOLS_CHARS:
        raise RequestError(f"the tools take more than {MAX_TOOLS_CHARS} characters", "tools")
    out, names = [], set()
    for i, tool in enumerate(tools):
        param = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise RequestError(f'{param} must be an object with "type": "function"', param)
        fn = tool.get("function")
        if not isinstance(fn, dict):
            raise RequestError(f"{param}.function must be an object", f"{param}.function")
        name = fn.get("name")
        if not isinstance(name, str) or not TOOL_NAME.fullmatch(name):
            raise RequestError(
                f"{param}.function.name must be 1 to 64 letters, digits, '_', '-' or '.', got "
                f"{_short(name)}",
                f"{param}.function.name",
            )
        if name in names:
            raise RequestError(f"two tools are named {name!r}", f"{param}.function.name")
        names.add(name)
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise RequestError(
                f"{param}.function.description must be a string", f"{param}.function.description"
            )
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise RequestError(f"{param}.function.strict must be a boolean", f"{param}.function")
        parameters = fn.get("parameters")
        parameters = EMPTY_PARAMETERS if parameters is None else parameters
        _check_schema(parameters, f"{param}.function.parameters")
        function: dict[str, Any] = {"name": name}  # in OpenAI's order: templates dump it as is
        if description is not None:
            function["description"] = description
        function["parameters"] = parameters
        out.append({"type": "function", "function": function})
    return out


def _text_schema(so: StructuredOutput) -> dict | bool:
    """The JSON schema of a json / json_object structured output."""
    if so.kind == "json_object":
        return {"type": "object"}
    try:
        schema = json.loads(so.spec)
    except ValueError as e:
        raise RequestError(f"the JSON schema is not valid JSON: {e}", "response_format") from None
    if not isinstance(schema, dict | bool):
        raise RequestError("a JSON schema must be an object (or true/false)", "response_format")
    return schema


def _check_schema(schema: Any, param: str) -> None:
    """The cheap checks of a tool's parameters: a schema object that describes an object (OpenAI's
    rule). `ToolRequest.check_schemas` checks the rest, off the event loop."""
    if not isinstance(schema, dict):
        raise RequestError(f"{param} must be a JSON schema object", param)
    if schema.get("type", "object") != "object":
        raise RequestError(f'{param} must describe an object ("type": "object")', param)
    if not isinstance(schema.get("$schema", ""), str):
        raise RequestError(f"{param}.$schema must be a string", param)
    for key in ("$defs", "definitions"):  # forced_schema moves them: they must be objects now
        if not isinstance(schema.get(key, {}), dict):
            raise RequestError(f"{param}.{key} must be an object", param)


@functools.lru_cache(maxsize=1024)  # clients send the same tools with every request
def _schema_error(schema_json: str) -> str | None:
    """Why a schema (as JSON text) is not a valid JSON schema, or None."""
    import jsonschema

    schema = json.loads(schema_json)
    # The metaschemas are bundled: an unknown $schema falls back to 2020-12, nothing is fetched.
    validator = jsonschema.validators.validator_for(schema, default=jsonschema.Draft202012Validator)
    try:
        validator.check_schema(schema)
    except jsonschema.SchemaError as e:
        where = "/".join(str(p) for p in e.absolute_path)
        return f"is not a valid JSON schema{f' at {where}' if where else ''}: {e.message}"
    return None


def _tool_choice(choice: Any, tools: list[dict]) -> tuple[ToolChoice, str | None]:
    if choice is None:
        return ("auto" if tools else "none"), None
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise RequestError(
                f'tool_choice must be "none", "auto", "required" or a function, got '
                f"{_short(choice)}",
                "tool_choice",
            )
        if choice != "none" and not tools:
            raise RequestError(f'tool_choice "{choice}" needs tools', "tool_choice")
        return choice, None  # type: ignore[return-value]
    fn = choice.get("function") if isinstance(choice, dict) else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str) or choice.get("type") != "function":  # type: ignore[union-attr]
        raise RequestError(
            'a named tool_choice is {"type": "function", "function": {"name": ...}}', "tool_choice"
        )
    if name not in {t["function"]["name"] for t in tools}:
        raise RequestError(
            f"tool_choice names {_short(name)}, which is not in tools", "tool_choice"
        )
    return "function", name


# ---- messages -----------------------------------------------------------------------------------


def assistant_tool_calls(calls: Any, param: str) -> list[dict[str, Any]]:
    """An assistant message's `tool_calls`, for the chat template: arguments as objects.

    Clients send arguments as a JSON string (as the API returned them); Qwen's and Hermes'
    templates render `arguments | tojson`, so, like vLLM, a string holding a JSON object becomes
    that object (anything else stays the string it was).
    """
    if not isinstance(calls, list):
        raise RequestError(f"{param} must be a list", param)
    if len(calls) > MAX_TOOL_CALLS_PER_MESSAGE:
        raise RequestError(f"{param}: at most {MAX_TOOL_CALLS_PER_MESSAGE} calls", param)
    out = []
    for j, call in enumerate(calls):
        where = f"{param}[{j}]"
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise RequestError(f"{where} must be a function call with a name", where)
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                parsed = json.loads(args) if args.strip() else {}
            except ValueError:
                parsed = None
            args = parsed if isinstance(parsed, dict) else args
        elif not isinstance(args, dict):
            raise RequestError(f"{where}.function.arguments must be a string or an object", where)
        call_id = call.get("id")
        if call_id is not None and not isinstance(call_id, str):
            raise RequestError(f"{where}.id must be a string", where)
        out.append(
            {
                "id": call_id or f"call_{j}",
                "type": "function",
                "function": {"name": fn["name"], "arguments": args},
            }
        )
    return out


def tool_message(m: dict, content: str, param: str) -> dict[str, Any]:
    """A `tool` message (a call's result) for the chat template."""
    call_id = m.get("tool_call_id")
    if not isinstance(call_id, str):
        raise RequestError(f"{param}.tool_call_id must be a string", f"{param}.tool_call_id")
    out = {"role": "tool", "tool_call_id": call_id, "content": content}
    if isinstance(m.get("name"), str):
        out["name"] = m["name"]
    return out


def message_texts(messages: list[dict[str, Any]]) -> list[str]:
    """The text in messages that tokenizing reads: contents and tool-call arguments."""
    texts = [m["content"] for m in messages]
    for m in messages:
        for call in m.get("tool_calls", ()):
            args = call["function"]["arguments"]
            texts.append(args if isinstance(args, str) else json.dumps(args))
    return texts


def _short(v: Any) -> str:
    text = repr(v)
    return text if len(text) <= 60 else text[:57] + "..."
