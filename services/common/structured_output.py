"""A structured-output constraint (JSON schema, any JSON object, regex, choice list, Lark grammar)
and the one grammar text it compiles to, for llguidance.

Torch-free: the gateway validates a constraint with the same compiler the workers run
(services/runtime/grammar.py), so a grammar that does not compile never reaches a worker.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Literal

import llguidance

Kind = Literal["json_schema", "json_object", "regex", "choice", "grammar"]
KINDS: tuple[Kind, ...] = ("json_schema", "json_object", "regex", "choice", "grammar")

# Compact separators and no free whitespace: a small model left free to emit whitespace between
# JSON tokens can fill max_tokens with newlines and never close the value.
_JSON_LAYOUT = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, slots=True)
class StructuredOutput:
    """What the output must follow. `spec` is the schema's JSON text, the regex, or the Lark
    grammar; `choices` the choice list; json_object needs neither."""

    kind: Kind
    spec: str = ""
    choices: tuple[str, ...] = ()
    strict: bool = False
    num_generated_prompt_tokens: int = 0  # a migrated continuation's prompt tail already generated

    def grammar(self) -> str:
        """The llguidance grammar text of this constraint (not yet checked: see `validate`)."""
        if self.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(
                self.spec, overrides={**_JSON_LAYOUT, "lenient": not self.strict})
        if self.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, overrides=_JSON_LAYOUT)
        if self.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(self.spec)
        if self.kind == "choice":
            # Lark string literals take JSON's escapes, so any choice text is one literal.
            return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in self.choices))
        return llguidance.LLMatcher.grammar_from_lark(self.spec)

    def validate(self) -> None:
        """Raise ValueError saying why the constraint does not compile."""
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {', '.join(KINDS)}, got {self.kind!r}")
        if self.kind == "choice" and (not self.choices or not all(self.choices)):
            raise ValueError("choice must be a non-empty list of non-empty strings")
        if self.kind in ("json_schema", "regex", "grammar") and not self.spec:
            raise ValueError(f"{self.kind} must not be empty")
        if self.kind == "json_schema":
            _check_json_object(self.spec)
        error = _compile_error(self.grammar())
        if error:
            raise ValueError(f"{self.kind} does not compile: {error.strip()}")
        if self.num_generated_prompt_tokens < 0:
            raise ValueError(f"num_generated_prompt_tokens must be >= 0, got {self.num_generated_prompt_tokens}")


def _check_json_object(spec: str) -> None:
    try:
        schema = json.loads(spec)
    except json.JSONDecodeError as exc:
        raise ValueError(f"json_schema is not valid JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise ValueError(f"json_schema must be a JSON object, got {type(schema).__name__}")


@functools.lru_cache(maxsize=256)
def _compile_error(grammar: str) -> str:
    """llguidance's error for a grammar text, "" when it compiles; cached, so a schema compiles once."""
    return llguidance.LLMatcher.validate_grammar(grammar)
