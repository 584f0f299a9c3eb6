"""TLS settings for tests, from the product's own throwaway CA (``dev_credentials``)."""

from __future__ import annotations

from pathlib import Path

from rollout_service.edge.dev_credentials import CertificateAuthority

LOCAL_HOSTS = ("localhost", "127.0.0.1")


def tls_security(directory: Path, principals: dict[str, dict[str, object]]) -> tuple[dict[str, object], Path]:
    """``security`` settings of a TLS-only service with these principals (a fresh CA and
    server certificate in ``directory``), and the CA file its clients trust."""
    ca = CertificateAuthority(directory, "test-ca", days=1)
    server = ca.issue_server("server", LOCAL_HOSTS)
    settings = {"tls_cert_file": str(server.cert), "tls_key_file": str(server.key), "principals": principals}
    return settings, ca.pem.cert
