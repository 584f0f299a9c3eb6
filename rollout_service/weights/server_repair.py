"""Servers back to generating after a weight update went wrong, or a service died mid-update.

A paused server is resumed until it works: left paused, it would never generate again. vLLM
cannot cancel a weight-transfer call, so a server still running an aborted update's join or
receive is held out of routing until a leave queued behind that call answers (``free``), and the
next begin waits for that (``await_freed``). At start-up, what a dead service left is undone.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from rollout_service.config import WeightSyncSettings
from rollout_service.engine.control import WeightControl, WeightSyncError
from rollout_service.errors import FailedPrecondition
from rollout_service.weights.update_messages import leave_info

logger = logging.getLogger(__name__)

RESUME_RETRY_S = 1.0
"""The first delay between /resume attempts (doubling; 8x this in the background)."""


class ServerRepair:
    def __init__(
        self,
        servers: list[WeightControl],
        settings: WeightSyncSettings,
        on_stuck: Callable[[str, str | None], None],
        spawn: Callable[[Awaitable[Any]], asyncio.Task[Any]],
    ) -> None:
        """``servers``: the coordinator's own list; ``on_stuck``: told a server held for an aborted
        call, and why, then None; ``spawn``: the coordinator's task owner (it cancels them at close)."""
        self.servers = servers
        self.settings = settings
        self._on_stuck = on_stuck
        self._spawn = spawn
        self.stuck_paused: set[str] = set()
        """Servers whose resume failed every retry; a background task keeps resuming them."""
        self.freeing: dict[str, asyncio.Task[None]] = {}
        """Servers being freed of an aborted update's call, by URL."""

    def free(self, url: str, update_id: str, call: str) -> None:
        """Start freeing the server at ``url`` of the aborted update's ``call`` (a join or a receive)."""
        server = next((server for server in self.servers if server.base_url == url), None)
        if server is not None and url not in self.freeing:
            self.freeing[url] = self._spawn(self._free(server, update_id, call))

    async def _free(self, server: WeightControl, update_id: str, call: str) -> None:
        """Hold ``server`` out of routing until a leave, run after the aborted call, answers: the
        engine is then free, and the leave dropped what the call joined or received."""
        bound = "weight_sync.join_timeout_s" if call == "join" else "weight_sync.transfer_timeout_s"
        reason = (
            f"its engine still runs the {call} of aborted weight update {update_id} and generates nothing "
            f"until that ends (at most {bound})"
        )
        self._on_stuck(server.base_url, reason)
        settings = self.settings
        timeout = settings.join_timeout_s + settings.transfer_timeout_s + settings.control_timeout_s
        try:
            for attempt in range(3):
                if attempt:
                    await asyncio.sleep(RESUME_RETRY_S)  # a backoff before asking again
                if await self.release_transfer(server, timeout):
                    return
            logger.error(
                "%s did not answer a leave after aborted update %s; its health probes decide",
                server.base_url,
                update_id,
            )
        finally:
            self.freeing.pop(server.base_url, None)
            self._on_stuck(server.base_url, None)

    async def await_freed(self) -> None:
        """Before a begin: wait a control timeout at most for busy servers, so no join queues behind another."""
        if not self.freeing:
            return
        _, busy = await asyncio.wait(list(self.freeing.values()), timeout=self.settings.control_timeout_s)
        if busy:
            urls = ", ".join(url for url, task in self.freeing.items() if task in busy)
            raise FailedPrecondition(
                f"{urls} still run a call of an aborted weight update (vLLM cannot cancel it); push again "
                "once it ends, within weight_sync.join_timeout_s for a join or transfer_timeout_s for a transfer"
            )

    async def resume(self, server: WeightControl, attempts: int = 3) -> bool:
        """Resume one server, retrying with a doubling delay; False if every attempt failed."""
        delay = RESUME_RETRY_S
        for attempt in range(attempts):
            try:
                await server.resume(self.settings.control_timeout_s)
                return True
            except Exception as exc:  # WeightSyncError, or anything unexpected: it must not stay paused
                logger.warning("resume of %s failed (attempt %d/%d): %s", server.base_url, attempt + 1, attempts, exc)
            if attempt + 1 < attempts:
                await asyncio.sleep(delay)  # a backoff before the next attempt
                delay *= 2
        return False

    def keep_resuming(self, server: WeightControl) -> None:
        """Resume ``server`` in the background until it works (or leaves the pool)."""
        if server.base_url in self.stuck_paused:
            return
        self.stuck_paused.add(server.base_url)

        async def retry() -> None:
            resumed = False
            while not resumed and server in self.servers:  # a removed server is no longer ours to resume
                await asyncio.sleep(8 * RESUME_RETRY_S)  # a retry period, not synchronisation
                resumed = await self.resume(server, attempts=1)
            self.stuck_paused.discard(server.base_url)
            logger.info("%s resumed after earlier failures", server.base_url)

        self._spawn(retry())

    async def resume_left_paused(self) -> list[str]:
        """At start-up: resume what a dead service left paused; their URLs (a server that cannot say is left alone)."""
        resumed = []
        for server in self.servers:
            try:
                paused = await server.is_paused(self.settings.control_timeout_s)
            except WeightSyncError as exc:
                logger.info("could not ask %s whether it is paused: %s", server.base_url, exc)
                continue
            if paused:
                logger.warning("%s was left paused (a service died mid-update?); resuming it", server.base_url)
                if not await self.resume(server):
                    self.keep_resuming(server)
                resumed.append(server.base_url)
        return resumed

    async def release_left_transfer(self, skip: frozenset[str] = frozenset()) -> list[str]:
        """At start-up: drop the servers' side of a transfer group a dead service left open, and any
        update it started, so a trainer's broadcast fails at once instead of waiting out gloo's group
        timeout; the URLs that answered. ``skip``: servers this service just started, which hold no
        group. On gloo a leave-only init drops what was received, so closing the update applies
        nothing; other backends get vLLM's release (refused mid-update: ``UpdatePipeline._start``)."""
        servers = [server for server in self.servers if server.base_url not in skip]
        answered = await asyncio.gather(*(self.release_transfer(server) for server in servers))
        return [server.base_url for server, ok in zip(servers, answered, strict=True) if ok]

    async def release_transfer(self, server: WeightControl, timeout_s: float | None = None) -> bool:
        """Drop the server's side of the group and close an update left open; whether it answered."""
        timeout = timeout_s or self.settings.control_timeout_s
        try:
            if self.settings.backend != "gloo":
                await server.shutdown_weight_transfer(timeout)
                return True
            await server.init_weight_transfer(leave_info(), timeout)
            try:  # no label: only a commit says which version a server holds (``ServerRecovery``)
                await server.finish_weight_update(None, timeout)
                logger.info("closed the weight update a previous service left open on %s", server.base_url)
            except WeightSyncError as exc:
                if "without a matching start" not in str(exc):
                    raise
        except WeightSyncError as exc:
            logger.info("could not release %s's weight-transfer group: %s", server.base_url, exc)
            return exc.answered
        return True
