"""The port a trainer hosts its weight-update rendezvous on: a configured one (for firewalls),
or the next free one for each further trainer on the host.

A claim is a bound, non-listening socket; ``SO_REUSEADDR`` is set only after the bind, so the
rendezvous store can bind beside it while another trainer's claim moves on to the next port.
"""

from __future__ import annotations

import socket

GROUP_PORT_SPAN = 64
"""Ports tried from the configured one: room for that many trainers on one host."""


class GroupPortClaim:
    """Holds one port of ``first .. first + GROUP_PORT_SPAN - 1`` (``first`` 0: any free port)."""

    def __init__(self, host: str, first: int) -> None:
        self.host = host
        self.first = first
        self._socket = _claim(host, first)
        self.port: int = self._socket.getsockname()[1]

    def renew(self) -> int:
        """Claim another port of the span, release the current one, and return the new port."""
        fresh = _claim(self.host, self.first)
        self._socket.close()
        self._socket = fresh
        self.port = fresh.getsockname()[1]
        return self.port

    def release(self) -> None:
        self._socket.close()


def _claim(host: str, first: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    ports = range(first, first + GROUP_PORT_SPAN) if first else [0]
    for port in ports:
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.bind((host, port))  # exclusive: fails where anyone else holds the port
        except OSError:
            sock.close()
            continue
        # Only now, so the store can bind beside it while another trainer's claim still fails.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        return sock
    raise OSError(
        f"no free port for the weight-update rendezvous on {host} in {first}..{first + GROUP_PORT_SPAN - 1}: "
        f"{GROUP_PORT_SPAN} trainers already run on this host, or other programs hold those ports; "
        "set --vllm_group_port to another free range"
    )
