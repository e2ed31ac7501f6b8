"""Conversions between the wire messages (`tandem.v1`) and the domain values, in one place.

Torch-free, so the gateway and the scheduler use the same conversions as the workers.
"""

from __future__ import annotations

from collections.abc import Iterable

from services.common.errors import InvalidRequest
from services.common.sampling_params import SamplingParams
from services.common.structured_output import StructuredOutput
from tandem.v1 import common_pb2

DEFAULT_MAX_TOKENS = 16  # gateway.proto / common.proto: what an unset SamplingParams.max_tokens means
MAX_ABORT_IDS = 1024  # request ids one Abort may name

FINISH_REASON_TO_PROTO: dict[str, int] = {
    "stop": common_pb2.FINISH_REASON_STOP,
    "length": common_pb2.FINISH_REASON_LENGTH,
    "abort": common_pb2.FINISH_REASON_ABORT,
    "error": common_pb2.FINISH_REASON_ERROR,
}
FINISH_REASON_FROM_PROTO: dict[int, str] = {value: name for name, value in FINISH_REASON_TO_PROTO.items()}


def sampling_from_proto(msg: common_pb2.SamplingParams, default_max_tokens: int) -> SamplingParams:
    """Unset optional fields take their documented defaults (temperature 1.0, as in OpenAI)."""
    return SamplingParams(
        max_tokens=msg.max_tokens if msg.HasField("max_tokens") else default_max_tokens,
        temperature=msg.temperature if msg.HasField("temperature") else 1.0,
        top_p=msg.top_p if msg.HasField("top_p") else 1.0,
        top_k=msg.top_k if msg.HasField("top_k") else 0,
        min_p=msg.min_p if msg.HasField("min_p") else 0.0,
        seed=msg.seed if msg.HasField("seed") else None,
        stop_token_ids=tuple(msg.stop_token_ids),
        ignore_eos=msg.ignore_eos,
        logprobs=msg.logprobs if msg.HasField("logprobs") else None,
        prompt_logprobs=msg.prompt_logprobs if msg.HasField("prompt_logprobs") else None,
        repetition_penalty=msg.repetition_penalty if msg.HasField("repetition_penalty") else 1.0,
        presence_penalty=msg.presence_penalty if msg.HasField("presence_penalty") else 0.0,
        frequency_penalty=msg.frequency_penalty if msg.HasField("frequency_penalty") else 0.0,
        min_tokens=msg.min_tokens,
        structured=structured_from_proto(msg.structured),
        logit_bias=tuple(sorted(msg.logit_bias.items())),
    )


def structured_from_proto(msg: common_pb2.StructuredOutput) -> StructuredOutput | None:
    """None when no kind is set (unconstrained)."""
    kind = msg.WhichOneof("kind")
    if kind is None:
        return None
    spec = getattr(msg, kind) if kind in ("json_schema", "regex", "grammar") else ""
    return StructuredOutput(kind, spec, tuple(msg.choice.choices), msg.strict, msg.num_generated_prompt_tokens)


def structured_to_proto(structured: StructuredOutput) -> common_pb2.StructuredOutput:
    msg = common_pb2.StructuredOutput(strict=structured.strict,
                                      num_generated_prompt_tokens=structured.num_generated_prompt_tokens)
    if structured.kind == "json_object":
        msg.json_object = True
    elif structured.kind == "choice":
        msg.choice.choices.extend(structured.choices)
    else:
        setattr(msg, structured.kind, structured.spec)
    return msg


def sampling_to_proto(params: SamplingParams) -> common_pb2.SamplingParams:
    msg = common_pb2.SamplingParams(
        max_tokens=params.max_tokens,
        temperature=params.temperature,
        top_p=params.top_p,
        top_k=params.top_k,
        min_p=params.min_p,
        stop_token_ids=list(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        min_tokens=params.min_tokens,
        logit_bias=dict(params.logit_bias),
    )
    if params.structured is not None:
        msg.structured.CopyFrom(structured_to_proto(params.structured))
    if params.seed is not None:
        msg.seed = params.seed
    if params.logprobs is not None:
        msg.logprobs = params.logprobs
    if params.prompt_logprobs is not None:
        msg.prompt_logprobs = params.prompt_logprobs
    return msg


def logprob_to_proto(token_id: int, logprob: float, top: Iterable[tuple[int, float]]) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(
        token_id=token_id,
        logprob=logprob,
        top_logprobs=[common_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in top],
    )


def usage_to_proto(prompt_tokens: int, cached_tokens: int, completion_tokens: int) -> common_pb2.Usage:
    return common_pb2.Usage(prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
                            completion_tokens=completion_tokens)


def abort_ids(msg: common_pb2.AbortRequest) -> list[str]:
    """The ids an Abort names, at most MAX_ABORT_IDS of them (InvalidRequest beyond)."""
    if len(msg.request_ids) > MAX_ABORT_IDS:
        raise InvalidRequest("request_ids", f"at most {MAX_ABORT_IDS} ids per Abort, got {len(msg.request_ids)}; "
                                            "send several Aborts")
    return list(msg.request_ids)
