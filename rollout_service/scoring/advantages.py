"""Group-normalised advantages, as TRL's GRPOTrainer computes them: (r_i - mean) / (std + 1e-4),
std being the group's, that of a sliding window of recent rewards (``"batch"``), or 1 (``"none"``).
"""

from __future__ import annotations

import math
import statistics
from collections import deque

from rollout_service.types import AdvantageScaling

EPS = 1e-4


class AdvantageComputer:
    """Stateful only for batch scaling, which needs the spread of recent rewards."""

    def __init__(self, scaling: AdvantageScaling) -> None:
        self.scaling = scaling
        self._recent: deque[float] = deque(maxlen=1024)

    def __call__(self, rewards: list[float]) -> list[float]:
        if len(rewards) < 2:
            raise ValueError("group advantages need at least 2 rewards")
        mean = statistics.fmean(rewards)
        if self.scaling is AdvantageScaling.GROUP:
            scale = statistics.stdev(rewards) + EPS
        elif self.scaling is AdvantageScaling.BATCH:
            self._recent.extend(rewards)
            scale = statistics.stdev(self._recent) + EPS
        else:
            scale = 1.0
        return [(r - mean) / scale for r in rewards]


def weighted_total(components: dict[str, list[float]], weights: dict[str, float], size: int) -> list[float]:
    """Weighted sum over reward functions ignoring NaN, like TRL's nansum; all NaN gives NaN."""
    totals: list[float] = []
    for i in range(size):
        values = [(components[name][i], weights[name]) for name in components]
        present = [v * w for v, w in values if not math.isnan(v)]
        totals.append(math.fsum(present) if present else math.nan)
    return totals
