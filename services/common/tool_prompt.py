"""How tools and tool calls are written into a chat prompt when the model's chat template knows
nothing of them (SmolLM2's does not): the fallback template, in the Hermes format that many
open models are trained on, and the tags the gateway's tool-call parser looks for.

The fallback keeps the model's own template for the turns and only rewrites their contents:
- the tools go into the system message (one is added when there is none), each tool's OpenAI
  `function` object as one JSON line inside <tools></tools>, with the instruction to answer a
  call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`;
- an assistant message's `tool_calls` are appended to its content in that same form;
- a `tool` message becomes a user turn holding `<tool_response>...</tool_response>`.
"""

from __future__ import annotations

import json
from typing import Any

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"

TOOLS_PREAMBLE = (
    "You may call one or more functions to assist with the user query. You are provided with function "
    "signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n</tools>\n\n"
    "For each function call, return a json object with function name and arguments within "
    f"{TOOL_CALL_OPEN}{TOOL_CALL_CLOSE} XML tags:\n"
    f'{TOOL_CALL_OPEN}\n{{{{"name": <function-name>, "arguments": <args-json-object>}}}}\n{TOOL_CALL_CLOSE}'
)


def template_supports_tools(chat_template: str) -> bool:
    """Whether a chat template renders tools itself (it reads the `tools` variable), as vLLM judges it."""
    return "tools" in chat_template


def fallback_messages(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None) -> list[dict[str, str]]:
    """`messages` with the tools, tool calls and tool results written into plain contents."""
    rendered = [_plain(message) for message in messages]
    if not tools:
        return rendered
    preamble = TOOLS_PREAMBLE.format(tools="\n".join(json.dumps(tool.get("function", tool)) for tool in tools))
    if rendered and rendered[0]["role"] == "system":
        return [{"role": "system", "content": f"{rendered[0]['content']}\n\n{preamble}"}, *rendered[1:]]
    return [{"role": "system", "content": preamble}, *rendered]


def native_messages(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`messages` as HF chat templates take tool calls: each call's `arguments` as an object, not
    the JSON text OpenAI sends (text that is not a JSON object stays text)."""
    return [{**message, "tool_calls": [_with_object_arguments(call) for call in message["tool_calls"]]}
            if message.get("tool_calls") else message for message in messages]


def call_text(name: str, arguments: Any) -> str:
    """One tool call as the fallback format writes it."""
    return f"{TOOL_CALL_OPEN}\n{json.dumps({'name': name, 'arguments': arguments})}\n{TOOL_CALL_CLOSE}"


def _plain(message: dict[str, Any]) -> dict[str, str]:
    content = message.get("content") or ""
    if message["role"] == "tool":
        return {"role": "user", "content": f"<tool_response>\n{content}\n</tool_response>"}
    calls = [call_text(call["function"]["name"], _arguments(call["function"].get("arguments", "")))
             for call in message.get("tool_calls") or ()]
    return {"role": message["role"], "content": "\n".join(part for part in (content, *calls) if part)}


def _with_object_arguments(call: dict[str, Any]) -> dict[str, Any]:
    function = call["function"]
    return {**call, "function": {**function, "arguments": _arguments(function.get("arguments", ""))}}


def _arguments(text: str) -> Any:
    try:
        value = json.loads(text)
    except (TypeError, ValueError):
        return text
    return value if isinstance(value, dict) else text
