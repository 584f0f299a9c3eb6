"""Server recovery as the app wires it, and a commit as the weight sync makes it."""

from __future__ import annotations

from rollout_service.engine.pool import EnginePool
from rollout_service.service import RolloutService
from rollout_service.weights.server_recovery import ServerRecovery


def recovery_of(service: RolloutService, pool: EnginePool) -> ServerRecovery:
    """As the app builds it: on the service's weight plane and policy version."""
    return ServerRecovery(service.weights, pool, service.versions)


def commit(service: RolloutService, recovery: ServerRecovery, version: int) -> None:
    """What the weight sync does at a commit: the versions move, then recovery hears of it."""
    service.versions.commit(version)
    recovery.version_committed(version)
