"""The gateway's gRPC door under hypothesis-generated GenerateRequests and raw random bytes: every
call ends OK with a finished stream, or is refused with a client status (INVALID_ARGUMENT,
NOT_FOUND, RESOURCE_EXHAUSTED, OUT_OF_RANGE, FAILED_PRECONDITION) and a message; never INTERNAL
or UNKNOWN. Afterwards the mesh serves the reference request's exact tokens and is idle.
"""

from __future__ import annotations

import grpc
import pytest
from google.protobuf.message import DecodeError
from hypothesis import assume, event, given
from hypothesis import strategies as st

from services.common.wire import DEFAULT_MAX_TOKENS
from tandem.v1 import common_pb2, gateway_pb2, gateway_pb2_grpc
from tests.fuzz.serving import AUTH, CALL_TIMEOUT_S, Outcome, assert_still_serving, budget, outcome_of
from tests.fuzz.strategies import CHEAP_MAX_TOKENS, COMMON_HINTS, INT32, VOCAB_SIZE, messages, odd_text

pytestmark = pytest.mark.slow

GENERATE = "/tandem.v1.GenerateService/Generate"
MODEL = "SmolLM2-135M-Instruct"
REFUSALS = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND,
                      grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.OUT_OF_RANGE,
                      grpc.StatusCode.FAILED_PRECONDITION})
# Refusals the gateway itself decides name the request in the initial metadata; grpc's own
# (a message over the size limit) happen before the servicer runs.
NAMED_REFUSALS = frozenset({grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND})
FINISHED = (common_pb2.FINISH_REASON_STOP, common_pb2.FINISH_REASON_LENGTH)
UNPARSED = "request: Error parsing message with type 'tandem.v1.GenerateRequest'"


def _floats(*usual: float) -> st.SearchStrategy[float]:
    return st.one_of(st.sampled_from(usual), st.floats(width=32))


def _ints(low: int, high: int) -> st.SearchStrategy[int]:
    return st.one_of(st.integers(low, high), st.integers(*INT32))


# Prompts: the usual, odd unicode, empty, over the character limit (200k), over the door's 4 MiB.
PROMPTS = st.one_of(odd_text, st.sampled_from(["", "Hello, my name is", "a " * 60_000, "x" * 200_001,
                                                "\u00e9" * (3 << 20)]))
SAMPLING_HINTS = {
    **COMMON_HINTS,
    "temperature": _floats(0.0, 0.7, 1.0), "top_p": _floats(1.0, 0.5), "top_k": _ints(-1, 50),
    "min_p": _floats(0.0, 0.1), "logprobs": _ints(0, 20), "repetition_penalty": _floats(1.0, 1.2),
    "presence_penalty": _floats(0.0, 1.5), "frequency_penalty": _floats(0.0, -1.0), "min_tokens": _ints(0, 3),
    "stop": st.one_of(st.lists(odd_text, max_size=3), st.just(["."] * 17)),
}
REQUEST_HINTS = {
    **COMMON_HINTS,
    "prompt": PROMPTS,
    "token_ids": st.one_of(COMMON_HINTS["token_ids"], st.just([200] * 9000)),
    "messages": st.lists(messages(gateway_pb2.ChatMessage.DESCRIPTOR,
                                  {"role": st.one_of(st.sampled_from(["user", "system", "assistant", ""]),
                                                     odd_text)}), max_size=3),
    "sampling": messages(common_pb2.SamplingParams.DESCRIPTOR, SAMPLING_HINTS),
    "model": st.one_of(st.sampled_from(["", MODEL]), odd_text),
    "request_id": st.one_of(st.from_regex(r"[A-Za-z0-9._:-]{1,128}", fullmatch=True), odd_text,
                            st.just("r" * 129)),
    "cache_salt": st.one_of(odd_text, st.just("s" * 257)),
}


