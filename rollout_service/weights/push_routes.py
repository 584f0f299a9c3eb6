"""Who may push weights, and to which servers: the one owner of that decision.

Invariant: a full-weight push reaches one set of servers, from a run that may change what they
serve. Without partitions that is the whole pool, and only the run holding the base-weights
claim pushes (a second run would train on the first's policy under its own versions); the claim
passes on once its owner has no consumer connected or is deleted. With partitions each
full-weight run pushes to its own servers. Adapter runs push adapters; evaluation runs never push.
"""

from __future__ import annotations

from typing import Any, Protocol, cast

from rollout_service.engine.pool import EnginePool
from rollout_service.engine.protocol import Engine
from rollout_service.errors import FailedPrecondition
from rollout_service.runs import Run, RunTable
from rollout_service.weights.adapters import AdapterPublisher, AdapterRouting
from rollout_service.weights.partitions import PartitionRouting, PoolPartitions
from rollout_service.weights.weight_sync import WeightSyncCoordinator, not_in_progress


class MetaStore(Protocol):
    """The part of the state store the weight plane writes (the weights do not import ``delivery``)."""

    def set_meta(self, key: str, value: Any) -> None: ...


class PushRoutes:
    def __init__(
        self,
        runs: RunTable,
        store: MetaStore | None = None,
        weight_sync: WeightSyncCoordinator | None = None,
        partitions: PoolPartitions | None = None,
        adapters: AdapterPublisher | None = None,
    ) -> None:
        """``store`` keeps the base-weights claim across restarts;
        ``weight_sync``: the pool's one weight sync, without partitions (None: the service does not
        sync weights); ``partitions``: a weight sync per full-weight run over its own servers;
        ``adapters``: when the servers load LoRA adapters at runtime (serve_adapter runs)."""
        self._runs = runs
        self._store = store
        self.weight_sync = weight_sync
        self.partitions = partitions
        self.adapters = adapters
        self.base_weights_run: str | None = None
        """The run whose trainer pushes the pool's base weights (``_claim``)."""

    async def close(self) -> None:
        if self.weight_sync is not None:
            await self.weight_sync.close()
        if self.partitions is not None:
            await self.partitions.close()

    def require(self) -> WeightSyncCoordinator:
        if self.weight_sync is None:
            raise FailedPrecondition("this service was started without weight sync")
        return self.weight_sync

    def for_push(self, run_id: str) -> WeightSyncCoordinator:
        """The weight sync ``run_id`` pushes through, once it is checked that it may push."""
        run = self._runs.require(run_id)
        if run.state != "running":
            raise FailedPrecondition(f"run {run_id} is {run.state}; push weights for a running run")
        if run.spec.eval is not None:
            raise FailedPrecondition(
                f"run {run_id} is an evaluation run, which never trains; push weights for your training run"
            )
        if run.spec.serve_adapter:
            raise FailedPrecondition(
                f"run {run_id} serves its own LoRA adapter (serve_adapter); push the adapter with PushAdapter, "
                "not base weights, which every run shares"
            )
        if self.partitions is not None:
            return self.partitions.coordinator(run_id)
        self._claim(run_id)
        return self.require()

    async def ready_for_push(self, run_id: str) -> WeightSyncCoordinator:
        """``for_push``; with partitions, once the run has servers (a rebalance may be bringing them)."""
        sync = self.for_push(run_id)
        if self.partitions is not None:
            await self.partitions.await_servers(run_id, sync.settings.transfer_timeout_s)
        return sync

    def of_update(self, update_id: str) -> WeightSyncCoordinator:
        """The weight sync an update was begun on (with partitions, its run's)."""
        if self.partitions is None:
            return self.require()
        sync = self.partitions.coordinator_of_update(update_id)
        if sync is None:
            raise not_in_progress(update_id)
        return sync

    def base_weights_owner(self) -> Run | None:
        """The live run whose trainer pushes the servers' base weights, if any."""
        return self._runs.get(self.base_weights_run or "")

    def _claim(self, run_id: str) -> None:
        owner = self.base_weights_owner()
        if owner is not None and owner.run_id != run_id and owner.broker.leases:
            raise FailedPrecondition(
                f"run {owner.run_id} pushes the base weights of these servers and its trainer is connected; a "
                f"second full-weight run would sample run {owner.run_id}'s policy. Train a LoRA adapter instead "
                f"(a serve_adapter run), add this trainer to run {owner.run_id} (rollout-trainer --run-id "
                f"{owner.run_id} --no-push), use another server pool, or delete run {owner.run_id} first"
            )
        if self.base_weights_run != run_id and self._store is not None:
            self._store.set_meta("base_weights_run", run_id)
        self.base_weights_run = run_id

    def run_started(self, run: Run) -> None:
        if self.partitions is not None and _partitioned(run):
            self.partitions.add_run(run.run_id, run.spec.weight, run.admission.versions)

    def run_failed(self, run: Run) -> None:
        """It generates no more: its servers go to the runs that do."""
        if self.partitions is not None:
            self.partitions.remove_run(run.run_id)

    async def run_deleted(self, run_id: str) -> None:
        if self.adapters is not None:
            await self.adapters.forget(run_id)
        if self.partitions is not None:
            self.partitions.remove_run(run_id)

    def engine_for(self, run: Run, engine: Engine) -> Engine:
        """A serve_adapter run names its adapter per request; with partitions a run uses its own servers."""
        if run.spec.serve_adapter:
            return AdapterRouting(engine, lambda: run.adapter)
        if (partitions := self.partitions) is not None:
            return PartitionRouting(cast(EnginePool, engine), run.run_id, lambda: partitions.servers_for(run.run_id))
        return engine


def _partitioned(run: Run) -> bool:
    """Full-weight training runs get servers of their own; adapter runs share every server."""
    return not run.spec.serve_adapter and run.spec.eval is None
