"""Durable state: the SQLite store's round trip, and a service restarted on it getting its
runs, unacked groups (leases returned), acked ids and policy version back. A scripted
engine stands in for vLLM; the kill -9 proof is tests/integration/faults/test_service_restart.py."""

from __future__ import annotations

import asyncio
import dataclasses
import sqlite3
from pathlib import Path

import pytest

from rollout_service.delivery import state_store
from rollout_service.delivery.consumer import ConsumerSession
from rollout_service.delivery.state_store import MemoryStore, SqliteStore, open_store
from rollout_service.edge.group_wire import WireCodec
from rollout_service.errors import FailedPrecondition
from rollout_service.eval_tally import EvalSpec
from rollout_service.generation.prompts import PromptSpec
from rollout_service.runs import RunSpec, RunTable
from rollout_service.types import SamplingParams
from rollout_service.weights.adapters import AdapterPublisher
from rollout_service.weights.push_routes import PushRoutes
from tests.support import wait_until
from tests.unit.rollout_service.builders import scored_group
from tests.unit.rollout_service.weights.scripted_control import ADAPTER, ScriptedServer
from tests.unit.scripted import ScriptedEngine, make_service


def spec(**kw) -> RunSpec:  # type: ignore[no-untyped-def]
    return RunSpec(
        source_kind="prompts",
        prompts=(PromptSpec(token_ids=[1, 2]), PromptSpec(token_ids=[3])),
        sampling=SamplingParams(max_tokens=4),
        group_size=2,
        rewards=(("completion_length", 1.0),),
        display_name="durable",
        **kw,
    )


def durable_service(path: Path, max_buffered: int = 4, adapters: AdapterPublisher | None = None):  # type: ignore[no-untyped-def]
    store, runs = SqliteStore(path, WireCodec()), RunTable()
    weights = PushRoutes(runs, store, adapters=adapters)
    return make_service(ScriptedEngine(), max_buffered=max_buffered, store=store, runs=runs, weights=weights)


