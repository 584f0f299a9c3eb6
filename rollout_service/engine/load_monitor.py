"""Reads every vLLM server's ``/metrics`` on a period: exports each server's KV-cache usage,
queue, preemptions and prefix-cache hits, and (when on) adapts each server's in-flight limit.

A server that does not answer keeps its last reading and limit: the pool's health probes,
not this loop, decide whether it takes traffic. A change of the servers' summed limits is
reported through ``on_capacity`` (the scheduler resizes its slots to it).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable

from rollout_service.config import AdaptiveInflightSettings
from rollout_service.engine.inflight_limit import AdaptiveLimit
from rollout_service.engine.server_load import ServerLoad
from rollout_service.engine.vllm_client import VLLMServerClient
from rollout_service.metrics import ServiceMetrics

logger = logging.getLogger(__name__)


class LoadMonitor:
    def __init__(
        self,
        clients: list[VLLMServerClient],
        metrics: ServiceMetrics,
        interval_s: float,
        adaptive: AdaptiveInflightSettings | None = None,
        initial_total: int = 64,
    ) -> None:
        self.clients = list(clients)
        self.metrics = metrics
        self.interval_s = interval_s
        self.on_capacity: Callable[[int], None] = lambda total: None
        self.limits: dict[str, AdaptiveLimit] = {}
        """Per server URL, when the limit adapts."""
        self._last: dict[str, ServerLoad] = {}
        self._adaptive = adaptive if adaptive is not None and adaptive.enabled else None
        self._first_limit = 0
        if self._adaptive is not None:
            self._first_limit = self._adaptive.initial_per_server or max(1, initial_total // len(clients))
            for client in clients:
                self._start_limit(client)

    def _start_limit(self, client: VLLMServerClient) -> None:
        adaptive = self._adaptive
        assert adaptive is not None
        self.limits[client.base_url] = AdaptiveLimit(
            self._first_limit, adaptive.min_per_server, adaptive.max_per_server, adaptive.target_kv_usage, adaptive.band
        )
        client.limit = self.limits[client.base_url].limit
        self.metrics.server_inflight_limit.labels(client.base_url).set(client.limit)

    def add(self, client: VLLMServerClient) -> None:
        """A server joined the pool: read it too, starting it at the first limit."""
        self.clients.append(client)
        if self._adaptive is not None:
            self._start_limit(client)
            self.on_capacity(self.capacity or 0)

    def remove(self, url: str) -> None:
        """A server left the pool: its limit leaves the capacity."""
        self.clients = [client for client in self.clients if client.base_url != url]
        self._last.pop(url, None)
        if self.limits.pop(url, None) is not None:
            self.on_capacity(self.capacity or 0)

    @property
    def capacity(self) -> int | None:
        """The summed per-server limits; None with a fixed slot count."""
        return sum(limit.limit for limit in self.limits.values()) if self.limits else None

    async def run(self) -> None:
        while True:
            try:
                await self.poll()
            except Exception:  # a reading must never end the loop
                logger.exception("reading the vLLM servers' /metrics failed")
            await asyncio.sleep(self.interval_s)  # a polling period, not synchronisation

    async def poll(self) -> None:
        """One reading of every server, then the limits and the exported series."""
        before = self.capacity
        clients = list(self.clients)  # a server may join or leave while they answer
        loads = await asyncio.gather(*(client.server_load() for client in clients))
        for client, load in zip(clients, loads, strict=True):
            if load is not None and client in self.clients:
                self._observe(client, load)
        if (after := self.capacity) is not None and after != before:
            logger.debug("in-flight limits %s (total %d)", {u: lim.limit for u, lim in self.limits.items()}, after)
            self.on_capacity(after)

    def _observe(self, client: VLLMServerClient, load: ServerLoad) -> None:
        url, m = client.base_url, self.metrics
        last = self._last.get(url, ServerLoad())
        m.server_kv_cache_usage.labels(url).set(load.kv_cache_usage)
        m.server_waiting.labels(url).set(load.waiting)
        for counter, now, then in (
            (m.server_preemptions, load.preemptions, last.preemptions),
            (m.server_prefix_cache_queries, load.prefix_cache_queries, last.prefix_cache_queries),
            (m.server_prefix_cache_hits, load.prefix_cache_hits, last.prefix_cache_hits),
        ):
            # vLLM's counters restart at 0 with the server: then all of the new value is new.
            counter.labels(url).inc(now - then if now >= then else now)
        self._last[url] = load
        # The peak since the last reading, not the count now: requests of a group end
        # together, and a reading taken between two waves would see the limit as unused.
        peak, client.peak_inflight = client.peak_inflight, client.inflight
        if (limit := self.limits.get(url)) is not None:
            client.limit = limit.update(load, peak)
            m.server_inflight_limit.labels(url).set(client.limit)
