"""Pool partitions: several full-weight runs share one pool, each sampling its own weights.

A vLLM server holds one set of base weights, so with ``weight_sync.partitions`` the servers
are split among the full-weight runs by ``weight`` (``plan_partitions``): each run pushes
through its own ``WeightSyncCoordinator`` and policy version, and its groups go only to its
servers (``PartitionRouting``). Adapter runs share every server; a run with none waits.

A server changes hands only when safe: it drains out of the old run's routing, leaves that run's
group between two of its updates, and takes the new run's requests only once it holds that run's
policy (the checkpoint if the run never pushed, else after its next push, asked for at once).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace

from rollout_service.config import WeightSyncSettings
from rollout_service.engine.control import WeightControl
from rollout_service.engine.pool import EnginePool
from rollout_service.engine.protocol import Completion, SamplingParams
from rollout_service.errors import FailedPrecondition
from rollout_service.metrics import ServiceMetrics
from rollout_service.versions import PolicyVersion
from rollout_service.weights.weight_sync import WeightSyncCoordinator

logger = logging.getLogger(__name__)

DEFAULT_DRAIN_TIMEOUT_S = 60.0


def plan_partitions(
    servers: Sequence[str], weights: Mapping[str, float], current: Mapping[str, str | None]
) -> dict[str, str | None]:
    """Which run each server serves: shares by ``weights`` (largest remainder, runs oldest first), at
    least one each while there are enough (else the heaviest, then oldest), and as few moves as
    possible; ``current``: server -> the run it serves now."""
    runs = list(weights)
    if not runs:
        return dict.fromkeys(servers)
    quota = _quotas(len(servers), runs, weights)
    plan: dict[str, str | None] = {}
    for url in servers:  # keep what may stay
        owner = current.get(url)
        if owner is not None and quota.get(owner, 0) > 0:
            plan[url] = owner
            quota[owner] -= 1
    for url in servers:
        if url in plan:
            continue
        wanting = next((run for run in runs if quota[run] > 0), None)
        plan[url] = wanting
        if wanting is not None:
            quota[wanting] -= 1
    return plan


def _quotas(count: int, runs: list[str], weights: Mapping[str, float]) -> dict[str, int]:
    if count <= len(runs):
        served = sorted(runs, key=lambda run: (-weights[run], runs.index(run)))[:count]
        return {run: int(run in served) for run in runs}
    quota = dict.fromkeys(runs, 1)  # one each first, then the rest by weight
    rest = count - len(runs)
    total = sum(weights[run] for run in runs)
    exact = {run: rest * weights[run] / total for run in runs}
    for run in runs:
        quota[run] += int(exact[run])
    left = count - sum(quota.values())
    by_remainder = sorted(runs, key=lambda run: (-(exact[run] - int(exact[run])), runs.index(run)))
    for run in by_remainder[:left]:
        quota[run] += 1
    return quota


@dataclass
class _Partition:
    run_id: str
    weight: float
    coordinator: WeightSyncCoordinator
    ready: set[str] = field(default_factory=set)
    """Its servers that hold its policy: the ones its requests go to."""
    removed: bool = False
    """Its run was deleted: its servers are being handed on."""


class PoolPartitions:
    def __init__(
        self,
        pool: EnginePool,
        controls: Sequence[WeightControl],
        settings: WeightSyncSettings,
        request_weights: Callable[[str, str], None],
        metrics: ServiceMetrics | None = None,
        drain_timeout_s: float = DEFAULT_DRAIN_TIMEOUT_S,
    ) -> None:
        self.pool = pool
        self.controls = {control.base_url: control for control in controls}
        self.settings = settings
        self.metrics = metrics
        self.drain_timeout_s = drain_timeout_s
        self.owner: dict[str, str | None] = dict.fromkeys(self.controls)
        """Server -> the run it serves (None: none)."""
        self.holds_weights_of: dict[str, str | None] = dict.fromkeys(self.controls)
        """Server -> the run whose pushed weights it holds (None: the checkpoint's)."""
        self.partitions: dict[str, _Partition] = {}
        self._request_weights = request_weights
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()

    # -- what routing and the RPCs ask ------------------------------------------------------
    def servers_for(self, run_id: str) -> Collection[str]:
        partition = self.partitions.get(run_id)
        return partition.ready if partition is not None else ()

    def coordinator(self, run_id: str) -> WeightSyncCoordinator:
        partition = self.partitions.get(run_id)
        if partition is None or partition.removed:
            raise FailedPrecondition(f"run {run_id} has no partition of the pool; is it a running full-weight run?")
        return partition.coordinator

    def coordinator_of_update(self, update_id: str) -> WeightSyncCoordinator | None:
        return next((p.coordinator for p in self.partitions.values() if p.coordinator.run_of(update_id)), None)

    def assignment(self) -> dict[str, str | None]:
        return dict(self.owner)

    def unready_reason(self, url: str) -> str:
        """Why the server takes no requests of its run now; empty when it does."""
        owner = self.owner.get(url)
        if owner is None:
            return "no full-weight run is assigned this server (weight_sync.partitions)"
        if url not in self.partitions[owner].ready:
            return f"serves run {owner} once the run pushes its weights (it holds other weights)"
        return ""

    # -- runs coming and going --------------------------------------------------------------
    def add_run(self, run_id: str, weight: float, versions: PolicyVersion) -> None:
        """The run's coordinator exists at once (its trainer may push); its servers follow in the
        background (``settled``), as taking one from another run waits for its requests to drain."""
        coordinator = WeightSyncCoordinator(
            [], self.settings, versions, metrics=self.metrics, on_stuck=self.pool.set_stuck
        )
        versions.watch(lambda change: self._committed(run_id) if change.committed else None)
        self.partitions[run_id] = _Partition(run_id, weight, coordinator)
        self._rebalance_soon()

    def remove_run(self, run_id: str) -> None:
        """The run was deleted: its servers go to the other runs (in the background)."""
        partition = self.partitions.get(run_id)
        if partition is not None and not partition.removed:
            partition.removed = True
            self._rebalance_soon()

    # -- servers coming and going (``PoolMembership``: AddEngine, RemoveEngine, discovery) ----
    def add_server(self, control: WeightControl) -> None:
        """A server joined the pool holding the checkpoint: a run gets it (in the background)."""
        url = control.base_url
        self.controls[url] = control
        self.owner[url] = None
        self.holds_weights_of[url] = None
        self._rebalance_soon()

    async def remove_server(self, url: str) -> None:
        """A server drained by the caller leaves its run's group between pushes; the rest are shared again."""
        async with self._lock:
            owner = self.owner.pop(url, None)
            if owner is not None:
                partition = self.partitions[owner]
                partition.ready.discard(url)
                await partition.coordinator.remove_server(url)
            self.controls.pop(url, None)
            self.holds_weights_of.pop(url, None)
        self._rebalance_soon()

    async def settled(self) -> None:
        """Wait for every rebalance asked for so far (cancelling the wait leaves them running)."""
        while self._tasks:
            await asyncio.wait(list(self._tasks))

    async def await_servers(self, run_id: str, timeout_s: float) -> None:
        """Before a push: wait up to ``timeout_s`` for rebalances that may bring the run its servers."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self.settled(), timeout_s)
        if not self.coordinator(run_id).servers:
            raise FailedPrecondition(
                f"run {run_id} has no vLLM server to push into yet: the pool's {len(self.controls)} servers go to "
                f"{len(self.partitions)} full-weight runs, heavier or older runs first (weight_sync.partitions). "
                "Add a server (AddEngine), give this run a larger weight, or delete a run, then push again"
            )

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*list(self._tasks), return_exceptions=True)
        for partition in list(self.partitions.values()):
            await partition.coordinator.close()

    def _rebalance_soon(self) -> None:
        task = asyncio.ensure_future(self._rebalance())
        self._tasks.add(task)
        task.add_done_callback(self._rebalanced)

    def _rebalanced(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not task.cancelled() and (exc := task.exception()) is not None:
            logger.error("rebalancing the pool partitions failed: %s", exc, exc_info=exc)

    async def _rebalance(self) -> None:
        async with self._lock:
            live = {run_id: p for run_id, p in self.partitions.items() if not p.removed}
            plan = plan_partitions(list(self.controls), {run_id: p.weight for run_id, p in live.items()}, self.owner)
            for url, new in plan.items():
                old = self.owner[url]
                if old == new:
                    continue
                if old is not None:
                    await self._release_from(self.partitions[old], url)
                if new is not None:
                    await self._assign(self.partitions[new], url)
            for run_id, partition in list(self.partitions.items()):
                if partition.removed:
                    del self.partitions[run_id]
                    await partition.coordinator.close()
            logger.info("pool partitions: %s", {url: owner or "-" for url, owner in self.owner.items()})

    async def _release_from(self, partition: _Partition, url: str) -> None:
        """Out of the run's routing, its requests drained, out of its transfer group."""
        partition.ready.discard(url)
        self.owner[url] = None
        client = self.pool.client(url)
        if client is not None:
            client.leaving = True  # a request failed by give_up starts over elsewhere
            try:
                await client.drain_or_give_up(
                    self.drain_timeout_s, f"changed partitions ({self.drain_timeout_s:g}s drain timeout passed)"
                )
            finally:
                client.leaving = False
        await partition.coordinator.remove_server(url)
        logger.info("%s left run %s's partition", url, partition.run_id)

    async def _assign(self, partition: _Partition, url: str) -> None:
        await partition.coordinator.add_server(self.controls[url])
        self.owner[url] = partition.run_id
        if self.holds_weights_of[url] is None and partition.coordinator.version == 0:
            self._ready(partition, url)  # the checkpoint is this run's policy: it has never pushed
            return
        why = f"{url} joined run {partition.run_id}'s partition"
        logger.info("%s; it takes the run's requests once the run pushes its weights, asked for now", why)
        self._request_weights(partition.run_id, why)

    def server_restarted(self, url: str) -> None:
        """A restarted server holds the checkpoint: it serves its run once it holds the run's policy."""
        self.holds_weights_of[url] = None
        owner = self.owner.get(url)
        if owner is None:
            return
        partition = self.partitions[owner]
        partition.ready.discard(url)
        partition.coordinator.server_restarted()
        if partition.coordinator.version == 0:
            self._ready(partition, url)
        else:
            self._request_weights(owner, f"{url} restarted with the checkpoint's weights")

    def _ready(self, partition: _Partition, url: str) -> None:
        partition.ready.add(url)
        self.pool.notify_changed()

    def _committed(self, run_id: str) -> None:
        """A push of the run committed: every server of its coordinator holds its policy."""
        partition = self.partitions.get(run_id)
        if partition is not None:
            for control in partition.coordinator.servers:
                self.holds_weights_of[control.base_url] = run_id
                if self.owner.get(control.base_url) == run_id and control.base_url not in partition.ready:
                    self._ready(partition, control.base_url)


class PartitionRouting:
    """Sends a run's requests only to its partition's servers, with the run in the prefix-cache salt:
    a server that changed runs may hold another run's blocks at the same version."""

    def __init__(self, pool: EnginePool, run_id: str, servers: Callable[[], Collection[str]]) -> None:
        self.pool = pool
        self.run_id = run_id
        self.servers = servers

    async def generate(
        self, prompt_ids: list[int], params: SamplingParams, *, affinity: str | None = None
    ) -> Completion:
        return (await self.generate_many(prompt_ids, params, 1, affinity=affinity))[0]

    async def generate_many(
        self, prompt_ids: list[int], params: SamplingParams, n: int, *, affinity: str | None = None
    ) -> list[Completion]:
        if params.cache_salt is not None:
            params = replace(params, cache_salt=f"{self.run_id}:{params.cache_salt}")
        return await self.pool.generate_many(prompt_ids, params, n, affinity=affinity, allowed=self.servers)
