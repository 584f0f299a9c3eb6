"""The seam between the scheduler and vLLM: integration tests use real servers behind it,
scheduler unit tests a scripted engine."""

from __future__ import annotations

from typing import Protocol

from rollout_service.types import Completion, SamplingParams


class Engine(Protocol):
    """Generates one completion; raises ``EngineError`` when a request fails for good."""

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, affinity: str | None = None
    ) -> Completion: ...
