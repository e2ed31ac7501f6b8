"""The prompt's logprobs in the response shapes: /v1/completions' legacy logprobs with echo (the
prompt's tokens first, the first one's null) and vLLM's prompt_logprobs on both endpoints; the
request fields that ask for them."""

from __future__ import annotations

import pytest

from services.common.errors import InvalidRequest
from services.common.tokenizer import TextCodec
from services.gateway.openai_requests import ChatCompletionRequest, CompletionRequest
from services.gateway.openai_responses import ChatShaper, Choice, CompletionShaper
from services.gateway.output import OutputAssembler, OutputOptions
from tandem.v1 import common_pb2, scheduler_pb2


def entry(token_id: int, logprob: float = 0.0, *top: tuple[int, float]) -> common_pb2.TokenLogprob:
    return common_pb2.TokenLogprob(token_id=token_id, logprob=logprob,
                                   top_logprobs=[common_pb2.TopLogprob(token_id=t, logprob=lp) for t, lp in top])


def token_text(token_id: int) -> str:
    return f"<{token_id}>"


def choice() -> Choice:
    """Prompt [5, 6, 7] (its first entry has no logprob), then output token 9."""
    return Choice(0, text="<9>", logprobs=[entry(9, -0.5, (9, -0.5))], finish_reason="length",
                  usage=common_pb2.Usage(prompt_tokens=3, completion_tokens=1),
                  prompt_logprobs=[entry(5), entry(6, -1.25, (8, -0.75)), entry(7, -2.0, (7, -2.0))])


def test_echo_with_logprobs_puts_the_prompt_tokens_first_the_first_one_null():
    shaper = CompletionShaper("cmpl-1", 0, "m", token_text, with_logprobs=True, echoes=["<5><6><7>"])
    (body,) = shaper.response([choice()])["choices"]
    assert body["text"] == "<5><6><7><9>"
    assert body["logprobs"] == {
        "tokens": ["<5>", "<6>", "<7>", "<9>"],
        "token_logprobs": [None, -1.25, -2.0, -0.5],
        "top_logprobs": [None, {"<8>": -0.75}, {"<7>": -2.0}, {"<9>": -0.5}],
        "text_offset": [0, 3, 6, 9],
    }
    assert "prompt_logprobs" not in body


def test_vllm_prompt_logprobs_on_a_completion_choice_and_atop_a_chat_response():
    expected = [None, {"6": {"logprob": -1.25, "decoded_token": "<6>"}, "8": {"logprob": -0.75, "decoded_token": "<8>"}},
                {"7": {"logprob": -2.0, "decoded_token": "<7>"}}]
    completion = CompletionShaper("cmpl-1", 0, "m", token_text, with_logprobs=False, with_prompt_logprobs=True)
    (body,) = completion.response([choice()])["choices"]
    assert body["prompt_logprobs"] == expected and body["logprobs"] is None
    chat = ChatShaper("chat-1", 0, "m", token_text, with_logprobs=False, with_prompt_logprobs=True)
    assert chat.response([choice()])["prompt_logprobs"] == expected


@pytest.mark.parametrize(("fields", "expected"), [
    ({"echo": True, "logprobs": 2}, 2),
    ({"echo": True, "logprobs": 0, "prompt_logprobs": 3}, 3),
    ({"logprobs": 2}, None),
    ({"echo": True}, None),
    ({"prompt_logprobs": 0}, 0),
])
def test_completion_fields_that_ask_for_prompt_logprobs(fields, expected):
    body = CompletionRequest.model_validate({"prompt": "Hi", **fields})
    body.check_undeclared()
    (request,) = body.generation_requests("r", "", 16)
    assert request.sampling.prompt_logprobs == expected


def test_chat_prompt_logprobs_and_a_stream_refused():
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "Hi"}], "prompt_logprobs": 1})
    body.check_undeclared()
    assert body.generation_requests("r", "", 16)[0].sampling.prompt_logprobs == 1
    streamed = CompletionRequest.model_validate({"prompt": "Hi", "echo": True, "logprobs": 1, "stream": True})
    with pytest.raises(InvalidRequest, match="whole responses only; send stream: false") as caught:
        streamed.check_undeclared()
    assert caught.value.field == "echo"


def test_echo_with_max_tokens_0_generates_one_hidden_token(default_model_dir):
    body = CompletionRequest.model_validate({"prompt": "Hi there", "echo": True, "max_tokens": 0, "logprobs": 1})
    body.check_undeclared()
    (request,) = body.generation_requests("r", "", 16)
    assert (request.sampling.max_tokens, request.prompt_only, request.sampling.prompt_logprobs) == (1, True, 1)
    assembler = OutputAssembler(TextCodec.from_model_dir(default_model_dir),
                                OutputOptions(request.sampling, prompt_only=True), [5, 6])
    first = scheduler_pb2.TokenEvent(token_ids=[9], logprobs=[entry(9, -0.5)], prompt_logprobs=[entry(6, -1.0)],
                                     finish_reason=common_pb2.FINISH_REASON_STOP)
    chunk = assembler.on_event(first)
    assert (chunk.token_ids, chunk.text, chunk.logprobs, chunk.finish_reason) == ([], "", [], "length")
    assert [e.token_id for e in chunk.prompt_logprobs] == [5, 6]
    assert (chunk.usage.prompt_tokens, chunk.usage.completion_tokens) == (2, 0)
    unechoed = CompletionRequest.model_validate({"prompt": "Hi", "max_tokens": 0})
    assert unechoed.generation_requests("r", "", 16)[0].prompt_only is False
