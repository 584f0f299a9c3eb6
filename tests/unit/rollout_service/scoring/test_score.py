"""``scoring.score.GroupScorer``: weighted rewards and advantages of one finished group, and
the reward errors that drop that group alone."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from rollout_service.errors import RewardError
from rollout_service.scoring.score import GroupScorer
from rollout_service.types import EpisodeResult, PromptItem
from tests.unit.rollout_service.builders import spec
from tests.unit.scripted import ScriptedEngine, make_service

PROMPT = PromptItem(index=0, token_ids=[1, 2, 3], text="abc")


def member(text: str) -> EpisodeResult:
    return EpisodeResult([5, 6], [-0.1, -0.2], [1, 1], "stop", text, 0, 0, reward_text=text)


def length(completions, **_):
    return [float(len(c)) for c in completions]


def nothing(completions, **_):
    return [None] * len(completions)


def huge(completions, **_):
    return [1e308] * len(completions)


async def score(rewards: dict, weighted: tuple[tuple[str, float], ...], texts: list[str]):
    service = make_service(ScriptedEngine(hold=True), rewards=rewards)
    run = await service.create_run(spec([[1, 2, 3]], group_size=len(texts), rewards=weighted))
    try:
        with ThreadPoolExecutor(2) as executor:
            scorer = GroupScorer(service.rewards, timeout_s=5, executor=executor)
            return await scorer.score(run, PROMPT, "g0", [member(t) for t in texts], seconds=0.5)
    finally:
        await service.close()


async def test_a_group_gets_weighted_rewards_and_group_scaled_advantages() -> None:
    group = await score({"length": length, "nothing": nothing}, (("length", 2.0), ("nothing", 1.0)), ["a", "abc"])
    assert group.reward_components["length"] == [1.0, 3.0]
    assert group.rewards == [2.0, 6.0]  # None from one function counts as no contribution
    assert group.advantages[0] < 0 < group.advantages[1]
    assert group.advantages[0] == pytest.approx(-group.advantages[1])
    assert (group.group_id, group.generation_seconds) == ("g0", 0.5)


@pytest.mark.parametrize(
    ("rewards", "message"),
    [({"nothing": nothing}, "returned None"), ({"huge": huge}, "overflowed")],
)
async def test_a_group_no_reward_can_score_is_a_reward_error(rewards: dict, message: str) -> None:
    name = next(iter(rewards))
    with pytest.raises(RewardError, match=message):
        await score(rewards, ((name, 2.0),), ["a", "b"])
