"""Brings a restarted vLLM server back to the runs' policies before it takes requests.

Why: a managed server that restarts (``engine.supervisor``) loads the checkpoint from disk
and no adapters. Routed to at once, it would serve every run on base weights the trainer
left behind long ago, labelled with the run's current policy version: samples trained as
on-policy that are not. So it stays held out of routing until it holds what the runs sample:

- its adapters are loaded again (adapter runs);
- if no full-weight push has committed (policy version 0), the checkpoint *is* the base
  policy, and it takes requests at once;
- otherwise it waits for the next push, which joins a fresh transfer group that includes
  it. The run that pushes the base weights is asked for that push at once (a WeightsWanted
  message on its streams): with one server, the trainer is waiting for groups that no
  server may generate, and would otherwise never push.

The same rule holds when the service itself restarts on its state store: its servers may
be fresh (a managed server started anew) or restarted behind its back, and hold the
checkpoint whatever version the store says. So every server starts held
(``hold_until_checked``) until its own label of the weights (vLLM's ``/weight_info``, set
after each commit) says it holds the restored version (``check_restored``).

With pool partitions the same rule holds per run: the server's run asks its own trainer
(``PoolPartitions.server_restarted``), and a restored partition takes a server only after
its run's next push.
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
    def __init__(
        self,
        weights: PushRoutes,
        pool: EnginePool,
        versions: PolicyVersion,
    ) -> None:
        self.weights = weights
        self.pool = pool
        self.versions = versions
        """The base weights' versions (served 0: no full-weight push has committed)."""
        self.awaiting_weights: set[str] = set()
        """Restarted servers held until the next full-weight push commits."""

    def hold_until_checked(self) -> None:
        """At start-up, before the stored runs start: no server takes a request until
        ``check_restored`` has seen which weights it holds."""
        for client in self.pool.clients:
            self.pool.hold(client.base_url, STARTUP_HOLD)

    async def check_restored(self, timeout_s: float) -> None:
        """After the restore and weight sync's start: release the servers that hold the
        restored policy version by their own label; hold the others until it is pushed, and
        ask for that push. A server that cannot say counts as not holding it."""
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
        """A server added to the pool (``PoolMembership``) is now one of the weight-sync
        servers; called between updates, so no update without it can still commit."""
        self._wait_for_policy(url, "joined the pool with the checkpoint's weights")

    def _wait_for_policy(self, url: str, why: str) -> None:
        """Release ``url`` if the checkpoint is the policy (no full-weight push yet), else
        hold it until the next push commits and ask for that push now."""
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

    def version_committed(self, version: int) -> None:
        """A full-weight push committed: every weight-sync server holds it, so the servers
        that waited for it take requests. One not yet among them (joining) waits on."""
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
