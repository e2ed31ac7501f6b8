"""Building a GenerateRequest from the SDK's keyword options.

The server validates every value (INVALID_ARGUMENT naming the field); the SDK only refuses
options it does not know, so a misspelt keyword fails at once instead of being dropped.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import TypedDict

from tandem.v1 import common_pb2, gateway_pb2

_REQUEST_FIELDS = ("model", "cache_salt", "request_id")
_STRUCTURED_FIELDS = ("json_schema", "json_object", "regex", "choice", "grammar", "strict")


class GenerateOptions(TypedDict, total=False):
    """Keyword options of generate/complete/chat. Unset (or None) takes the server's default."""

    model: str                          # served model name; "" = the deployment's model
    max_tokens: int | None              # most tokens to generate (server default 16)
    temperature: float | None           # 0 = greedy; default 1.0
    top_p: float | None                 # nucleus mass in (0, 1]
    top_k: int | None                   # keep the k most likely; 0 or -1 = off
    min_p: float | None                 # drop tokens below min_p x the top token's probability
    seed: int | None                    # sampling is a pure function of (seed, position, logits)
    stop: str | Sequence[str] | None    # stop strings, cut from the returned text
    stop_token_ids: Sequence[int] | None
    ignore_eos: bool | None
    logprobs: int | None                # 0 = chosen token only; N = also the top N alternatives
    presence_penalty: float | None
    frequency_penalty: float | None
    repetition_penalty: float | None
    min_tokens: int | None              # no EOS/stop token before this many tokens
    include_stop_str_in_output: bool | None
    skip_special_tokens: bool | None
    logit_bias: Mapping[int, float] | None  # token id -> bias added to its logit, clamped to [-100, 100]
    json_schema: Mapping[str, object] | str | None  # the output is JSON valid under this schema
    json_object: bool | None            # the output is a JSON object
    regex: str | None                   # the output matches this regular expression
    choice: Sequence[str] | None        # the output is exactly one of these strings
    grammar: str | None                 # the output follows this Lark grammar
    strict: bool | None                 # json_schema: every keyword must be enforceable (else INVALID_ARGUMENT)
    cache_salt: str                     # tenant salt: requests with different salts never share prefix cache
    request_id: str                     # caller-chosen id, echoed back and usable in `tandem trace`


_SAMPLING_FIELDS = frozenset(GenerateOptions.__annotations__) - frozenset(_REQUEST_FIELDS) - frozenset(_STRUCTURED_FIELDS)


def build_request(
    options: Mapping[str, object],
    prompt: str | None = None,
    token_ids: Sequence[int] | None = None,
    messages: Sequence[Mapping[str, str]] | None = None,
) -> gateway_pb2.GenerateRequest:
    """The wire request; exactly one of prompt, token_ids, messages should be given (the server checks)."""
    unknown = sorted(set(options) - set(GenerateOptions.__annotations__))
    if unknown:
        raise TypeError(f"unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(_SAMPLING_FIELDS))}, "
                        f"{', '.join(_STRUCTURED_FIELDS)}, {', '.join(_REQUEST_FIELDS)}")
    request = gateway_pb2.GenerateRequest(sampling=_sampling(options))
    _set_structured(request.sampling.structured, options)
    for name in _REQUEST_FIELDS:
        if options.get(name) is not None:
            setattr(request, name, options[name])
    if prompt is not None:
        request.prompt = prompt
    if token_ids is not None:
        request.token_ids.extend(token_ids)
    if messages is not None:
        request.messages.extend(_chat_message(index, message) for index, message in enumerate(messages))
    return request


def _sampling(options: Mapping[str, object]) -> common_pb2.SamplingParams:
    sampling = common_pb2.SamplingParams()
    for name in _SAMPLING_FIELDS:
        value = options.get(name)
        if value is None:
            continue
        try:
            _set_field(sampling, name, value)
        except (TypeError, ValueError) as exc:
            raise TypeError(f"option {name}={value!r}: {exc}") from None
    return sampling


def _set_field(sampling: common_pb2.SamplingParams, name: str, value: object) -> None:
    if name == "stop" and isinstance(value, str):
        sampling.stop.append(value)
    elif name in ("stop", "stop_token_ids"):
        getattr(sampling, name).extend(value)
    elif name == "logit_bias":
        sampling.logit_bias.update(value)
    else:
        setattr(sampling, name, value)


def _set_structured(structured: common_pb2.StructuredOutput, options: Mapping[str, object]) -> None:
    """The one structured-output constraint among the options (TypeError when several are given)."""
    kinds = [name for name in _STRUCTURED_FIELDS[:-1] if options.get(name) not in (None, False)]
    if len(kinds) > 1:
        raise TypeError(f"options {' and '.join(kinds)} are exclusive; give one structured output")
    if options.get("strict") is not None:
        structured.strict = bool(options["strict"])
    if not kinds:
        return
    kind, value = kinds[0], options[kinds[0]]
    if kind == "choice":
        structured.choice.choices.extend(value)  # type: ignore[arg-type]
    elif kind == "json_schema" and not isinstance(value, str):
        structured.json_schema = json.dumps(value)
    else:
        setattr(structured, kind, value)


def _chat_message(index: int, message: Mapping[str, str]) -> gateway_pb2.ChatMessage:
    if not isinstance(message, Mapping) or "role" not in message or "content" not in message:
        raise TypeError(f"messages[{index}] must be a mapping with 'role' and 'content', got {message!r}")
    return gateway_pb2.ChatMessage(role=message["role"], content=message["content"])
