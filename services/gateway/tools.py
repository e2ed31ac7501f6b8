"""Tool calling on /v1/chat/completions: the `tools`, `tool_choice` and `parallel_tool_calls` of a
request, the JSON schema that forces a call when one is required, and the reading of the model's
output back into OpenAI's `tool_calls`, whole or as stream deltas.

What the model writes, by tool_choice:
- "auto": text, with each call as `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  (tool_prompt's format); the text outside the tags is the message content.
- "required": a JSON array of `{"name": ..., "parameters": {...}}`, at least one (one when
  parallel_tool_calls is false), enforced by the structured-output grammar, so it always parses.
- a named function: that function's arguments as one JSON object, enforced likewise.
- "none": plain text; the tools are not shown to the model.
"""

from __future__ import annotations

import json
import secrets
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

from services.common.errors import InvalidRequest
from services.common.structured_output import StructuredOutput
from services.common.tool_prompt import TOOL_CALL_CLOSE, TOOL_CALL_OPEN


class _Part(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)


class FunctionDefinition(_Part):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Part):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(_Part):
    name: str


class NamedToolChoice(_Part):
    type: Literal["function"]
    function: FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call the model made: OpenAI's `{"id", "type": "function", "function": {"name", "arguments"}}`."""

    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{secrets.token_hex(12)}")

    def as_json(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(frozen=True, slots=True)
class ToolPlan:
    """A request's tools and how the model must use them. `choice` is "auto", "required" or the
    name of the one function to call."""

    tools: tuple[Tool, ...]
    choice: str
    parallel: bool = True

    @classmethod
    def of(cls, tools: list[Tool] | None, choice: ToolChoice | None, parallel: bool | None) -> ToolPlan | None:
        """The plan of a request's fields (None: no tools, or tool_choice "none": the model is not
        shown them and its text is read as text); InvalidRequest naming the field that does not
        fit the others."""
        if not tools:
            if choice not in (None, "none"):
                raise InvalidRequest("tool_choice", "needs tools: send the functions the model may call")
            return None
        names = [tool.function.name for tool in tools]
        if len(set(names)) != len(names):
            raise InvalidRequest("tools", "function names must be unique")
        if isinstance(choice, NamedToolChoice):
            if choice.function.name not in names:
                raise InvalidRequest("tool_choice", f"names function {choice.function.name!r}, which is not in tools")
            return cls(tuple(tools), choice.function.name, parallel is not False)
        return None if choice == "none" else cls(tuple(tools), choice or "auto", parallel is not False)

    @property
    def forced(self) -> bool:
        """Whether the output must be calls only (required or a named function)."""
        return self.choice != "auto"

    def template_tools(self) -> list[dict[str, Any]]:
        """The tools as the chat template shows them to the model."""
        return [tool.model_dump(exclude_none=True) for tool in self.tools]

    def json_schema(self) -> dict[str, Any] | None:
        """The schema the output must follow, for a forced choice; None otherwise."""
        if self.choice == "required":
            calls = {"anyOf": [_call_schema(tool.function) for tool in self.tools]}
            return {"type": "array", "items": calls, "minItems": 1, **({} if self.parallel else {"maxItems": 1})}
        if self.forced:
            return _parameters(self._function(self.choice))
        return None

    def structured_output(self) -> StructuredOutput | None:
        """The constraint that forces a required or named call, compiled (InvalidRequest naming
        tools when a function's parameters do not compile); None for "auto"."""
        schema = self.json_schema()
        if schema is None:
            return None
        structured = StructuredOutput("json_schema", json.dumps(schema))
        try:
            structured.validate()
        except ValueError as exc:
            raise InvalidRequest("tools", f"the parameters cannot force a call: {exc}") from None
        return structured

    def _function(self, name: str) -> FunctionDefinition:
        return next(tool.function for tool in self.tools if tool.function.name == name)


@dataclass(slots=True)
class ToolDelta:
    """What a piece of output adds: content text and finished tool calls."""

    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


class ToolCallReader:
    """Reads one choice's output, as it arrives, into content and tool calls. Call order: `push`
    for each piece of text, then `finish` once. Text that may be the start of a tool-call tag is
    held back until it is known; a forced choice's output is all held until `finish` parses it."""

    def __init__(self, plan: ToolPlan) -> None:
        self._plan = plan
        self._held = ""
        self.num_calls = 0

    def push(self, text: str) -> ToolDelta:
        self._held += text
        delta = ToolDelta()
        if self._plan.forced:
            return delta
        while True:
            start = self._held.find(TOOL_CALL_OPEN)
            if start < 0:
                start = len(self._held) - _partial_tag_length(self._held)
            delta.content += self._held[:start]
            self._held = self._held[start:]
            end = self._held.find(TOOL_CALL_CLOSE)
            if not self._held.startswith(TOOL_CALL_OPEN) or end < 0:
                return delta
            stop = end + len(TOOL_CALL_CLOSE)
            tagged, self._held = self._held[:stop], self._held[stop:]
            self._add(delta, _tagged_call(tagged[len(TOOL_CALL_OPEN):end]), tagged)

    def finish(self) -> ToolDelta:
        """The rest: a forced choice's calls, an unclosed last call, or held text."""
        held, self._held = self._held, ""
        delta = ToolDelta()
        if self._plan.choice == "required":
            calls = _required_calls(held)
        elif self._plan.forced:
            calls = _named_call(self._plan.choice, held)
        elif held.startswith(TOOL_CALL_OPEN):
            body = held[len(TOOL_CALL_OPEN):]
            self._add(delta, _tagged_call(body), held)
            return delta
        else:
            return ToolDelta(content=held)
        if calls is None:
            return ToolDelta(content=held)  # cut short (max_tokens): the text as it is
        for call in calls[: None if self._plan.parallel else 1]:
            self._add(delta, call, "")
        return delta

    def _add(self, delta: ToolDelta, call: ToolCall | None, text: str) -> None:
        """A parsed call joins the delta (only one in all unless parallel); text that is no call
        stays content."""
        if call is None:
            delta.content += text
        elif self._plan.parallel or self.num_calls == 0:
            delta.calls.append(call)
            self.num_calls += 1


def _call_schema(function: FunctionDefinition) -> dict[str, Any]:
    return {"type": "object", "properties": {"name": {"type": "string", "enum": [function.name]},
                                             "parameters": _parameters(function)},
            "required": ["name", "parameters"], "additionalProperties": False}


def _parameters(function: FunctionDefinition) -> dict[str, Any]:
    return function.parameters if function.parameters is not None else {"type": "object"}


def _partial_tag_length(text: str) -> int:
    """How many characters at the end of `text` could begin the tool-call tag."""
    for length in range(min(len(text), len(TOOL_CALL_OPEN) - 1), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-length:]):
            return length
    return 0


def _tagged_call(body: str) -> ToolCall | None:
    """The call inside a tag: {"name", "arguments"} (None when it is not one)."""
    value = _json(body)
    if not isinstance(value, dict) or not isinstance(value.get("name"), str):
        return None
    return ToolCall(value["name"], json.dumps(value.get("arguments", {})))


def _required_calls(text: str) -> list[ToolCall] | None:
    value = _json(text)
    if not isinstance(value, list) or not all(isinstance(item, dict) and isinstance(item.get("name"), str)
                                              for item in value):
        return None
    return [ToolCall(item["name"], json.dumps(item.get("parameters", {}))) for item in value]


def _named_call(name: str, text: str) -> list[ToolCall] | None:
    value = _json(text)
    return None if value is None else [ToolCall(name, json.dumps(value))]


def _json(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return None
