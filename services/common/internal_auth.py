"""How Tandem's services authenticate one another: the internal token they share (--internal-token,
TANDEM_INTERNAL_TOKEN, or --internal-token-file for mounted secrets), mutual TLS (--internal-tls-ca,
--internal-tls-cert, --internal-tls-key), or both, and what having neither means.

Closed by default: a service given neither refuses to start (exit status 2) unless
--insecure-internal (TANDEM_INSECURE_INTERNAL=1) says to leave its internal RPCs open.
"""

from __future__ import annotations

import argparse
import logging
import re
from dataclasses import dataclass
from pathlib import Path

from services.common.config import add_option, add_switch
from services.common.tls import MutualTLS, TLSConfigError, mutual_tls

log = logging.getLogger(__name__)

TOKEN_ENV = "TANDEM_INTERNAL_TOKEN"
MIN_TOKEN_CHARS = 16
# URL-safe characters only: the token also rides in gRPC metadata and in the Redis URL's password.
_TOKEN = re.compile(r"[A-Za-z0-9_.~-]+")
GENERATE_HINT = "python3 -c 'import secrets; print(secrets.token_urlsafe(32))'"


class InternalAuthError(ValueError):
    """The token or mutual TLS settings are missing or invalid; the message says what to set."""


@dataclass(frozen=True, slots=True)
class InternalAuth:
    """What this service requires of internal callers and presents to its peers: the token
    (`x-tandem-internal-token`), mutual TLS, or both. Neither only under --insecure-internal."""

    token: str | None = None
    tls: MutualTLS | None = None


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """--internal-token, --internal-token-file, the --internal-tls-* files and --insecure-internal, each
    with its TANDEM_* variable."""
    add_option(parser, "--internal-token", env=TOKEN_ENV, metavar="TOKEN",
               help="shared secret of internal calls, required from callers and sent to peers; prefer the "
                    "variable or --internal-token-file, which `ps` does not show")
    add_option(parser, "--internal-token-file", type=Path, metavar="FILE",
               help="file holding the internal token (a mounted secret); surrounding whitespace is ignored")
    add_switch(parser, "--insecure-internal",
               help="run without an internal token or mutual TLS: anyone who reaches this service may call its "
                    "internal RPCs")
    add_option(parser, "--internal-tls-ca", type=Path, metavar="PEM",
               help="mutual TLS of internal calls: the CA that signed every Tandem service's certificate; this "
                    "service then accepts only callers presenting one (with --internal-tls-cert and -key)")
    add_option(parser, "--internal-tls-cert", type=Path, metavar="PEM",
               help="this service's certificate chain, served to callers and presented to peers")
    add_option(parser, "--internal-tls-key", type=Path, metavar="PEM", help="the private key of --internal-tls-cert")
    add_option(parser, "--internal-tls-server-name", metavar="NAME",
               help="the name peers' certificates are checked against instead of the host dialled (one "
                    "certificate shared by every service)")


def auth_from_args(args: argparse.Namespace, command: str) -> InternalAuth:
    """The token and mutual TLS the flags give; neither only under --insecure-internal (logged as a warning).

    Raises InternalAuthError naming what to set when there is neither, or one too many settings.
    """
    token = read_token(args.internal_token, args.internal_token_file)
    try:
        tls = mutual_tls(args.internal_tls_ca, args.internal_tls_cert, args.internal_tls_key,
                         args.internal_tls_server_name)
    except TLSConfigError as exc:
        raise InternalAuthError(str(exc)) from exc
    if args.insecure_internal:
        if token is not None or tls is not None:
            raise InternalAuthError("--insecure-internal (TANDEM_INSECURE_INTERNAL) and an internal token or mutual "
                                    "TLS are both set; drop one")
        log.warning("INSECURE: %s runs with --insecure-internal: its internal RPCs accept calls from anyone who "
                    "can reach it, and it sends no token to its peers. Set %s in production.", command, TOKEN_ENV)
        return InternalAuth()
    if token is None and tls is None:
        raise InternalAuthError(
            f"no internal token: set {TOKEN_ENV} (or pass --internal-token-file FILE) to the secret that every "
            f"Tandem service of this deployment shares, e.g. from {GENERATE_HINT}; or give mutual TLS "
            "(--internal-tls-ca, --internal-tls-cert, --internal-tls-key); or pass --insecure-internal "
            "(TANDEM_INSECURE_INTERNAL=1) to leave the internal RPCs open to anyone who can reach them")
    return InternalAuth(token, tls)


def read_token(token: str | None, token_file: Path | None) -> str | None:
    """The token given inline or in a file (not both), checked; None when neither is given."""
    if token and token_file is not None:
        raise InternalAuthError(f"both {TOKEN_ENV} (--internal-token) and --internal-token-file are set; drop one")
    if token_file is not None:
        try:
            token = token_file.read_text().strip()
        except OSError as exc:
            raise InternalAuthError(f"cannot read --internal-token-file {token_file}: {exc.strerror}") from exc
        if not token:
            raise InternalAuthError(f"--internal-token-file {token_file} is empty; write the token into it")
    if not token:
        return None
    check_token(token)
    return token


def check_token(token: str) -> None:
    """Raise InternalAuthError unless the token is long enough and URL-safe."""
    if len(token) < MIN_TOKEN_CHARS or not _TOKEN.fullmatch(token):
        raise InternalAuthError(
            f"the internal token must be at least {MIN_TOKEN_CHARS} characters of letters, digits, '-', '_', '.' "
            f"or '~' (got {len(token)} characters); generate one with {GENERATE_HINT}")
