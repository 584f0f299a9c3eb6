import math
import random

import pytest
import torch

from rollout_service.scoring.advantages import EPS, AdvantageComputer, weighted_total
from rollout_service.types import AdvantageScaling


def trl_group_advantages(rewards: list[float], scale: bool) -> list[float]:
    """TRL GRPOTrainer's formula: unbiased std of the group, eps 1e-4."""
    r = torch.tensor(rewards, dtype=torch.float64)
    adv = r - r.mean()
    if scale:
        adv = adv / (r.std() + 1e-4)
    return adv.tolist()


@pytest.mark.parametrize("size", [2, 4, 16])
def test_group_scaling_matches_trl(size: int) -> None:
    rng = random.Random(size)
    rewards = [rng.uniform(-2, 3) for _ in range(size)]
    ours = AdvantageComputer(AdvantageScaling.GROUP)(rewards)
    assert ours == pytest.approx(trl_group_advantages(rewards, scale=True), rel=1e-9, abs=1e-12)
    assert sum(ours) == pytest.approx(0.0, abs=1e-9)


def test_no_scaling_is_mean_centred_only() -> None:
    rewards = [1.0, 2.0, 6.0]
    assert AdvantageComputer(AdvantageScaling.NONE)(rewards) == pytest.approx([-2.0, -1.0, 3.0])


def test_equal_rewards_give_zero_advantage() -> None:
    assert AdvantageComputer(AdvantageScaling.GROUP)([0.5] * 4) == [0.0] * 4


def test_batch_scaling_uses_std_over_recent_groups() -> None:
    computer = AdvantageComputer(AdvantageScaling.BATCH)
    computer([0.0, 2.0])
    second = computer([1.0, 3.0])
    batch_std = torch.tensor([0.0, 2.0, 1.0, 3.0], dtype=torch.float64).std().item()
    assert second == pytest.approx([-1.0 / (batch_std + EPS), 1.0 / (batch_std + EPS)])


def test_single_member_group_is_rejected() -> None:
    with pytest.raises(ValueError, match="at least 2"):
        AdvantageComputer(AdvantageScaling.GROUP)([1.0])


def test_weighted_total_ignores_none_like_trl_nansum() -> None:
    components = {"a": [1.0, math.nan, math.nan], "b": [2.0, 3.0, math.nan]}
    totals = weighted_total(components, {"a": 0.5, "b": 2.0}, 3)
    assert totals[:2] == [4.5, 6.0]
    assert math.isnan(totals[2])
