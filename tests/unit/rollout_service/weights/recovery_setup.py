"""A commit as the weight sync makes it."""

from __future__ import annotations

from rollout_service.service import RolloutService


def commit(service: RolloutService, version: int) -> None:
    """The versions move; server recovery, watching them, hears of it."""
    service.versions.commit(version)
