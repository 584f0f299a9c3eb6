"""What an evaluation run is asked for and has scored (``runs.Run.eval``)."""

from __future__ import annotations

import asyncio
import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from rollout_service.types import ScoredGroup


@dataclass(frozen=True)
class EvalSpec:
    """``RunSpec.eval``: the version to evaluate; None means the servers' version at creation."""

    policy_version: int | None = None


@dataclass
class EvalTally:
    """What an evaluation run has scored so far, at its one policy version."""

    policy_version: int
    prompts: int
    groups_scored: int = 0
    samples: int = 0
    reward_sum: float = 0.0
    component_sums: dict[str, float] = field(default_factory=dict)
    component_counts: dict[str, int] = field(default_factory=dict)
    """Per reward function: samples it scored (None skipped, as TRL's nanmean)."""
    complete: bool = False
    started: asyncio.Event = field(default_factory=asyncio.Event)
    """Set once the run holds its version: the scheduler feeds it only then."""

    def record(self, group: ScoredGroup) -> None:
        self.groups_scored += 1
        self.samples += len(group.rewards)
        self.reward_sum += sum(group.rewards)
        for name, values in group.reward_components.items():
            scored = [value for value in values if value is not None and not math.isnan(value)]
            self.component_sums[name] = self.component_sums.get(name, 0.0) + sum(scored)
            self.component_counts[name] = self.component_counts.get(name, 0) + len(scored)

    @property
    def reward_mean(self) -> float:
        return self.reward_sum / self.samples if self.samples else 0.0

    @property
    def reward_means(self) -> dict[str, float]:
        return {
            name: total / self.component_counts[name]
            for name, total in self.component_sums.items()
            if self.component_counts[name]
        }
