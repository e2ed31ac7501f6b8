"""Self-signed certificates for TLS tests, made on the spot with `cryptography`: a CA, and leaf
certificates it signs for 127.0.0.1 and localhost, each written as PEM files.
"""

from __future__ import annotations

import datetime
import ipaddress
from dataclasses import dataclass
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

_VALID = datetime.timedelta(days=1)


@dataclass(frozen=True, slots=True)
class Issued:
    """A certificate and its key as PEM files, and the CA file that verifies it."""

    cert: Path
    key: Path
    ca: Path

    def pem(self) -> tuple[bytes, bytes, bytes]:
        """(CA, certificate chain, private key) as bytes."""
        return self.ca.read_bytes(), self.cert.read_bytes(), self.key.read_bytes()


@dataclass(frozen=True, slots=True)
class CertificateAuthority:
    name: str
    key: ec.EllipticCurvePrivateKey
    certificate: x509.Certificate
    file: Path

    @classmethod
    def create(cls, directory: Path, name: str = "tandem-test-ca") -> CertificateAuthority:
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        certificate = (_builder(subject, subject, key.public_key())
                       .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
                       .sign(key, hashes.SHA256()))
        file = directory / f"{name}.pem"
        file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
        return cls(name, key, certificate, file)

    def issue(self, directory: Path, name: str) -> Issued:
        """A certificate for `name`, valid for servers and clients on 127.0.0.1 and localhost."""
        key = ec.generate_private_key(ec.SECP256R1())
        subject = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name)])
        alternative = x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.DNSName(name),
                                                   x509.IPAddress(ipaddress.ip_address("127.0.0.1"))])
        usage = x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH])
        certificate = (_builder(subject, self.certificate.subject, key.public_key())
                       .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
                       .add_extension(alternative, critical=False)
                       .add_extension(usage, critical=False)
                       .sign(self.key, hashes.SHA256()))
        cert_file, key_file = directory / f"{name}.pem", directory / f"{name}.key"
        cert_file.write_bytes(certificate.public_bytes(serialization.Encoding.PEM))
        key_file.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                               serialization.NoEncryption()))
        return Issued(cert_file, key_file, self.file)


def _builder(subject: x509.Name, issuer: x509.Name, public_key) -> x509.CertificateBuilder:
    now = datetime.datetime.now(datetime.timezone.utc)
    return (x509.CertificateBuilder().subject_name(subject).issuer_name(issuer).public_key(public_key)
            .serial_number(x509.random_serial_number()).not_valid_before(now - _VALID).not_valid_after(now + _VALID))
