"""A chat template that renders tools, for the tool-calling tests (no model of ours ships one).

`QWEN_TOOL_TEMPLATE` is Qwen2.5's Hermes-style template: tools as JSON inside <tools></tools> in
the system turn, calls as <tool_call> JSON in assistant turns, results as <tool_response> in a
user turn. `write_tool_template` puts it into a model or tokenizer directory (the default model's
tokenizer has the same <|im_start|> / <|im_end|> tokens). Used by tests/common/api/test_tools.py,
tests/router/test_tool_calls.py and tests/e2e/test_tool_calls.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

QWEN_TOOL_TEMPLATE = """\
{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\n\
You are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and \
arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \
\\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- else %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or \
(message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""


def write_tool_template(model_dir: Path) -> Path:
    """Give the model (or tokenizer) directory `model_dir` the tool-rendering chat template."""
    (Path(model_dir) / "chat_template.jinja").write_text(QWEN_TOOL_TEMPLATE)
    return Path(model_dir)


def tool_tokenizer_dir(dst: Path) -> Path:
    """The default model's tokenizer files in `dst`, with the tool-rendering chat template."""
    from common.model.model_files import resolve_model

    dst.mkdir(parents=True, exist_ok=True)
    for f in resolve_model("default").hf_dir.iterdir():
        shutil.copy(f, dst)
    return write_tool_template(dst)
