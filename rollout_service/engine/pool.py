"""Routes requests over several vLLM servers: sticky least-loaded.

A request's affinity key (a group's id, or an episode's) sticks to the server it was first
sent to (its prefix cache holds the prompt) while that server holds at most ``sticky_slack``
more sequences than the least loaded one; an episode's first turn follows its group's server.
Failed servers are tried only when no healthy one is left (``probe`` brings them back), held
and stuck servers never; with every server held, requests wait instead of failing.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import logging
from collections.abc import Callable, Collection

from rollout_service.engine.load_monitor import LoadMonitor
from rollout_service.engine.protocol import EPISODE_SEPARATOR
from rollout_service.engine.vllm_client import VLLMServerClient
from rollout_service.errors import EngineError
from rollout_service.types import Completion, SamplingParams

logger = logging.getLogger(__name__)

STICKY_SLACK = 2
"""The load imbalance sticky routing accepts to keep a prefix cache."""


class EnginePool:
    def __init__(
        self,
        clients: list[VLLMServerClient],
        probe_interval_s: float = 2.0,
        health_timeout_s: float = 10.0,
        *,
        monitor: LoadMonitor | None = None,
    ) -> None:
        self.clients = list(clients)
        self.probe_interval_s = probe_interval_s
        self.health_timeout_s = health_timeout_s
        self.sticky_slack = STICKY_SLACK
        self.monitor = monitor
        self._monitor_task: asyncio.Task[None] | None = None
        self.on_usable: Callable[[bool], None] = lambda usable: None
        self.usable = True
        self._affinity: dict[str, VLLMServerClient] = {}
        self._picks = itertools.count()
        self._last_pick: dict[str, int] = {}
        """Pick count at each server's last pick: ties go to the least recently picked."""
        self._prober: asyncio.Task[None] | None = None
        self.held: dict[str, str] = {}
        """Servers (by URL) that take no requests, and why."""
        self.stuck: dict[str, str] = {}
        """Servers (by URL) whose engine runs a call the service gave up, and which call."""
        self._changed = asyncio.Event()
        """Set (then replaced) when a server may have become routable."""

    async def start(self) -> None:
        for client in self.clients:
            await client.start()
        await self._check_answering()
        self._prober = asyncio.create_task(self._probe_forever(), name="engine-probe")
        if self.monitor is not None:
            self._monitor_task = asyncio.create_task(self.monitor.run(), name="engine-load")

    async def close(self) -> None:
        for task in (self._prober, self._monitor_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        for client in self.clients:
            await client.close()

    async def _check_answering(self) -> None:
        """At start-up a server that does not answer /health counts as failed, so ``usable`` is not a guess."""
        answers = await asyncio.gather(*(client.healthy(self.health_timeout_s) for client in self.clients))
        for client, answered in zip(self.clients, answers, strict=True):
            if not answered:
                client.consecutive_failures = max(client.consecutive_failures, 1)
                logger.warning("%s does not answer /health yet; it takes requests once it does", client.base_url)
        self.usable = any(c.consecutive_failures == 0 for c in self.clients)

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(self.probe_interval_s)  # a probe period, not synchronisation
            try:
                await self.probe()
            except Exception:  # a probe must never end the loop
                logger.exception("probing the vLLM servers failed")

    async def probe(self) -> None:
        """Bring back failed servers that answer /health, give up on busy ones that do not."""
        await asyncio.gather(*(self._probe(client) for client in list(self.clients)))
        self._report_usable()

    def _report_usable(self) -> None:
        """Tell ``on_usable`` when the pool starts or stops having a server that can generate."""
        usable = any(c.consecutive_failures == 0 and c.base_url not in self.stuck for c in self.clients)
        if usable != self.usable:
            self.usable = usable
            if not usable:
                stuck = "; ".join(f"{url}: {why}" for url, why in self.stuck.items())
                logger.error("no vLLM server can generate: %s", stuck or "none is answering; groups are dropped")
            self.on_usable(usable)

    async def _probe(self, client: VLLMServerClient) -> None:
        if client.consecutive_failures:
            if await client.healthy():
                client.consecutive_failures = 0
                logger.info("%s answers again; routing requests to it", client.base_url)
        elif client.inflight and not await client.healthy(self.health_timeout_s):
            client.give_up(f"did not answer /health within {self.health_timeout_s:g}s (engine.health_timeout_s)")

    def client(self, url: str) -> VLLMServerClient | None:
        url = url.rstrip("/")
        return next((c for c in self.clients if c.base_url == url), None)

    def add(self, client: VLLMServerClient, hold_reason: str | None = None) -> None:
        """A started client's server joins, held out of routing at once with ``hold_reason`` if given."""
        self.clients.append(client)
        if hold_reason is not None:
            self.hold(client.base_url, hold_reason)
        if self.monitor is not None:
            self.monitor.add(client)
        self.notify_changed()

    def remove(self, url: str) -> None:
        """Take a drained server out (``PoolMembership`` keeps the last one); the caller closes its client."""
        client = self.client(url)
        assert client is not None, f"{url} is not in the pool"
        self.clients.remove(client)
        self.held.pop(client.base_url, None)
        self.stuck.pop(client.base_url, None)
        self._affinity = {key: chosen for key, chosen in self._affinity.items() if chosen is not client}
        self._last_pick.pop(client.base_url, None)
        if self.monitor is not None:
            self.monitor.remove(client.base_url)

    def hold(self, url: str, reason: str) -> None:
        url = url.rstrip("/")
        if url not in self.held:
            logger.warning("holding %s out of routing: %s", url, reason)
        self.held[url] = reason

    def release(self, url: str) -> None:
        if self.held.pop(url.rstrip("/"), None) is not None:
            logger.info("%s takes requests again", url)
            self.notify_changed()

    def set_stuck(self, url: str, reason: str | None) -> None:
        """Hold ``url`` out of routing while its engine is busy with ``reason``; None: it is free."""
        url = url.rstrip("/")
        if reason is not None:
            logger.warning("holding %s out of routing: %s", url, reason)
            self.stuck[url] = reason
        elif self.stuck.pop(url, None) is not None:
            logger.info("%s is free of the aborted weight update; it takes requests again", url)
            self.notify_changed()
        self._report_usable()

    def notify_changed(self) -> None:
        """A server may have become routable (released, or given to a run's partition)."""
        self._changed.set()
        self._changed = asyncio.Event()

    async def routable(self, allowed: Callable[[], Collection[str]] | None = None) -> list[VLLMServerClient]:
        """The servers not held (and in ``allowed``, when given); waits while there is none."""
        while True:
            names = allowed() if allowed is not None else None
            out = self.held.keys() | self.stuck.keys()
            if free := [c for c in self.clients if c.base_url not in out and (names is None or c.base_url in names)]:
                return free
            await self._changed.wait()

    def pick(self, affinity: str | None = None, servers: list[VLLMServerClient] | None = None) -> VLLMServerClient:
        """The server for a request; ``servers``: the candidates (default: every server)."""
        servers = servers if servers is not None else self.clients
        healthy = [c for c in servers if c.consecutive_failures == 0] or servers
        least = min(healthy, key=lambda c: (c.inflight, self._last_pick.get(c.base_url, -1)))
        if not affinity:
            return self._picked(least)
        preferred = self._affinity.get(affinity)
        group, is_episode, _ = affinity.rpartition(EPISODE_SEPARATOR)
        if preferred is None and is_episode:
            preferred = self._affinity.get(group)
        keeps = preferred in healthy and preferred.inflight <= least.inflight + self.sticky_slack
        chosen = preferred if keeps and preferred is not None else least
        self._affinity[affinity] = chosen
        if is_episode:
            self._affinity.setdefault(group, chosen)
        return self._picked(chosen)

    def _picked(self, client: VLLMServerClient) -> VLLMServerClient:
        self._last_pick[client.base_url] = next(self._picks)
        return client

    def forget(self, affinity: str) -> None:
        self._affinity.pop(affinity, None)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, affinity: str | None = None
    ) -> Completion:
        return (await self.generate_many(prompt_ids, params, 1, affinity=affinity))[0]

    async def generate_many(
        self,
        prompt_ids: list[int],
        params: SamplingParams,
        n: int,
        *,
        affinity: str | None = None,
        allowed: Callable[[], Collection[str]] | None = None,
    ) -> list[Completion]:
        """``allowed``: the servers this request may go to (a run's partition); default all."""
        while True:
            client = self.pick(affinity, await self.routable(allowed))
            try:
                completions = await client.generate_many(prompt_ids, params, n)
                if not self.usable:  # an answer proves a server generates: health need not wait for a probe
                    self._report_usable()
                return completions
            except EngineError as exc:
                if not client.leaving:
                    raise
                # Held now, so the request starts over on another server.
                logger.info(
                    "%s left the pool mid-request (%s); sending the request to another server", client.base_url, exc
                )
