"""The request limits of the gateway, one set for both doors (gRPC and HTTP): how much a request may
ask for, checked by validation.py before any work is done for it (tokenizing included).

Limits fixed elsewhere: prompt tokens plus max_tokens within the model's context (ServedModel),
logprobs and top_logprobs at most sampling_params.MAX_LOGPROBS, request ids of at most 128
characters, and the largest message each door receives (--max-body-bytes for HTTP bodies,
grpc_server.PUBLIC_MESSAGE_BYTES for gRPC).
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from services.common.config import add_option, from_args


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What one request may ask for; larger asks are refused with INVALID_ARGUMENT / 400."""

    max_prompt_chars: int = 200_000  # a text prompt, or all chat messages' roles and contents together
    max_messages: int = 1024  # chat messages in one request
    max_stop_strings: int = 16
    max_stop_chars: int = 1024  # characters of one stop string
    max_stop_token_ids: int = 256
    max_n: int = 16  # choices of one request (the HTTP API's n)
    max_cache_salt_chars: int = 256


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per limit (and its TANDEM_* variable)."""
    defaults = RequestLimits()
    add_option(parser, "--max-prompt-chars", type=int, default=defaults.max_prompt_chars,
               help="longest text prompt (or all chat messages' roles and contents) in characters")
    add_option(parser, "--max-messages", type=int, default=defaults.max_messages,
               help="most chat messages one request may send")
    add_option(parser, "--max-stop-strings", type=int, default=defaults.max_stop_strings,
               help="most stop strings one request may set")
    add_option(parser, "--max-stop-chars", type=int, default=defaults.max_stop_chars,
               help="longest stop string in characters")
    add_option(parser, "--max-stop-token-ids", type=int, default=defaults.max_stop_token_ids,
               help="most stop token ids one request may set")
    add_option(parser, "--max-n", type=int, default=defaults.max_n, help="most choices (n) one request may ask")
    add_option(parser, "--max-cache-salt-chars", type=int, default=defaults.max_cache_salt_chars,
               help="longest cache_salt in characters")


def limits_from_args(args: argparse.Namespace) -> RequestLimits:
    """RequestLimits from the parsed flags of add_arguments."""
    return from_args(RequestLimits, args)
