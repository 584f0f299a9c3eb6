"""The seam between the scheduler and vLLM: integration tests use real servers behind it,
scheduler unit tests a scripted engine."""

from __future__ import annotations

from typing import Protocol

from rollout_service.types import Completion, SamplingParams

EPISODE_SEPARATOR = "#"


def episode_affinity(group_key: str, member: int) -> str:
    """The affinity key of one episode of a group: a router starts it where its group is, and
    keeps its turns where its transcript is cached."""
    return f"{group_key}{EPISODE_SEPARATOR}{member}"


class Engine(Protocol):
    """Generates one completion; raises ``EngineError`` when a request fails for good.

    ``affinity``: a key (a group's id, or ``episode_affinity``) whose requests a router keeps
    on one server, for its prefix cache."""

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, affinity: str | None = None
    ) -> Completion: ...


class GroupEngine(Engine, Protocol):
    """An engine that can also sample ``n`` completions of one prompt in one request.

    Why: a single-turn group is G samples of one prompt. As one request (vLLM's ``n``) the
    server parses, schedules and prefills the prompt once and answers once, instead of G
    times; on a 2-core host that cut vLLM's time per group by about a fifth
    (``benchmarks/bench_vs_trl.py``). The completions are independent samples, as G requests
    would give.
    """

    async def generate_many(
        self, prompt_ids: list[int], params: SamplingParams, n: int, *, affinity: str | None = None
    ) -> list[Completion]: ...


def samples_groups_at_once(engine: Engine) -> bool:
    """Whether ``engine`` is a ``GroupEngine`` (scripted test engines usually are not)."""
    return callable(getattr(engine, "generate_many", None))
