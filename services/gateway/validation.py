"""Every check a generation request must pass before the gateway does any work for it.

Errors name the field as the request spells it (`prompt`, `max_tokens`, `temperature`, ...) and
the limit it broke, so the gRPC door reports INVALID_ARGUMENT and the HTTP bridge a 400 with that
`param` and the same message. Sizes are checked before anything walks the values: a request of
100k stop strings or a 10 MB prompt is refused by its length alone.
"""

from __future__ import annotations

import re

from services.common.errors import InvalidRequest, NotFound
from services.gateway.limits import RequestLimits
from services.gateway.request import GenerationRequest, ServedModel, new_request_id

REQUEST_ID_PATTERN = re.compile(r"[A-Za-z0-9._:-]{1,128}")


def validate_request(request: GenerationRequest, model: ServedModel, limits: RequestLimits = RequestLimits()) -> str:
    """Checks every field that does not need the prompt's tokens; returns the prompt field set.

    Order: model (NOT_FOUND), the prompt field, sampling, stop strings, request id, cache salt.
    """
    check_model(request.model, model)
    field = _check_prompt_field(request, model, limits)
    _check_sampling(request, model, limits)
    _check_stop(request.stop, limits)
    if request.request_id and not REQUEST_ID_PATTERN.fullmatch(request.request_id):
        raise InvalidRequest("request_id", "must be 1 to 128 characters of A-Z a-z 0-9 . _ : -")
    _check_at_most("cache_salt", len(request.cache_salt), limits.max_cache_salt_chars, "characters")
    return field


def check_repeated_sizes(num_messages: int, num_token_ids: int, model: ServedModel, limits: RequestLimits) -> None:
    """The sizes of the repeated prompt fields, checked before a door converts them: turning a gRPC
    message of 600k chat messages into dicts would hold the event loop for half a second."""
    _check_at_most("messages", num_messages, limits.max_messages, "messages")
    _check_prompt_fits("token_ids", num_token_ids, model)


def check_choices(n: int, limits: RequestLimits) -> None:
    """The number of choices (the HTTP API's n) is in [1, max_n]."""
    if not 1 <= n <= limits.max_n:
        raise InvalidRequest("n", f"must be in [1, {limits.max_n}], got {n}")


def check_generations(num_prompts: int, n: int, limits: RequestLimits) -> None:
    """A request's prompts times n stay within max_n generations (--max-n)."""
    if num_prompts * n > limits.max_n:
        raise InvalidRequest("prompt", f"{num_prompts} prompts with n={n} make {num_prompts * n} generations; "
                             f"at most {limits.max_n} (--max-n) per request")


def request_id_or_new(candidate: str) -> str:
    """The caller's request id when it is a valid one, else a new id: every response names its
    request, even one refused for its id."""
    return candidate if REQUEST_ID_PATTERN.fullmatch(candidate) else new_request_id()


def check_model(name: str, model: ServedModel) -> None:
    """An empty name means the served model; any other name must be it or one of its adapters'."""
    if name and name not in model.served_names:
        served = ", ".join(repr(n) for n in model.served_names)
        raise NotFound(f"model {name!r} not found; this gateway serves {served}")


def check_prompt_length(field: str, num_prompt_tokens: int, max_tokens: int, model: ServedModel) -> None:
    """The tokenized prompt and then prompt + max_tokens must fit the model's context."""
    context = model.max_model_len
    _check_prompt_fits(field, num_prompt_tokens, model)
    if num_prompt_tokens + max_tokens > context:
        raise InvalidRequest(
            "max_tokens",
            f"the prompt ({num_prompt_tokens} tokens) plus max_tokens ({max_tokens}) exceeds the model's "
            f"context of {context} tokens; set max_tokens to at most {context - num_prompt_tokens}",
        )


def _check_prompt_fits(field: str, num_prompt_tokens: int, model: ServedModel) -> None:
    context = model.max_model_len
    if num_prompt_tokens >= context:
        raise InvalidRequest(
            field,
            f"the prompt has {num_prompt_tokens} tokens but the model's context is {context} tokens, "
            f"including at least one generated token; shorten it to at most {context - 1} tokens",
        )


def _check_at_most(field: str, size: int, limit: int, unit: str, subject: str = "has") -> None:
    """'<field>: has 17 stop strings; this server accepts at most 16'."""
    if size > limit:
        raise InvalidRequest(field, f"{subject} {size} {unit}; this server accepts at most {limit}")


def _check_prompt_field(request: GenerationRequest, model: ServedModel, limits: RequestLimits) -> str:
    fields = request.prompt_fields
    if not fields:
        raise InvalidRequest("prompt", "missing; set one of prompt, token_ids or messages")
    if len(fields) > 1:
        raise InvalidRequest(fields[1], f"cannot be combined with {fields[0]}; set only one of prompt, "
                                        "token_ids or messages")
    field = fields[0]
    if field == "prompt":
        if request.prompt == "":
            raise InvalidRequest("prompt", "must not be empty")
        _check_at_most("prompt", len(request.prompt or ""), limits.max_prompt_chars, "characters")
    if field == "token_ids":
        _check_prompt_fits("token_ids", len(request.token_ids or []), model)
        check_token_ids("token_ids", request.token_ids or [], model, allow_empty=False)
    if field == "messages":
        _check_messages(request.messages or [], model, limits)
    return field


def check_token_ids(field: str, token_ids: list[int], model: ServedModel, allow_empty: bool = True) -> None:
    """Every id is in the model's vocabulary (InvalidRequest naming the first that is not)."""
    if not token_ids and not allow_empty:
        raise InvalidRequest(field, "must not be empty")
    for index, token_id in enumerate(token_ids):
        if not 0 <= token_id < model.vocab_size:
            raise InvalidRequest(field, f"token id {token_id} at index {index} is outside the vocabulary "
                                        f"[0, {model.vocab_size})")


def _check_messages(messages: list[dict[str, str]], model: ServedModel, limits: RequestLimits) -> None:
    if not messages:
        raise InvalidRequest("messages", "must not be empty")
    _check_at_most("messages", len(messages), limits.max_messages, "messages")
    characters = sum(len(message.get("role", "")) + len(message.get("content", "")) for message in messages)
    _check_at_most("messages", characters, limits.max_prompt_chars, "characters in roles and contents")
    if not model.has_chat_template:
        raise InvalidRequest("messages", f"model {model.name!r} has no chat template; send prompt or "
                                         "token_ids instead")
    for index, message in enumerate(messages):
        if not message.get("role"):
            raise InvalidRequest("messages", f"message {index} has no role")


def _check_sampling(request: GenerationRequest, model: ServedModel, limits: RequestLimits) -> None:
    stop_token_ids = request.sampling.stop_token_ids
    _check_at_most("stop_token_ids", len(stop_token_ids), limits.max_stop_token_ids, "ids")
    try:
        request.sampling.validate()
    except ValueError as exc:  # "<field> <rule>, got <value>"
        field, _, problem = str(exc).partition(" ")
        raise InvalidRequest(field, problem) from None
    check_token_ids("stop_token_ids", list(stop_token_ids), model)
    check_token_ids("logit_bias", [token_id for token_id, _ in request.sampling.logit_bias], model)


def _check_stop(stop: tuple[str, ...], limits: RequestLimits) -> None:
    _check_at_most("stop", len(stop), limits.max_stop_strings, "stop strings")
    for index, text in enumerate(stop):
        if not text:
            raise InvalidRequest("stop", f"stop string {index} is empty")
        _check_at_most("stop", len(text), limits.max_stop_chars, "characters", f"stop string {index} has")
