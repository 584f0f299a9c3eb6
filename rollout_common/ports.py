"""Ports both sides pick at run time."""

import socket


def free_port(host: str = "127.0.0.1") -> int:
    """A port that is free right now (the usual small race until it is bound again)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
