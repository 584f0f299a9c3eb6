"""Brings a restarted vLLM server back to the runs' policies before it takes requests.

A restarted server holds the checkpoint and no adapters: routed to at once, it would serve stale
base weights labelled with the current policy version. So it stays held until its adapters are
loaded again and it holds the base policy: at once if no full-weight push has committed (version
0), else after the next push, which the base-weights run is asked for at once (WeightsWanted:
with one server its trainer would otherwise wait for groups forever). A restarted service holds
every server until its ``/weight_info`` label shows the restored version (``check_restored``).
With partitions each run does the same for its servers (``PoolPartitions.server_restarted``).
"""

from __future__ import annotations

import asyncio
import logging

from rollout_service.engine.control import WeightControl, WeightSyncError
from rollout_service.engine.pool import EnginePool
from rollout_service.versions import PolicyVersion
from rollout_service.weights.push_routes import PushRoutes

logger = logging.getLogger(__name__)

STARTUP_HOLD = "the service is starting: which policy version this server holds is not checked yet"


class ServerRecovery:
    def __init__(self, weights: PushRoutes, pool: EnginePool, versions: PolicyVersion) -> None:
        self.weights = weights
        self.pool = pool
        self.versions = versions
        """The base weights' versions (served 0: no full-weight push has committed)."""
        self.awaiting_weights: set[str] = set()
        """Restarted servers held until the next full-weight push commits."""
        versions.watch(lambda change: self.version_committed() if change.committed else None)

    def hold_until_checked(self) -> None:
        """At start-up, before the stored runs start: hold every server until ``check_restored``."""
        for client in self.pool.clients:
            self.pool.hold(client.base_url, STARTUP_HOLD)

    async def check_restored(self, timeout_s: float) -> None:
        """Release the servers labelled with the restored version; hold the rest (unlabelled too), ask for a push."""
        weights, sync = self.weights, self.weights.weight_sync
        version = self.versions.served
        if weights.partitions is not None or sync is None or version == 0:
            for client in self.pool.clients:  # partitions route by their own readiness; 0: the checkpoint
                self.pool.release(client.base_url)
            return
        labels = await asyncio.gather(*(_label(server, timeout_s) for server in sync.servers))
        for server, label in zip(sync.servers, labels, strict=True):
            if label == str(version):
                self.pool.release(server.base_url)
                continue
            logger.warning(
                "%s serves weights labelled %r, not the restored policy version %d", server.base_url, label, version
            )
            self.awaiting_weights.add(server.base_url)
            self._wait_for_policy(server.base_url, f"serves weights labelled {label!r} after the service restarted")

    def server_down(self, url: str) -> None:
        self.pool.hold(url, "its vLLM process exited; restarting it")

    async def server_restarted(self, url: str) -> None:
        weights = self.weights
        if weights.partitions is not None:
            weights.partitions.server_restarted(url)
        elif weights.weight_sync is not None:
            weights.weight_sync.server_restarted()
        if weights.adapters is not None:
            await weights.adapters.reload(url)
        if weights.partitions is not None:  # its run routes to it once it holds the run's policy
            self.pool.release(url)
            return
        self.awaiting_weights.add(url)
        self._wait_for_policy(url, "restarted with the checkpoint's weights")

    def joined(self, url: str) -> None:
        """A joined server is now a weight-sync server, between updates, so the next commit includes it."""
        self._wait_for_policy(url, "joined the pool with the checkpoint's weights")

    def _wait_for_policy(self, url: str, why: str) -> None:
        """Release ``url`` if the checkpoint is the policy, else hold it and ask for the next push now."""
        version = self.versions.served
        if version == 0:
            self.awaiting_weights.discard(url)
            self.pool.release(url)
            return
        reason = f"{url} {why}; it takes requests once policy version {version} is pushed"
        self.pool.hold(url, reason)
        owner = self.weights.base_weights_owner()
        if owner is None:
            logger.warning("%s; no run pushes the base weights now, so it waits for the next push", reason)
            return
        logger.info("asking run %s's trainer to push its weights now: %s", owner.run_id, reason)
        owner.admission.request_weights(reason)

    def version_committed(self) -> None:
        """Release the waiting servers the committed push reached (one still joining waits on)."""
        sync = self.weights.weight_sync
        synced = {server.base_url for server in sync.servers} if sync is not None else set(self.awaiting_weights)
        for url in self.awaiting_weights & synced:
            self.pool.release(url)
        self.awaiting_weights -= synced


async def _label(server: WeightControl, timeout_s: float) -> str | None:
    try:
        return await server.weight_version(timeout_s)
    except WeightSyncError as exc:
        logger.warning("could not ask %s which weights it serves: %s", server.base_url, exc)
        return None
