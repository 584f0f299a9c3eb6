import asyncio

import pytest

from rollout_service.broker import ACK_DROPPED_STALE, ACK_TRAINED, RunBroker
from rollout_service.errors import AlreadyExists, FailedPrecondition
from rollout_service.metrics import ServiceMetrics
from rollout_service.types import EpisodeResult, PromptItem, ScoredGroup


def group(group_id: str) -> ScoredGroup:
    episode = EpisodeResult([1], [-0.1], [1], "stop", "x", 0, 0)
    return ScoredGroup(group_id, "r", PromptItem(0, [1], "p"), [episode] * 2, [0.0, 1.0], {}, {}, [-1.0, 1.0], 0.1)


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
