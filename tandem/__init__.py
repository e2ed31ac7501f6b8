"""Tandem: LLM serving with disaggregated prefill and decode over gRPC.

`tandem.Client` / `tandem.AsyncClient` are the Python SDK (tandem/client/), imported on first use
so that `tandem` commands that do not need grpc start fast; `tandem.errors` holds its exceptions.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tandem.client import (
        AsyncClient, Chunk, Client, Completion, ModelInfo, RetryPolicy, TLSConfig, TokenLogprob, Usage,
    )

_SDK_NAMES = ("AsyncClient", "Chunk", "Client", "Completion", "ModelInfo", "RetryPolicy", "TLSConfig",
              "TokenLogprob", "Usage")
__all__ = list(_SDK_NAMES)


def __getattr__(name: str) -> Any:
    if name in _SDK_NAMES:
        return getattr(importlib.import_module("tandem.client"), name)
    raise AttributeError(f"module 'tandem' has no attribute {name!r}")
