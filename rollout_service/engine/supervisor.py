"""Restarts a managed vLLM server whose API process died, at most ``max_restarts`` times;
``on_restarted`` brings it back to the runs' policies (a restarted server holds the
checkpoint's weights).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable
from typing import Protocol

logger = logging.getLogger(__name__)

MAX_RESTARTS = 3
"""Then the server stays down: a crash loop is a bug to read in vLLM's log, not to hide."""


class Supervisable(Protocol):
    url: str

    @property
    def pid(self) -> int | None: ...

    def restart(self) -> None:
        """Reap the old process group and start again (blocking)."""

    def log_tail(self) -> str: ...


class ServerSupervisor:
    def __init__(
        self,
        server: Supervisable,
        on_down: Callable[[str], None],
        on_restarted: Callable[[str], Awaitable[None]],
        on_restart_counted: Callable[[], None] = lambda: None,
        *,
        max_restarts: int = MAX_RESTARTS,
    ) -> None:
        self.server = server
        self.max_restarts = max_restarts
        self.on_down = on_down
        self.on_restarted = on_restarted
        self.on_restart_counted = on_restart_counted
        self.restarts = 0
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._supervise(), name=f"supervise-{self.server.url}")

    async def close(self) -> None:
        """Stop supervising (before the server is stopped on purpose)."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _supervise(self) -> None:
        while True:
            if (pid := self.server.pid) is None:
                return
            await wait_for_exit(pid)
            self.on_down(self.server.url)
            if self.restarts >= self.max_restarts:
                logger.error(
                    "vLLM on %s exited and was restarted %d times already (MAX_RESTARTS); "
                    "leaving it down. Its log ends:\n%s",
                    self.server.url, self.restarts, self.server.log_tail(),
                )  # fmt: skip
                return
            self.restarts += 1
            self.on_restart_counted()
            logger.warning(
                "vLLM on %s exited; restarting it (%d of %d). Its log ends:\n%s",
                self.server.url, self.restarts, self.max_restarts, self.server.log_tail(),
            )  # fmt: skip
            try:
                await asyncio.to_thread(self.server.restart)
            except Exception:
                logger.exception("restarting vLLM on %s failed; leaving it down", self.server.url)
                return
            try:
                await self.on_restarted(self.server.url)
            except Exception:  # the server is up; what failed is bringing it back to the runs' policies
                logger.exception("vLLM on %s restarted, but bringing it back into service failed", self.server.url)


async def wait_for_exit(pid: int) -> None:
    """Return once child ``pid`` has exited (a zombie until reaped, so the pid is not reused meanwhile)."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return
    exited = asyncio.Event()
    loop = asyncio.get_running_loop()
    loop.add_reader(pidfd, exited.set)
    try:
        await exited.wait()
    finally:
        loop.remove_reader(pidfd)
        os.close(pidfd)
