import asyncio
from typing import Any

import pytest

from rollout_service.delivery.admission import RunAdmission
from rollout_service.delivery.broker import ACK_DROPPED_STALE, ACK_TRAINED, RunBroker
from rollout_service.errors import AlreadyExists, FailedPrecondition
from rollout_service.metrics import ServiceMetrics
from tests.unit.rollout_service.delivery.broker_helpers import Clock, group, produce


def admission(metrics: ServiceMetrics | None = None, **kwargs: Any) -> RunAdmission:
    return RunAdmission("r", metrics if metrics is not None else ServiceMetrics(), **kwargs)


async def filled(*ids: str, max_buffered: int = 8) -> RunBroker:
    broker = RunBroker("r", max_buffered, ServiceMetrics())
    for group_id in ids:
        assert await broker.reserve()
        await broker.put(group(group_id))
    return broker


async def test_groups_are_leased_acked_once_and_counted() -> None:
    broker = await filled("g1", "g2")
    broker.subscribe("c")
    assert (await broker.take("c")).group_id == "g1"
    assert broker.num_leased == 1 and len(broker.buffered) == 1
    assert broker.ack("c", ["g1"], ACK_TRAINED) == 1
    assert broker.ack("c", ["g1"], ACK_TRAINED) == 0  # idempotent
    assert broker.ack_counts == {ACK_TRAINED: 1, ACK_DROPPED_STALE: 0}
    assert broker.num_leased == 0


async def test_ack_of_a_group_not_leased_is_refused() -> None:
    broker = await filled("g1")
    broker.subscribe("c")
    with pytest.raises(FailedPrecondition, match="not leased to consumer 'c'"):
        broker.ack("c", ["g1"], ACK_TRAINED)


async def test_consumer_ids_are_unique_per_run() -> None:
    broker = await filled()
    broker.subscribe("c")
    with pytest.raises(AlreadyExists, match="already subscribed"):
        broker.subscribe("c")


async def test_released_leases_return_to_the_front_in_order() -> None:
    broker = await filled("g1", "g2", "g3")
    broker.subscribe("a")
    await broker.take("a")
    await broker.take("a")
    broker.ack("a", ["g1"], ACK_TRAINED)
    assert await broker.release("a") == 1
    broker.subscribe("b")
    assert [(await broker.take("b")).group_id for _ in range(2)] == ["g2", "g3"]


async def test_reservations_bound_the_buffer() -> None:
    broker = await filled("g1", max_buffered=2)
    assert await broker.reserve()
    assert not broker.has_room()
    waiter = asyncio.create_task(broker.reserve())
    await asyncio.sleep(0)
    assert not waiter.done()
    await broker.unreserve()  # a dropped group gives its place back
    assert await asyncio.wait_for(waiter, 1)


async def test_cancelled_take_loses_nothing() -> None:
    broker = await filled()
    broker.subscribe("c")
    taker = asyncio.create_task(broker.take("c"))
    await asyncio.sleep(0)
    taker.cancel()
    await asyncio.gather(taker, return_exceptions=True)
    assert await broker.reserve()
    await broker.put(group("g1"))
    assert len(broker.buffered) == 1


async def test_close_wakes_waiting_consumers() -> None:
    broker = await filled()
    broker.subscribe("c")
    taker = asyncio.create_task(broker.take("c"))
    await broker.close()
    assert await asyncio.wait_for(taker, 1) is None
    assert not await broker.reserve()


async def test_expired_lease_goes_to_another_consumer_and_the_late_ack_is_refused() -> None:
    clock = Clock()
    broker = RunBroker("r", 8, ServiceMetrics(), lease_timeout_s=30, clock=clock)
    for group_id in ("g1", "g2"):
        assert await broker.reserve()
        await broker.put(group(group_id))
    broker.subscribe("hung")
    broker.subscribe("healthy")
    assert (await broker.take("hung")).group_id == "g1"
    clock.now = 10
    assert (await broker.take("hung")).group_id == "g2"
    clock.now = 31  # g1's lease is past due, g2's is not
    assert (await broker.take("healthy")).group_id == "g1"  # the oldest goes first
    assert broker.leases_expired == 1 and set(broker.leases["hung"]) == {"g2"}
    assert broker.ack("healthy", ["g1"], ACK_TRAINED) == 1
    with pytest.raises(FailedPrecondition, match="lease of group 'g1' expired"):
        broker.ack("hung", ["g1"], ACK_TRAINED)  # told, even though g1 is already acked
    assert broker.ack("hung", ["g2"], ACK_TRAINED) == 1  # within its lease
    assert broker.ack_counts[ACK_TRAINED] == 2


