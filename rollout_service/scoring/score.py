"""Scoring a finished group: its members' rewards (every function of the run concurrently),
their weighted total, and the advantages. A ``RewardError`` drops that group alone, never the run.
"""

from __future__ import annotations

import asyncio
import math
from concurrent.futures import Executor
from dataclasses import dataclass
from typing import TYPE_CHECKING

from rollout_service.errors import RewardError
from rollout_service.scoring.advantages import weighted_total
from rollout_service.scoring.rewards import RewardRegistry, call_reward, reward_inputs
from rollout_service.types import EpisodeResult, PromptItem, ScoredGroup

if TYPE_CHECKING:
    from rollout_service.runs import Run


@dataclass(frozen=True)
class GroupScorer:
    rewards: RewardRegistry
    timeout_s: float
    executor: Executor

    async def score(
        self, run: Run, prompt: PromptItem, group_id: str, episodes: list[EpisodeResult], seconds: float
    ) -> ScoredGroup:
        inputs = reward_inputs(prompt, episodes, multi_turn=run.episode is not None)  # TRL's inputs
        names = [name for name, _ in run.spec.rewards]
        values = await asyncio.gather(
            *(call_reward(name, self.rewards.get(name), inputs, self.timeout_s, self.executor) for name in names)
        )
        components = dict(zip(names, values, strict=True))
        weights = run.reward_weights()
        totals = weighted_total(components, weights, len(episodes))
        if any(math.isnan(t) for t in totals):
            raise RewardError("every reward function returned None for a sample of the group")
        if not all(math.isfinite(t) for t in totals):
            raise RewardError(f"the weighted reward overflowed ({totals}); use smaller rewards or weights")
        return ScoredGroup(
            group_id=group_id,
            run_id=run.run_id,
            prompt=prompt,
            episodes=episodes,
            rewards=totals,
            reward_components=components,
            reward_weights=weights,
            advantages=run.advantages(totals),
            generation_seconds=seconds,
            requested_size=run.spec.group_size,
        )