async def test_a_restarted_service_gets_its_runs_unacked_groups_and_acked_ids_back(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    first = durable_service(path)
    first.set_policy_version(3)
    run = await first.create_run(spec())
    gone = await first.create_run(spec())
    await wait_until(lambda: len(run.broker.buffered) == 4, 5, "a full buffer")
    run.broker.subscribe("trainer")
    taken = [await asyncio.wait_for(run.broker.take("trainer"), 5) for _ in range(3)]
    run.broker.ack("trainer", [taken[0].group_id], "trained")  # 2 stay leased, 1+ buffered
    await first.delete_run(gone.run_id)
    await wait_until(lambda: len(run.broker.buffered) >= 1, 5, "the buffer to refill")
    unacked = {g.group_id for g in run.broker.buffered} | {g.group_id for g in taken[1:]}
    for r in list(first.runs.values()):
        await first.scheduler.stop_run(r)  # stop generating before the store is read back
    first.versions.set_trainer(4)  # a push begins and commits
    first.set_policy_version(4)
    # Staleness admission's estimate and its switch, learned from acks and pushes:
    run.admission.trained_per_version, run.admission.version_bumped = 2.5, True
    first.versions.set_trainer(5)  # the next push begins: the runs' state is written
    first.store.close()  # the writes still queued are flushed

    second = durable_service(path)
    assert await second.restore() == 1
    assert second.policy_version == 4 and list(second.runs) == [run.run_id]
    restored = second.runs[run.run_id]
    assert restored.spec == run.spec and restored.policy_version == 4
    assert restored.admission.trained_per_version == 2.5 and restored.admission.version_bumped
    held = {g.group_id for g in restored.broker.buffered}
    assert unacked <= held  # every unacked group is back, the leased ones returned
    assert taken[0].group_id not in held and restored.broker.acked == {taken[0].group_id: "trained"}
    restored.broker.subscribe("trainer")
    again = await asyncio.wait_for(restored.broker.take("trainer"), 5)
    assert again.group_id in unacked and again.episodes[0].completion_ids == [7, 7, 7, 7]
    # The trainer that held a group before the restart trained it and acks it without a
    # lease now: taken, and out of the buffer, so nobody trains it again.
    late = next(g.group_id for g in restored.broker.buffered if g.group_id in unacked)
    assert restored.broker.ack("trainer", [late], "trained") == 1
    assert late not in {g.group_id for g in restored.broker.buffered}
    await second.delete_run(run.run_id)
    second.store.close()
    assert sqlite3.connect(path).execute("SELECT COUNT(*) FROM runs").fetchone() == (0,)


async def test_a_restarted_service_keeps_a_paced_runs_lookahead(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    first = durable_service(path)
    run = await first.create_run(spec(admission="paced", max_staleness=2))
    await first.scheduler.stop_run(run)
    assert run.admission.lookahead is not None and run.admission.lookahead_versions == 2.0
    run.admission.lookahead.versions = 0.75  # learned: the trainer is the slower side
    first.set_policy_version(1)  # as at a push: the runs' state is written
    first.store.close()

    second = durable_service(path)
    assert await second.restore() == 1
    restored = second.runs[run.run_id]
    assert restored.admission.lookahead_versions == 0.75  # not relearned from max_staleness
    await second.delete_run(run.run_id)
    second.store.close()


async def test_a_failed_run_stays_failed_after_a_restart_and_its_groups_are_still_handed_out(tmp_path: Path) -> None:
    path = tmp_path / "state.db"
    first = durable_service(path, max_buffered=2)
    run = await first.create_run(spec())
    await wait_until(lambda: len(run.broker.buffered) == 2, 5, "a full buffer")
    first.scheduler.fail_run(run, "vLLM refused its requests")
    held = {group.group_id for group in run.broker.buffered}
    first.store.close()

    second = durable_service(path)
    assert await second.restore() == 1
    restored = second.runs[run.run_id]
    assert (restored.state, restored.error) == ("failed", "vLLM refused its requests")
    restored.broker.subscribe("trainer", 8)
    session = ConsumerSession(second, run.run_id, "trainer", 8)
    handed = [await asyncio.wait_for(session.next_message(), 5) for _ in held]
    assert {message.group.group_id for message in handed} == held
    with pytest.raises(FailedPrecondition, match=f"run {run.run_id} failed: vLLM refused its requests"):
        await asyncio.wait_for(session.next_message(), 5)
    assert restored.counters.groups_started == 0  # it generates nothing more
    await second.delete_run(run.run_id)
    second.store.close()


async def test_a_store_write_is_durable_when_put_group_returns(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "state.db", WireCodec(), flush_interval_s=0.001)
    service = make_service(ScriptedEngine(), max_buffered=1, store=store)
    run = await service.create_run(spec())
    await wait_until(lambda: len(run.broker.buffered) == 1, 5, "a group")
    reader = sqlite3.connect(tmp_path / "state.db")  # another connection sees it committed
    [(group_id,)] = reader.execute("SELECT group_id FROM groups").fetchall()
    assert group_id == run.broker.buffered[0].group_id
    await service.delete_run(run.run_id)
    store.close()


async def test_evaluation_runs_are_not_resumed_and_memory_keeps_nothing(tmp_path: Path) -> None:
    service = durable_service(tmp_path / "state.db")
    await service.create_run(spec(eval=EvalSpec()))
    service.store.close()
    assert SqliteStore(tmp_path / "state.db", WireCodec()).load() == ([], {})
    assert isinstance(open_store("memory", WireCodec()), MemoryStore) and MemoryStore().load() == ([], {})


async def test_a_restored_adapter_run_serves_its_newest_adapter_at_its_version(tmp_path: Path) -> None:
    path, adapters = tmp_path / "state.db", tmp_path / "adapters"
    first = durable_service(path, adapters=AdapterPublisher(adapters, [ScriptedServer("http://a")], timeout_s=5))  # type: ignore[list-item]
    run = await first.create_run(spec(serve_adapter=True))
    for _ in range(2):
        await first.publish_adapter(run.run_id, ADAPTER)
    await first.scheduler.stop_run(run)
    first.store.close()

    server = ScriptedServer("http://a")
    second = durable_service(path, adapters=AdapterPublisher(adapters, [server], timeout_s=5))  # type: ignore[list-item]
    await second.restore()
    await second.restore_adapters()
    restored = second.runs[run.run_id]
    assert (restored.adapter, restored.policy_version) == (f"{run.run_id}@v2", 2)
    assert set(server.loaded) == {f"{run.run_id}@v2"}
    await second.delete_run(run.run_id)
    second.store.close()


async def test_writes_queued_at_close_are_written_and_the_wal_is_checkpointed(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "state.db", WireCodec(), flush_interval_s=60, checkpoint_interval_s=0.01)
    store.set_meta("policy_version", 7)  # queued: its flush is a minute away
    await wait_until(lambda: store.checkpoints >= 2, 5, "the checkpointer to run")
    store.close()
    assert store.writes == 1 and not (tmp_path / "state.db-wal").exists()  # all in the database, the WAL gone
    assert SqliteStore(tmp_path / "state.db", WireCodec()).load() == ([], {"policy_version": 7})


def test_without_an_event_loop_a_write_is_committed_at_once(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "state.db", WireCodec())
    store.save_run("run-1", "alice", {"spec": 1}, {"policy_version": 2})
    reader = sqlite3.connect(tmp_path / "state.db")
    assert reader.execute("SELECT owner FROM runs").fetchall() == [("alice",)]
    store.close()


async def test_submitted_prompts_come_back_queued_unless_their_group_was_stored(tmp_path: Path) -> None:
    """Each submitted prompt is, after a restart, either a stored group or queued again with
    its index (a group in flight at the stop is generated again); new ones number on."""
    path = tmp_path / "state.db"
    first = durable_service(path, max_buffered=2)
    run = await first.create_run(dataclasses.replace(spec(), source_kind="submitted", prompts=()))
    await first.submit_prompts(run.run_id, [PromptSpec(token_ids=[i + 1]) for i in range(6)])
    await wait_until(lambda: len(run.broker.buffered) == 2, 5, "a full buffer")
    await first.scheduler.stop_run(run)
    first.store.close()

    second = durable_service(path, max_buffered=2)
    assert await second.restore() == 1
    restored = second.runs[run.run_id]
    await second.scheduler.stop_run(restored)  # hold generation: look at what came back
    grouped = [group.prompt.index for group in restored.broker.buffered]
    queued = [(await restored.source.next()).index for _ in range(restored.source.queued)]
    assert len(grouped) == 2 and sorted(grouped + queued) == list(range(6)) and queued == sorted(queued)
    await second.submit_prompts(run.run_id, [PromptSpec(token_ids=[9])])
    assert (await restored.source.next()).index == 6
    second.store.close()


async def test_acked_groups_leave_the_file_and_only_the_newest_acks_are_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The maintenance thread deletes acked groups' rows, so the file holds what a restart
    needs, not every group ever made, and keeps the newest ``ACKED_KEPT`` acked ids."""
    monkeypatch.setattr(state_store, "ACKED_KEPT", 2)
    path = tmp_path / "state.db"
    store = SqliteStore(path, WireCodec(), checkpoint_interval_s=0.01)
    groups = [dataclasses.replace(scored_group(), group_id=f"run-1/{i}") for i in range(5)]
    for group in groups:
        await store.put_group(group)
    store.ack("run-1", [group.group_id for group in groups[:3]], "trained")
    await wait_until(lambda: store.deleted_groups == 3 and store.checkpoints >= 2, 5, "acked groups deleted")
    store.close()
    db = sqlite3.connect(path)
    assert db.execute("SELECT group_id FROM groups ORDER BY seq").fetchall() == [("run-1/3",), ("run-1/4",)]
    assert db.execute("SELECT group_id FROM acked").fetchall() == [("run-1/1",), ("run-1/2",)]