async def test_an_expired_group_does_not_come_back_to_the_stream_that_still_holds_it() -> None:
    """Handed back on the same stream, both copies would be trained and acked as one."""
    clock = Clock()
    broker = RunBroker("r", 8, ServiceMetrics(), lease_timeout_s=5, clock=clock)
    for group_id in ("g1", "g2"):
        assert await broker.reserve()
        await broker.put(group(group_id))
    broker.subscribe("c")
    assert (await broker.take("c")).group_id == "g1"
    clock.now = 6  # g1's lease expires: it goes back to the front of the buffer ...
    assert (await broker.take("c")).group_id == "g2"  # ... but not to "c", which gets the next one
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(broker.take("c"), 0.1)
    assert [g.group_id for g in broker.buffered] == ["g1"]
    # Once "c" reconnects (its first copy is gone with its stream), g1 may go to it again.
    await broker.release("c")
    broker.subscribe("c")
    assert (await broker.take("c")).group_id == "g2"  # the returned lease comes first, oldest first
    assert (await broker.take("c")).group_id == "g1"
    assert broker.ack("c", ["g1", "g2"], ACK_TRAINED) == 2
    assert broker.ack("c", ["g1"], ACK_TRAINED) == 0  # repeats stay no-ops


async def test_a_waiting_consumer_is_woken_when_a_lease_expires() -> None:
    broker = RunBroker("r", 8, ServiceMetrics(), lease_timeout_s=0.05)  # real clock: nothing else would wake it
    assert await broker.reserve()
    await broker.put(group("g1"))
    broker.subscribe("hung")
    broker.subscribe("waiting")
    await broker.take("hung")
    taken = await asyncio.wait_for(broker.take("waiting"), 5)
    assert taken.group_id == "g1" and broker.leases_expired == 1


async def test_without_a_lease_timeout_leases_never_expire() -> None:
    clock = Clock()
    broker = RunBroker("r", 8, ServiceMetrics(), clock=clock)
    assert await broker.reserve()
    await broker.put(group("g1"))
    broker.subscribe("c")
    await broker.take("c")
    clock.now = 1e9
    broker.subscribe("other")
    with pytest.raises(TimeoutError):
        await asyncio.wait_for(broker.take("other"), 0.1)
    assert broker.leases_expired == 0 and "g1" in broker.leases["c"]


async def consume(broker: RunBroker, consumer: str, n: int) -> None:
    ids = [(await broker.take(consumer)).group_id for _ in range(n)]
    broker.ack(consumer, ids, ACK_TRAINED)


async def test_admission_keeps_pending_groups_within_what_trains_before_max_staleness() -> None:
    broker = RunBroker("r", 100, ServiceMetrics(), admission=admission(max_staleness=1))
    broker.subscribe("c")
    await produce(broker, *(f"a{i}" for i in range(4)))  # C unknown: only max_buffered applies
    await consume(broker, "c", 4)
    broker.admission.set_policy_version(1)
    assert broker.admission.trained_per_version == 4 and broker.admission.trained_at_version == 0

    # (max_staleness + 1) * C = 8 groups may be pending: all of them train within one version.
    await produce(broker, *(f"b{i}" for i in range(8)))
    assert not broker.has_room()
    await consume(broker, "c", 4)  # consumed at this version: k = 4, pending 4
    assert not broker.has_room()  # k + P = 8: the next group would be two versions old
    broker.admission.set_policy_version(2)
    assert broker.admission.trained_per_version == 4
    await produce(broker, *(f"c{i}" for i in range(4)))  # k = 0, pending 4 -> 8
    assert not broker.has_room()


async def test_one_step_off_policy_pipeline_generates_the_next_step_while_this_one_trains() -> None:
    """max_staleness 1, a trainer that pushes in the background: while step s trains on its
    leased groups, the next step's groups are generated from the weights step s-1 made."""
    broker = RunBroker("r", 100, ServiceMetrics(), admission=admission(max_staleness=1))
    broker.subscribe("c", credits=4)
    broker.admission.set_trainer_version(1)  # the first push begins ...
    broker.admission.set_policy_version(1)  # ... and lands
    await produce(broker, *(f"a{i}" for i in range(4)))
    taken = [(await broker.take("c")).group_id for _ in range(4)]  # step 1 trains at version 1
    await produce(broker, *(f"b{i}" for i in range(4)))  # step 2's groups, generated meanwhile
    assert not broker.has_room()  # a third step's worth would be two versions old
    broker.ack("c", taken, ACK_TRAINED, trained_at=1)
    broker.admission.set_trainer_version(2)  # step 1's push begins; the servers still hold version 1
    assert not broker.has_room()  # admitted now, from version 1, it would train at version 3
    broker.admission.set_policy_version(2)  # the push lands: generating from version 2 is fine again
    assert broker.admission.trained_per_version == 4
    assert broker.has_room()


