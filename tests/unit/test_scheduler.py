import asyncio
import logging

import pytest

from rollout_service.prompts import PromptSpec
from rollout_service.runs import RunSpec
from rollout_service.types import SamplingParams
from tests.support import wait_until
from tests.unit.scripted import FAIL_TOKEN, ScriptedEngine, make_service


def spec(prompts: list[list[int]], group_size: int = 3, rewards=(("completion_length", 1.0),), **kw) -> RunSpec:
    return RunSpec(
        source_kind="prompts",
        prompts=tuple(PromptSpec(token_ids=p) for p in prompts),
        sampling=SamplingParams(max_tokens=4),
        group_size=group_size,
        rewards=rewards,
        **kw,
    )


async def test_slots_are_never_exceeded_and_refilled_at_once() -> None:
    engine = ScriptedEngine(hold=True)
    service = make_service(engine, max_inflight=4)
    run = await service.create_run(spec([[1, 2]], group_size=3))
    try:
        await engine.wait_for(lambda: engine.active == 4)
        for _ in range(10):
            calls = engine.calls
            assert engine.release(count=1) == 1
            await engine.wait_for(lambda c=calls: engine.calls == c + 1)  # the freed slot is refilled
            assert engine.active == 4
            assert service.scheduler.slots_busy == 4
        assert engine.max_active == 4
        assert service.scheduler.max_slots_busy_seen == 4
    finally:
        await service.delete_run(run.run_id)
    assert service.scheduler.slots_busy == 0


async def test_run_limit_is_below_service_limit() -> None:
    engine = ScriptedEngine(hold=True)
    service = make_service(engine, max_inflight=6)
    run = await service.create_run(spec([[1]], group_size=2, max_inflight=2))
    await engine.wait_for(lambda: engine.active == 2)
    assert run.counters.slots_busy == 2
    await service.delete_run(run.run_id)


async def test_group_is_scored_while_others_still_generate() -> None:
    engine = ScriptedEngine(hold=True)
    service = make_service(engine, max_inflight=6)
    run = await service.create_run(spec([[1, 2]], group_size=3))
    await engine.wait_for(lambda: engine.active == 6)
    first_group = engine.pending[0][0]
    assert engine.release(affinity=first_group) == 3
    run.broker.subscribe("t")
    group = await asyncio.wait_for(run.broker.take("t"), 5)
    assert group.group_id == first_group
    assert engine.active >= 3  # the other group was still generating when this one was scored
    assert len(group.advantages) == 3
    assert sum(group.advantages) == pytest.approx(0.0, abs=1e-9)
    await service.delete_run(run.run_id)


async def test_failed_request_drops_its_group_and_the_run_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    engine = ScriptedEngine()
    service = make_service(engine, max_inflight=4, max_buffered=5)
    run = await service.create_run(spec([[1, 2], [FAIL_TOKEN]], group_size=2))
    with caplog.at_level(logging.WARNING):
        await wait_until(lambda: len(run.broker.buffered) >= 5 and run.counters.groups_dropped >= 3, 5, "drops")
    await service.delete_run(run.run_id)
    assert all(FAIL_TOKEN not in g.prompt.token_ids for g in run.broker.buffered)
    assert run.counters.groups_dropped >= 3
    assert any("dropped group" in r.message and "scripted failure" in r.message for r in caplog.records)
    assert service.scheduler.engine_failures == run.counters.groups_dropped


async def test_failing_reward_drops_the_group_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    def broken(prompts, completions, completion_ids, **kw):
        raise RuntimeError("reward bug")

    engine = ScriptedEngine()
    service = make_service(engine, max_inflight=2, rewards={"broken": broken})
    run = await service.create_run(spec([[1]], group_size=2, rewards=(("broken", 1.0),)))
    with caplog.at_level(logging.WARNING):
        await wait_until(lambda: run.counters.groups_dropped >= 2, 5, "dropped groups")
    await service.delete_run(run.run_id)
    assert run.counters.groups_scored == 0
    assert any("(reward)" in r.message and "reward bug" in r.message for r in caplog.records)
    assert run.state == "stopped"


async def test_full_buffer_stops_new_groups() -> None:
    engine = ScriptedEngine()
    service = make_service(engine, max_inflight=4, max_buffered=3)
    run = await service.create_run(spec([[1]], group_size=2))
    await wait_until(lambda: len(run.broker.buffered) >= 3 and run.counters.slots_busy == 0, 5, "a full buffer")
    started = run.counters.groups_started
    assert started == 3  # started groups are reserved in the buffer: never more than it holds
    for _ in range(50):
        await asyncio.sleep(0)  # let the loop run: nothing new may start
    assert run.counters.groups_started == started
    # A consumer taking a group makes room, and generation resumes.
    run.broker.subscribe("c")
    await run.broker.take("c")
    await wait_until(lambda: run.counters.groups_started > started, 5, "a new group")
    await service.delete_run(run.run_id)
