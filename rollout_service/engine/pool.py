"""Routes requests over several vLLM servers: least-loaded, with group affinity.

Members of a group prefer the server their first member went to (its prefix cache holds
the prompt) unless that server is clearly busier than the least-loaded one. Servers whose
last request failed are tried only when no healthy one is left, and are probed (/health)
every ``probe_interval_s``: one that answers again takes traffic again. Servers with requests
in flight are probed too: one that does not answer within ``health_timeout_s`` is hung (a
stopped process, a network path that keeps connections open and moves nothing); its
requests are abandoned at once instead of at their deadline, and it counts as failed.
``on_usable`` is told when the pool goes from having a working server to none, and back
(the service's gRPC health follows it).

A server can also be held out of routing (``hold``): while its managed process restarts,
and after, while it holds other weights than the runs' policy. Requests then go to the
others; with every server held they wait for a ``release`` instead of failing.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from rollout_service.engine.vllm_client import VLLMServerClient
from rollout_service.types import Completion, SamplingParams

logger = logging.getLogger(__name__)

AFFINITY_SLACK = 2
"""How many more in-flight requests than the least-loaded server affinity may accept."""


class EnginePool:
    def __init__(
        self, clients: list[VLLMServerClient], probe_interval_s: float = 2.0, health_timeout_s: float = 10.0
    ) -> None:
        if not clients:
            raise ValueError("an engine pool needs at least one server")
        self.clients = clients
        self.probe_interval_s = probe_interval_s
        self.health_timeout_s = health_timeout_s
        self.on_usable: Callable[[bool], None] = lambda usable: None
        self.usable = True
        self._affinity: dict[str, VLLMServerClient] = {}
        self._prober: asyncio.Task[None] | None = None
        self.held: dict[str, str] = {}
        """Servers (by URL) that take no requests, and why."""
        self._released = asyncio.Event()
        self._released.set()

    async def start(self) -> None:
        for client in self.clients:
            await client.start()
        self._prober = asyncio.create_task(self._probe_forever(), name="engine-probe")

    async def close(self) -> None:
        if self._prober is not None:
            self._prober.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._prober
        for client in self.clients:
            await client.close()

    async def _probe_forever(self) -> None:
        while True:
            await asyncio.sleep(self.probe_interval_s)  # a probe period, not synchronisation
            try:
                await self.probe()
            except Exception:  # a probe must never end the loop
                logger.exception("probing the vLLM servers failed")

    async def probe(self) -> None:
        """Bring back failed servers that answer /health, give up on busy ones that do not,
        and report whether any server works."""
        await asyncio.gather(*(self._probe(client) for client in self.clients))
        usable = any(c.consecutive_failures == 0 for c in self.clients)
        if usable != self.usable:
            self.usable = usable
            if not usable:
                logger.error("no vLLM server is answering; groups are dropped until one does")
            self.on_usable(usable)

    async def _probe(self, client: VLLMServerClient) -> None:
        if client.consecutive_failures:
            if await client.healthy():
                client.consecutive_failures = 0
                logger.info("%s answers again; routing requests to it", client.base_url)
        elif client.inflight and not await client.healthy(self.health_timeout_s):
            client.give_up(f"did not answer /health within {self.health_timeout_s:g}s (engine.health_timeout_s)")

    def hold(self, url: str, reason: str) -> None:
        """Route nothing to ``url`` until ``release``."""
        url = url.rstrip("/")
        if url not in self.held:
            logger.warning("holding %s out of routing: %s", url, reason)
        self.held[url] = reason
        if len(self.held) == len(self.clients):
            self._released.clear()

    def release(self, url: str) -> None:
        if self.held.pop(url.rstrip("/"), None) is not None:
            logger.info("%s takes requests again", url)
            self._released.set()

    async def routable(self) -> list[VLLMServerClient]:
        """The servers not held; while every one is held, wait for a release."""
        while not (free := [c for c in self.clients if c.base_url not in self.held]):
            await self._released.wait()
        return free

    def pick(self, affinity: str | None = None, servers: list[VLLMServerClient] | None = None) -> VLLMServerClient:
        """``servers``: the candidates (default: every server)."""
        servers = servers if servers is not None else self.clients
        healthy = [c for c in servers if c.consecutive_failures == 0] or servers
        least = min(healthy, key=lambda c: c.inflight)
        preferred = self._affinity.get(affinity) if affinity else None
        if preferred in healthy and preferred.inflight <= least.inflight + AFFINITY_SLACK:
            return preferred
        if affinity:
            self._affinity[affinity] = least
        return least

    def forget(self, affinity: str) -> None:
        """Drop a finished group's affinity entry."""
        self._affinity.pop(affinity, None)

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, affinity: str | None = None
    ) -> Completion:
        return await self.pick(affinity, await self.routable()).generate(prompt_ids, params)

    async def generate_many(
        self, prompt_ids: list[int], params: SamplingParams, n: int, *, affinity: str | None = None
    ) -> list[Completion]:
        return await self.pick(affinity, await self.routable()).generate_many(prompt_ids, params, n)