async def test_an_ack_that_arrives_after_the_next_push_began_counts_where_it_was_trained() -> None:
    broker = RunBroker("r", 100, ServiceMetrics(), admission=admission(max_staleness=1))
    broker.subscribe("c", credits=4)
    broker.admission.set_trainer_version(1)
    broker.admission.set_policy_version(1)
    await produce(broker, *(f"a{i}" for i in range(4)))
    taken = [(await broker.take("c")).group_id for _ in range(4)]
    broker.admission.set_trainer_version(2)  # the begin overtook the ack
    broker.ack("c", taken, ACK_TRAINED, trained_at=1)
    assert broker.admission.trained_at_version == 0  # nothing is trained at version 2 yet


async def test_an_aborted_push_gives_the_trainer_the_servers_version_back() -> None:
    broker = RunBroker("r", 100, ServiceMetrics(), admission=admission(max_staleness=0))
    broker.subscribe("c", credits=2)
    broker.admission.set_policy_version(1)
    assert broker.has_room()
    broker.admission.set_trainer_version(2)  # a push begins: anything admitted now would be stale
    assert not broker.has_room()
    broker.admission.set_trainer_version(1)  # aborted: the trainer goes on from version 1
    assert broker.has_room()


async def test_admission_never_starves_below_one_versions_worth() -> None:
    broker = RunBroker("r", 100, ServiceMetrics(), admission=admission(max_staleness=0))
    broker.subscribe("c")
    await produce(broker, "a0", "a1")
    await consume(broker, "c", 2)
    broker.admission.set_policy_version(1)  # C = 2
    await produce(broker, "b0", "b1")
    assert not broker.has_room()
    await consume(broker, "c", 2)  # k = 2 = (0 + 1) * C: the version's budget is spent ...
    await produce(broker, "c0", "c1")  # ... yet a trainer that needs more before it pushes gets them
    assert not broker.has_room()


async def test_a_bump_without_consumption_teaches_nothing() -> None:
    broker = RunBroker("r", 100, ServiceMetrics(), admission=admission(max_staleness=1))
    broker.admission.set_policy_version(1)  # a trainer's first push, before it trained anything
    assert broker.admission.trained_per_version is None
    await produce(broker, *(f"a{i}" for i in range(50)))  # no consumer credits either: only max_buffered


async def test_a_waiting_reservation_is_admitted_after_a_version_bump() -> None:
    broker = RunBroker("r", 100, ServiceMetrics(), admission=admission(max_staleness=0))
    broker.subscribe("c")
    await produce(broker, "a0")
    await consume(broker, "c", 1)
    broker.admission.set_policy_version(1)  # C = 1
    await produce(broker, "b0")
    waiting = asyncio.ensure_future(broker.reserve())
    await asyncio.sleep(0)  # let it reach its wait
    assert not waiting.done() and broker.admission.admission_waits == 1
    await consume(broker, "c", 1)
    broker.admission.set_policy_version(2)
    assert await asyncio.wait_for(waiting, 5)


async def test_await_version_holds_generation_until_the_first_push() -> None:
    broker = RunBroker("r", 100, ServiceMetrics(), admission=admission(await_version=1))
    assert not broker.has_room()
    waiting = asyncio.ensure_future(broker.reserve())
    await asyncio.sleep(0)
    assert not waiting.done()
    broker.admission.set_policy_version(1)
    assert await asyncio.wait_for(waiting, 5)


async def test_the_consumers_credits_stand_in_for_c_until_it_is_measured() -> None:
    broker = RunBroker("r", 100, ServiceMetrics(), admission=admission(max_staleness=1))
    broker.subscribe("trainer", credits=3)  # a trainer asks for one step's worth
    assert broker.admission.groups_per_version is None  # nobody pushes: nothing can go stale
    broker.admission.set_policy_version(1)  # the trainer's first push, before it trained anything
    assert broker.admission.groups_per_version == 3
    await produce(broker, *(f"a{i}" for i in range(6)))  # (1 + 1) * 3
    assert not broker.has_room()


async def test_dropped_groups_do_not_count_as_trained_per_version() -> None:
    broker = RunBroker("r", 100, ServiceMetrics(), admission=admission(max_staleness=1))
    broker.subscribe("c")
    await produce(broker, *(f"a{i}" for i in range(8)))
    taken = [(await broker.take("c")).group_id for _ in range(8)]
    broker.ack("c", taken[:4], ACK_TRAINED)
    broker.ack("c", taken[4:], ACK_DROPPED_STALE)
    broker.admission.set_policy_version(1)
    assert broker.admission.trained_per_version == 4  # counting drops would admit more and drop more


