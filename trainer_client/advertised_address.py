"""The address a trainer advertises for the weight transfer's rendezvous.

The service accepts a push only from the caller's own address as it sees it (or an allow-listed
one), so ``auto`` picks the local address this host uses to reach the service.
"""

from __future__ import annotations

from vllm_gloo_transfer.groups import local_address_towards


class AddressError(ValueError):
    """The address cannot be worked out; the message says which flag to set."""


def service_host_port(target: str) -> tuple[str, int]:
    """``host:port``, ``[v6]:port`` or ``dns:///host:port`` -> (host, port)."""
    address = target.removeprefix("dns:///").removeprefix("ipv4:").removeprefix("ipv6:")
    host, separator, port = address.rpartition(":")
    if not separator or not port.isdigit():
        raise AddressError(f"cannot tell the service's host and port from --target {target!r}; use HOST:PORT")
    return host.strip("[]"), int(port)


def advertised_address(trainer_address: str, target: str) -> str:
    """``trainer_address`` as given, or for ``auto`` the local address that reaches ``target``."""
    if trainer_address != "auto":
        return trainer_address
    host, port = service_host_port(target)
    try:
        return local_address_towards(host, port)
    except OSError as exc:
        raise AddressError(
            f"cannot find the local address that reaches the service at {target!r} ({exc}); "
            "pass --trainer-address with an address vLLM's workers can reach"
        ) from None
