"""What the gateway is asked to do, whatever the protocol: `GenerationRequest` (gRPC and HTTP
both convert into it at their edge), `ServedModel`, the model it serves and its limits, and the
names both doors give a request's ids (headers on HTTP, initial metadata on gRPC).
"""

from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from services.common.model_config import ModelConfig
from services.common.model_store import model_name
from services.common.sampling_params import SamplingParams
from services.common.tokenizer import TextCodec

REQUEST_ID_HEADER = "x-request-id"
TRACE_ID_HEADER = "x-trace-id"
OWNED_BY = "tandem"  # the owner a model card names, on both doors


@dataclass(slots=True)
class GenerationRequest:
    """One generation request. Exactly one of `prompt`, `token_ids` or `messages` should be set
    (None = not set); validation.validate_request says what is wrong otherwise."""

    sampling: SamplingParams = field(default_factory=SamplingParams)
    model: str = ""  # empty: the served model
    prompt: str | None = None
    token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None  # {"role", "content"}, and OpenAI's tool_calls, tool_call_id
    tools: list[dict[str, Any]] | None = None  # OpenAI's tool objects, rendered by the chat template
    stop: tuple[str, ...] = ()  # stop strings, matched on the detokenized output
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    cache_salt: str = ""
    request_id: str = ""  # empty: the gateway assigns one
    max_tokens_to_context: bool = False  # no max_tokens given: generate up to the model's context
    # echo with max_tokens 0 (lm-eval's loglikelihood): the workers generate one token, for the
    # prompt's logprobs, which the output hides (no tokens, finish "length", 0 completion tokens)
    prompt_only: bool = False
    served_at: tuple[str, int] | None = None  # the door's (host, port) it came in on: the span's server.address/port

    @property
    def prompt_fields(self) -> list[str]:
        """Names of the prompt fields that are set, in declaration order."""
        values = {"prompt": self.prompt, "token_ids": self.token_ids, "messages": self.messages}
        return [name for name, value in values.items() if value is not None]


@dataclass(frozen=True, slots=True)
class ServedModel:
    """The model behind this gateway: its name (a model directory's name, as workers register it)
    and the limits requests are validated against."""

    name: str
    max_model_len: int  # prompt plus generated tokens must fit
    vocab_size: int  # valid token ids: [0, vocab_size)
    has_chat_template: bool
    created: int  # when the gateway loaded it, Unix seconds
    loras: tuple[str, ...] = ()  # LoRA adapters served on it, requested as model "NAME:ADAPTER"

    @property
    def served_names(self) -> list[str]:
        """The model's name, then each adapter's as requests name it."""
        return [self.name, *(f"{self.name}:{lora}" for lora in self.loras)]

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, codec: TextCodec, loras: tuple[str, ...] = ()) -> ServedModel:
        """The limits the workers apply too: context and vocabulary from config.json (ModelLoadError
        when it is missing or unsupported)."""
        config = ModelConfig.from_model_dir(model_dir)
        return cls(
            name=model_name(model_dir),
            max_model_len=config.max_position_embeddings,
            vocab_size=config.vocab_size,
            has_chat_template=codec.has_chat_template,
            created=int(time.time()),
            loras=loras,
        )


def salt_for_key(api_key: str | None) -> str:
    """The default cache salt of a tenant: derived from its API key, so tenants never share
    prefix-cache blocks unless they send the same explicit cache_salt. No key: the shared cache."""
    if not api_key:
        return ""
    return hashlib.blake2b(api_key.encode(), digest_size=16, person=b"tandem-salt").hexdigest()


def new_request_id() -> str:
    """A fresh request id, for requests whose caller named none."""
    return f"req-{secrets.token_hex(12)}"
