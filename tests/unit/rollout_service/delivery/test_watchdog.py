"""The run watchdog on a scripted engine with a test clock: each kind of stall is reported
on the run, in the metrics and once to each consumer stream, and clears on progress."""

from __future__ import annotations

import asyncio
import dataclasses

import pytest

from rollout_api import rollout_pb2 as pb
from rollout_service.delivery.consumer import ConsumerSession
from rollout_service.edge.convert import consumer_message_to_wire, run_to_pb
from rollout_service.types import RunStall
from tests.support import wait_until
from tests.unit.rollout_service.builders import spec
from tests.unit.scripted import ScriptedEngine, make_service


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def stalled(service, run_id: str, kind: str) -> float | None:
    return service.metrics.registry.get_sample_value("rollout_run_stalled", {"run": run_id, "kind": kind})


async def test_a_run_whose_generation_stopped_is_reported_once_and_clears_when_groups_come() -> None:
    engine = ScriptedEngine(hold=True)  # requests wait: nothing is scored
    service = make_service(engine, max_inflight=2, stall_timeout_s=60)
    clock = Clock()
    service.watchdog.clock = clock
    run = await service.create_run(spec([[1, 2]], group_size=2))
    session = ConsumerSession(service, run.run_id, "c", credits=4)
    health: list[bool] = []
    service.watchdog.on_stalled = health.append
    try:
        await engine.wait_for(lambda: engine.active == 2)
        service.watchdog.check(service.runs.values(), engines_usable=True)
        clock.now += 59
        service.watchdog.check(service.runs.values(), engines_usable=True)
        assert run.stall is None  # not yet
        clock.now += 2
        service.engines_usable(False)
        service.watchdog.check(service.runs.values(), engines_usable=service.pool_usable)
        assert run.stall is not None and run.stall.kind == "generation"
        assert "no group scored for 61s: no vLLM server is answering" in run.stall.reason
        assert stalled(service, run.run_id, "generation") == 1 and health == [True]
        message = run_to_pb(run)
        assert message.stall.kind == pb.STALL_KIND_GENERATION and message.stall.seconds == pytest.approx(61)
        # The stream sends it once, without a credit.
        first = await asyncio.wait_for(session.next_message(), 5)
        assert isinstance(first, RunStall) and consumer_message_to_wire(first).stall.reason == run.stall.reason
        service.watchdog.check(service.runs.values(), engines_usable=False)
        assert run.stalls == 1 and session._stall() is None
        # Groups come again: it clears.
        service.engines_usable(True)
        engine.release()
        await wait_until(lambda: run.counters.groups_scored >= 1, 5, "a group to be scored")
        service.watchdog.check(service.runs.values(), engines_usable=True)
        assert run.stall is None and stalled(service, run.run_id, "generation") == 0 and health == [True, False]
        assert not run_to_pb(run).HasField("stall")
    finally:
        await service.delete_run(run.run_id)


@pytest.mark.parametrize(
    ("dropped", "await_update", "why"),
    [
        (True, False, "groups were dropped since the last one scored"),
        (False, True, "the run waits for its first weight update"),
        (False, False, "groups are generating but none finished"),
    ],
    ids=["groups-fail", "no-first-push", "groups-hang"],
)
async def test_a_generation_stall_says_why(dropped: bool, await_update: bool, why: str) -> None:
    engine = ScriptedEngine(hold=True)
    service = make_service(engine, max_inflight=2, stall_timeout_s=10)
    clock = Clock()
    service.watchdog.clock = clock
    prompt = [1, 999] if dropped else [1, 2]  # 999: the scripted engine fails it
    run = await service.create_run(spec([prompt], group_size=2, await_first_update=await_update))
    try:
        service.watchdog.check(service.runs.values(), True)
        if not (dropped or await_update):
            await engine.wait_for(lambda: engine.active == 2)  # generating, and held there
        if dropped:
            engine.hold = False  # every request now fails at once
            engine.release()
            await wait_until(lambda: run.counters.groups_dropped >= 2, 5, "two dropped groups")
        clock.now += 11
        service.watchdog.check(service.runs.values(), True)
        assert run.stall is not None and why in run.stall.reason
    finally:
        await service.delete_run(run.run_id)


async def test_consumers_that_stop_acking_are_reported_and_a_full_buffer_after_a_long_wait_is_not() -> None:
    engine = ScriptedEngine()
    service = make_service(engine, max_inflight=2, max_buffered=2, stall_timeout_s=30)
    clock = Clock()
    service.watchdog.clock = clock
    run = await service.create_run(spec([[1, 2]], group_size=2))
    try:
        service.watchdog.check(service.runs.values(), True)
        await wait_until(lambda: len(run.broker.buffered) == 2, 5, "the buffer to fill")
        clock.now += 100  # long after the last ack (none yet): the wait counts from when groups came
        service.watchdog.check(service.runs.values(), True)
        assert run.stall is None
        clock.now += 20  # groups have waited 20 s so far ...
        service.watchdog.check(service.runs.values(), True)
        assert run.stall is None
        clock.now += 15  # ... and 35 s, with nobody to take them
        service.watchdog.check(service.runs.values(), True)
        assert run.stall is not None and run.stall.kind == "consumers"
        assert "2 groups wait and 0 are leased" in run.stall.reason and "no consumer is subscribed" in run.stall.reason
        assert stalled(service, run.run_id, "consumers") == 1
        run.broker.subscribe("t")
        group = await asyncio.wait_for(run.broker.take("t"), 5)
        run.broker.ack("t", [group.group_id], "trained")
        service.watchdog.check(service.runs.values(), True)
        assert run.stall is None
    finally:
        await service.delete_run(run.run_id)


async def test_a_zero_timeout_turns_the_watchdog_off() -> None:
    service = make_service(ScriptedEngine(), stall_timeout_s=0)
    await asyncio.wait_for(service.watch_runs(), 1)  # returns at once


async def test_a_submitted_prompts_run_with_no_prompts_says_so() -> None:
    service = make_service(ScriptedEngine(), stall_timeout_s=10)
    clock = Clock()
    service.watchdog.clock = clock
    run = await service.create_run(dataclasses.replace(spec([[1]], group_size=2), source_kind="submitted", prompts=()))
    try:
        service.watchdog.check(service.runs.values(), True)
        clock.now += 11
        service.watchdog.check(service.runs.values(), True)
        assert run.stall is not None and "it has no prompts to start" in run.stall.reason
    finally:
        await service.delete_run(run.run_id)
