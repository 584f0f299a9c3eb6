"""Pool partitions: the plan that splits servers among full-weight runs, and the hand-over of
a server between runs, against scripted control endpoints (the weights themselves are
proven against real vLLM servers in tests/integration/test_partitions.py)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from rollout_service.config import EngineSettings, WeightSyncSettings
from rollout_service.engine.pool import EnginePool
from rollout_service.engine.vllm_client import VLLMServerClient
from rollout_service.errors import FailedPrecondition
from rollout_service.eval_tally import EvalSpec
from rollout_service.metrics import ServiceMetrics
from rollout_service.runs import RunTable
from rollout_service.types import SamplingParams
from rollout_service.versions import PolicyVersion
from rollout_service.weights.adapters import AdapterRouting
from rollout_service.weights.partitions import PartitionRouting, PoolPartitions, plan_partitions
from rollout_service.weights.push_routes import PushRoutes
from tests.support import listening_port
from tests.unit.rollout_service.builders import one_prompt_spec as run_spec
from tests.unit.rollout_service.weights.scripted_control import TENSORS, Clock, ScriptedControl
from tests.unit.scripted import ScriptedEngine, make_service

A, B, C = "http://a:8000", "http://b:8000", "http://c:8000"


def test_servers_are_shared_in_proportion_to_the_runs_weights() -> None:
    plan = plan_partitions([A, B, C], {"big": 2.0, "small": 1.0}, {})
    assert sorted(plan.values()) == ["big", "big", "small"]
    plan = plan_partitions([A, B, C], {"x": 1.0, "y": 1.0, "z": 1.0}, {})
    assert sorted(plan.values()) == ["x", "y", "z"]


def test_every_run_gets_a_server_before_any_gets_a_second() -> None:
    plan = plan_partitions([A, B], {"heavy": 100.0, "light": 1.0}, {})
    assert sorted(plan.values()) == ["heavy", "light"]


def test_with_fewer_servers_than_runs_the_heaviest_then_oldest_runs_get_one_each() -> None:
    plan = plan_partitions([A, B], {"first": 1.0, "second": 1.0, "third": 5.0}, {})
    assert sorted(plan.values()) == ["first", "third"]
    current = {A: "first", B: "second"}
    plan = plan_partitions([A, B], {"first": 1.0, "second": 1.0, "third": 5.0}, current)
    assert plan == {A: "first", B: "third"}  # the newest of the light runs waits


def test_a_new_run_takes_as_few_servers_as_possible_from_the_others() -> None:
    current = {A: "old", B: "old", C: "old"}
    plan = plan_partitions([A, B, C], {"old": 1.0, "new": 1.0}, current)
    moved = [url for url in plan if plan[url] != current[url]]
    assert len(moved) == 1 and plan[moved[0]] == "new"
    assert plan_partitions([A, B, C], {"old": 1.0, "new": 1.0}, plan) == plan  # stable once placed


def test_without_runs_no_server_is_assigned() -> None:
    assert plan_partitions([A, B], {}, {A: "gone"}) == {A: None, B: None}


class Server(ScriptedControl):
    def __init__(self, url: str) -> None:
        super().__init__(Clock())
        self.base_url = url


def partitions_over(urls: list[str], runs: RunTable | None = None) -> tuple[PoolPartitions, dict[str, list[str]]]:
    """Partitions over ``urls``; their requests for weights are recorded, or go to ``runs`` (as the app wires them)."""
    metrics = ServiceMetrics()
    settings = EngineSettings(urls=urls, model="tiny")
    pool = EnginePool([VLLMServerClient(url, "tiny", settings, metrics, 4) for url in urls])
    wanted: dict[str, list[str]] = {}
    partitions = PoolPartitions(
        pool,
        [Server(url) for url in urls],
        WeightSyncSettings(transfer_timeout_s=60, control_timeout_s=60),
        runs.request_weights if runs is not None else lambda run, why: wanted.setdefault(run, []).append(why),
        metrics,
        drain_timeout_s=5,
    )

    return partitions, wanted


def recorded(log: dict[str, list[int]], run_id: str) -> PolicyVersion:
    """A run's versions, with each version it commits recorded in ``log``."""
    versions = PolicyVersion()
    versions.watch(lambda change: log.setdefault(run_id, []).append(versions.served) if change.committed else None)
    return versions


