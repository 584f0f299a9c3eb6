"""What generation hands each finished group to. Scoring is a later stage, so the service
passes the scorer in (``tools/import_graph.py``: a stage imports earlier stages only)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from rollout_service.types import EpisodeResult, PromptItem, ScoredGroup

if TYPE_CHECKING:
    from rollout_service.runs import Run


class GroupScoring(Protocol):
    async def score(
        self, run: Run, prompt: PromptItem, group_id: str, episodes: list[EpisodeResult], seconds: float
    ) -> ScoredGroup: ...
