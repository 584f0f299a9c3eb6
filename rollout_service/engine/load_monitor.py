"""Reads every vLLM server's ``/metrics`` on a period and exports its load (``rollout_engine_*``).
A server that does not answer keeps its last reading: the pool's probes decide its health.
"""

from __future__ import annotations

import asyncio
import logging

from rollout_service.engine.server_load import ServerLoad
from rollout_service.engine.vllm_client import VLLMServerClient
from rollout_service.metrics import ServiceMetrics

logger = logging.getLogger(__name__)

READ_INTERVAL_S = 2.0


class LoadMonitor:
    def __init__(self, clients: list[VLLMServerClient], metrics: ServiceMetrics) -> None:
        self.clients = list(clients)
        self.metrics = metrics
        self._last: dict[str, ServerLoad] = {}

    def add(self, client: VLLMServerClient) -> None:
        self.clients.append(client)

    def remove(self, url: str) -> None:
        self.clients = [client for client in self.clients if client.base_url != url]
        self._last.pop(url, None)

    async def run(self) -> None:
        while True:
            try:
                await self.poll()
            except Exception:  # a reading must never end the loop
                logger.exception("reading the vLLM servers' /metrics failed")
            await asyncio.sleep(READ_INTERVAL_S)  # a polling period, not synchronisation

    async def poll(self) -> None:
        clients = list(self.clients)  # a server may join or leave while they answer
        loads = await asyncio.gather(*(client.server_load() for client in clients))
        for client, load in zip(clients, loads, strict=True):
            if load is not None and client in self.clients:
                self._observe(client, load)

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
