"""Helpers shared by the test suites."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import socket
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable, Iterator

POLL_INTERVAL_S = 0.05


async def wait_until(
    condition: Callable[[], Awaitable[bool] | bool], timeout_s: float, what: str | Callable[[], str]
) -> None:
    """Wait for a condition that has no event to wait on (a counter behind an RPC), polling
    it with a deadline; fails with ``what`` in the message when the deadline passes (a
    callable ``what`` is asked then, so the message can say the state the wait ended in)."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = condition()
        if isinstance(result, Awaitable):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            said = what if isinstance(what, str) else what()
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {said}")
        await asyncio.sleep(POLL_INTERVAL_S)  # poll interval, not synchronisation


@functools.cache
def listening_port(who: str = "trainer") -> int:
    """A local port where something accepts connections and hangs up, as a trainer's
    rendezvous answers the service's check before a join; one per ``who``, for the session."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            connection, _ = server.accept()
            connection.close()

    threading.Thread(target=serve, name=f"listening for {who}", daemon=True).start()
    return server.getsockname()[1]


@contextlib.contextmanager
def started(command: list[str], **options) -> Iterator[subprocess.Popen[bytes]]:  # type: ignore[no-untyped-def]
    """``command`` in a process group of its own, killed at the end whatever happened."""
    process = subprocess.Popen(command, start_new_session=True, **options)
    try:
        yield process
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=10)
