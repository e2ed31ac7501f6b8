"""Migration: a request whose generating worker was lost goes on from where its stream stands.

Model: the gateway reads the tokens, so it knows the ones delivered so far: when the scheduler tells
it the attempt's worker was lost, it submits them back with the request. The continuation
is a new request (a new attempt id on the workers, so the lost attempt's late events and aborts
cannot touch it) whose prompt is the prompt plus those tokens, with max_tokens and min_tokens
reduced by their count, and the same seed and cache salt. The sampler draws by absolute sequence
position, so a seeded or greedy continuation produces the tokens the lost worker would have; the
gateway's relay numbers its outputs from the delivered count. Presence and frequency penalties count output
tokens only, and a worker cannot tell which prompt tokens were outputs: such a request moves only
while nothing was delivered (then the continuation is the request itself).
"""

from __future__ import annotations

from collections.abc import Container, Sequence

from services.common.errors import InvalidRequest
from services.common.wire import DEFAULT_MAX_TOKENS
from tandem.v1 import scheduler_pb2

MAX_MIGRATIONS = 3  # a request that keeps losing its workers (it may be what kills them) fails after this many


def refusal(request: scheduler_pb2.SubmitRequest, delivered: int, migrations: int) -> str | None:
    """Why the request cannot move to another worker after `delivered` tokens; None when it can."""
    if migrations >= MAX_MIGRATIONS:
        return f"it moved {migrations} times already"
    sampling = request.sampling
    if delivered and (sampling.presence_penalty or sampling.frequency_penalty):
        return "presence and frequency penalties count output tokens, which a continuation cannot tell apart"
    return None


def check_continuation(request: scheduler_pb2.SubmitRequest) -> None:
    """A continuation's fields make sense (InvalidRequest naming the field otherwise)."""
    if request.migration < 0:
        raise InvalidRequest("migration", f"must be >= 0 (0: a new request), got {request.migration}")
    delivered = len(request.delivered_token_ids)
    if delivered and not request.migration:
        raise InvalidRequest("delivered_token_ids", "are for a continuation only (migration > 0)")
    sampling = request.sampling
    limit = sampling.max_tokens if sampling.HasField("max_tokens") else DEFAULT_MAX_TOKENS
    if delivered >= limit:
        raise InvalidRequest("delivered_token_ids", f"{delivered} token(s) delivered of max_tokens {limit}: "
                                                    "nothing is left to generate")


def continuation(request: scheduler_pb2.SubmitRequest, delivered: Sequence[int],
                 attempt_id: str) -> scheduler_pb2.SubmitRequest:
    """The request as the next worker gets it: the delivered tokens appended to the prompt and taken
    off max_tokens and min_tokens, under `attempt_id`."""
    moved = scheduler_pb2.SubmitRequest()
    moved.CopyFrom(request)
    moved.request_id = attempt_id
    moved.token_ids.extend(delivered)
    moved.ClearField("delivered_token_ids")
    sampling = moved.sampling
    limit = sampling.max_tokens if sampling.HasField("max_tokens") else DEFAULT_MAX_TOKENS
    sampling.max_tokens = limit - len(delivered)
    sampling.min_tokens = max(0, sampling.min_tokens - len(delivered))
    if sampling.HasField("structured"):  # the worker's grammar starts after the delivered tokens
        sampling.structured.num_generated_prompt_tokens += len(delivered)
    return moved


def attempt_id(request_id: str, migration: int, taken: Container[str]) -> str:
    """The id the workers know the request by after its `migration`-th move (the first attempt has
    the request id): `REQUEST_ID#migrated-N`, N counting up past the ids `taken` (in flight)."""
    while (candidate := f"{request_id}#migrated-{migration}") in taken:
        migration += 1
    return candidate

