"""The seam between the scheduler and vLLM: integration tests use real servers behind it,
scheduler unit tests a scripted engine."""

from __future__ import annotations

from typing import Protocol

from rollout_service.types import Completion, SamplingParams

EPISODE_SEPARATOR = "#"


def episode_affinity(group_key: str, member: int) -> str:
    """The affinity key of one episode: it starts where its group is, and its turns stay with its cache."""
    return f"{group_key}{EPISODE_SEPARATOR}{member}"


class Engine(Protocol):
    """Generates one completion; raises ``EngineError`` when a request fails for good.
    ``affinity``: a key whose requests a router keeps on one server, for its prefix cache."""

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, affinity: str | None = None
    ) -> Completion: ...


class GroupEngine(Engine, Protocol):
    """An engine that also samples ``n`` completions of one prompt in one request (one prefill per group)."""

    async def generate_many(
        self, prompt_ids: list[int], params: SamplingParams, n: int, *, affinity: str | None = None
    ) -> list[Completion]: ...


def samples_groups_at_once(engine: Engine) -> bool:
    """Whether ``engine`` is a ``GroupEngine`` (scripted test engines usually are not)."""
    return callable(getattr(engine, "generate_many", None))
