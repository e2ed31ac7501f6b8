"""TLS material read from PEM files once at start-up: the certificate of a public door (the gateway's
gRPC and HTTPS ports) and the internal plane's mutual TLS (this service's certificate and key, and the
CA that signed every peer's). A missing or unreadable file stops the service with a message naming
the flag to fix.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

import grpc

from services.common.config import add_option


class TLSConfigError(ValueError):
    """A TLS flag is missing its partner, or names a file that cannot be read."""


@dataclass(frozen=True, slots=True)
class ServerCertificate:
    """A public door's certificate chain and private key; clients are not asked for a certificate.
    The paths stay for uvicorn, which reads them itself."""

    cert_file: Path
    key_file: Path
    certificate_chain: bytes
    private_key: bytes

    def grpc_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.private_key, self.certificate_chain)])


@dataclass(frozen=True, slots=True)
class MutualTLS:
    """The internal plane's mutual TLS. As a server, this service accepts only clients presenting a
    certificate that `ca` signed; as a client, it presents its own and trusts only servers whose
    certificate `ca` signed and names the host dialled (or `server_name`, when set)."""

    ca: bytes
    certificate_chain: bytes
    private_key: bytes
    server_name: str | None = None

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(self.private_key, self.certificate_chain)],
                                           root_certificates=self.ca, require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(self.ca, self.private_key, self.certificate_chain)


def read_pem(path: Path, flag: str) -> bytes:
    """The PEM text of `path`, given by `flag`; TLSConfigError when unreadable or not PEM."""
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise TLSConfigError(f"cannot read {flag} {path}: {exc.strerror}") from exc
    if b"-----BEGIN " not in data:
        raise TLSConfigError(f"{flag} {path} holds no PEM block (-----BEGIN ...); give a PEM-encoded file")
    return data


def add_server_arguments(parser: argparse.ArgumentParser) -> None:
    """--tls-cert and --tls-key: a public door's certificate (TANDEM_TLS_CERT, TANDEM_TLS_KEY)."""
    add_option(parser, "--tls-cert", type=Path, metavar="PEM",
               help="certificate chain served on the public gRPC and HTTP ports (with --tls-key); none: plaintext")
    add_option(parser, "--tls-key", type=Path, metavar="PEM", help="the private key of --tls-cert")


def server_certificate(cert_file: Path | None, key_file: Path | None) -> ServerCertificate | None:
    """The public door's certificate from --tls-cert and --tls-key (both or neither; None: plaintext)."""
    if cert_file is None and key_file is None:
        return None
    if cert_file is None or key_file is None:
        missing = "--tls-cert" if cert_file is None else "--tls-key"
        raise TLSConfigError(f"TLS needs both --tls-cert and --tls-key; {missing} is missing")
    return ServerCertificate(cert_file, key_file, read_pem(cert_file, "--tls-cert"), read_pem(key_file, "--tls-key"))


def mutual_tls(ca_file: Path | None, cert_file: Path | None, key_file: Path | None,
               server_name: str | None = None) -> MutualTLS | None:
    """The internal plane's mutual TLS from --internal-tls-ca, -cert and -key (all three or none)."""
    files = {"--internal-tls-ca": ca_file, "--internal-tls-cert": cert_file, "--internal-tls-key": key_file}
    given = [flag for flag, path in files.items() if path is not None]
    if not given:
        if server_name:
            raise TLSConfigError("--internal-tls-server-name needs --internal-tls-ca, --internal-tls-cert and "
                                 "--internal-tls-key")
        return None
    if len(given) < len(files):
        missing = ", ".join(flag for flag in files if flag not in given)
        raise TLSConfigError(f"mutual TLS needs --internal-tls-ca, --internal-tls-cert and --internal-tls-key; "
                             f"{missing} missing")
    ca, cert, key = (read_pem(path, flag) for flag, path in files.items())
    return MutualTLS(ca, cert, key, server_name or None)