async def test_admission_wait_seconds_count_only_while_a_slot_is_free() -> None:
    """A wait is measured on the free-slot clock: seconds with every slot busy cost nothing."""
    clock, free = Clock(), Clock()
    metrics = ServiceMetrics()
    broker = RunBroker("r", 1, metrics, clock=clock, admission=admission(metrics, free_clock=free))
    assert await broker.reserve()  # room: no wait
    assert broker.admission.admission_wait_seconds == 0.0
    waiting = asyncio.ensure_future(broker.reserve())  # the buffer is full: held back
    await asyncio.sleep(0)  # let it reach its wait
    assert not waiting.done()
    free.now = 4.0  # 4 s with a slot free ...
    clock.now = 10.0  # ... out of 10 s of waiting
    assert broker.admission.admission_wait_seconds == 4.0  # a wait in progress counts up to now
    await broker.unreserve()
    assert await asyncio.wait_for(waiting, 5)
    free.now = 9.0  # after the wait nothing more is counted
    assert broker.admission.admission_wait_seconds == 4.0
    assert metrics.registry.get_sample_value("rollout_admission_wait_seconds_total", {"run": "r"}) == 4.0


async def test_admission_wait_seconds_end_at_close() -> None:
    clock = Clock()
    broker = RunBroker("r", 100, ServiceMetrics(), admission=admission(await_version=1, free_clock=clock))
    waiting = asyncio.ensure_future(broker.reserve())  # held until the trainer's first push
    await asyncio.sleep(0)
    clock.now = 2.5
    await broker.close()
    assert not await asyncio.wait_for(waiting, 5)
    clock.now = 7.0
    assert broker.admission.admission_wait_seconds == 2.5


async def test_a_draining_broker_starts_and_hands_out_nothing_while_leases_settle() -> None:
    broker = await filled("g1", "g2", "g3")
    broker.subscribe("a")
    broker.subscribe("b")
    held_a, held_b = await broker.take("a"), await broker.take("b")
    await broker.drain()
    assert not await broker.reserve()  # the scheduler's feeder ends: no new group starts
    waiting = asyncio.ensure_future(broker.take("a"))  # g3 is buffered, but not handed out
    settled = asyncio.ensure_future(broker.wait_leases_settled())
    async with asyncio.timeout(5):
        assert broker.ack("a", [held_a.group_id], ACK_TRAINED) == 1  # acks still count
        await broker.release("b")  # and a consumer that leaves returns what it held
        await settled
    assert not waiting.done()
    assert [g.group_id for g in broker.buffered] == [held_b.group_id, "g3"]
    await broker.close()
    assert await asyncio.wait_for(waiting, 5) is None


def test_admission_answers_from_versions_and_pending_counts_alone() -> None:
    """The versions' owner needs no broker: weight sync moves them, the broker asks."""
    gate = admission(max_staleness=0, await_version=1)
    assert not gate.allows(0)  # held until the first push lands
    woken: list[int] = []
    gate.on_change(lambda: woken.append(gate.policy_version))
    gate.credits["c"] = 2
    gate.set_policy_version(1)  # C stands in as the credits: 2
    assert woken == [1] and gate.allows(1) and not gate.allows(2)
    gate.trained(trained_at=1)
    gate.set_trainer_version(2)  # a push is in flight: nothing admitted now would be fresh
    assert gate.trained_per_version == 1 and not gate.allows(0)
    gate.set_policy_version(2)
    assert woken == [1, 1, 2] and gate.allows(0)


def test_no_group_starts_that_could_only_go_stale() -> None:
    """A group is not started while the servers' version is more than max_staleness behind
    the trainer's; a run that trains nothing (no max_staleness) is never held."""
    admission = RunAdmission("r", ServiceMetrics(), max_staleness=0)
    assert admission.allows(0)
    admission.set_trainer_version(1)  # a push begins: a group started now on version 0 is already too old
    assert admission.doomed and not admission.allows(0)
    admission.set_policy_version(1)  # it commits
    assert not admission.doomed and admission.allows(0)
    lenient = RunAdmission("r", ServiceMetrics(), max_staleness=1)
    lenient.set_trainer_version(1)
    assert lenient.allows(0)  # one version behind is within max_staleness 1
    unchecked = RunAdmission("r", ServiceMetrics(), max_staleness=None)
    unchecked.set_trainer_version(3)
    assert unchecked.allows(0)
