"""Routes requests over several vLLM servers: least-loaded, with group affinity.

Members of a group prefer the server their first member went to (its prefix cache holds
the prompt) unless that server is clearly busier than the least-loaded one. Servers whose
last request failed are tried only when no healthy one is left.
"""

from __future__ import annotations

from rollout_service.engine.vllm_client import VLLMServerClient
from rollout_service.types import Completion, SamplingParams

AFFINITY_SLACK = 2
"""How many more in-flight requests than the least-loaded server affinity may accept."""


class EnginePool:
    def __init__(self, clients: list[VLLMServerClient]) -> None:
        if not clients:
            raise ValueError("an engine pool needs at least one server")
        self.clients = clients
        self._affinity: dict[str, VLLMServerClient] = {}

    async def start(self) -> None:
        for client in self.clients:
            await client.start()

    async def close(self) -> None:
        for client in self.clients:
            await client.close()

    def pick(self, affinity: str | None = None) -> VLLMServerClient:
        healthy = [c for c in self.clients if c.consecutive_failures == 0] or self.clients
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
        return await self.pick(affinity).generate(prompt_ids, params)

    async def generate_many(
        self, prompt_ids: list[int], params: SamplingParams, n: int, *, affinity: str | None = None
    ) -> list[Completion]:
        return await self.pick(affinity).generate_many(prompt_ids, params, n)
