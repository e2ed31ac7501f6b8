"""The OpenAI request fields Tandem does not implement, and what happens when a client sends one:
no field is silently dropped. A field either changes nothing in the output by design (`Inert`:
accepted, the reason written here), or is refused (`Refused`: a 400 naming it) unless its value
asks for nothing. Any other field the body does not declare is unknown: accepted with a warning
in the log, as vLLM does, since clients send vendor extras.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from services.common.errors import InvalidRequest

log = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class Inert:
    """Accepted and without effect on the output, for `reason`."""

    reason: str


@dataclass(frozen=True, slots=True)
class Refused:
    """Refused with a 400 saying `reason`, unless the value sent is one of `harmless`."""

    reason: str
    harmless: tuple[Any, ...] = (None,)


FieldPolicy = Inert | Refused

# Fields of both endpoints: OpenAI's, then vLLM's extras that would change the output.
SHARED_FIELDS: dict[str, FieldPolicy] = {
    "use_beam_search": Refused("beam search is not supported; use n for several samples", (None, False)),
    "length_penalty": Refused("applies to beam search, which is not supported", (None, 1, 1.0)),
    "truncate_prompt_tokens": Refused("prompts are never truncated here; shorten the prompt"),
    "allowed_token_ids": Refused("not supported; use logit_bias or a structured output"),
    "bad_words": Refused("not supported; use logit_bias", (None, [])),
    "spaces_between_special_tokens": Refused("special tokens are always joined without spaces", (None, True)),
    "return_tokens_as_token_ids": Refused("not supported; /tokenize gives token ids", (None, False)),
    "priority": Refused("requests are served first come, first served", (None, 0)),
    "request_id": Refused("send the request id in the x-request-id header"),
}

COMPLETION_FIELDS: dict[str, FieldPolicy] = {
    **SHARED_FIELDS,
    "suffix": Refused("insertion after a suffix is not supported; put all the text in prompt"),
    "add_special_tokens": Refused("the tokenizer's special tokens are always added", (None, True)),
}

CHAT_FIELDS: dict[str, FieldPolicy] = {
    **SHARED_FIELDS,
    "metadata": Inert("tags for stored completions; nothing is stored, so they have no use"),
    "safety_identifier": Inert("an end-user label for OpenAI's abuse checks; Tandem serves every caller alike"),
    "prompt_cache_key": Inert("a routing hint for OpenAI's cache; Tandem's prefix cache matches prompts itself"),
    "prompt_cache_retention": Inert("Tandem's prefix cache keeps blocks until it needs the room"),
    "prompt_cache_options": Inert("Tandem's prefix cache keeps blocks until it needs the room"),
    "service_tier": Refused("service tiers are not offered; send auto or default", (None, "auto", "default")),
    "store": Refused("completions are not stored by this server; send false", (None, False)),
    "modalities": Refused("only text output is supported", (None, ["text"])),
    "audio": Refused("audio output is not supported"),
    "prediction": Refused("predicted outputs are not supported"),
    "reasoning_effort": Refused("this server does not run reasoning models"),
    "verbosity": Refused("verbosity is not supported; say it in the messages"),
    "web_search_options": Refused("web search is not supported"),
    "moderation": Refused("moderation is not supported"),
    "functions": Refused("the deprecated functions API is not supported; send tools"),
    "function_call": Refused("the deprecated functions API is not supported; send tool_choice"),
    "echo": Refused("echo is a /v1/completions feature", (None, False)),
    "add_generation_prompt": Refused("the assistant's turn is always opened", (None, True)),
    "continue_final_message": Refused("the assistant's turn is always a new one", (None, False)),
    "add_special_tokens": Refused("the chat template places the special tokens", (None, False)),
    "chat_template": Refused("the model's own chat template is used"),
    "chat_template_kwargs": Refused("the model's own chat template is used as it is"),
    "documents": Refused("put the documents in the messages"),
}


def check_undeclared(extras: Mapping[str, Any], policies: Mapping[str, FieldPolicy], endpoint: str) -> None:
    """Apply the policies to the fields a body sent but does not declare: InvalidRequest for the
    first refused one, a log warning naming the unknown ones."""
    unknown = []
    for name, value in extras.items():
        policy = policies.get(name)
        if policy is None:
            unknown.append(name)
        elif isinstance(policy, Refused) and not _is_harmless(value, policy.harmless):
            raise InvalidRequest(name, policy.reason)
    if unknown:
        log.warning("%s: ignoring fields this server does not know: %s", endpoint, ", ".join(sorted(unknown)))


def _is_harmless(value: Any, harmless: tuple[Any, ...]) -> bool:
    # Compared with the type too: 0 == False, but `store: 0` is not the JSON false asked for.
    return any(type(value) is type(allowed) and value == allowed for allowed in harmless)
