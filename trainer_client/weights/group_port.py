"""The port a trainer hosts its weight-update rendezvous on: a fixed, configured one, so a
firewall or a container can open it, and the next free one for each further trainer on
the same host.

A port is claimed by a socket bound to it and held (not listening) until released. The
rendezvous store binds beside it (both set ``SO_REUSEADDR``, which Linux allows while
neither listens), and another trainer's claim, which does not set it, moves on to the next
port: two trainers started together never pick the same one.
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
        """Claim another port of the span (the current one is skipped, being held until
        now), release the current one, and return the new port."""
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
