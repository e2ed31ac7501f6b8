"""The structured-output and logit_bias fields of the OpenAI-compatible bodies: OpenAI's
`response_format` (chat), vLLM's `structured_outputs` object and its older `guided_*` fields (both
endpoints), and `logit_bias`, turned into the SamplingParams' `structured` and `logit_bias`.

A constraint is compiled here, when the body is read, so one that does not compile is a 400
naming the field the client sent (`response_format`, `structured_outputs`, `guided_json`, ...)
before any worker sees it.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from services.common.errors import InvalidRequest
from services.common.structured_output import StructuredOutput


class _Strict(BaseModel):
    # A misspelt key inside these objects would drop the constraint silently: refuse it instead.
    model_config = ConfigDict(extra="forbid", strict=True, populate_by_name=True)


class JsonSchemaFormat(_Strict):
    """response_format.json_schema: OpenAI's named schema."""

    name: str = ""
    description: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Strict):
    """OpenAI's response_format: text (unconstrained), json_object, or json_schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputsParams(_Strict):
    """vLLM's structured_outputs object: exactly one of these constraints."""

    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class StructuredFields(BaseModel):
    """The fields both endpoints take (mixed into their bodies), and what they ask for."""

    structured_outputs: StructuredOutputsParams | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    logit_bias: dict[str, float] | None = None

    def structured_output(self) -> StructuredOutput | None:
        """The one constraint the body asks for, compiled (InvalidRequest naming its field when it
        does not compile, or when the body asks for more than one)."""
        sent = self._constraints()
        if len(sent) > 1:
            raise InvalidRequest(sent[1][0], f"cannot be combined with {sent[0][0]}; send one structured output")
        if not sent:
            return None
        param, structured = sent[0]
        try:
            structured.validate()
        except ValueError as exc:
            raise InvalidRequest(param, str(exc)) from None
        return structured

    def structured_output_with(self, response_format: ResponseFormat | None) -> StructuredOutput | None:
        """The chat body's constraint: response_format, or the vLLM fields, not both."""
        from_format = response_format_output(response_format)
        if from_format is not None and self._constraints():
            raise InvalidRequest("response_format", f"cannot be combined with {self._constraints()[0][0]}; "
                                                    "send one structured output")
        return from_format or self.structured_output()

    def logit_bias_pairs(self) -> tuple[tuple[int, float], ...]:
        """logit_bias as (token id, bias) pairs; its keys are token ids written as strings, as OpenAI's."""
        pairs = []
        for key, bias in (self.logit_bias or {}).items():
            if not key.strip().isdigit():
                raise InvalidRequest("logit_bias", f"keys must be token ids (non-negative integers), got {key!r}")
            pairs.append((int(key), float(bias)))
        return tuple(sorted(pairs))

    def _constraints(self) -> list[tuple[str, StructuredOutput]]:
        """(field name, constraint) for every constraint field sent, in declaration order."""
        sent: list[tuple[str, StructuredOutput]] = []
        if self.structured_outputs is not None:
            sent.extend(("structured_outputs", s) for s in _vllm_constraints(self.structured_outputs))
        if self.guided_json is not None:
            sent.append(("guided_json", StructuredOutput("json_schema", _schema_text(self.guided_json))))
        if self.guided_regex is not None:
            sent.append(("guided_regex", StructuredOutput("regex", self.guided_regex)))
        if self.guided_choice is not None:
            sent.append(("guided_choice", StructuredOutput("choice", choices=tuple(self.guided_choice))))
        if self.guided_grammar is not None:
            sent.append(("guided_grammar", StructuredOutput("grammar", self.guided_grammar)))
        return sent


def response_format_output(response_format: ResponseFormat | None) -> StructuredOutput | None:
    """The constraint of OpenAI's response_format, compiled (InvalidRequest naming response_format)."""
    if response_format is None or response_format.type == "text":
        return None
    if response_format.type == "json_object":
        return StructuredOutput("json_object")
    spec = response_format.json_schema
    if spec is None or spec.schema_ is None:
        raise InvalidRequest("response_format", "type json_schema needs json_schema.schema, the JSON schema to follow")
    structured = StructuredOutput("json_schema", json.dumps(spec.schema_), strict=bool(spec.strict))
    try:
        structured.validate()
    except ValueError as exc:
        raise InvalidRequest("response_format", str(exc)) from None
    return structured


def _vllm_constraints(params: StructuredOutputsParams) -> list[StructuredOutput]:
    found = []
    if params.json_ is not None:
        found.append(StructuredOutput("json_schema", _schema_text(params.json_)))
    if params.regex is not None:
        found.append(StructuredOutput("regex", params.regex))
    if params.choice is not None:
        found.append(StructuredOutput("choice", choices=tuple(params.choice)))
    if params.grammar is not None:
        found.append(StructuredOutput("grammar", params.grammar))
    if params.json_object:
        found.append(StructuredOutput("json_object"))
    if not found:
        raise InvalidRequest("structured_outputs", "set one of json, regex, choice, grammar or json_object")
    return found


def _schema_text(schema: dict[str, Any] | str) -> str:
    """A schema sent as an object or as its JSON text, as JSON text."""
    return schema if isinstance(schema, str) else json.dumps(schema)
