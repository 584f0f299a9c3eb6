import asyncio
import dataclasses
import logging
import re
import threading

import pytest

from rollout_api import rollout_pb2 as pb
from rollout_service.edge.convert import run_spec_from_pb, run_spec_to_pb, stats_to_pb
from rollout_service.edge.group_wire import group_to_pb
from rollout_service.errors import EngineError, InvalidArgument
from rollout_service.generation.prompts import PromptSpec
from rollout_service.generation.scheduler import (
    BACKOFF_AFTER_FAILURES,
    BACKOFF_FIRST_S,
    REFUSED_BEFORE_FAILING,
)
from rollout_service.metrics import RecentRate
from rollout_service.types import SamplingParams
from tests.support import wait_until
from tests.unit.rollout_service.builders import spec
from tests.unit.scripted import (
    ABORT_TOKEN,
    FAIL_TOKEN,
    REFUSE_TOKEN,
    ScriptedEngine,
    ScriptedGroupEngine,
    make_service,
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
    buffered = list(run.broker.buffered)
    await service.delete_run(run.run_id)
    assert buffered and all(FAIL_TOKEN not in g.prompt.token_ids for g in buffered)
    assert run.counters.groups_dropped >= 3
    assert any("dropped group" in r.message and "scripted failure" in r.message for r in caplog.records)
    assert service.scheduler.engine_failures == run.counters.groups_dropped


async def test_a_run_with_some_requests_refused_goes_on() -> None:
    engine = ScriptedEngine()
    service = make_service(engine, max_inflight=4, max_buffered=1000)
    run = await service.create_run(spec([[1, 2], [REFUSE_TOKEN]], group_size=2))
    await wait_until(lambda: run.counters.groups_refused > 2 * REFUSED_BEFORE_FAILING, 5, "refusals")
    assert run.state == "running" and run.counters.groups_scored > 0
    await service.delete_run(run.run_id)


class FlakyEngine(ScriptedEngine):
    """Fails every request while ``failing``, as a server or environment that is down would."""

    failing = True

    async def generate(self, prompt_ids: list[int], params: SamplingParams, *, affinity: str | None = None):
        if self.failing:
            raise EngineError("scripted", "scripted outage")
        return await super().generate(prompt_ids, params, affinity=affinity)


async def test_failures_in_a_row_pause_the_run_doubling_per_pause_and_a_scored_group_ends_the_pause() -> None:
    """The groups in flight at the 16th failure fail too: the pause doubles with each pause taken,
    not with each failure, so that the first is the shortest however many were in flight."""
    engine = FlakyEngine()
    service = make_service(engine, max_inflight=4)
    scheduler = service.scheduler
    pauses: list[float] = []
    backoff_s = scheduler.failure_backoff_s

    def recorded(run):  # type: ignore[no-untyped-def]
        if (pause_s := backoff_s(run)) > 0:
            pauses.append(pause_s)
        return pause_s

    scheduler.failure_backoff_s = recorded  # type: ignore[method-assign]
    run = await service.create_run(spec([[1, 2]], group_size=2))
    await wait_until(lambda: len(pauses) >= 3, 5, "three pauses")
    assert pauses[:3] == [BACKOFF_FIRST_S, 2 * BACKOFF_FIRST_S, 4 * BACKOFF_FIRST_S]
    assert run.counters.groups_dropped >= BACKOFF_AFTER_FAILURES
    engine.failing = False
    await wait_until(lambda: run.counters.groups_scored > 0, 10, "a group scored after the outage")
    assert backoff_s(run) == 0.0 and run.state == "running"
    await service.delete_run(run.run_id)


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


async def test_an_unexpected_scoring_failure_drops_the_group_and_frees_its_buffer_place(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Before, such a task died unobserved and kept its place: after max_buffered_groups of
    them the run stopped generating while it still said running."""
    service = make_service(ScriptedEngine(), max_inflight=2)
    run = await service.create_run(spec([[1]], group_size=2, max_buffered_groups=2))

    def broken_advantages(rewards):
        raise AttributeError("advantage bug")

    run.advantages = broken_advantages  # type: ignore[method-assign]
    with caplog.at_level(logging.WARNING):
        await wait_until(lambda: run.counters.groups_dropped >= 5, 5, "more drops than buffer places")
    await service.delete_run(run.run_id)
    assert run.counters.groups_scored == 0 and run.state == "stopped"
    assert any("(internal)" in r.message and "advantage bug" in r.message for r in caplog.records)


async def test_a_group_too_large_to_send_is_dropped_and_the_run_goes_on(caplog: pytest.LogCaptureFixture) -> None:
    """Buffered, it would fail every consumer's stream and return to the front, for ever."""
    service = make_service(ScriptedEngine(), max_inflight=2, max_group_bytes=4096)
    prompts = (PromptSpec(token_ids=[1], metadata={"notes": "x" * 8000}), PromptSpec(token_ids=[2]))
    run = await service.create_run(dataclasses.replace(spec([[1]], group_size=2), prompts=prompts))
    with caplog.at_level(logging.WARNING):
        await wait_until(lambda: run.counters.groups_dropped >= 2 and len(run.broker.buffered) >= 2, 5, "both kinds")
    buffered = list(run.broker.buffered)
    await service.delete_run(run.run_id)
    assert buffered and all(group.prompt.index % 2 == 1 for group in buffered)  # only the small prompt's groups
    assert any("(too_large)" in r.message and "scheduler.max_group_bytes (4096)" in r.message for r in caplog.records)


async def test_a_group_with_an_aborted_member_is_dropped_not_delivered(caplog: pytest.LogCaptureFixture) -> None:
    service = make_service(ScriptedEngine(), max_inflight=2)
    run = await service.create_run(spec([[1, ABORT_TOKEN], [2]], group_size=2))
    with caplog.at_level(logging.WARNING):
        await wait_until(lambda: run.counters.groups_dropped >= 2 and len(run.broker.buffered) >= 2, 5, "both kinds")
    buffered = list(run.broker.buffered)
    await service.delete_run(run.run_id)
    assert buffered and all(group.prompt.token_ids == [2] for group in buffered)
    assert any("(aborted)" in r.message for r in caplog.records)


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


async def test_a_single_turn_group_is_one_request_that_holds_g_slots() -> None:
    engine = ScriptedGroupEngine(hold=True)
    service = make_service(engine, max_inflight=7)
    run = await service.create_run(spec([[1, 2]], group_size=3))
    try:
        await engine.wait_for(lambda: engine.group_calls == 2)  # 2 x 3 slots ...
        for _ in range(20):
            await asyncio.sleep(0)  # yields: the third group's feeder gets as far as it can
        assert service.scheduler.slots_busy == 6  # ... and the third takes none until its 3 are free
        group_id = engine.pending[0][0]
        assert engine.release(affinity=group_id) == 1
        run.broker.subscribe("t")
        group = await asyncio.wait_for(run.broker.take("t"), 5)
        assert group.group_id == group_id and len(group.episodes) == 3 and len(group.advantages) == 3
        await engine.wait_for(lambda: engine.group_calls == 3)  # its 3 slots went to the next group
        assert engine.calls == engine.group_calls  # no per-member requests
    finally:
        await service.delete_run(run.run_id)
    assert service.scheduler.slots_busy == 0


async def test_group_requests_of_several_runs_never_hold_part_of_their_slots() -> None:
    """Two runs of G = 3 on 4 slots: taken one at a time, each run could hold 2 and wait for
    a third that the other holds, for ever. Granted together, both keep going."""
    engine = ScriptedGroupEngine()
    service = make_service(engine, max_inflight=4)
    runs = [await service.create_run(spec([[1, 2]], group_size=3)) for _ in range(2)]
    try:
        for run in runs:
            run.broker.subscribe("t")

        async def consume(run) -> None:  # type: ignore[no-untyped-def]
            for _ in range(10):
                group = await run.broker.take("t")
                run.broker.ack("t", [group.group_id], "trained")

        await asyncio.wait_for(asyncio.gather(*(consume(run) for run in runs)), 10)
        assert service.scheduler.max_slots_busy_seen <= 4
    finally:
        for run in runs:
            await service.delete_run(run.run_id)
    assert service.scheduler.slots_busy == 0


async def test_seeded_runs_keep_one_request_per_member_for_their_per_member_seeds() -> None:
    engine = ScriptedGroupEngine(hold=True)
    service = make_service(engine, max_inflight=3)
    seeded = dataclasses.replace(spec([[1]], group_size=3), sampling=SamplingParams(max_tokens=4, seed=7))
    run = await service.create_run(seeded)
    try:
        await engine.wait_for(lambda: engine.active == 3)
        assert engine.group_calls == 0 and engine.calls == 3
    finally:
        await service.delete_run(run.run_id)


async def test_a_failed_group_request_drops_the_group_and_frees_its_slots() -> None:
    engine = ScriptedGroupEngine()
    service = make_service(engine, max_inflight=4, max_buffered=3)
    run = await service.create_run(spec([[FAIL_TOKEN]], group_size=2))
    await wait_until(lambda: run.counters.groups_dropped >= 3, 5, "dropped groups")
    await service.delete_run(run.run_id)
    assert run.counters.groups_scored == 0 and service.scheduler.slots_busy == 0
    assert service.scheduler.engine_failures == run.counters.groups_dropped


def test_recent_rate_covers_the_last_window_only() -> None:
    now = [100.0]
    rate = RecentRate(window_s=10, bucket_s=1, clock=lambda: now[0])
    now[0] = 102.0
    assert rate.rate() == (0.0, 2.0)  # just after start the window is the uptime
    rate.add(40)
    now[0] = 104.0
    assert rate.rate() == (10.0, 4.0)
    now[0] = 110.5
    rate.add(30)
    assert rate.rate() == pytest.approx((70 / 9.5, 9.5))  # the window: whole buckets 101..110
    now[0] = 113.5
    assert rate.rate() == pytest.approx((30 / 9.5, 9.5))  # the 40 tokens of t=102 left the window
    assert rate.total == 70


async def test_stats_account_tokens_slot_time_and_admission_waits() -> None:
    """A run whose buffer fills while slots are free: GetStats shows its tokens, the slot
    time it used, and the seconds admission then held it back."""
    engine = ScriptedEngine()
    service = make_service(engine, max_inflight=4, max_buffered=2)
    run = await service.create_run(spec([[1]], group_size=2))
    try:
        await wait_until(lambda: len(run.broker.buffered) == 2 and run.counters.slots_busy == 0, 5, "a full buffer")
        await wait_until(lambda: run.admission.admission_wait_seconds > 0, 5, "an admission wait")
        stats = service.stats()
        response = stats_to_pb(stats, service.runs.values())
    finally:
        await service.delete_run(run.run_id)
    assert stats.tokens_generated == run.ledger.generated.tokens == 2 * 2 * 4  # 2 groups of 2, 4 tokens each
    assert response.tokens_generated == stats.tokens_generated
    assert (response.max_inflight, response.slots_busy) == (4, 0)
    assert 0 < stats.recent_window_seconds <= stats.uptime_seconds + 1e-9
    assert stats.recent_tokens_per_second == pytest.approx(stats.tokens_generated / stats.recent_window_seconds)
    assert response.uptime_seconds > 0
    assert response.slot_seconds_total > 0
    assert 0 < response.slots_busy_time_average <= 4
    assert response.runs[run.run_id].admission_wait_seconds > 0
    assert response.weight_updates_committed == 0 and not response.HasField("last_weight_update")
    gauge = service.metrics.registry.get_sample_value("rollout_slots_busy_time_average")
    assert gauge is not None and 0 < gauge <= 4


async def test_a_push_that_begins_moves_the_trainer_version_of_runs_on_the_base_weights() -> None:
    """Admission plans with the trainer's version, which leads the servers' while a push lands."""
    service = make_service(ScriptedEngine(hold=True))
    base = await service.create_run(spec([[1]], max_staleness=2))
    adapter = await service.create_run(spec([[1]], max_staleness=2, serve_adapter=True))
    try:
        service.versions.set_trainer(1)
        assert (base.admission.trainer_version, base.admission.policy_version) == (1, 0)
        assert adapter.admission.trainer_version == 0  # its versions count its own adapter pushes
        service.set_policy_version(1)
        assert (base.admission.trainer_version, base.admission.policy_version) == (1, 1)
    finally:
        await service.close()


async def test_hung_sync_rewards_hold_only_their_own_threads() -> None:
    """Sync rewards used to run in asyncio's default pool (6 threads on 2 cores), shared with
    the service's own blocking work (rendering prompts, writing adapters): a few hung reward
    calls stopped all of it."""
    release = threading.Event()

    def hangs(prompts, completions, completion_ids, **kwargs):  # type: ignore[no-untyped-def]
        release.wait(30)
        return [0.0] * len(completions)

    service = make_service(ScriptedEngine(), rewards={"hangs": hangs}, reward_timeout_s=0.2, user_code_threads=2)
    run = await service.create_run(spec([[1], [2]], group_size=2, rewards=(("hangs", 1.0),)))
    try:
        # More hung calls than the default pool has threads...
        await wait_until(lambda: run.counters.groups_dropped >= 12, 20, "12 groups dropped at the reward timeout")
        # ...and the default pool still runs the service's own work at once.
        assert await asyncio.wait_for(asyncio.to_thread(lambda: "free"), 2) == "free"
    finally:
        release.set()
        await service.close()
    assert run.counters.groups_scored == 0


@pytest.mark.parametrize("engine_class", [ScriptedEngine, ScriptedGroupEngine])
async def test_a_group_the_trainer_moved_past_is_aborted_in_flight_and_counted(engine_class) -> None:
    """max_staleness 1: groups started at version 0 can still train at trainer version 1, not
    at 2. When the trainer reaches 2, their requests are cancelled and their slots refilled."""
    engine = engine_class(hold=True)
    service = make_service(engine, max_inflight=4)
    run = await service.create_run(spec([[1, 2]], group_size=2, max_staleness=1))
    try:
        await engine.wait_for(lambda: engine.active == engine.calls == (2 if engine.group_calls else 4))
        generating = 2  # 4 slots, G = 2 (a third group waits for slots, and starts at a later version)
        service.versions.set_trainer(1)  # a push begins: version-0 groups are still trainable
        service.set_policy_version(1)
        assert run.counters.groups_dropped == 0 and engine.active == engine.calls
        service.versions.set_trainer(2)  # the next push begins: the version-0 groups can only go stale
        await wait_until(lambda: run.counters.groups_dropped == generating, 5, "the stale groups to be dropped")
        dropped = service.metrics.registry.get_sample_value(
            "rollout_groups_dropped_total", {"run": run.run_id, "reason": "stale_inflight"}
        )
        assert dropped == generating
        # Their slots went to new groups, started at version 1, which still generate.
        await engine.wait_for(lambda: engine.active == (2 if engine.group_calls else 4))
        assert run.counters.groups_started >= 2 * generating and run.counters.groups_scored == 0
        assert run.counters.groups_dropped == generating
    finally:
        await service.delete_run(run.run_id)


async def test_a_group_past_its_deadline_is_scored_from_the_members_that_finished() -> None:
    """G = 4, min_group_size 2: three members finish, the fourth straggles. At the deadline
    it is cancelled and the group is scored from three, advantages over those three."""
    engine = ScriptedGroupEngine(hold=True)  # can sample a group at once, but a deadline needs members
    service = make_service(engine, max_inflight=4)
    run = await service.create_run(spec([[1, 2]], group_size=4, group_deadline_s=0.5, min_group_size=2))
    run.broker.subscribe("t")
    try:
        await engine.wait_for(lambda: engine.active == 4)
        assert engine.group_calls == 0
        group_id = engine.pending[0][0]
        engine.pending[0], engine.pending[3] = engine.pending[3], engine.pending[0]  # member 0 straggles
        assert engine.release(affinity=group_id, count=3) == 3
        group = await asyncio.wait_for(run.broker.take("t"), 5)
        assert group.group_id == group_id and len(group.episodes) == 3 and group.requested_size == 4
        assert len(group.advantages) == 3 and sum(group.advantages) == pytest.approx(0.0, abs=1e-9)
        assert run.counters.groups_partial == 1  # (later groups straggle entirely: dropped)
        assert service.metrics.registry.get_sample_value("rollout_groups_partial_total", {"run": run.run_id}) == 1
        assert group_to_pb(group).requested_size == 4 and len(group_to_pb(group).samples) == 3
        assert stats_to_pb(service.stats(), [run]).runs[run.run_id].groups_partial == 1
        await engine.wait_for(lambda: engine.active == 4)  # the straggler's slot went to the next group
    finally:
        await service.delete_run(run.run_id)


@pytest.mark.parametrize("min_group_size", [0, 3], ids=["no-partial-groups", "too-few-finished"])
async def test_a_group_past_its_deadline_with_too_few_members_is_dropped(min_group_size, caplog) -> None:
    engine = ScriptedEngine(hold=True)
    service = make_service(engine, max_inflight=4)
    run = await service.create_run(spec([[1, 2]], group_size=4, group_deadline_s=0.3, min_group_size=min_group_size))
    try:
        await engine.wait_for(lambda: engine.active == 4)
        engine.release(affinity=engine.pending[0][0], count=2)
        # The later groups straggle entirely (nothing releases them) and are dropped too.
        await wait_until(lambda: run.counters.groups_dropped >= 1, 5, "the group to be dropped at its deadline")
        dropped = service.metrics.registry.get_sample_value(
            "rollout_groups_dropped_total", {"run": run.run_id, "reason": "deadline"}
        )
        assert dropped >= 1 and run.counters.groups_scored == 0 and run.counters.groups_partial == 0
        assert "2 of 4 members finished within group_deadline_seconds 0.3" in caplog.text
    finally:
        await service.delete_run(run.run_id)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"group_deadline_s": -1.0}, "group_deadline_seconds is -1.0"),
        ({"group_deadline_s": float("inf")}, "group_deadline_seconds is inf"),
        ({"group_deadline_s": 5.0, "min_group_size": 1}, "min_group_size is 1; it must be between 2 and group_size"),
        ({"group_deadline_s": 5.0, "min_group_size": 9}, "min_group_size is 9"),
        ({"min_group_size": 2}, "set a deadline for partial groups"),
    ],
)
def test_bad_deadline_settings_say_what_to_change(fields, message) -> None:
    with pytest.raises(InvalidArgument, match=re.escape(message)):
        spec([[1]], group_size=4, **fields).validate()


