"""Tool calling's pure parts: the plan a request's fields make, the schema a forced choice puts on
the output, the reading of output text into content and calls however it is cut into pieces, and
the fallback prompt for templates without tool support.
"""

from __future__ import annotations

import json

import pytest

from services.common.errors import InvalidRequest
from services.common.tool_prompt import call_text, fallback_messages, native_messages, template_supports_tools
from services.gateway.tools import NamedToolChoice, Tool, ToolCallReader, ToolDelta, ToolPlan

WEATHER = Tool.model_validate({"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}})
CLOCK = Tool.model_validate({"type": "function", "function": {"name": "get_time"}})
TEXT = f"Sure. {call_text('get_weather', {'city': 'Paris'})} and {call_text('get_time', {})} done"


def _read(plan: ToolPlan, pieces: list[str]) -> tuple[str, list[tuple[str, dict]]]:
    reader = ToolCallReader(plan)
    deltas = [reader.push(piece) for piece in pieces] + [reader.finish()]
    content = "".join(delta.content for delta in deltas)
    return content, [(call.name, json.loads(call.arguments)) for delta in deltas for call in delta.calls]


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_auto_reads_tagged_calls_however_the_text_is_cut(size):
    plan = ToolPlan.of([WEATHER, CLOCK], "auto", None)
    pieces = [TEXT[i:i + size] for i in range(0, len(TEXT), size)]
    assert _read(plan, pieces) == ("Sure.  and  done", [("get_weather", {"city": "Paris"}), ("get_time", {})])


def test_text_that_only_looks_like_a_tag_stays_content():
    plan = ToolPlan.of([WEATHER], None, None)
    assert _read(plan, ["a <tool", "_cal", "l is < x <tool_call>not json</tool_call>"]) == (
        "a <tool_call is < x <tool_call>not json</tool_call>", [])


def test_an_unclosed_last_call_is_read_at_the_end():
    plan = ToolPlan.of([WEATHER], "auto", None)
    assert _read(plan, ['<tool_call>{"name": "get_weather", "arguments": {"city": "Rome"}}']) == (
        "", [("get_weather", {"city": "Rome"})])
    assert _read(plan, ['<tool_call>{"name": "get_wea']) == ('<tool_call>{"name": "get_wea', [])


def test_a_forced_choice_is_read_at_the_end_and_cut_output_stays_text():
    required = ToolPlan.of([WEATHER, CLOCK], "required", False)
    reader = ToolCallReader(required)
    assert reader.push('[{"name": "get_time", "parameters": {}}, ') == ToolDelta()
    assert _read(required, ['[{"name": "get_time", "parameters": {}}, {"name": "get_time", "parameters": {}}]']) == (
        "", [("get_time", {})])  # parallel_tool_calls false: the first only
    named = ToolPlan.of([WEATHER], NamedToolChoice.model_validate(
        {"type": "function", "function": {"name": "get_weather"}}), None)
    assert _read(named, ['{"city":', ' "Oslo"}']) == ("", [("get_weather", {"city": "Oslo"})])
    assert _read(named, ['{"city": "Os']) == ('{"city": "Os', [])  # max_tokens cut it


def test_forced_schemas():
    assert ToolPlan.of([WEATHER, CLOCK], None, None).json_schema() is None
    named = ToolPlan.of([CLOCK], NamedToolChoice.model_validate({"type": "function", "function": {"name": "get_time"}}),
                        None)
    assert named.json_schema() == {"type": "object"}
    assert ToolPlan.of([WEATHER, CLOCK], "required", False).json_schema() == {
        "type": "array", "minItems": 1, "maxItems": 1, "items": {"anyOf": [
            {"type": "object", "required": ["name", "parameters"], "additionalProperties": False, "properties": {
                "name": {"type": "string", "enum": ["get_weather"]},
                "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}},
            {"type": "object", "required": ["name", "parameters"], "additionalProperties": False, "properties": {
                "name": {"type": "string", "enum": ["get_time"]}, "parameters": {"type": "object"}}}]}}


def test_no_plan_without_tools_or_with_choice_none():
    assert ToolPlan.of(None, None, None) is None
    assert ToolPlan.of([], "none", True) is None
    assert ToolPlan.of([WEATHER], "none", None) is None
    with pytest.raises(InvalidRequest, match="^tool_choice: needs tools"):
        ToolPlan.of(None, "required", None)


def test_fallback_prompt_writes_tools_calls_and_results_into_plain_messages():
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Go"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}]},
                {"role": "tool", "content": "ok", "tool_call_id": "c"}]
    rendered = fallback_messages(messages, [tool])
    assert [m["role"] for m in rendered] == ["system", "user", "assistant", "user"]
    assert rendered[0]["content"].startswith("Be brief.\n\nYou may call one or more functions")
    assert '<tools>\n{"name": "f", "parameters": {"type": "object"}}\n</tools>' in rendered[0]["content"]
    assert rendered[2:] == [{"role": "assistant", "content": '<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>'},
                            {"role": "user", "content": "<tool_response>\nok\n</tool_response>"}]
    assert fallback_messages([{"role": "user", "content": "Hi"}], None) == [{"role": "user", "content": "Hi"}]


def test_native_templates_get_arguments_as_objects():
    call = {"id": "c", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    assert native_messages([{"role": "assistant", "content": "", "tool_calls": [call]}]) == [
        {"role": "assistant", "content": "", "tool_calls": [{**call, "function": {"name": "f", "arguments": {"x": 1}}}]}]
    assert template_supports_tools("{% if tools %}...{% endif %}")
    assert not template_supports_tools("{% for message in messages %}{{ message.content }}{% endfor %}")
