"""How a Tandem server reads and checks a caller's secret, the same for gRPC metadata and HTTP
headers: which header carries it, how an `authorization: Bearer` value is read, and a
constant-time comparison. The gRPC AuthInterceptor (grpc_server) and the gateway's HTTP bridge
both check credentials through these.
"""

from __future__ import annotations

import hmac
from collections.abc import Callable, Iterable

API_KEY_HEADERS = ("authorization", "x-api-key")


def presented_secret(lookup: Callable[[str], str | None], headers: Iterable[str] = API_KEY_HEADERS) -> str | None:
    """The secret in the first of `headers` that `lookup` finds (gRPC metadata or HTTP headers).

    `authorization` must use the Bearer scheme ('Bearer KEY' -> 'KEY', scheme case-insensitive);
    any other value there is not a credential ("").
    """
    for header in headers:
        value = lookup(header)
        if value is None:
            continue
        if header != "authorization":
            return value
        scheme, _, token = value.strip().partition(" ")
        return token.strip() if scheme.lower() == "bearer" else ""
    return None


def secret_matches(presented: str, secrets: Iterable[bytes]) -> bool:
    """Constant-time comparison against every accepted secret."""
    return any(hmac.compare_digest(presented.encode(), secret) for secret in secrets)