async def push(partitions: PoolPartitions, run_id: str) -> int:
    sync = partitions.coordinator(run_id)
    ticket = await sync.begin(run_id, "127.0.0.1", listening_port(), TENSORS, "none")
    version, _ = await sync.commit(ticket.update_id)
    return version


@pytest.mark.timeout(30)
async def test_a_server_changes_runs_only_once_it_holds_the_new_runs_policy() -> None:
    partitions, wanted = partitions_over([A, B, C])
    versions: dict[str, list[int]] = {}
    try:
        partitions.add_run("first", 1.0, recorded(versions, "first"))
        await partitions.settled()
        assert set(partitions.servers_for("first")) == {A, B, C}  # the checkpoint is its policy
        assert await push(partitions, "first") == 1
        assert versions == {"first": [1]}
        assert {s.base_url for s in partitions.coordinator("first").servers} == {A, B, C}

        partitions.add_run("second", 1.0, recorded(versions, "second"))
        waiting = asyncio.ensure_future(partitions.pool.routable(lambda: partitions.servers_for("second")))
        await partitions.settled()
        (moved,) = [url for url, owner in partitions.assignment().items() if owner == "second"]
        # It holds the first run's pushed weights: not the second run's policy yet.
        assert not waiting.done() and not partitions.servers_for("second")
        assert wanted["second"] and moved in wanted["second"][0]
        assert moved not in partitions.servers_for("first")
        assert moved not in {s.base_url for s in partitions.coordinator("first").servers}

        assert await push(partitions, "second") == 1
        assert [client.base_url for client in await asyncio.wait_for(waiting, 5)] == [moved]
        assert set(partitions.servers_for("second")) == {moved}
        assert versions == {"first": [1], "second": [1]}
        assert len(partitions.servers_for("first")) == 2

        partitions.remove_run("first")
        await partitions.settled()
        assert set(partitions.assignment().values()) == {"second"}
        assert set(partitions.servers_for("second")) == {moved}  # the others hold the first run's weights
        assert await push(partitions, "second") == 2
        assert set(partitions.servers_for("second")) == {A, B, C}
        with pytest.raises(FailedPrecondition, match="no partition"):
            partitions.coordinator("first")
    finally:
        await partitions.close()


@pytest.mark.timeout(30)
async def test_a_restarted_server_waits_for_its_runs_next_push() -> None:
    partitions, wanted = partitions_over([A, B])
    try:
        partitions.add_run("run", 1.0, PolicyVersion())
        await partitions.settled()
        await push(partitions, "run")
        partitions.server_restarted(A)
        assert set(partitions.servers_for("run")) == {B}
        assert "restarted" in wanted["run"][-1]
        await push(partitions, "run")
        assert set(partitions.servers_for("run")) == {A, B}
    finally:
        await partitions.close()


