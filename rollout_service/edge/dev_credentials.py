"""Throwaway credentials for a private deployment or a test: a CA, a server certificate, and per
principal a client certificate and a bearer token, so TLS and tokens need no openssl recipes.
Not a PKI: the CA key sits beside the certificates; use your own CA in production.
"""

from __future__ import annotations

import datetime
import ipaddress
import os
import re
import secrets
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import yaml
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

ROLES = ("admin", "push_base_weights")


@dataclass(frozen=True)
class Pem:
    cert: Path
    key: Path


@dataclass(frozen=True)
class PrincipalSpec:
    """``name`` or ``name:role[:role]`` from the command line."""

    name: str
    roles: frozenset[str] = frozenset()

    @classmethod
    def parse(cls, text: str) -> PrincipalSpec:
        name, *roles = text.split(":")
        if not name.isidentifier():
            raise ValueError(f"principal name {name!r}: use letters, digits and underscores (e.g. trainer)")
        unknown = set(roles) - set(ROLES)
        if unknown:
            raise ValueError(f"principal {name!r}: unknown role(s) {sorted(unknown)}; roles are {', '.join(ROLES)}")
        return cls(name, frozenset(roles))


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def _write_private(path: Path, data: bytes) -> None:
    """Create ``path`` readable by its owner only (keys and tokens)."""
    path.unlink(missing_ok=True)
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(descriptor, "wb") as handle:
        handle.write(data)


def _write(directory: Path, stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey) -> Pem:
    cert_path, key_path = directory / f"{stem}.crt", directory / f"{stem}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    _write_private(
        key_path,
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()),
    )
    return Pem(cert_path, key_path)


HOST_NAME = re.compile(r"(\*\.)?[A-Za-z0-9_-]{1,63}(\.[A-Za-z0-9_-]{1,63})*\.?")
"""ASCII labels (an international name in its xn-- form), a leading wildcard, and underscores:
Compose service names have them, and gRPC's TLS name check takes them."""


def _subject_alternative_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        if not HOST_NAME.fullmatch(host):
            raise ValueError(
                f"--host {host!r} is neither a host name nor an IP address (an international name in its xn-- form)"
            ) from None
        return x509.DNSName(host)


class CertificateAuthority:
    """A self-signed CA (P-256) that signs server and client certificates into ``directory``."""

    def __init__(self, directory: Path, name: str, days: float) -> None:
        self.directory = directory
        self.days = days
        self.key = ec.generate_private_key(ec.SECP256R1())
        self.cert = (
            self._builder(_name(name), _name(name), self.key.public_key())
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(self.key, hashes.SHA256())
        )
        self.pem = _write(directory, name, self.cert, self.key)

    def _builder(
        self, subject: x509.Name, issuer: x509.Name, public_key: ec.EllipticCurvePublicKey
    ) -> x509.CertificateBuilder:
        now = datetime.datetime.now(datetime.UTC)
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(issuer)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=self.days))
        )

    def _issue(self, stem: str, extensions: list[x509.ExtensionType]) -> Pem:
        key = ec.generate_private_key(ec.SECP256R1())
        builder = self._builder(_name(stem), self.cert.subject, key.public_key())
        for extension in extensions:
            builder = builder.add_extension(extension, critical=False)
        return _write(self.directory, stem, builder.sign(self.key, hashes.SHA256()), key)

    def issue_server(self, stem: str, hosts: Iterable[str]) -> Pem:
        """A server certificate valid for ``hosts`` (DNS names or IP addresses)."""
        names = [_subject_alternative_name(host) for host in hosts]
        return self._issue(stem, [x509.SubjectAlternativeName(names)])

    def issue_client(self, stem: str) -> Pem:
        """A client certificate for mutual TLS (``security.tls_client_ca_file``)."""
        return self._issue(stem, [])


@dataclass(frozen=True)
class DevCredentials:
    directory: Path
    created: bool
    """False when the directory already held credentials."""

    @property
    def ca(self) -> Path:
        return self.directory / "ca.crt"

    @property
    def tokens_file(self) -> Path:
        return self.directory / "tokens.yaml"

    def server(self) -> Pem:
        return Pem(self.directory / "server.crt", self.directory / "server.key")

    def token_file(self, principal: str) -> Path:
        return self.directory / f"{principal}.token"


def write_dev_credentials(
    directory: Path, hosts: Iterable[str], principals: Iterable[PrincipalSpec], days: float = 30
) -> DevCredentials:
    """Write the CA, a server certificate for ``hosts``, per principal a token and a client
    certificate, and ``tokens.yaml``; a directory that has ``tokens.yaml`` is kept as it is."""
    if directory.exists() and not directory.is_dir():
        raise ValueError(f"{directory} is a file; give a folder for the credentials")
    hosts = list(hosts)
    for host in hosts:
        _subject_alternative_name(host)  # a bad host fails before anything is written
    directory.mkdir(parents=True, exist_ok=True)
    credentials = DevCredentials(directory, created=False)
    if credentials.tokens_file.exists():
        return credentials
    principals = list(principals)
    if not principals:  # an empty tokens.yaml would turn authentication off
        raise ValueError("name at least one principal (e.g. trainer:push_base_weights)")
    ca = CertificateAuthority(directory, "ca", days)  # ca.crt, ca.key
    ca.issue_server("server", hosts)
    table: dict[str, dict[str, object]] = {}
    for principal in principals:
        token = secrets.token_urlsafe(32)
        _write_private(credentials.token_file(principal.name), f"{token}\n".encode())
        ca.issue_client(principal.name)
        table[principal.name] = {"token": token, **{role: True for role in sorted(principal.roles)}}
    # Written last: its presence marks the set as complete.
    _write_private(credentials.tokens_file, yaml.safe_dump(table, sort_keys=True).encode())
    return DevCredentials(directory, created=True)