# Requests that pass validation, so most examples reach the scheduler and the workers: one prompt
# field, every sampling value in range, odd unicode in the texts.
PLAUSIBLE_PROMPT = st.one_of(
    st.builds(lambda text: {"prompt": text}, odd_text.filter(bool)),
    st.builds(lambda ids: {"token_ids": ids}, st.lists(st.integers(0, VOCAB_SIZE - 1), min_size=1, max_size=24)),
    st.builds(lambda turns: {"messages": turns}, st.lists(st.builds(
        gateway_pb2.ChatMessage, role=st.sampled_from(["user", "system", "assistant"]), content=odd_text),
        min_size=1, max_size=3)),
)
PLAUSIBLE_SAMPLING = st.builds(
    common_pb2.SamplingParams, max_tokens=st.integers(1, CHEAP_MAX_TOKENS),
    temperature=st.sampled_from([0.0, 0.7, 1.0]), top_p=st.floats(0.0625, 1.0, width=32), top_k=st.integers(-1, 50),
    min_p=st.floats(0.0, 1.0, width=32), seed=st.integers(0, 2**64 - 1),
    stop_token_ids=st.lists(st.integers(0, VOCAB_SIZE - 1), max_size=3), ignore_eos=st.booleans(),
    logprobs=st.integers(0, 20), repetition_penalty=st.floats(0.5, 2.0, width=32),
    presence_penalty=st.floats(-2.0, 2.0, width=32), frequency_penalty=st.floats(-2.0, 2.0, width=32),
    stop=st.lists(odd_text.filter(bool), max_size=3), include_stop_str_in_output=st.booleans(),
    skip_special_tokens=st.booleans())
PLAUSIBLE = st.builds(lambda prompt, sampling, salt: gateway_pb2.GenerateRequest(**prompt, sampling=sampling,
                                                                                 cache_salt=salt),
                      PLAUSIBLE_PROMPT, PLAUSIBLE_SAMPLING, odd_text)


def generate(gateway: grpc.Channel, request: gateway_pb2.GenerateRequest) -> tuple[Outcome, list, grpc.RpcError | None]:
    """The call's outcome, its responses when OK, and the error when refused."""
    try:
        responses = list(gateway_pb2_grpc.GenerateServiceStub(gateway).Generate(
            request, metadata=AUTH, timeout=CALL_TIMEOUT_S))
    except grpc.RpcError as error:
        return Outcome(error.code(), error.details() or ""), [], error
    return Outcome(grpc.StatusCode.OK, ""), responses, None


@budget(max_examples=100)
@given(request=st.one_of(messages(gateway_pb2.GenerateRequest.DESCRIPTOR, REQUEST_HINTS), PLAUSIBLE))
def test_generated_requests_end_ok_or_with_a_client_status(gateway, reference, request):
    outcome, responses, error = generate(gateway, request)
    event(outcome.code.name)
    if outcome.code == grpc.StatusCode.OK:
        last = responses[-1]
        limit = request.sampling.max_tokens if request.sampling.HasField("max_tokens") else DEFAULT_MAX_TOKENS
        assert last.finish_reason in FINISHED, (request, last)
        assert last.usage.completion_tokens == sum(len(r.token_ids) for r in responses) <= limit, (request, last)
        return
    assert outcome.code in REFUSALS and outcome.details, (request, outcome)
    if outcome.code in NAMED_REFUSALS:
        assert "x-request-id" in dict(error.trailing_metadata() or ()), (request, outcome)


@budget(max_examples=40)
@given(raw=st.one_of(st.binary(max_size=256), PLAUSIBLE.map(lambda m: _mangled(m.SerializeToString()))))
def test_raw_bytes_never_fault(gateway, reference, raw):
    parsed = _parsed(raw)
    assume(parsed is None or not _costly(parsed))
    call = gateway.unary_stream(GENERATE)  # no serializers: the bytes go as they are
    outcome, _ = outcome_of(lambda: list(call(raw, metadata=AUTH, timeout=CALL_TIMEOUT_S)))
    event(outcome.code.name)
    if parsed is None:
        assert outcome.code == grpc.StatusCode.INVALID_ARGUMENT, (raw, outcome)
        assert outcome.details.startswith(UNPARSED), (raw, outcome)
    else:
        assert outcome.code == grpc.StatusCode.OK or (outcome.code in REFUSALS and outcome.details), (raw, outcome)


def test_mesh_serves_the_same_tokens_after_the_fuzzing(mesh, reference):
    assert_still_serving(mesh, reference)


def _mangled(serialized: bytes) -> bytes:
    """A valid message cut short by a third: a truncated field or length prefix."""
    return serialized[: len(serialized) * 2 // 3]


def _parsed(raw: bytes) -> gateway_pb2.GenerateRequest | None:
    try:
        return gateway_pb2.GenerateRequest.FromString(raw)
    except DecodeError:
        return None


def _costly(request: gateway_pb2.GenerateRequest) -> bool:
    """A request asking for more than the default max_tokens: a generation that long is slow on
    this machine and tests nothing the generated requests do not."""
    return request.sampling.HasField("max_tokens") and request.sampling.max_tokens > DEFAULT_MAX_TOKENS
