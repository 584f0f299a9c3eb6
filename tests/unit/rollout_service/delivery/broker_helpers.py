"""Groups put into a run's broker, and a test clock for its leases and admission."""

from __future__ import annotations

from rollout_service.delivery.broker import RunBroker
from rollout_service.types import EpisodeResult, PromptItem, ScoredGroup


def group(group_id: str) -> ScoredGroup:
    episode = EpisodeResult([1], [-0.1], [1], "stop", "x", 0, 0)
    return ScoredGroup(group_id, "r", PromptItem(0, [1], "p"), [episode] * 2, [0.0, 1.0], {}, {}, [-1.0, 1.0], 0.1)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


async def produce(broker: RunBroker, *ids: str) -> None:
    for group_id in ids:
        assert broker.has_room(), f"no room for {group_id}"
        assert await broker.reserve()
        await broker.put(group(group_id))