def test_the_deadline_fields_go_over_the_wire_both_ways() -> None:
    message = pb.RunSpec(group_size=8, group_deadline_seconds=12.5, min_group_size=6)
    message.prompt_source.dataset = "letters"
    message.sampling.max_tokens = 4
    message.reward_functions.add(name="char_fraction")
    spec_ = run_spec_from_pb(message)
    assert (spec_.group_deadline_s, spec_.min_group_size, spec_.fewest_members) == (12.5, 6, 6)
    back = run_spec_to_pb(spec_)
    assert (back.group_deadline_seconds, back.min_group_size) == (12.5, 6)
    assert run_spec_from_pb(pb.RunSpec(**{**_fields(message), "min_group_size": 0})).fewest_members == 8


def _fields(message: pb.RunSpec) -> dict:
    return {field.name: value for field, value in message.ListFields()}


async def test_a_group_larger_than_the_runs_slots_goes_one_member_at_a_time_instead_of_waiting_for_ever() -> None:
    """A group request holds G slots at once; with fewer slots for the run it used to wait
    for them for ever (rollout-trainer --max-inflight 4 --group-size 8)."""
    engine = ScriptedGroupEngine()
    service = make_service(engine, max_inflight=8)
    run = await service.create_run(spec([[1, 2]], group_size=8, max_inflight=4))
    try:
        await wait_until(lambda: run.counters.groups_scored >= 2, 5, "groups to be scored")
        assert engine.group_calls == 0 and engine.max_active <= 4
    finally:
        await service.delete_run(run.run_id)
