"""Who is calling, over what: TLS credentials, bearer tokens and the principal of a call.

Once principals are configured every RPC but health (and reflection, when on) needs
``authorization: Bearer <token>``; without them every caller is ``ANONYMOUS``, an admin.
Tokens are compared in constant time against every configured one, so a refusal's timing
leaks nothing. Plain text is allowed only on loopback unless ``security.allow_insecure``.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import logging
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
import yaml
from pydantic import ValidationError

from rollout_service.config import PrincipalSettings, SecuritySettings
from rollout_service.errors import StartupError

logger = logging.getLogger(__name__)

OPEN_METHOD_PREFIXES = ("/grpc.health.v1.Health/",)
REFLECTION_PREFIX = "/grpc.reflection."


@dataclass(frozen=True)
class Principal:
    name: str
    admin: bool = False
    push_base_weights: bool = False


ANONYMOUS = Principal("", admin=True, push_base_weights=True)
"""Every caller when authentication is off."""


class TokenTable:
    """The configured principals by token; empty: authentication is off."""

    def __init__(self, principals: dict[str, PrincipalSettings]) -> None:
        self._entries = [
            (settings.token.get_secret_value().encode(), Principal(name, settings.admin, settings.push_base_weights))
            for name, settings in principals.items()
        ]

    @property
    def enabled(self) -> bool:
        return bool(self._entries)

    def authenticate(self, metadata: Sequence[tuple[str, Any]] | None) -> Principal | None:
        """The principal whose token the call carries; ANONYMOUS when authentication is off."""
        if not self._entries:
            return ANONYMOUS
        presented = _bearer_token(metadata)
        if presented is None:
            return None
        # No early exit: every token is compared. Tokens are unique, so one matches at most.
        matches = [principal for token, principal in self._entries if hmac.compare_digest(token, presented)]
        return matches[0] if matches else None


def _bearer_token(metadata: Sequence[tuple[str, Any]] | None) -> bytes | None:
    for key, value in metadata or ():
        if key == "authorization":
            text = value.decode() if isinstance(value, bytes) else str(value)
            scheme, _, token = text.partition(" ")
            if scheme.lower() == "bearer" and token:
                return token.strip().encode()
    return None


def load_token_table(security: SecuritySettings) -> TokenTable:
    principals = dict(security.principals)
    if security.tokens_file is not None:
        principals.update(_read_tokens_file(security.tokens_file))
    tokens = [p.token.get_secret_value() for p in principals.values()]
    if len(set(tokens)) != len(tokens):
        raise StartupError("two principals share a token; give each its own")
    return TokenTable(principals)


def _read_tokens_file(path: Path) -> dict[str, PrincipalSettings]:
    try:
        text = path.read_text()
    except OSError as exc:
        raise StartupError(f"cannot read security.tokens_file {path}: {exc}") from None
    try:
        raw = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        if not isinstance(raw, dict):
            raise ValueError("expected a mapping {name: {token: ..., admin: ..., push_base_weights: ...}}")
        return {str(name): PrincipalSettings.model_validate(entry) for name, entry in raw.items()}
    except (ValueError, yaml.YAMLError, ValidationError) as exc:
        raise StartupError(f"security.tokens_file {path} is not valid: {exc}") from None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_bind(host: str, security: SecuritySettings) -> None:
    """Plain text only on loopback, unless explicitly allowed (then with a warning)."""
    if security.tls or is_loopback(host):
        return
    if not security.allow_insecure:
        raise StartupError(
            f"refusing to serve plain-text gRPC on {host}: set security.tls_cert_file and "
            "security.tls_key_file, or security.allow_insecure: true if only a private network reaches it"
        )
    logger.warning(
        "serving plain-text gRPC on %s (security.allow_insecure): tokens and samples travel unencrypted", host
    )


def server_credentials(security: SecuritySettings) -> grpc.ServerCredentials | None:
    """TLS (mutual TLS with a client CA) credentials of the settings; None: plain text."""
    if not security.tls:
        return None
    assert security.tls_cert_file is not None and security.tls_key_file is not None
    try:
        cert, key = security.tls_cert_file.read_bytes(), security.tls_key_file.read_bytes()
        ca = security.tls_client_ca_file.read_bytes() if security.tls_client_ca_file is not None else None
    except OSError as exc:
        raise StartupError(f"cannot read a TLS file: {exc}") from None
    return grpc.ssl_server_credentials([(key, cert)], root_certificates=ca, require_client_auth=ca is not None)


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Refuses calls without a valid token (UNAUTHENTICATED), before any handler runs."""

    def __init__(self, tokens: TokenTable, open_reflection: bool) -> None:
        self.tokens = tokens
        self.open_prefixes = OPEN_METHOD_PREFIXES + ((REFLECTION_PREFIX,) if open_reflection else ())

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler:
        handler = await continuation(handler_call_details)
        method = handler_call_details.method or ""
        if handler is None or method.startswith(self.open_prefixes):
            return handler
        if self.tokens.authenticate(handler_call_details.invocation_metadata) is not None:
            return handler
        return _refusing(handler, "send a valid token as 'authorization: Bearer <token>' metadata")


def _refusing(handler: grpc.RpcMethodHandler, message: str) -> grpc.RpcMethodHandler:
    async def refuse(request: Any, context: grpc.aio.ServicerContext) -> None:
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, message)

    serializers = {
        "request_deserializer": handler.request_deserializer,
        "response_serializer": handler.response_serializer,
    }
    if handler.unary_unary is not None:
        return grpc.unary_unary_rpc_method_handler(refuse, **serializers)
    if handler.unary_stream is not None:
        return grpc.unary_stream_rpc_method_handler(refuse, **serializers)
    if handler.stream_unary is not None:
        return grpc.stream_unary_rpc_method_handler(refuse, **serializers)
    return grpc.stream_stream_rpc_method_handler(refuse, **serializers)


def principal_of(tokens: TokenTable, context: grpc.aio.ServicerContext) -> Principal:
    principal = tokens.authenticate(context.invocation_metadata())
    if principal is None:  # only if the interceptor was bypassed
        raise PermissionError("unauthenticated call reached the servicer")
    return principal


def peer_host(context: grpc.aio.ServicerContext) -> str:
    """The caller's IP address, from gRPC's ``ipv4:1.2.3.4:5678`` / ``ipv6:[::1]:5678``."""
    peer = context.peer() or ""
    kind, _, rest = peer.partition(":")
    if kind == "ipv6":
        return rest.rsplit(":", 1)[0].strip("[]")
    if kind == "ipv4":
        return rest.rsplit(":", 1)[0]
    return rest