@pytest.mark.timeout(30)
async def test_a_partitioned_service_gives_each_full_weight_run_its_own_weight_sync() -> None:
    runs = RunTable()
    partitions, _ = partitions_over([A, B], runs)
    service = make_service(ScriptedEngine(), runs=runs, weights=PushRoutes(runs, partitions=partitions))
    try:
        one = await service.create_run(run_spec())
        two = await service.create_run(run_spec())
        await partitions.settled()
        assert sorted(partitions.assignment().values()) == sorted([one.run_id, two.run_id])
        sync = service.weights.for_push(one.run_id)
        assert sync is partitions.coordinator(one.run_id) and sync is not service.weights.for_push(two.run_id)
        ticket = await sync.begin(one.run_id, "127.0.0.1", listening_port(), TENSORS, "none")
        assert service.weights.of_update(ticket.update_id) is sync
        await sync.commit(ticket.update_id)
        assert one.policy_version == 1 and two.policy_version == 0  # its version, not the pool's
        assert one.admission.versions is not service.versions
        with pytest.raises(FailedPrecondition, match="not in progress"):
            service.weights.of_update(ticket.update_id)

        with pytest.raises(FailedPrecondition, match=r"weight_sync\.partitions.*evaluation run"):
            await service.create_run(replace(run_spec(), eval=EvalSpec()))
        adapter_run = await service.create_run(replace(run_spec(), serve_adapter=True))
        await partitions.settled()
        assert adapter_run.run_id not in partitions.partitions  # it shares every server
        assert isinstance(service.weights.engine_for(adapter_run, service.scheduler.engine), AdapterRouting)
        await service.delete_run(adapter_run.run_id)

        await service.delete_run(one.run_id)
        await partitions.settled()
        assert set(partitions.assignment().values()) == {two.run_id}
    finally:
        await service.delete_run(two.run_id)
        await partitions.close()


@pytest.mark.timeout(30)
async def test_a_failed_run_gives_its_servers_to_the_runs_that_generate() -> None:
    runs = RunTable()
    partitions, _ = partitions_over([A, B], runs)
    service = make_service(ScriptedEngine(), runs=runs, weights=PushRoutes(runs, partitions=partitions))
    try:
        failed, going = await service.create_run(run_spec()), await service.create_run(run_spec())
        await partitions.settled()
        assert sorted(partitions.assignment().values()) == sorted([failed.run_id, going.run_id])
        service.scheduler.fail_run(failed, "vLLM refused its requests")
        await partitions.settled()
        assert set(partitions.assignment().values()) == {going.run_id}
        await service.delete_run(failed.run_id)  # its partition is gone already
    finally:
        await service.delete_run(going.run_id)
        await partitions.close()


async def test_a_runs_requests_go_to_its_servers_with_a_cache_salt_naming_it() -> None:
    class Pool:
        async def generate_many(self, prompt_ids, params, n, *, affinity=None, allowed=None):  # type: ignore[no-untyped-def]
            self.seen = (params.cache_salt, set(allowed()))
            return [None] * n

    pool = Pool()
    routing = PartitionRouting(pool, "run-1", lambda: {A})  # type: ignore[arg-type]
    await routing.generate([1], SamplingParams(max_tokens=1, cache_salt="v3"))
    assert pool.seen == ("run-1:v3", {A})  # vLLM refuses '/' in a salt


@pytest.mark.timeout(30)
async def test_servers_that_join_or_leave_the_pool_are_shared_again() -> None:
    partitions, wanted = partitions_over([A])
    try:
        partitions.add_run("first", 1.0, PolicyVersion())
        partitions.add_run("second", 1.0, PolicyVersion())
        await partitions.settled()
        assert partitions.assignment() == {A: "first"}  # the second run waits for a server
        await partitions.await_servers("first", 5)
        with pytest.raises(FailedPrecondition, match="no vLLM server to push into yet"):
            await partitions.await_servers("second", 5)
        assert await push(partitions, "first") == 1

        partitions.pool.add(VLLMServerClient(B, "tiny", EngineSettings(urls=[B], model="tiny"), ServiceMetrics(), 4))
        partitions.add_server(Server(B))  # as PoolMembership does once B holds the checkpoint
        await partitions.settled()
        assert partitions.assignment() == {A: "first", B: "second"}
        assert set(partitions.servers_for("second")) == {B}  # the checkpoint is its policy

        await partitions.remove_server(A)
        await partitions.settled()
        assert partitions.assignment() == {B: "first"}  # the oldest run keeps a server
        assert not partitions.servers_for("first")  # B holds the checkpoint, not the first run's push
        assert B in wanted["first"][-1]
        assert await push(partitions, "first") == 2
        assert set(partitions.servers_for("first")) == {B}
        assert not partitions.servers_for("second")
    finally:
        await partitions.close()
